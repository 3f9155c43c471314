"""One name per meaning (issue #21): **hybrid** is the expert backend (`--moe-backend hybrid`)
and, qualified, the hybrid-state radix cache (`cache/hybrid.py`); a model with linear-attention
layers is "a model with linear attention" (`ModelConfig.has_linear_attention`, the scheduler's
`has_state`, the cache's `has_state_pool`), never a "hybrid model". Checked over the product's
code (freetoken/, freetoken/kernels/) and the reference docs that name the flags. Bug it catches:
"hybrid" with a third meaning in a help text or a contract (`--state-slots ... hybrid models`),
which reads as the expert backend."""
from __future__ import annotations

import re
from pathlib import Path

from tests.structure.test_import_layers import ROOT

WRONG = re.compile(r"\bhybrid[- ]models?\b", re.IGNORECASE)
DOCS = ("architecture.md", "cli.md", "kernels.md", "models.md")


def misnamed(paths: list[Path], root: Path = ROOT) -> list[str]:
    return [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) if WRONG.search(line)]


def test_no_hybrid_model_in_the_product() -> None:
    paths = [p for top in ("freetoken",) for p in sorted((ROOT / top).rglob("*.py"))]
    paths += [ROOT / "docs" / d for d in DOCS]
    bad = misnamed(paths)
    assert not bad, "say 'model(s) with linear attention':\n" + "\n".join(bad)


def test_the_scan_finds_a_planted_name(tmp_path) -> None:
    p = tmp_path / "planted.py"
    p.write_text("ok: the hybrid backend, cache/hybrid.py\nbad: state slots (Hybrid models)\n")
    assert [b.split(":")[1] for b in misnamed([p], tmp_path)] == ["2"]

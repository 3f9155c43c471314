"""File sizes (issue #21, acceptance 4; STYLE: a module past ~400 lines is two modules): no file
under freetoken/ exceeds 400 lines, and the engine's two central files, `engine/core.py`
(schedule, run, postprocess) and `engine/graph_runner.py` (capture and replay), stay at 300 or
fewer, split along the moves of the issue (in_flight, eager, decode_staging, graph_capture, ...).
Bug it catches: a step loop or a runner growing back into one file that holds everything."""
from __future__ import annotations

from pathlib import Path

from tests.structure.test_import_layers import ROOT

LIMIT = 400
CENTRAL = {"freetoken/engine/core.py": 300, "freetoken/engine/graph_runner.py": 300}


def oversized(root: Path) -> list[str]:
    out = []
    for p in sorted((root / "freetoken").rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        n = len(p.read_text().splitlines())
        if n > CENTRAL.get(rel, LIMIT):
            out.append(f"{rel}: {n} lines (limit {CENTRAL.get(rel, LIMIT)})")
    return out


def test_no_file_over_its_limit() -> None:
    bad = oversized(ROOT)
    assert not bad, "split these files:\n" + "\n".join(bad)


def test_the_size_check_finds_a_planted_file(tmp_path) -> None:
    """The checker itself can fail: a 301-line core.py and a 401-line module are found."""
    (tmp_path / "freetoken" / "engine").mkdir(parents=True)
    (tmp_path / "freetoken" / "engine" / "core.py").write_text("x = 1\n" * 301)
    (tmp_path / "freetoken" / "big.py").write_text("x = 1\n" * 401)
    (tmp_path / "freetoken" / "ok.py").write_text("x = 1\n" * 400)
    assert [b.split(":")[0] for b in oversized(tmp_path)] == ["freetoken/big.py",
                                                             "freetoken/engine/core.py"]

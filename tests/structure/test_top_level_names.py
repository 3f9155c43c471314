"""The project's top-level import names shadow no other installed distribution. Bug it catches
(CI, 2026-12-04): our kernels lived in a top-level `kernels` package, and transformers 5.25
began to import Hugging Face's `kernels` distribution at model construction; from the repo root
(and in any environment where FreeToken is installed) `import kernels` found ours, so every
transformers model failed to build (`cannot import name 'CUDAProperties' from 'kernels'`) and
423 tests failed. The kernels are `freetoken.kernels` now; this keeps every top-level name ours.
"""
from __future__ import annotations

import importlib.metadata as md
import re

from tests.structure.test_import_layers import ROOT

OURS = "freetoken"


def top_level_packages() -> list[str]:
    """The names pyproject's `packages.find` include list ships at the top level."""
    text = (ROOT / "pyproject.toml").read_text()
    include = re.search(r"^include = \[(.*?)\]", text, re.MULTILINE | re.DOTALL)
    assert include, "pyproject.toml has no [tool.setuptools.packages.find] include list"
    return [n.strip().strip('"').rstrip("*") for n in include.group(1).split(",") if n.strip()]


def test_no_top_level_package_shadows_another_distribution() -> None:
    names = top_level_packages()
    assert names and "freetoken" in names, names
    owners = md.packages_distributions()
    clash = {n: sorted(set(owners[n]) - {OURS}) for n in names
             if set(owners.get(n, ())) - {OURS}}
    assert not clash, f"top-level names another installed distribution also ships: {clash}"


def test_every_shipped_top_level_name_is_a_package_here() -> None:
    """The include list and the tree agree (a package moved under freetoken/ left no stale entry,
    and no stray top-level package with an __init__.py is left out of the wheel)."""
    names = set(top_level_packages())
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert names == on_disk, (names, on_disk)
    assert not (ROOT / "kernels").exists(), "the kernels are freetoken/kernels"

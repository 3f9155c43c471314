"""tests/ mirrors the packages (issue #21 target layout): each top-level test directory is named
after a package (of freetoken/, or a top-level one) or is one of the suite's own kinds below;
kernel tests sit under tests/kernels/{cpu,triton}. Bug it catches: a test directory named after
no package (`tests/kernels_cpu`, `tests/kernels_triton_attn`), where nobody looks for a
kernel's tests."""
from __future__ import annotations

from tests.structure.test_import_layers import ROOT

OWN_KINDS = {
    "e2e": "whole-stack tests through the server and the engine",
    "structure": "the code's shape (imports, sizes, names)",
    "data": "recorded traces and templates the tests read",
    "peer": "real harness peers against the stack",
    "reliability": "the reliability suite (faults, fuzzing, soak)",
}
# (no "gpu": GPU tests sit next to their package under the `gpu` marker, test_gpu_tests.py)


def packages() -> set[str]:
    out = {p.name for p in (ROOT / "freetoken").iterdir() if p.is_dir() and
           (p / "__init__.py").exists()}
    out |= {p.stem for p in (ROOT / "freetoken").glob("*.py") if p.stem != "__init__"}
    out |= {"harness_adapters", "workloads"}
    return out


def test_each_test_directory_names_a_package() -> None:
    dirs = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir()
            and not p.name.startswith((".", "_"))}
    stray = dirs - packages() - set(OWN_KINDS)
    assert not stray, f"test directories named after no package: {sorted(stray)}"


def test_kernel_tests_sit_under_tests_kernels() -> None:
    kernels = {p.name for p in (ROOT / "tests" / "kernels").iterdir() if p.is_dir()
               and not p.name.startswith((".", "_"))}
    assert {"cpu", "triton"} <= kernels
    assert kernels <= {"cpu", "triton"} | {p.name for p in
                                           (ROOT / "freetoken" / "kernels").iterdir()}

"""GPU tests sit next to their package's CPU tests under the `gpu` marker (issue #21): there is
no `gpu` folder under tests/, every test that runs CUDA-only code is `gpu`-marked (its own
decorator or its module's `pytestmark`), and the one rule of tests/conftest.py skips a marked
test without CUDA, with the reason. Bug it catches: a GPU test added without the marker (on a
CPU it errors instead of skipping, and `pytest -m gpu` on the H200 — scripts/gpu_check.sh —
never runs it), or the old folder of GPU tests, skipped by its path, coming back.

"CUDA-only" is read from the source, cheaply: `device="cuda"`, `torch.device("cuda")`, a bare
`.cuda()`, `torch.cuda.CUDAGraph`, `torch.cuda.graph`, `torch.cuda.set_sync_debug_mode`,
outside a branch on `torch.cuda.is_available()` (the interpreter twins pick their device so)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch

from tests.structure.test_import_layers import ROOT

CUDA_ATTRS = ("torch.cuda.CUDAGraph", "torch.cuda.graph", "torch.cuda.set_sync_debug_mode")


def _guarded(tree: ast.AST) -> set[int]:
    """ids of the nodes inside an `if` or a ternary whose test reads CUDA's availability."""
    out: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.If, ast.IfExp)) and "cuda" in ast.unparse(n.test).lower():
            parts = [n.body, n.orelse] if isinstance(n, ast.IfExp) else n.body + n.orelse
            out |= {id(m) for part in parts for m in ast.walk(part)}
    return out


def _names_cuda(v: ast.AST) -> bool:
    return isinstance(v, ast.Constant) and str(v.value).startswith("cuda")


def _cuda_only(n: ast.AST) -> bool:
    if isinstance(n, ast.keyword):
        return n.arg == "device" and _names_cuda(n.value)
    if isinstance(n, ast.Call):
        f = n.func
        bare = isinstance(f, ast.Attribute) and f.attr == "cuda" and not n.args
        return bare or (ast.unparse(f) == "torch.device" and bool(n.args)
                        and _names_cuda(n.args[0]))
    return isinstance(n, ast.Attribute) and ast.unparse(n) in CUDA_ATTRS


def cuda_only_lines(node: ast.AST, guarded: set[int]) -> list[int]:
    """Lines under `node` that run CUDA-only code unconditionally."""
    return [getattr(n, "lineno", None) or n.value.lineno for n in ast.walk(node)
            if id(n) not in guarded and _cuda_only(n)]


def unmarked_cuda_tests(path: Path) -> list[str]:
    """'file:line test' for each test function running CUDA-only code without the gpu marker,
    and 'file:line (module)' when an unmarked module does so outside its tests (fixtures,
    helpers)."""
    src = path.read_text()
    if "cuda" not in src:
        return []
    tree = ast.parse(src, str(path))
    guarded = _guarded(tree)
    module_marked = any(isinstance(s, ast.Assign) and "pytestmark" in ast.unparse(s)
                        and "mark.gpu" in ast.unparse(s.value) for s in tree.body)
    if module_marked:
        return []
    rel, bad = (path.relative_to(ROOT) if path.is_relative_to(ROOT) else path), []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name.startswith("test"):
            if any("mark.gpu" in ast.unparse(d) for d in node.decorator_list):
                continue
            bad += [f"{rel}:{ln} {node.name}" for ln in cuda_only_lines(node, guarded)[:1]]
    if not bad and "mark.gpu" not in src:
        bad += [f"{rel}:{ln} (module)" for ln in cuda_only_lines(tree, guarded)[:1]]
    return bad


def test_no_tests_gpu_directory() -> None:
    assert not (ROOT / "tests" / "gpu").exists(), (
        "GPU tests live next to their package under `pytestmark = pytest.mark.gpu`; "
        "tests/conftest.py skips them without CUDA")


def test_cuda_only_tests_are_gpu_marked() -> None:
    bad = [b for p in sorted((ROOT / "tests").rglob("*.py")) if "data" not in p.parts
           for b in unmarked_cuda_tests(p)]
    assert not bad, "CUDA-only code without the gpu marker:\n" + "\n".join(bad)


def test_the_detector_sees_cuda_only_code(tmp_path) -> None:
    """The checker itself can fail: an unmarked CUDA test and an unmarked CUDA fixture are
    found; a guarded device pick, a marked test and a marked module are not."""
    cases = {
        "a.py": ("import torch\ndef test_a():\n    torch.zeros(1, device='cuda')\n", 1),
        "b.py": ("import torch\ng = torch.cuda.CUDAGraph\ndef helper():\n    return 1\n", 1),
        "c.py": (("import torch\nDEV = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
                  "def test_c():\n    if torch.cuda.is_available():\n"
                  "        torch.zeros(1).cuda()\n"), 0),
        "d.py": (("import pytest, torch\n@pytest.mark.gpu\ndef test_d():\n"
                  "    torch.device('cuda')\n"), 0),
        "e.py": (("import pytest, torch\npytestmark = pytest.mark.gpu\ndef test_e():\n"
                  "    torch.zeros(1, device='cuda:0')\n"), 0),
        "f.py": ("import torch\ndef test_f():\n    torch.zeros(1).cuda()\n", 1),
    }
    for name, (src, want) in cases.items():
        p = tmp_path / name
        p.write_text(src)
        assert len(unmarked_cuda_tests(p)) == want, name


def test_a_gpu_module_skips_without_cuda_with_the_reason() -> None:
    """The one conftest rule at work, in a real pytest run over a moved GPU module: collected
    on a CPU (`-m gpu` selects it) and skipped with the reason, not an error."""
    if torch.cuda.is_available():
        return  # (on the H200 the module runs for real: scripts/gpu_check.sh tests)
    from tests.conftest import GPU_SKIP_REASON

    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "-m", "gpu", "tests/engine/test_flashinfer_build_gpu.py"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "1 skipped" in r.stdout and GPU_SKIP_REASON in r.stdout, r.stdout[-2000:]

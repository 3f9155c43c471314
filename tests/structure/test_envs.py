"""Environment variables have one home (freetoken/envs.py) and data directories one resolver.

Bugs they catch: an `FT_*` switch read ad hoc where it is used (an experiment toggle nobody
documents, or one read at import time; issue #21 found `FT_GDN_SCAN`, `FT_BRIDGE_PIN`,
`FT_STATE_HOST_MEM`), and the shared routing traces found through `parents[2]` of a module
file (`SHARED_TRACE_DIR`), which breaks as soon as the module moves or the package is
installed, with a `FileNotFoundError` naming a .npy file instead of how to point at one.
"""
from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

from freetoken import envs
from freetoken.bench.routing_trace import load_trace
from freetoken.models.routing_hooks import trace_path
from tests.structure.test_import_layers import ROOT

SOURCES = ("freetoken", "workloads", "harness_adapters", "scripts", "tests")
# C preprocessor names of freetoken/kernels/cpu (passed with -D), not environment variables
NOT_ENV = {"FT_HAVE_DPBF16", "FT_ISA", "FT_SIMDE_AVX512"}
NAME = re.compile(r"\bFT_[A-Z][A-Z0-9_]*\b")


def _files(*suffixes: str):
    for top in SOURCES:
        for p in sorted((ROOT / top).rglob("*")):
            if p.suffix in suffixes and "data" not in p.relative_to(ROOT).parts[:2] \
                    and p.resolve() != Path(__file__).resolve():  # (names planted here)
                yield p


def test_every_ft_name_in_the_sources_is_declared_in_envs() -> None:
    declared = {v.name for v in envs.ALL}
    seen = {}
    for p in _files(".py", ".sh"):
        for name in NAME.findall(p.read_text(errors="replace")):
            seen.setdefault(name, p.relative_to(ROOT))
    unknown = {n: str(p) for n, p in seen.items() if n not in declared | NOT_ENV}
    assert not unknown, f"FT_* names not declared in freetoken/envs.py: {unknown}"
    assert "FT_ROUTING_TRACES" in seen and "FT_TEST_JOBS" in seen  # the scan sees .py and .sh


def _direct_reads(tree: ast.AST) -> list[str]:
    """`os.environ.get("FT_..")`, `os.getenv("FT_..")`, `environ["FT_.."]`, `x.get("FT_..")`
    on anything called environ: reads that bypass `EnvVar.get`."""
    out = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if (node.func.attr == "get" and owner.endswith("environ")) or \
                    ast.unparse(node.func) == "os.getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ") \
                and isinstance(node.ctx, ast.Load):
            key = node.slice
        if isinstance(key, ast.Constant) and str(key.value).startswith("FT_"):
            out.append(ast.unparse(node))
    return out


def test_nothing_reads_an_ft_variable_past_envvar_get() -> None:
    bad = {}
    for p in _files(".py"):
        if p == ROOT / "freetoken" / "envs.py":
            continue
        reads = _direct_reads(ast.parse(p.read_text(), str(p)))
        if reads:
            bad[str(p.relative_to(ROOT))] = reads
    assert not bad, f"read FT_* through freetoken/envs.py's EnvVar.get: {bad}"


def test_the_direct_read_finder_finds_planted_reads() -> None:
    """The checker itself can fail: each form of a direct read is found, `EnvVar.get` not."""
    src = ('os.environ.get("FT_X")\nos.getenv("FT_Y", "1")\nenviron["FT_Z"]\n'
           'self.environ.get("FT_W")\nFT_CPU_ISA.get()\nos.environ.get("HOME")\n')
    assert len(_direct_reads(ast.parse(src))) == 4


def test_routing_traces_default_to_the_workloads_copy() -> None:
    want = ROOT / "workloads" / "data" / "routing_traces"
    assert envs.routing_traces_dir({}).resolve() == want.resolve()
    assert trace_path("shared").resolve() == (want / "decode_routing.npy").resolve()


def test_ft_routing_traces_moves_them(tmp_path, monkeypatch) -> None:
    src = envs.routing_traces_dir({})
    for f in ("decode_routing.npy", "meta.json"):
        shutil.copy(src / f, tmp_path / f)
    monkeypatch.setenv("FT_ROUTING_TRACES", str(tmp_path))
    assert trace_path("shared") == tmp_path / "decode_routing.npy"
    tr = load_trace("shared")  # read at the call, not at import: the variable is honoured
    assert tr.prefill is None and tr.num_experts == 256  # no prefill_routing.npy copied


def test_a_directory_without_traces_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="FT_ROUTING_TRACES=DIR"):
        envs.routing_traces_dir({"FT_ROUTING_TRACES": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="FT_HARNESS_TRACES=DIR"):
        envs.harness_traces_dir({"FT_HARNESS_TRACES": str(tmp_path / "none")})


def test_harness_traces_default_to_the_checkouts_own() -> None:
    want = ROOT / "tests" / "data" / "harness_traces"
    assert envs.harness_traces_dir({}).resolve() == want.resolve()


def import_time_reads(tree: ast.Module) -> list[str]:
    """`FT_X.get()` / `envs.FT_X.get()` (or `.value()`) run at import: in a module's or a
    class's body, or in a default argument (evaluated when the `def` runs)."""
    out = []

    def scan(nodes: list[ast.AST]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                scan([d for d in node.args.defaults + node.args.kw_defaults if d is not None])
                scan(node.decorator_list if not isinstance(node, ast.Lambda) else [])
                continue
            if isinstance(node, ast.ClassDef):
                scan(node.body)
                continue
            for n in ast.walk(node):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    continue
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                        and n.func.attr in ("get", "value") \
                        and NAME.search(ast.unparse(n.func.value)):
                    out.append(ast.unparse(n))

    scan(list(tree.body))
    return out


def test_no_ft_variable_is_read_at_import_time() -> None:
    bad = {}
    for p in _files(".py"):
        if p.parts[len(ROOT.parts)] == "tests" or p == ROOT / "freetoken" / "envs.py":
            continue
        reads = import_time_reads(ast.parse(p.read_text(), str(p)))
        if reads:
            bad[str(p.relative_to(ROOT))] = reads
    assert not bad, f"FT_* read at import time (read at the call instead): {bad}"


def test_the_import_time_finder_finds_planted_reads() -> None:
    src = ("ISA = FT_CPU_ISA.get()\nclass C:\n    x = envs.FT_LOG_LEVEL.get()\n"
           "def f(a=FT_API_KEY.get()):\n    return FT_TEST_JOBS.get()\n")
    assert import_time_reads(ast.parse(src)) == ["FT_CPU_ISA.get()", "envs.FT_LOG_LEVEL.get()",
                                                 "FT_API_KEY.get()"]


def test_every_variable_has_a_kind_its_default_satisfies() -> None:
    """envs.py declares name, kind, default and doc (issue 21's `envs.py`): each default
    reads back under its kind, and a value of the wrong kind is refused naming the variable."""
    for v in envs.ALL:
        assert v.kind in envs.KINDS and v.doc, v.name
        assert v.value({}) == (int(v.default) if v.kind == "count" and v.default else v.default)
        if v.kind == "count":
            for bad in ("-1", "two", "1.5", ""):
                with pytest.raises(ValueError, match=v.name):
                    v.value({v.name: bad})
        if v.kind == "choice":
            assert v.default in v.choices
            with pytest.raises(ValueError, match=v.name):
                v.value({v.name: "no-such-choice"})
    assert envs.FT_CPU_ISA.value({"FT_CPU_ISA": "avx2"}) == "avx2"
    with pytest.raises(ValueError, match="kind"):
        envs.EnvVar("FT_X", None, "x", "number")

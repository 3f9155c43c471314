"""The moves of issue #21 are done, not shadowed: no "from" file of its Moves table is left
(a re-export shim included), no moved name is still defined where it came from, and the files
its Delete list names are gone. Bug it catches: an import surface kept "where it was" (the
`experts/bandwidth.py` shim over calibrate.py), which keeps the lab's helpers inside the expert
runtime and lets new code import the old path, or a moved function defined twice."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.structure.test_import_layers import ROOT

GONE = [
    # Moves (from -> to)
    "freetoken/layers/expert_backend.py",  # -> experts/base.py
    "freetoken/experts/setup.py",  # -> experts/runtime.py, types/config.py
    "freetoken/experts/backends.py",  # -> experts/offload.py, split.py, auto.py
    "freetoken/experts/bandwidth.py",  # -> experts/calibrate.py, bench/bandwidth.py
    "freetoken/experts/random_fill.py",  # -> experts/calibrate.py
    "freetoken/experts/record.py",  # -> bench/routing_trace.py
    "freetoken/experts/cpu_bridge.py",  # -> experts/bridge.py, experts/runtime.py
    "freetoken/cli.py", "freetoken/cli_options.py",  # -> cli/__init__.py, cli/options.py
    "freetoken/engine/cli_generate.py", "freetoken/server/cli_serve.py",
    "freetoken/server/cli_ctl.py", "freetoken/proxy/cli_proxy.py",
    "freetoken/proxy/cli_launch.py",  # -> cli/generate.py, serve.py, ctl.py, proxy.py, launch.py
    "tests/engine/test_moe_backends.py", "tests/engine/test_prefill_stream.py",  # tests/experts
    "tests/engine/test_snapshot_tiers.py",  # -> tests/scheduler
    "tests/engine/test_options.py",  # -> tests/cli
    "tests/cache/test_bench_anchors.py",  # -> tests/bench
    "tests/kernels_triton", "tests/kernels_triton_attn",
    "tests/kernels_triton_engine",  # -> tests/kernels/triton/{moe,attn,engine}
    # Delete
    "scripts/bench_handoff.py", "scripts/bench_bridge.py", "scripts/gpu_run.sh",
]
# (file, names it must no longer define): the moved functions and constants
NOT_DEFINED = {
    "freetoken/layers/moe.py": {"expert_group_forward", "GATHER_MAX_ENTRIES",
                                "gathered_experts", "dispatch_experts", "run_experts",
                                "FusedExperts"},
    "freetoken/layers/fast_ops.py": {"fused_moe", "shared_expert", "SHARED_DECODE_MAX_T",
                                     "triton_module", "triton_for"},
    "freetoken/engine/async_engine.py": {"build_engine", "kv_pool_tokens", "default_kv_tokens",
                                         "default_chunk_tokens", "STREAM_CHUNK_TOKENS"},
    "freetoken/engine/core.py": {"_launch_ahead", "_settle_ahead", "_on_token"},
    "freetoken/kernels/triton/fused_moe.py": {"_block", "check_args", "interpreting"},
    "harness_adapters/base.py": {"digest"},
    "freetoken/kernels/cpu/expert_ops.py": {"cpu_experts_ref"},
    "freetoken/experts/calibrate.py": {"measure_b_h", "device_can_read"},  # dead: deleted
    "freetoken/models/loader.py": {"load_with_experts"},  # the composition: cli/build.py
}
# where the moved names live now (one definition each)
HOMES = {
    "freetoken/experts/ffn.py": {"expert_group_forward", "dispatch_experts", "run_experts"},
    "freetoken/experts/fused.py": {"FusedExperts"},
    "freetoken/kernels/dispatch.py": {"triton_module", "triton_for"},
    "freetoken/cli/build.py": {"build_engine", "load_with_experts"},
    "freetoken/engine/sizing.py": {"kv_pool_tokens", "default_kv_tokens", "default_chunk_tokens"},
    "freetoken/kernels/triton/moe_common.py": {"_block", "check_args", "interpreting"},
    "harness_adapters/normalise.py": {"digest"},
    "freetoken/scheduler/overlap.py": {"schedule_ahead"},
    "freetoken/scheduler/finish.py": {"postprocess"},
}


def defined(path: Path) -> set[str]:
    """Top-level and class-level names `path` defines (functions, classes, assignments)."""
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


def test_no_moved_file_is_left() -> None:
    left = [p for p in GONE if (ROOT / p).exists()]
    assert not left, f"moved or deleted by issue #21, still here: {left}"


def test_no_moved_name_is_defined_where_it_came_from() -> None:
    bad = {f: sorted(defined(ROOT / f) & names) for f, names in NOT_DEFINED.items()
           if defined(ROOT / f) & names}
    assert not bad, f"moved names still defined at their old home: {bad}"


def test_each_moved_name_has_its_new_home() -> None:
    missing = {f: sorted(names - defined(ROOT / f)) for f, names in HOMES.items()
               if names - defined(ROOT / f)}
    assert not missing, f"moved names missing from their new home: {missing}"


def test_defined_sees_functions_classes_and_constants(tmp_path) -> None:
    p = tmp_path / "m.py"
    p.write_text("X = 1\nY: int = 2\ndef f(): pass\nclass C:\n    def g(self): pass\n"
                 "import os\n")
    assert defined(p) == {"X", "Y", "f", "C", "g"}


# Delete: the dead functions (anywhere in the product), and the lab's conventions in the README
DEAD = {"measure_b_h", "device_can_read", "sized_fn"}
DEAD_METHODS = {("SamplingRows", "narrow")}
LAB_IN_README = ("gpu_run.sh", ".whl/", ".jitcache/", "$OUT")


def test_the_dead_functions_are_gone() -> None:
    found = []
    for top in ("freetoken",):
        for p in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(p.read_text(), str(p))
            found += [f"{p.relative_to(ROOT)}: {n.name}" for n in ast.walk(tree)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.name in DEAD]
            found += [f"{p.relative_to(ROOT)}: {c.name}.{f.name}" for c in ast.walk(tree)
                      if isinstance(c, ast.ClassDef) for f in c.body
                      if isinstance(f, ast.FunctionDef) and (c.name, f.name) in DEAD_METHODS]
    assert not found, f"deleted by issue #21, defined again: {found}"


def test_the_readme_has_no_lab_conventions() -> None:
    """The device machine's conventions (wheels in .whl/, the compile cache carried as
    .jitcache/, results under $OUT) are docs/testing.md's, not the README's."""
    text = (ROOT / "README.md").read_text()
    assert not [c for c in LAB_IN_README if c in text]
    assert "gpu_check.sh" in text and ".jitcache/" in (ROOT / "docs" / "testing.md").read_text()

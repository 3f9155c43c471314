"""The CUDA decode step's kernel inventory, counted on the CPU: the tiny hybrid model's decode
step through the graph runner's static buffers with every `fast_ops` switch pointed at our
Triton kernels (run by the interpreter on CPU tensors) and the paged attention on the Triton
kernel, i.e. the code path a CUDA graph captures. Counted, not measured: each aten op that
launches work counts 1 (views, `empty` and other metadata ops count 0), each Triton launch 1.
cuBLAS may add a split-K reduce to a GEMM, and flashinfer replaces the two Triton attention
launches on the H200; neither shows here.

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python -m tests.kernels.triton.engine.inventory

TRITON_INTERPRET must be set before the kernel modules are imported.
"""
from __future__ import annotations

import collections
import contextlib
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch no kernel on CUDA (metadata, allocation, views)
FREE = {
    "view", "_unsafe_view", "reshape", "slice", "split", "split_with_sizes", "select", "t",
    "transpose", "expand", "unsqueeze", "squeeze", "as_strided", "detach", "alias", "empty",
    "empty_like", "empty_strided", "permute", "lift_fresh", "unbind", "narrow", "_reshape_alias",
    "new_empty", "new_empty_strided", "unflatten", "flatten", "view_as", "expand_as",
}


FREE |= {"promote_types", "result_type", "size", "stride", "dim", "is_nonzero"}
# composite ops the mode sees whole: a launch only when they had to copy
MAYBE_COPY = {"reshape", "contiguous", "to", "type_as", "flatten", "view_as", "float"}
FREE -= MAYBE_COPY


def _same_storage(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


class Ops(TorchDispatchMode):
    """Counts launches per scope ("step", or the decoder layer "L<i>:<kind>" running), as
    `ops[(scope, name)]`. The interpreter's own tensor traffic inside a Triton launch is not
    counted."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[tuple[str, str]] = collections.Counter()
        self.scope = "step"
        self.in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.in_kernel or name in FREE:
            return out
        if name in MAYBE_COPY and _same_storage(args[0], out):  # a view or its input itself
            return out
        self.ops[(self.scope, name)] += 1
        return out


@contextlib.contextmanager
def count_triton(mode: Ops):
    from triton.runtime.interpreter import InterpretedFunction

    orig = InterpretedFunction.run

    def run(self, *args, **kwargs):
        mode.ops[(mode.scope, "triton:" + self.fn.__name__)] += 1
        mode.in_kernel = True
        try:
            return orig(self, *args, **kwargs)
        finally:
            mode.in_kernel = False

    InterpretedFunction.run = run
    try:
        yield
    finally:
        InterpretedFunction.run = orig


@contextlib.contextmanager
def layer_scopes(model, mode: Ops):
    hooks = []
    for i, layer in enumerate(model.model.layers):
        kind = "gdn" if layer.is_linear else "attn"

        def pre(m, a, tag=f"L{i}:{kind}"):
            mode.scope = tag

        def post(m, a, o):
            mode.scope = "step"

        hooks += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def cuda_path():
    """Point the kernels' one switch (freetoken/kernels/dispatch.py) at the Triton kernels for CPU
    tensors too (interpreted), and cut the paged attention to 2 splits (the H200 default of
    ~64 costs seconds per interpreted step; the launches are the same two). Returns an undo
    callable."""
    import freetoken.kernels.triton.paged_attention as pa
    from freetoken.kernels import dispatch

    orig, splits = dispatch.triton_for, pa.default_num_splits
    dispatch.triton_for = lambda x, name: dispatch.triton_module(name)
    pa.default_num_splits = lambda *a, **k: 2

    def undo() -> None:
        dispatch.triton_for, pa.default_num_splits = orig, splits

    return undo


def decode_runner(model_dir, rows: int, dtype: torch.dtype = torch.bfloat16):
    """A decode runner on the tiny model with its attention on the Triton kernel, warmed by one
    step; returns (runner, rows, bucket)."""
    from freetoken.engine.attention_plans import TritonDecode  # noqa: F401
    from freetoken.engine.core import EngineCore
    from freetoken.engine.decode_staging import DecodeRow
    from freetoken.models.loader import load_model

    model = load_model(model_dir, dtype=dtype, progress=False)
    core = EngineCore(model, [2], kv_tokens=256, state_slots=8, max_running=4,
                      decode_runner=True)
    runner = core.runner
    runner.attention = "triton"
    dec = [DecodeRow(token=5 + b, position=10, out_slot=20 * b + 10, state_slot=b,
                     kv_slots=torch.arange(20 * b, 20 * b + 11)) for b in range(rows)]
    runner.step(dec)
    return runner, dec, runner.bucket(rows)


def count_step(model_dir, rows: int = 1, dtype: torch.dtype = torch.bfloat16
               ) -> collections.Counter:
    """Launches of one decode step on the CUDA path: {(scope, op): count}, scope "step" or
    "L<i>:gdn" / "L<i>:attn" for decoder layer i."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 before importing the kernels")
    undo = cuda_path()
    try:
        runner, dec, bk = decode_runner(model_dir, rows, dtype)
        _, total = runner._stage(dec, bk.size)
        runner._upload(bk.size, total)
        attn = runner._attn(bk, dec)
        mode = Ops()
        with mode, count_triton(mode), layer_scopes(runner.model, mode):
            runner._forward(bk.size, attn, greedy=True)
    finally:
        undo()
    return mode.ops


def per_layer(ops: collections.Counter) -> dict[str, collections.Counter]:
    """{"gdn" / "attn": the ops of the first gated-DeltaNet / attention layer past layer 0 (a
    steady-state layer: layer 0 also runs the model's first input norm, which later layers get
    from the previous layer's combine), "step": outside the layers}."""
    out: dict[str, collections.Counter] = {}
    for (scope, name), n in ops.items():
        out.setdefault(scope, collections.Counter())[name] += n
    firsts: dict[str, collections.Counter] = {"step": out.get("step", collections.Counter())}
    for scope in sorted(out, key=lambda s: int(s[1:].split(":")[0]) if s != "step" else -1):
        if scope == "step" or scope.startswith("L0:"):
            continue
        firsts.setdefault(scope.split(":")[-1], out[scope])
    return firsts


def main() -> None:
    import tempfile

    from tests.models.fixtures import build_tiny_hf

    with tempfile.TemporaryDirectory() as d:
        path = build_tiny_hf("qwen3_5_moe", d, dtype=torch.float32)
        ops = count_step(path, 1)
    print(f"{sum(ops.values())} launches per decode step (tiny model, 4 layers, batch 1)")
    for kind, c in per_layer(ops).items():
        print(f"-- {kind}: {sum(c.values())}")
        for k, v in sorted(c.items(), key=lambda kv: -kv[1]):
            print(f"{v:4d}  {k}")


if __name__ == "__main__":
    main()

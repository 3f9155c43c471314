"""Count the work of decode steps instead of timing them: every aten op each step dispatches
(with its shapes, the decoder layer it ran in, and whether it ran inside the decode runner's
`_forward`, the region a CUDA graph captures), and every host sync (a read of a tensor's
values on the host: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()/int()/float()` of
a tensor, `nonzero`, `torch.cuda.synchronize`, an event's `synchronize`), each with the first
freetoken/kernels frame that called it.

At ~2 ms a token on the H200 a decode step is launch-bound: a few more kernels a layer inside
the graph, one more launch outside it, or one host sync a step shows up as a few per cent of
tok/s, and timing on a shared CPU cannot see that; counts can. `scripts/profile_decode.py
--count` drives the bench's and the server's steps under `StepOps`; tests/bench/
test_decode_step_ops.py holds the served step to its counts.

This module imports nothing of freetoken (the profile script loads it by path to count an
older checkout of the engine with the same counter).

On the CPU every tensor is a host tensor, so a "sync" there is a read the GPU path would pay
for only when the tensor lives on the device: the call site says which (the runner's read of
its pinned output buffer is the one read back a step needs).
"""
from __future__ import annotations

import sys
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that do no device work (views, metadata): not counted as launches
_FREE = {"view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze",
         "expand", "permute", "transpose", "t", "alias", "detach", "_reshape_alias",
         "reshape", "unbind", "split", "split_with_sizes", "chunk", "narrow", "lift_fresh",
         "view_as_real", "view_as_complex", "_to_copy_meta", "sym_size", "sym_stride",
         "sym_numel", "sym_storage_offset", "is_contiguous", "dim", "size", "stride",
         "numel", "_local_scalar_dense", "diagonal", "unfold", "movedim", "flatten",
         "unflatten", "squeeze_", "unsqueeze_", "as_strided_", "set_",
         "_has_compatible_shallow_copy_type", "_nested_tensor_size", "clone_meta", "resolve_conj",
         "resolve_neg", "conj", "_conj", "_neg_view", "empty", "empty_strided", "empty_like"}
_FREE |= {"promote_types", "result_type", "is_nonzero", "new_empty", "new_empty_strided",
          "view_as", "expand_as"}
# composite ops seen whole: a launch only when they had to copy
_MAYBE_COPY = {"reshape", "contiguous", "to", "type_as", "flatten", "view_as", "float"}
_FREE -= _MAYBE_COPY
_SYNC_OPS = {"nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique2",
             "unique_consecutive", "repeat_interleave_Tensor"}


@dataclass
class Op:
    name: str  # aten overload packet name ("mm", "index_select", ...)
    shapes: tuple  # input tensor shapes
    region: str  # "graph" (inside the runner's _forward) or "host"
    layer: int  # decoder layer index, -1 outside the layers
    site: str = ""  # first freetoken/kernels frame (host ops and syncs only)

    def key(self) -> str:
        return f"{self.name}{list(self.shapes)}"


@dataclass
class StepLog:
    """The ops and syncs of one window (a step, or several: divide by `steps`)."""

    ops: list[Op] = field(default_factory=list)
    syncs: list[tuple[str, str]] = field(default_factory=list)  # (kind, site)
    # Python function calls outside the graph region, by file (the host's own work: at ~2 ms
    # a GPU step, it is what a step costs beyond its launches; deterministic, unlike timing)
    calls: Counter = field(default_factory=Counter)
    steps: int = 1

    def launches(self, region: str | None = None) -> int:
        return sum(1 for o in self.ops if o.name not in _FREE
                   and (region is None or o.region == region))

    def by_layer(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for o in self.ops:
            if o.name not in _FREE and o.region == "graph":
                out.setdefault(o.layer, []).append(o.key())
        return out

    def host_sites(self) -> Counter:
        return Counter(f"{o.name} @ {o.site}" for o in self.ops
                       if o.region == "host" and o.name not in _FREE)

    def sync_sites(self) -> Counter:
        return Counter(f"{k} @ {s}" for k, s in self.syncs)

    def summary(self) -> dict:
        n = max(1, self.steps)
        return {"steps": self.steps,
                "graph_ops_per_step": round(self.launches("graph") / n, 2),
                "host_ops_per_step": round(self.launches("host") / n, 2),
                "syncs_per_step": round(len(self.syncs) / n, 2),
                "host_py_calls_per_step": round(sum(self.calls.values()) / n, 1)}

    def call_files(self, top: int = 12) -> list[tuple[str, float]]:
        n = max(1, self.steps)
        return [(f, round(c / n, 1)) for f, c in self.calls.most_common(top)]


def _same_storage(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _site() -> str:
    """The innermost frame in freetoken/ (the kernels included; not this module): file:line
    function."""
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if ("freetoken" in fn or "profile_decode" in fn) \
                and not fn.endswith("step_ops.py"):
            parts = fn.replace("\\", "/").split("/")
            short = "/".join(parts[-2:])
            return f"{short}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "?"


class StepOps(TorchDispatchMode):
    """Records the ops of the thread that entered it (other threads' ops, the CPU bridge's
    worker for instance, are not the step's launches) into `log`. Use `tag_model(model)` for
    layer indices and `tag_forward(cls)` for the graph region; `window()` starts a new log."""

    def __init__(self) -> None:
        super().__init__()
        self.log = StepLog()
        self.region = "host"
        self.layer = -1
        self._thread = threading.get_ident()
        self._in_kernel = 0  # inside an interpreted Triton launch
        self._undo: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if threading.get_ident() != self._thread or self._in_kernel:
            return out
        name = func.overloadpacket.__name__
        if name in _MAYBE_COPY and _same_storage(args[0] if args else None, out):
            return out  # a view, or its input itself: no kernel
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        site = _site() if self.region == "host" or name in _SYNC_OPS else ""
        self.log.ops.append(Op(name, shapes, self.region, self.layer, site))
        if name in _SYNC_OPS and name != "_local_scalar_dense":
            self.log.syncs.append((name, site))
        return out

    def _profile(self, frame, event, _arg) -> None:
        if event == "call" and self.region == "host" and not self._in_kernel:
            fn = frame.f_code.co_filename
            if fn.endswith("step_ops.py"):  # the counter's own hooks
                return
            i = fn.rfind("freetoken/")  # (the kernels are freetoken/kernels/)
            if i >= 0:  # the project's own Python (torch's and the mode's are not ours)
                self.log.calls[fn[i:]] += 1

    def count_calls(self) -> None:
        """Count Python calls (of this thread) outside the graph region into `log.calls`."""
        sys.setprofile(self._profile)
        self._undo.append(lambda: sys.setprofile(None))

    def new_window(self, steps: int = 1) -> StepLog:
        """Close the current log (returned) and start an empty one."""
        done, self.log = self.log, StepLog()
        done.steps = steps
        return done

    # -- tagging ------------------------------------------------------------------------------

    def tag_model(self, model) -> None:
        """Layer indices from forward hooks on `model.model.layers`."""
        for i, layer in enumerate(model.model.layers):
            def pre(_m, _a, _i=i):
                self.layer = _i

            def post(_m, _a, _o):
                self.layer = -1

            self._undo.append(layer.register_forward_pre_hook(pre).remove)
            self._undo.append(layer.register_forward_hook(post).remove)

    def tag_forward(self, cls, name: str = "_forward") -> None:
        """Ops inside `cls.<name>` (the decode runner's captured step) are region "graph"."""
        orig = getattr(cls, name)
        mode = self

        def wrapped(*a, **k):
            prev, mode.region = mode.region, "graph"
            try:
                return orig(*a, **k)
            finally:
                mode.region = prev

        setattr(cls, name, wrapped)
        self._undo.append(lambda: setattr(cls, name, orig))

    def patch_syncs(self) -> None:
        """Count host reads of tensor values (the calling thread's only)."""
        mode = self
        T = torch.Tensor
        for meth in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__",
                     "__index__"):
            orig = getattr(T, meth)

            def wrapped(t, *a, _orig=orig, _m=meth, **k):
                if threading.get_ident() == mode._thread and not _is_meta(t):
                    mode.log.syncs.append((_m.strip("_"), _site()))
                return _orig(t, *a, **k)

            setattr(T, meth, wrapped)
            self._undo.append(lambda _m=meth, _o=orig: setattr(T, _m, _o))
        for owner, meth in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize")):
            orig = getattr(owner, meth)

            def wrapped_sync(*a, _orig=orig, _m=meth, _o=owner, **k):
                if threading.get_ident() == mode._thread:
                    kind = "event_sync" if _o is torch.cuda.Event else "cuda_sync"
                    mode.log.syncs.append((kind, _site()))
                return _orig(*a, **k)

            setattr(owner, meth, wrapped_sync)
            self._undo.append(lambda _o=owner, _m=meth, _f=orig: setattr(_o, _m, _f))

    def count_triton(self) -> None:
        """Count Triton launches (the interpreter's, TRITON_INTERPRET=1: the CUDA path run on
        CPU tensors) as ops `triton:<kernel>`; the interpreter's own tensor work inside a
        launch is not counted."""
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:
            return
        orig = InterpretedFunction.run
        mode = self

        def run(fn, *a, **k):
            if threading.get_ident() != mode._thread:
                return orig(fn, *a, **k)
            mode.log.ops.append(Op("triton:" + fn.fn.__name__, (), mode.region, mode.layer,
                                   _site() if mode.region == "host" else ""))
            mode._in_kernel += 1
            try:
                return orig(fn, *a, **k)
            finally:
                mode._in_kernel -= 1

        InterpretedFunction.run = run
        self._undo.append(lambda: setattr(InterpretedFunction, "run", orig))

    def untag(self) -> None:
        while self._undo:
            self._undo.pop()()


def _is_meta(t) -> bool:
    try:
        return t.device.type == "meta"
    except Exception:  # noqa: BLE001
        return False


@contextmanager
def counting(model=None, runner_cls=None):
    """`StepOps` entered, with the model's layers tagged, `runner_cls._forward` as the graph
    region and the host reads patched; everything undone on exit."""
    mode = StepOps()
    if model is not None:
        mode.tag_model(model)
    if runner_cls is not None:
        mode.tag_forward(runner_cls)
    mode.patch_syncs()
    mode.count_triton()
    mode.count_calls()
    try:
        with mode:
            yield mode
    finally:
        mode.untag()


def diff_layers(a: StepLog, b: StepLog) -> list[str]:
    """Per decoder layer, the graph-region ops one step of `a` has and `b` lacks and the other
    way round (multisets of `op[shapes]`), one line per layer that differs."""
    la, lb = a.by_layer(), b.by_layer()
    out = []
    for layer in sorted(set(la) | set(lb)):
        ca = Counter(la.get(layer, []))
        cb = Counter(lb.get(layer, []))
        na, nb = a.steps or 1, b.steps or 1
        ca = Counter({k: v // na for k, v in ca.items() if v // na})
        cb = Counter({k: v // nb for k, v in cb.items() if v // nb})
        if ca != cb:
            out.append(f"layer {layer}: {sum(ca.values())} vs {sum(cb.values())} ops; "
                       f"only first: {dict(ca - cb)}; only second: {dict(cb - ca)}")
    return out


_RUNTIME = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync",
            "cudaMemsetAsync", "cudaEventSynchronize", "cudaStreamSynchronize",
            "cudaDeviceSynchronize", "cudaEventRecord", "cudaStreamWaitEvent")


def cuda_counts(step, steps: int) -> dict:
    """On CUDA: `steps` calls of `step()` under torch.profiler, per step: kernels run on the
    device (graph replays' kernels included), memcpys, device time (ms), and the host's CUDA
    runtime calls by name (each launch or sync outside a graph is one of them)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    dev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    mem = [e for e in dev if "memcpy" in e.name.lower() or "memset" in e.name.lower()]
    api = Counter(e.name for e in prof.events() if e.name in _RUNTIME)
    return {"kernels_per_step": round((len(dev) - len(mem)) / steps, 1),
            "memcpy_per_step": round(len(mem) / steps, 1),
            "device_ms_per_step": round(sum(e.device_time_total for e in dev) / 1e3 / steps, 3),
            "runtime_calls_per_step": {k: round(v / steps, 2) for k, v in sorted(api.items())}}

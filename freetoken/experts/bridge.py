"""The CPU expert branch of a captured decode step: the GPU hands each MoE layer's CPU share to a
host worker through flags in mapped pinned memory, with no host sync of the compute stream.

Per hybrid (or cpu) MoE layer m, inside the graph, in stream order:

1. `send(m, x, ids, cpu_mask)`: a kernel stores the layer's input rows, routed ids and CPU mask
   into pinned buffers through their mapped addresses, then a one-thread kernel stores the
   step's sequence number into `go[m]` (freetoken/kernels/triton/host_flags.py).
2. the GPU fills the fetched experts and computes the resident ones meanwhile;
3. `receive(m, mask, y)`: a one-thread kernel spins until `done[m]` holds the sequence number
   (not at all when the layer's CPU mask is empty: most layers, when the cache hits), then a
   kernel reads the CPU results of the masked rows from the pinned output into `y`.

The worker thread, told before each replay that step `seq` begins (`begin_step`), walks the
layers in order: it waits for `go[m] >= seq` (the GPU, which did not wait for layers without
CPU work, may already be in the next step: the buffers then hold that step's layer, whose own
pass computes it again before its `done`), computes the layer's masked entries (or nothing,
when the layer has no CPU work), writes the results into the pinned output and then stores
`done[m] = seq`. x86 stores are seen in program order, so the results are in place before the
flag the GPU is waiting on. Two ways to walk the layers:

- native (freetoken/kernels/cpu/bridge_kernel.cpp, whenever the C++ kernel is built and computes
  this step the way the Python path would: bf16 banks, or fp32 banks with one row): one call per
  step, the GIL released, one OpenMP team for every layer, whose thread 0 spins on the flags
  with `pause` and whose threads run each layer as soon as its flag arrives — no fork/join,
  futex wake or Python per layer. Each output row is the same dot products as `ft_cpu_experts`
  (bit-identical results).
- Python (the fallback): polls `go[m]` with `sleep(0)` (never holding the GIL against the
  thread that launched the graph) and calls `compute` per layer.

If the worker cannot answer (it died, or a layer took seconds), the wait kernel gives up after
a bounded number of polls and sets an error flag that `end_step` raises as an error, so a
broken host thread fails the step instead of hanging the GPU; the engine then drops the bridge
and serves on without it (EngineCore).

A step begun that will never send its remaining layers (its graph replay, or the eager run
through the runner, raised part-way: issue 22) is `abandon`ed: the layers it did not send get
an empty CPU mask and their `go` flag raised from the host, so the worker walks past them
computing nothing; once the worker is through, the device's step counter is set back to the
host's, so the next step's flags carry the number the worker waits for. Without that the worker
kept waiting inside the dead step while the next step waited for its `done` flags, until both
timed out and the bridge was dropped, failing the re-run rows.

The worker's own wait for a layer's `go` flag is bounded only for graph replays (`begin_step(
..., replay=True)`): their launch is one call and every layer's flag comes within the step's
GPU time. An eager step (the runner's warm-up and capture runs, buckets that run without a
graph) may compile kernels between two layers' sends — tens of seconds on a cold start — so
the worker waits for those flags without a clock; any later step's flags release it too
(`go[m] >= seq`), so a step that never sends cannot wedge it.

Why a spin-wait: it measured the fastest of the hand-offs (H200: 12.5 µs per layer bare,
6.5–7.5 µs with host work that overlaps the GPU's share; one graph per layer with a host sync
11–15 µs, host-function nodes 15–49 µs; the deleted scripts/bench_handoff.py, in git history).

Without CUDA (tests on the CPU) the same protocol runs with host writes for the flags and a
host spin for the wait, so the worker and the bookkeeping are exercised everywhere.

Shapes: L MoE layers, B rows of the bucket, K top-k, H hidden.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

from freetoken.kernels.cpu.bridge_ops import NativeBridge, native_supported
from freetoken.log import get_logger, kv

log = get_logger("experts")

# in a replayed step the worker gives up waiting for a layer after this long (the GPU side has
# its own bound); eager steps are not timed (module docstring)
WORKER_TIMEOUT_S = 10.0
# the native loop's "no bound" (seconds: about 30 years)
_UNBOUNDED_S = 1e9


class BridgeError(RuntimeError):
    """The CPU branch did not answer a captured step in time."""


class CpuBridge:
    def __init__(self, num_layers: int, max_rows: int, top_k: int, hidden: int,
                 dtype: torch.dtype, device: torch.device,
                 compute: Callable[[int, Tensor, Tensor, Tensor], Tensor],
                 banks: tuple[list[Tensor], list[Tensor]] | None = None,
                 threads: int | None = None,
                 sample: Callable[[int, float], None] | None = None):
        """`compute(m, x [B, H], ids [B, K], mask [B, K]) -> y [B, K, H]`: the CPU branch of
        MoE layer m on host tensors (entries outside the mask are not read). `banks`: every
        layer's (gate_up [E, 2I, H], down [E, H, I]) host banks, for the native step loop
        with `threads` threads (None: torch's thread count); without them, or without the C++
        kernel, every step takes the Python path. `sample(experts, seconds)`: told after each
        native step that computed something, the distinct experts it computed (summed over
        the layers) and its busy time (the call less its waits for the GPU's flags): the
        bandwidth re-profiler's B_H samples (experts/bw_track.py; the Python path is timed
        inside `compute`)."""
        self.L, self.B, self.K, self.H = num_layers, max_rows, top_k, hidden
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        pin = self.cuda
        L, B, K, H = num_layers, max_rows, top_k, hidden
        self.x = torch.zeros(L, B, H, dtype=dtype, pin_memory=pin)
        self.ids = torch.zeros(L, B, K, dtype=torch.int64, pin_memory=pin)
        self.mask = torch.zeros(L, B, K, dtype=torch.bool, pin_memory=pin)
        self.out = torch.zeros(L, B, K, H, dtype=dtype, pin_memory=pin)
        self.go = torch.full((L,), -1, dtype=torch.int64, pin_memory=pin)
        self.done = torch.full((L,), -1, dtype=torch.int64, pin_memory=pin)
        self._go_np, self._done_np = self.go.numpy(), self.done.numpy()
        self.seq_dev = torch.zeros(1, dtype=torch.int64, device=self.device)
        # set by a wait that gave up; in pinned memory (the wait kernel stores to it mapped),
        # so end_step reads it without a device sync that would wait for a step launched ahead
        self.err = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self.compute = compute
        self.sample = sample
        self.seq = 0  # host mirror of seq_dev after begin_step
        self._steps: deque[tuple[int, int, bool]] = deque()  # (seq, rows, replay) begun
        self._closed = False
        self._start = threading.Event()
        self._failed: BaseException | None = None
        self.busy_s = self.wait_go_s = 0.0  # worker time computing / waiting for layers
        self.steps_done = self.native_steps = 0
        self.last_run = 0  # the last step the worker went through (computed or abandoned)
        self.abandoned = 0  # steps abandoned part-way (`abandon`)
        self.native = _native(self, banks, threads)
        self._native_fp32 = banks is not None and banks[0][0].dtype == torch.float32
        self._thread = threading.Thread(target=self._worker, name="ft-cpu-bridge", daemon=True)
        self._thread.start()

    # -- device side (captured) -------------------------------------------------------------

    def send(self, m: int, x: Tensor, ids: Tensor, mask: Tensor) -> None:
        T = x.shape[0]
        if m == 0:
            self.seq_dev.add_(1)  # one step = one sequence number for every layer
        if self.cuda:
            from freetoken.kernels.triton.host_flags import raise_flag, store_rows

            store_rows(x, ids, mask, self.x[m, :T], self.ids[m, :T], self.mask[m, :T])
            raise_flag(self.go, m, self.seq_dev)
        else:
            self.x[m, :T].copy_(x)
            self.ids[m, :T].copy_(ids)
            self.mask[m, :T].copy_(mask)
            self._go_np[m] = int(self.seq_dev)

    def receive(self, m: int, mask: Tensor, y: Tensor) -> Tensor:
        """`y [T, K, H]` (the GPU's results, on the device) with the rows of `mask` [T, K] (the
        layer's CPU mask) replaced by the CPU branch's; when the mask is empty the GPU does not
        wait for the host."""
        T = y.shape[0]
        if self.cuda:
            from freetoken.kernels.triton.host_flags import merge_rows, wait_flag

            wait_flag(self.done, m, self.seq_dev, self.err, need=mask)
            return merge_rows(y, self.out[m, :T], mask)
        if bool(mask.any()):
            seq, t0 = int(self.seq_dev), time.perf_counter()
            while self._done_np[m] != seq:
                if self._failed is not None or time.perf_counter() - t0 > WORKER_TIMEOUT_S:
                    self.err.fill_(1)
                    break
                time.sleep(0)
        return torch.where(mask[..., None], self.out[m, :T], y)

    # -- host side ----------------------------------------------------------------------------

    def begin_step(self, rows: int, replay: bool = False) -> None:
        """Before launching step seq+1: a graph replay (`replay`), or an eager run through the
        runner, whose layers the worker waits for without a clock (it may compile kernels).
        Steps may be begun ahead of the worker (the runner launches step n+1 before step n's
        tokens are read): the worker runs them in order."""
        if self._failed is not None:
            raise BridgeError(f"the CPU branch worker failed: {self._failed!r}")
        if self._closed:
            raise BridgeError("the CPU bridge was closed")
        self.seq += 1
        self._steps.append((self.seq, rows, replay))
        self._start.set()

    @property
    def failed(self) -> bool:
        """Whether the worker has stopped on an error (every later step raises)."""
        return self._failed is not None

    @property
    def failure(self) -> BaseException | None:
        return self._failed

    def close(self) -> None:
        """Stop the worker once it has run the steps begun so far (the engine dropped this
        bridge); a closed bridge begins no step."""
        self._closed = True
        self._start.set()

    def join(self, timeout_s: float) -> bool:
        """Wait for a closed bridge's worker to return; True when it has."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def end_step(self) -> None:
        """After the step's tokens are back: raise if any layer's wait gave up."""
        if int(self.err[0]) != 0:
            self.err.zero_()
            raise BridgeError("a captured step's CPU branch did not answer "
                              f"(worker error: {self._failed!r})")

    def abandon(self) -> None:
        """The step begun last sends no more layers (its launch raised, before or after some
        of them; nothing of it is still running on the device): release the worker from it,
        wait until the worker has gone through every step begun, and set the device's step
        counter to the host's, so that the next step is numbered as the worker expects.
        Raises BridgeError when the worker has failed or does not get through within
        WORKER_TIMEOUT_S (the engine then drops the bridge)."""
        s = self.seq
        if self.cuda:
            try:  # (the layers the step did send are answered by the worker meanwhile)
                torch.cuda.synchronize()
            except RuntimeError as e:
                raise BridgeError(f"the device failed under the abandoned step: {e!r}") from e
        sent = [m for m in range(self.L) if self._go_np[m] >= s]
        for m in range(self.L):  # the worker reads a layer's mask only after its go flag
            if self._go_np[m] < s:
                self.mask[m].zero_()
                self._go_np[m] = s
        t0 = time.perf_counter()
        while self.last_run < s and self._failed is None:
            if time.perf_counter() - t0 > WORKER_TIMEOUT_S:
                raise BridgeError(f"the CPU branch did not get through abandoned step {s}")
            time.sleep(1e-4)
        if self._failed is not None:
            raise BridgeError(f"the CPU branch worker failed: {self._failed!r}")
        self.seq_dev.fill_(s)
        self.abandoned += 1
        log.warning(kv("cpu_bridge_abandoned", seq=s, layers_sent=len(sent), layers=self.L,
                       waited_ms=f"{(time.perf_counter() - t0) * 1e3:.1f}"))

    def _worker(self) -> None:
        while True:
            self._start.wait()
            self._start.clear()
            while self._steps:
                seq, T, replay = self._steps.popleft()
                if not self._run(seq, T, WORKER_TIMEOUT_S if replay else None):
                    return
            if self._closed:
                return

    def _run(self, seq: int, T: int, timeout_s: float | None) -> bool:
        """One step's layers; False (and the error kept for begin_step / end_step) on failure."""
        try:
            # fp32 banks: the Python path computes several rows with grouped F.linear, the
            # native loop with the C++ kernel — equal only for one row
            if self.native is not None and (T == 1 or not self._native_fp32):
                self._native_step(seq, T, timeout_s)
            else:
                self._python_step(seq, T, timeout_s)
            self.steps_done += 1
            self.last_run = seq
        except BaseException as e:  # noqa: BLE001 — reported by begin_step / end_step
            self._failed = e
            log.error(kv("cpu_bridge_failed", seq=seq, error=repr(e)[:200]))
            return False
        return True

    def _native_step(self, seq: int, T: int, timeout_s: float | None) -> None:
        assert self.native is not None
        st = self.native.run_step(seq, T, _UNBOUNDED_S if timeout_s is None else timeout_s)
        self.wait_go_s += st.wait_s
        self.busy_s += st.busy_s
        self.native_steps += 1
        if self.sample is not None and st.experts:
            self.sample(st.experts, st.busy_s)
        if st.max_wait_s > 0.05:
            log.warning(kv("cpu_bridge_slow", seq=seq, layer=st.max_wait_layer,
                           waited_ms=f"{st.max_wait_s * 1e3:.1f}"))

    def _python_step(self, seq: int, T: int, timeout_s: float | None) -> None:
        go, done = self._go_np, self._done_np
        for m in range(self.L):
            t0 = time.perf_counter()
            while go[m] < seq:
                if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                    raise BridgeError(f"layer {m} of step {seq} never arrived")
                time.sleep(0)
            t1 = time.perf_counter()
            self.wait_go_s += t1 - t0
            if t1 - t0 > 0.05:
                log.warning(kv("cpu_bridge_slow", seq=seq, layer=m,
                               waited_ms=f"{(t1 - t0) * 1e3:.1f}"))
            mask = self.mask[m, :T]
            if bool(mask.any()):
                y = self.compute(m, self.x[m, :T], self.ids[m, :T], mask)  # [T, K, H]
                self.out[m, :T].copy_(y)
            done[m] = seq
            self.busy_s += time.perf_counter() - t1


def _native(bridge: CpuBridge, banks: tuple[list[Tensor], list[Tensor]] | None,
            threads: int | None) -> NativeBridge | None:
    """The step loop over `bridge`'s buffers, or None (no banks, no C++ kernel, a dtype it
    does not take: the Python path then)."""
    if banks is None or not native_supported(banks[0][0].dtype, bridge.x.dtype):
        return None
    from freetoken.kernels.cpu.ext import load_kernel

    kern = load_kernel()
    if kern is None:
        return None
    nth = threads if threads is not None else torch.get_num_threads()
    return NativeBridge(kern, banks[0], banks[1], bridge.x, bridge.ids, bridge.mask,
                        bridge.out, bridge.go, bridge.done, nth)

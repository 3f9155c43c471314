"""CUDA graph capture of the decode runner's buckets (engine/graph_runner.py).

Each bucket (a batch size the runner pads a step to) holds up to two graphs, greedy and
sampling, captured on the runner's static buffers with every row a padding row (their KV and
state go to the scratch slots, their experts are masked): the warm-up runs before a capture
touch nothing live. A bucket is captured by the idle warm-up (`where=idle`) or lazily in the
first step that needs it (`where=step`); a capture that fails (a host sync or an uncapturable
op in the step, or another thread's work that invalidated it) is retried up to CAPTURE_TRIES
times, then the bucket decodes eagerly for good. Graphs are dropped whenever what they read
changes (a re-budgeted slot cache, a new KV or state pool, the CPU bridge dropped, a switch of
the attention plan, a replay fault) and captured again at their bucket's next step.

`GraphCapture` is a mixin of `DecodeRunner`: it uses the runner's buckets, staging, `_attn`,
`_forward`, `bridge`, `moe`, `use_graphs` and `_pool`, set by `DecodeRunner.__init__`.
"""
from __future__ import annotations

import time

import torch

from freetoken.layers.step_context import PagedDecode
from freetoken.log import get_logger, kv

log = get_logger("graph")
warm_log = get_logger("warmup")


def buckets_for(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 16 up to max_batch (always including max_batch)."""
    out = [b for b in (1, 2, 4, 8, 16) if b < max_batch]
    b = 32
    while b < max_batch:
        out.append(b)
        b += 16
    return sorted(set(out + [max_batch]))


# a bucket whose capture failed this many times decodes eagerly from then on (a failure can be
# transient: work of another thread that invalidated the capture)
CAPTURE_TRIES = 3


class Bucket:
    """One batch size the runner pads a step to: its graphs (greedy and sampling), failed
    capture tries, and its attention plan (`attention_plans.bucket_plan`, made on first use)."""

    def __init__(self, size: int):
        self.size = size
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}  # greedy? -> graph
        self.failures = 0  # failed captures since the graphs were last dropped
        self.attn: PagedDecode | None = None

    @property
    def failed(self) -> bool:
        return self.failures >= CAPTURE_TRIES


class GraphCapture:
    capture_s: float  # seconds spent capturing graphs (idle or in steps)

    def graphs_held(self) -> int:
        return sum(len(b.graphs) for b in self.buckets.values())

    def _drop_graphs(self) -> int:
        """Forget every graph (and each bucket's failed tries); returns how many there were.
        The next captures go to a new memory pool: the old one outlives its graphs while
        tensors allocated in their captures are alive, and capturing into a pool whose graphs
        are all gone trips the caching allocator's `use_count > 0` assert (every recapture
        after a slot-cache resize failed that way on the H200, 2026-12-03); its memory is
        freed as those tensors go."""
        n = self.graphs_held()
        for b in self.buckets.values():
            b.graphs.clear()
            b.failures = 0
        if n and self._pool is not None:
            self._pool = torch.cuda.graph_pool_handle()
        return n

    def capture_bucket(self, size: int, greedy: bool, where: str = "idle") -> bool:
        """Capture one bucket's graph unless it is held, failed, or graphs are off; returns
        whether one was captured. Logs `ft.warmup: captured ... seconds=` (`where`: idle, a
        warm-up between steps, or step, lazily in the first step that needs it). An idle
        capture is a safe point first: a finished attention build switches the plan before
        the graph is captured on it (`PlanSwitch.at_safe_point`)."""
        if where == "idle":
            self.at_safe_point()
        bk = self.buckets[size]
        if not self.use_graphs or bk.failed or greedy in bk.graphs:
            return False
        t0 = time.perf_counter()
        g = self._capture(bk, greedy)
        dt = time.perf_counter() - t0
        self.capture_s += dt
        warm_log.info(kv("captured", bucket=size, greedy=greedy, where=where,
                         seconds=f"{dt:.2f}", ok=g is not None, attention=self.attention))
        if g is None:
            return False
        bk.graphs[greedy] = g
        return True

    def _capture(self, bk: Bucket, greedy: bool) -> torch.cuda.CUDAGraph | None:
        """Capture the bucket's step; the warm-up runs before it use the scratch slots only.
        The seam a CPU test replaces (no CUDA graphs there) with a stand-in handle."""
        Bk = bk.size
        self.drain()
        ptr, total = self._stage([], Bk)  # every row a padding row
        self._upload(Bk, total)
        attn = self._attn(bk, None)
        if hasattr(attn, "prepare"):
            attn.prepare(ptr, total)
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    if self.bridge is not None:
                        self.bridge.begin_step(Bk)
                    self._forward(Bk, attn, greedy)
                    torch.cuda.synchronize()
                    if self.bridge is not None:
                        self.bridge.end_step()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            # thread_local: only this thread's unsafe calls break the capture; the state host
            # tier's filler, the CPU bridge and the attention builder allocate pinned memory
            # or load libraries on their own threads meanwhile (in "global" mode a
            # cudaHostAlloc of another thread invalidated the capture, H200 2026-12-02)
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                self._forward(Bk, attn, greedy)
            torch.cuda.synchronize()
        except RuntimeError as e:  # a host sync or an uncapturable op somewhere in the step
            bk.failures += 1
            log.warning(kv("capture_failed", bucket=Bk, greedy=greedy, tries=bk.failures,
                           eager_from_now=bk.failed, error=repr(e)[:200]))
            torch.cuda.synchronize()
            return None
        finally:
            if self.moe is not None:  # the warm-up's routing is not the workload's
                self.moe.counters.discard_device()
        return g

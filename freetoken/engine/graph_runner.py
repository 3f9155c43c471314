"""Decode-only steps through static device buffers, captured once per batch-size bucket in a CUDA
graph and replayed (eagerly run through the same buffers on the CPU, with --no-cuda-graph, or
when a bucket cannot be captured).

The host stages each step's inputs in pinned memory and uploads them with one copy
(engine/decode_staging.py); the only read back is the sampled ids. `launch` and `collect` split a
step so the host stages step n+1 while step n runs: a row of step n+1 may take its input token
from step n's sampled ids on the device (`chain`). KV slots, state slots and the attention CSR
sit in device buffers the graph reads in place (layers/step_context.py); the MoE layers see a
`captured` MoEStep (types/forward_batch.py) carrying the runtime's CPU bridge.

A replay that raises, or that returns a row its step poisoned (FAILED_ROW where the eager
step need not have), is the graph's failure: the runner drops every graph, decodes eagerly
from then on and says so in one `ft.engine: graph_fault` line; the engine re-runs the rows
concerned alone from their cached prefix (engine/isolation.py: `GraphFault`,
`GRAPH_POISONED`). `_replay` is the seam a CPU test injects such a fault through.

A bucket larger than the batch is padded with rows that write to a scratch KV slot and a scratch
state slot (one of each reserved beyond what the allocators hand out) and whose routed experts
are masked to -1, so padding never moves an expert or touches live state.

Shapes: B rows of the step, Bk its bucket, V vocabulary, NB blocked stop ids per row.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from freetoken.cache.tensors import Caches
from freetoken.engine import gpu_sampler
from freetoken.engine.attention_plans import bucket_plan, choose_backend, choose_mla_backend
from freetoken.engine.decode_staging import (
    MAX_BLOCKED,
    DecodeRow,
    DecodeStaging,
    _Bucket,
    buckets_for,
)
from freetoken.engine.isolation import GRAPH_POISONED, GraphFault
from freetoken.layers.step_context import DecodeContext, PagedDecode, TorchPagedDecode
from freetoken.log import get_logger, kv
from freetoken.types.forward_batch import ForwardBatch, MoEStep

log = get_logger("graph")
warm_log = get_logger("warmup")
engine_log = get_logger("engine")


@dataclass(eq=False)
class Pending:
    """A launched step: its row count, the pinned buffer its ids land in and the event after
    that copy."""

    n: int
    out: Tensor
    done: object  # torch.cuda.Event on CUDA, None on the CPU (the step ran synchronously)
    bridged: bool
    replayed: bool = False  # from a graph (its poisoned rows are the graph's failure)


class DecodeRunner(DecodeStaging):
    def __init__(self, model, caches: Caches, max_batch: int, scratch_kv: int,
                 scratch_state: int | None, use_graphs: bool = True, attention: str = "auto",
                 moe=None):
        """`moe`: the model's expert runtime (experts/runtime.py), or None (every expert
        resident): it says whether the steps can be captured and lends the CPU bridge."""
        self.model, self.caches, self.moe = model, caches, moe
        cfg = model.cfg
        w = model.model.embed_tokens.weight
        self.device, self.dtype = w.device, w.dtype
        self.vocab = cfg.vocab_size
        self.scratch_kv, self.scratch_state = scratch_kv, scratch_state
        self.bridge = moe.bridge_for(max_batch) if moe is not None else None
        # every MoE layer must decode without host syncs (see MoERuntime.capturable)
        self.capturable = moe.capturable(self.bridge) if moe is not None else True
        self._generation = self._cache_generation()
        self._want_graphs = use_graphs
        self.use_graphs = use_graphs and self.device.type == "cuda" and self.capturable
        self.buckets = {b: _Bucket(b) for b in buckets_for(max_batch)}
        self.max_batch = max(self.buckets)
        Bm, d = self.max_batch, self.device
        pin = self.device.type == "cuda"
        self._init_staging(Bm, caches.kv.num_slots + Bm, pin)
        self.logits_rows = torch.arange(Bm, device=d)
        self.h_outs = [torch.zeros(Bm, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._last: Pending | None = None  # the step launched last (chain refers to its rows)
        self._open: list[Pending] = []  # launched and not collected yet (at most one before a
        # launch: its ids and the next step's land in the two alternating pinned buffers)
        # MLA (a latent pool, absorbed queries): its own Triton plan (no GQA kernel fits);
        # sink / sliding-window attention (gpt_oss) has no flashinfer / Triton plan yet: torch
        if self.device.type != "cuda" or cfg.attention_sinks:
            self.attention = "torch"
        elif cfg.is_mla:
            self.attention = choose_mla_backend(cfg)
        else:
            self.attention = choose_backend(attention, self.dtype, cfg.head_dim)
        if self.attention == "torch":  # per-row slot lists: not capturable
            self.use_graphs = False
        self._workspace = None
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.steps = self.replays = 0
        self.graph_faults = 0  # replays that raised or poisoned rows (graphs off after one)
        self.capture_s = 0.0  # seconds spent capturing graphs (idle or in steps)
        self.host_s = self.wait_s = 0.0  # staging + planning; launch to tokens on the host
        log.info(kv("decode_runner", buckets=list(self.buckets), graphs=self.use_graphs,
                    capturable=self.capturable,
                    attention=self.attention, kv_cap=self.caches.kv.num_slots + Bm))

    def _cache_generation(self) -> int:
        return self.moe.generation if self.moe is not None else 0

    def drop_bridge(self) -> None:
        """Serve on without the CPU bridge (its worker failed): steps in flight are dropped,
        every graph goes (they hold the bridge's flags), and the steps run eagerly wherever a
        layer needs the CPU (its backend then syncs with the host)."""
        br, self.bridge = self.bridge, None
        self._open.clear()
        self._last = None
        self._drop_graphs()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if br is not None and self.moe is not None:
            self.moe.drop_bridge(br)
        self.capturable = self.moe.capturable(None) if self.moe is not None else True
        self.use_graphs = (self._want_graphs and self.device.type == "cuda" and self.capturable
                           and self.attention != "torch")
        log.warning(kv("cpu_bridge_dropped", graphs=self.use_graphs, capturable=self.capturable))

    def _graph_fault(self, kind: str, bucket: int, rows: int, error: object) -> None:
        """A replay failed (module docstring): every graph goes, eager from here on."""
        self.graph_faults += 1
        was_on = self.use_graphs
        if self.device.type == "cuda":
            try:  # (no graph is destroyed while a replay of it may still run)
                torch.cuda.synchronize()
            except RuntimeError:
                pass
        self._drop_graphs()
        self._want_graphs = self.use_graphs = False
        if was_on:
            engine_log.warning(kv("graph_fault", kind=kind, bucket=bucket, rows=rows,
                                  error=repr(error)[:200], graphs="off", recovery="rows re-run "
                                  "alone, eagerly"))

    def _replay(self, graph: torch.cuda.CUDAGraph, bk: _Bucket, attn: PagedDecode,
                greedy: bool) -> None:
        """Replay `graph`, the capture of `bk`'s step for `greedy` (`attn`: the step's plan,
        which the graph reads from the static buffers it was captured on). The seam a CPU
        test injects a replay fault through: its stand-in runs `_forward` with the same
        arguments, then fails."""
        graph.replay()

    def _drop_graphs(self) -> None:
        for b in self.buckets.values():
            b.graphs.clear()
            b.failures = 0

    def bucket(self, n: int) -> _Bucket | None:
        for b in sorted(self.buckets):
            if b >= n:
                return self.buckets[b]
        return None

    def fits(self, rows: list[DecodeRow]) -> bool:
        return (0 < len(rows) <= self.max_batch
                and all(len(r.blocked) <= MAX_BLOCKED for r in rows))

    def _attn(self, bk: _Bucket, rows: list[DecodeRow] | None) -> PagedDecode:
        if self.attention == "torch":
            assert rows is not None
            slots = [r.kv_slots.to(self.device) for r in rows]
            slots += [torch.tensor([self.scratch_kv], device=self.device)] * (bk.size - len(rows))
            return TorchPagedDecode(slots)
        if bk.attn is None:
            bk.attn, self._workspace = bucket_plan(self.attention, bk.size, self.d_indptr,
                                                   self.d_indices, self.model.cfg, self.dtype,
                                                   self._workspace)
        return bk.attn

    def _forward(self, Bk: int, attn: PagedDecode, greedy: bool) -> None:
        """The whole decode step on the static buffers: forward, LM head, sampling into
        out_ids[:Bk]. Issues no host sync (this is what a graph captures)."""
        d = self.d_i64
        # staged ids, or the last step's (chain); a chained row whose previous row failed
        # (gpu_sampler.FAILED_ROW) is fed token 0: its request fails, the row is discarded
        ids = self._flat.index_select(0, d[7, :Bk]).clamp(min=0)
        state = d[3, :Bk] if self.caches.state is not None else None
        ctx = DecodeContext(out_slots=d[2, :Bk], state_slots=state, attn=attn)
        # the MoE layers run without host syncs where they can, the CPU share via the bridge
        moe = MoEStep("captured", row_mask=self.row_mask[:Bk], bridge=self.bridge)
        batch = ForwardBatch(input_ids=ids, positions=d[1, :Bk], new_lens=[1] * Bk,
                             prefix_lens=[0] * Bk, kv_slots=[], state_slots=[],
                             logits_rows=self.logits_rows[:Bk], ctx=ctx, moe=moe)
        logits = self.model(batch, self.caches)  # [Bk, V] fp32
        rows = gpu_sampler.SamplingRows(self.d_f32[0, :Bk], d[6, :Bk], self.d_f32[1, :Bk],
                                        d[4, :Bk], d[5, :Bk], self.d_blk[:Bk],
                                        self.d_blk_on[:Bk])
        ids = gpu_sampler.greedy(logits, rows) if greedy else gpu_sampler.sample(logits, rows)
        self.out_ids[:Bk].copy_(ids)

    def _capture(self, bk: _Bucket, greedy: bool) -> torch.cuda.CUDAGraph | None:
        """Capture the bucket's step; the warm-up runs before it use the scratch slots only."""
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
            # tier's filler and the CPU bridge allocate pinned memory on their own threads
            # meanwhile (in "global" mode their cudaHostAlloc invalidated the capture, H200)
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

    def graphs_held(self) -> int:
        return sum(len(b.graphs) for b in self.buckets.values())

    def capture_bucket(self, size: int, greedy: bool, where: str = "idle") -> bool:
        """Capture one bucket's graph unless it is held, failed, or graphs are off; returns
        whether one was captured. Logs `ft.warmup: captured ... seconds=` (`where`: idle, a
        warm-up between steps, or step, lazily in the first step that needs it)."""
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

    def step(self, rows: list[DecodeRow]) -> list[int]:
        """Run one decode step for `rows` (at most max_batch); returns the sampled token ids."""
        return self.collect(self.launch(rows))

    def launch(self, rows: list[DecodeRow], chain: list[int] | None = None) -> Pending:
        """Stage and launch one decode step without waiting for its tokens (`collect` them).
        `chain[i] >= 0` feeds row i the id sampled in row chain[i] of the step launched just
        before, read on the device: the host stages step n+1 while step n runs. A chained
        step launched after the sequence ended (its input a stop token) only writes the
        sequence's own next KV slot and state, which the caller discards."""
        bk = self.bucket(len(rows))
        assert bk is not None and self.fits(rows)
        assert chain is None or (self._last is not None and len(chain) == len(rows)
                                 and max(chain) < self._last.n), "chain: no such previous row"
        greedy = all(r.temperature <= 0 for r in rows)
        gen = self._cache_generation()
        if gen != self._generation:  # the slot cache was re-budgeted: its buffers are new
            self.drain()
            self._drop_graphs()
            self._generation = gen
            log.info(kv("graphs_dropped", why="slot_cache_resized"))
        graph = None
        if self.use_graphs and not bk.failed:
            graph = bk.graphs.get(greedy)
            if graph is None and chain is None:  # (capturing would overwrite the ids a
                # chained step reads: that step runs eagerly, the next unchained one captures)
                if self.capture_bucket(bk.size, greedy, where="step"):
                    graph = bk.graphs[greedy]
                if self.moe is not None:  # this step's time is the capture's, not the backend's
                    self.moe.discard_step_timing()
        assert len(self._open) <= 1, "collect a step before launching two ahead"
        t0 = time.perf_counter()
        self._turn ^= 1
        self._use_buffer(self._turn)
        ptr, total = self._stage(rows, bk.size, chain)
        self._upload(bk.size, total)
        attn = self._attn(bk, rows)
        if hasattr(attn, "prepare"):
            prev = self._uploaded[self._turn ^ 1]  # the plan reuses its own pinned buffer:
            if prev is not None:  # the previous step's plan copies must have run
                prev.synchronize()
            attn.prepare(ptr, total)
        self._uploaded_now()
        t1 = time.perf_counter()
        self.host_s += t1 - t0
        bridged = self.bridge is not None
        if bridged:  # (a replay's layers come within its GPU time; eager runs may compile)
            self.bridge.begin_step(bk.size, replay=graph is not None)
        try:
            if graph is not None:
                try:
                    self._replay(graph, bk, attn, greedy)
                except Exception as e:  # (the rows are re-run: engine/isolation.py)
                    self._graph_fault("replay_raised", bk.size, len(rows), e)
                    raise GraphFault(f"decode graph replay failed: {e!r}") from e
                self.replays += 1
            else:
                self._forward(bk.size, attn, greedy)
        except Exception:
            if bridged:  # its unsent layers: the worker must not wait for them (CpuBridge)
                self.bridge.abandon()
            raise
        self.steps += 1
        n = len(rows)
        out = self.h_outs[self._turn]
        done = None
        if self.device.type == "cuda":
            out[:n].copy_(self.out_ids[:n], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            out[:n].copy_(self.out_ids[:n])
        self._last = Pending(n, out, done, bridged, replayed=graph is not None)
        self._open.append(self._last)
        self.wait_s += time.perf_counter() - t1
        return self._last

    def collect(self, p: Pending) -> list[int]:
        """The sampled ids of a launched step (waits for it)."""
        t0 = time.perf_counter()
        if p.done is not None:
            p.done.synchronize()
        out = p.out[:p.n].tolist()
        if p.bridged and self.bridge is not None:
            self.bridge.end_step()
        if p in self._open:
            self._open.remove(p)
        if self._last is p:
            self._last = None
        if p.replayed and gpu_sampler.FAILED_ROW in out:
            bad = [i for i, t in enumerate(out) if t == gpu_sampler.FAILED_ROW]
            self._graph_fault("poisoned_rows", p.n, p.n, f"rows {bad} non-finite")
            out = [GRAPH_POISONED if t == gpu_sampler.FAILED_ROW else t for t in out]
        self.wait_s += time.perf_counter() - t0
        return out

    def drain(self) -> None:
        """Wait for the step in flight, if any, and forget it (its ids are not wanted)."""
        for p in list(self._open):
            self.collect(p)

    def rebind_kv(self, scratch_kv: int) -> None:
        """The engine replaced its KV pool (`caches.kv`, engine/elastic.py): its scratch slot
        is now `scratch_kv`. Waits for the step in flight, rebuilds the staging for the new
        pool's key count and drops every graph and attention plan (they hold the old
        buffers); each bucket is captured again at its next step."""
        self.drain()
        self._last = None
        self.scratch_kv = scratch_kv
        self._init_staging(self.max_batch, self.caches.kv.num_slots + self.max_batch,
                           self.device.type == "cuda")
        self._drop_graphs()
        for b in self.buckets.values():
            b.attn = None

    def rebind_state(self, scratch_state: int) -> None:
        """The engine replaced its state tensors (`caches.state`, engine/elastic_state.py):
        its scratch slot is now `scratch_state`. Waits for the step in flight and drops every
        graph (they captured the old tensors); each bucket is captured again at its next
        step."""
        self.drain()
        self._last = None
        self.scratch_state = scratch_state
        self._drop_graphs()

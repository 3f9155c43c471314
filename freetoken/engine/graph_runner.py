"""Decode-only steps through static device buffers, captured once per batch-size bucket in a CUDA
graph and replayed (eagerly run through the same buffers on the CPU, with --no-cuda-graph, or
when a bucket cannot be captured).

The host stages each step's inputs in pinned memory and uploads them with one copy
(engine/decode_staging.py); the only read back is the sampled ids. `launch` and `collect` split a
step so the host stages step n+1 while step n runs: a row of step n+1 may take its input token
from step n's sampled ids on the device (`chain`). KV slots, state slots and the attention CSR
sit in device buffers the graph reads in place (layers/step_context.py); the MoE layers see a
`captured` MoEStep (types/forward_batch.py) carrying the runtime's CPU bridge.

Graphs are captured per bucket (engine/graph_capture.py); a replay that raises or poisons a
row turns graphs off and the rows are re-run alone (engine/graph_faults.py). The attention plan
(`attention_plans.py`) is chosen by `attention_build.plan_attention`: Triton while flashinfer's
module builds on its own thread, switched at a safe point once it is built
(engine/plan_switch.py), so no request waits for a JIT compile.

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
from freetoken.engine.attention_build import PlanBuild, plan_attention
from freetoken.engine.attention_plans import bucket_plan, choose_mla_backend, choose_sink_backend
from freetoken.engine.decode_staging import MAX_BLOCKED, DecodeRow, DecodeStaging
from freetoken.engine.graph_capture import Bucket, GraphCapture, buckets_for
from freetoken.engine.graph_faults import ReplayFaults
from freetoken.engine.plan_switch import PlanSwitch
from freetoken.layers.step_context import DecodeContext, PagedDecode, TorchPagedDecode
from freetoken.log import get_logger, kv
from freetoken.types.forward_batch import ForwardBatch, MoEStep

log = get_logger("graph")


@dataclass(eq=False)
class Pending:
    """A launched step: its row count, the pinned buffer its ids land in and the event after
    that copy."""

    n: int
    out: Tensor
    done: object  # torch.cuda.Event on CUDA, None on the CPU (the step ran synchronously)
    bridged: bool
    replayed: bool = False  # from a graph (its poisoned rows are the graph's failure)


class DecodeRunner(DecodeStaging, GraphCapture, ReplayFaults, PlanSwitch):
    def __init__(self, model, caches: Caches, max_batch: int, scratch_kv: int,
                 scratch_state: int | None, use_graphs: bool = True, attention: str = "auto",
                 moe=None):
        """`moe`: the model's expert runtime (experts/runtime.py), or None (every expert
        resident): it says whether the steps can be captured and lends the CPU bridge.
        `attention`: `--decode-attention` (auto | flashinfer | triton; see
        engine/attention_build.py), for GQA pools on CUDA."""
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
        self.buckets = {b: Bucket(b) for b in buckets_for(max_batch)}
        self.max_batch = max(self.buckets)
        Bm, d = self.max_batch, self.device
        pin = self.device.type == "cuda"
        self._init_staging(Bm, caches.kv.num_slots + Bm, pin)
        self.logits_rows = torch.arange(Bm, device=d)
        self.h_outs = [torch.zeros(Bm, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._last: Pending | None = None  # the step launched last (chain refers to its rows)
        self._open: list[Pending] = []  # launched and not collected yet (at most one before a
        # launch: its ids and the next step's land in the two alternating pinned buffers)
        # MLA (a latent pool, absorbed queries) and sink / sliding-window attention (gpt_oss):
        # their own Triton plans (no GQA kernel fits)
        self._build: PlanBuild | None = None  # flashinfer building off the request path
        self.attention_switches = 0
        if self.device.type != "cuda" or cfg.dsv4 is not None:  # (deepseek_v4: torch only)
            self.attention = "torch"
        elif cfg.attention_sinks:
            self.attention = choose_sink_backend()
        elif cfg.is_mla:
            self.attention = choose_mla_backend(cfg)
        else:
            self.attention, self._build = plan_attention(attention, self.dtype, cfg.head_dim)
        self.use_graphs = self._graphs_allowed()  # ("torch": per-row slot lists, no graphs)
        self._workspace = None
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.steps = self.replays = 0
        self.graph_faults = 0  # replays that raised or poisoned rows (graphs off after one)
        self.capture_s = 0.0  # seconds spent capturing graphs (idle or in steps)
        self.host_s = self.wait_s = 0.0  # staging + planning; launch to tokens on the host
        log.info(kv("decode_runner", buckets=list(self.buckets), graphs=self.use_graphs,
                    capturable=self.capturable, attention=self.attention,
                    building=self.building(), kv_cap=self.caches.kv.num_slots + Bm))

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
        self.use_graphs = self._graphs_allowed()
        log.warning(kv("cpu_bridge_dropped", graphs=self.use_graphs, capturable=self.capturable))

    def bucket(self, n: int) -> Bucket | None:
        for b in sorted(self.buckets):
            if b >= n:
                return self.buckets[b]
        return None

    def fits(self, rows: list[DecodeRow]) -> bool:
        return (0 < len(rows) <= self.max_batch
                and all(len(r.blocked) <= MAX_BLOCKED for r in rows))

    def _attn(self, bk: Bucket, rows: list[DecodeRow] | None) -> PagedDecode:
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
        # a safe point: a finished attention build switches the plan here (the module's load
        # is not the backend's step time)
        if not self._open and self.at_safe_point() and self.moe is not None:
            self.moe.discard_step_timing()
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
                self._replay_or_fault(graph, bk, attn, greedy, len(rows))
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
        if p.replayed:
            out = self._poisoned(p.n, out)
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

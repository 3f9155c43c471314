"""Decode-only steps through static device buffers, captured once per batch-size bucket in a CUDA
graph and replayed (eagerly run through the same buffers on the CPU, with --no-cuda-graph, or
when a bucket cannot be captured).

Per step the host writes the rows' inputs into a pinned staging buffer and issues one
asynchronous copy; the only read back is the sampled token ids, copied into pinned memory at the
end of the replay. `launch` and `collect` split a step so that the host can stage step n+1
while step n runs: a row of step n+1 may take its input token from step n's sampled ids on the
device (`chain`), so the host need not wait for them (`generate` decodes that way; the staging
alternates between two pinned buffers so that the next step's writes never race the copy of
the one in flight). Everything else a layer needs — the KV slot of each new token,
the recurrent-state slots, the CSR of the pool slots each row attends over — sits in device
buffers the graph reads in place (see freetoken/layers/step_context.py).

A bucket larger than the batch is padded with rows that write to a scratch KV slot and a scratch
state slot (one of each reserved beyond what the allocators hand out) and whose routed experts
are masked to -1, so padding never moves an expert or touches live state.

Shapes: B rows of the step, Bk its bucket, V vocabulary, NB blocked stop ids per row.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from freetoken.cache.tensors import Caches
from freetoken.engine import gpu_sampler
from freetoken.engine.attention_plans import FlashInferDecode, TritonDecode, choose_backend
from freetoken.layers.step_context import DecodeContext, PagedDecode, TorchPagedDecode
from freetoken.log import get_logger, kv
from freetoken.types.forward_batch import ForwardBatch, MoEStep

log = get_logger("graph")

MAX_BLOCKED = 16  # stop ids a row may need blocked in one step (more: the step runs eagerly)


def buckets_for(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 16 up to max_batch (always including max_batch)."""
    out = [b for b in (1, 2, 4, 8, 16) if b < max_batch]
    b = 32
    while b < max_batch:
        out.append(b)
        b += 16
    return sorted(set(out + [max_batch]))


@dataclass
class DecodeRow(gpu_sampler.RowSampling):
    """One sequence's decode step: feed `token` at `position` (its KV goes to `out_slot`), attend
    over `kv_slots` (the whole context, `out_slot` last), sample with the request's parameters
    (the `RowSampling` fields)."""

    token: int = 0
    position: int = 0
    out_slot: int = 0
    state_slot: int = -1  # -1 for attention-only models
    kv_slots: Tensor = None  # type: ignore[assignment]  # [position + 1] int64 on the host


class _Layout:
    """Byte offsets of the runner's packed step inputs (see DecodeRunner.__init__); every
    section starts 8-byte aligned so the typed views are valid on both sides."""

    def __init__(self, bm: int, cap: int):
        specs = [("i64", torch.int64, (8, bm)), ("blk", torch.int64, (bm, MAX_BLOCKED)),
                 ("f32", torch.float32, (2, bm)), ("indptr", torch.int32, (bm + 1,)),
                 ("mask", torch.bool, (bm,)), ("blk_on", torch.bool, (bm, MAX_BLOCKED)),
                 ("indices", torch.int32, (cap,)), ("out", torch.int64, (bm,))]
        self.specs, at = [], 0  # (offset, dtype, shape, bytes)
        for name, dt, shape in specs:
            nbytes = dt.itemsize * math.prod(shape)
            self.specs.append((at, dt, shape, nbytes))
            if name == "indices":
                self.indices_at = at
            if name == "out":
                self.out_at = at
            at += (nbytes + 7) // 8 * 8
        self.nbytes = at

    def views(self, buf: Tensor) -> list[Tensor]:
        return [buf[at:at + n].view(dt).view(shape) for at, dt, shape, n in self.specs]


@dataclass(eq=False)
class Pending:
    """A launched step: its row count, the pinned buffer its ids land in and the event after
    that copy."""

    n: int
    out: Tensor
    done: object  # torch.cuda.Event on CUDA, None on the CPU (the step ran synchronously)
    bridged: bool


class _Bucket:
    def __init__(self, size: int):
        self.size = size
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}  # greedy? -> graph
        self.failed = False
        self.attn: PagedDecode | None = None


class DecodeRunner:
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
        # The step's inputs live in one packed buffer on each side (pinned host staging and its
        # device twin, the same byte layout), carved into typed views, so a step uploads them
        # with one copy: rows of the int64 block are ids, positions, out_slots, state_slots,
        # seeds, steps, top_k, source (where the row's input id is read: its own id above,
        # or the id the previous step sampled); then blocked ids, temperature/top_p, the
        # attention indptr, the row mask, the blocked flags, the attention indices (every key
        # of every row, padding rows included), of which a step copies only the used prefix,
        # and last the sampled ids, which the graph writes and no upload reaches. Two host
        # buffers alternate between steps (see `launch`).
        cap = caches.kv.num_slots + Bm
        self._layout = _Layout(Bm, cap)
        self.h_bufs = [torch.zeros(self._layout.nbytes, dtype=torch.uint8, pin_memory=pin)
                       for _ in range(2)]
        self._views = [self._layout.views(b) for b in self.h_bufs]
        # numpy views of the host staging: list -> buffer writes without a tensor per column
        self._nps = [[t.numpy() for t in v] for v in self._views]
        self._uploaded = [None, None]  # per host buffer: event after its last upload
        self._turn = 0
        self._use_buffer(0)
        self.d_buf = torch.zeros(self._layout.nbytes, dtype=torch.uint8, device=d)
        (self.d_i64, self.d_blk, self.d_f32, self.d_indptr, self.row_mask, self.d_blk_on,
         self.d_indices, self.out_ids) = self._layout.views(self.d_buf)
        # the whole buffer as int64: a row's input is one gather from it (source row of i64)
        self._flat = self.d_buf.view(torch.int64)
        self._out_at = self._layout.out_at // 8
        self.logits_rows = torch.arange(Bm, device=d)
        self.h_outs = [torch.zeros(Bm, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._last: Pending | None = None  # the step launched last (chain refers to its rows)
        self._open: list[Pending] = []  # launched and not collected yet (at most one before a
        # launch: its ids and the next step's land in the two alternating pinned buffers)
        self.attention = (choose_backend(attention, self.dtype, cfg.head_dim)
                          if self.device.type == "cuda"
                          else "torch")
        if self.attention == "torch":  # per-row slot lists: not capturable
            self.use_graphs = False
        self._workspace = None
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.steps = self.replays = 0
        self.host_s = self.wait_s = 0.0  # staging + planning; launch to tokens on the host
        log.info(kv("decode_runner", buckets=list(self.buckets), graphs=self.use_graphs,
                    capturable=self.capturable,
                    attention=self.attention, kv_cap=cap))

    def _use_buffer(self, k: int) -> None:
        """Stage into host buffer k from now on (after its previous upload has run)."""
        ev = self._uploaded[k]
        if ev is not None:
            ev.synchronize()
        self.h_buf = self.h_bufs[k]
        (self.h_i64, self.h_blk, self.h_f32, self.h_indptr, self.h_mask, self.h_blk_on,
         self.h_indices, _) = self._views[k]
        self._np = self._nps[k]

    def _cache_generation(self) -> int:
        return self.moe.generation if self.moe is not None else 0

    def drop_bridge(self) -> None:
        """Serve on without the CPU bridge (its worker failed): steps in flight are dropped,
        every graph goes (they hold the bridge's flags), and the steps run eagerly wherever a
        layer needs the CPU (its backend then syncs with the host)."""
        br, self.bridge = self.bridge, None
        self._open.clear()
        self._last = None
        for b in self.buckets.values():
            b.graphs.clear()
            b.failed = False
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if br is not None and self.moe is not None:
            self.moe.drop_bridge(br)
        self.capturable = self.moe.capturable(None) if self.moe is not None else True
        self.use_graphs = (self._want_graphs and self.device.type == "cuda" and self.capturable
                           and self.attention != "torch")
        log.warning(kv("cpu_bridge_dropped", graphs=self.use_graphs, capturable=self.capturable))

    # -- host side -------------------------------------------------------------------------

    def bucket(self, n: int) -> _Bucket | None:
        for b in sorted(self.buckets):
            if b >= n:
                return self.buckets[b]
        return None

    def fits(self, rows: list[DecodeRow]) -> bool:
        return (0 < len(rows) <= self.max_batch
                and all(len(r.blocked) <= MAX_BLOCKED for r in rows))

    def _stage(self, rows: list[DecodeRow], Bk: int, chain: list[int] | None = None
               ) -> tuple[Tensor, int]:
        """Write the rows, padded to Bk with rows on the scratch slots, into the host staging
        (through numpy views: one write per column); returns indptr [Bk+1] and the key
        count. `chain[i] >= 0`: row i's input is the id the previous step sampled in its row
        chain[i] (its `token` is ignored)."""
        n = len(rows)
        temp, top_k, top_p, seed, step, blk, on = gpu_sampler.sampling_columns(rows, MAX_BLOCKED)
        state_pad = self.scratch_state if self.scratch_state is not None else 0
        i64, nblk, f32, ptr, mask, blk_on, idx, _ = self._np
        # the source of row i's input id in the device buffer as int64: its own staged id
        # (row 0 of the i64 block: index i) or the previous step's sampled id in row c
        src = (list(range(n)) if chain is None
               else [self._out_at + c if c >= 0 else i for i, c in enumerate(chain)])
        if n:  # (none at capture: every row a padding row)
            i64[:, :n] = [[r.token for r in rows], [r.position for r in rows],
                          [r.out_slot for r in rows], [max(r.state_slot, 0) for r in rows],
                          seed, step, top_k, src]
            f32[:, :n] = [temp, top_p]
            nblk[:n] = blk
            blk_on[:n] = on
        i64[:, n:Bk] = [[0], [0], [self.scratch_kv], [state_pad], [0], [0], [0], [0]]
        f32[:, n:Bk] = [[0.0], [1.0]]
        nblk[n:Bk] = 0
        blk_on[n:Bk] = False
        mask[:n] = True
        mask[n:Bk] = False
        lens = [r.kv_slots.numel() for r in rows] + [1] * (Bk - n)
        ptr[0] = 0
        ptr[1:Bk + 1] = lens
        ptr[1:Bk + 1] = ptr[1:Bk + 1].cumsum()
        total = int(ptr[Bk])
        at = 0
        for r in rows:
            k = r.kv_slots.numel()
            idx[at:at + k] = r.kv_slots.numpy()
            at += k
        idx[at:total] = self.scratch_kv
        return self.h_indptr[:Bk + 1], total

    def _upload(self, Bk: int, total: int) -> None:
        """One copy: the packed inputs up to the last used attention index."""
        end = self._layout.indices_at + 4 * total
        self.d_buf[:end].copy_(self.h_buf[:end], non_blocking=self.device.type == "cuda")

    def _uploaded_now(self) -> None:
        """Mark the current host buffer's upload (and the attention plan's own copies, issued
        after it) as enqueued; the buffer is staged into again only once they have run."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._uploaded[self._turn] = ev

    # -- device side -------------------------------------------------------------------------

    def _attn(self, bk: _Bucket, rows: list[DecodeRow] | None) -> PagedDecode:
        if self.attention == "torch":
            assert rows is not None
            slots = [r.kv_slots.to(self.device) for r in rows]
            slots += [torch.tensor([self.scratch_kv], device=self.device)] * (bk.size - len(rows))
            return TorchPagedDecode(slots)
        if bk.attn is None:
            cfg = self.model.cfg
            if self.attention == "flashinfer":
                if self._workspace is None:
                    self._workspace = torch.empty(128 << 20, dtype=torch.uint8, device=self.device)
                bk.attn = FlashInferDecode(bk.size, self.d_indptr, self.d_indices, cfg.num_heads,
                                           cfg.num_kv_heads, cfg.head_dim, self.dtype,
                                           cfg.head_dim ** -0.5, self._workspace)
            else:
                bk.attn = TritonDecode(bk.size, self.d_indptr, self.d_indices)
        return bk.attn

    def _forward(self, Bk: int, attn: PagedDecode, greedy: bool) -> None:
        """The whole decode step on the static buffers: forward, LM head, sampling into
        out_ids[:Bk]. Issues no host sync (this is what a graph captures)."""
        d = self.d_i64
        ids = self._flat.index_select(0, d[7, :Bk])  # staged ids, or the last step's (chain)
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
            with torch.cuda.graph(g, pool=self._pool):
                self._forward(Bk, attn, greedy)
            torch.cuda.synchronize()
        except RuntimeError as e:  # a host sync or an uncapturable op somewhere in the step
            log.warning(kv("capture_failed", bucket=Bk, greedy=greedy, error=repr(e)[:200]))
            torch.cuda.synchronize()
            bk.failed = True
            return None
        finally:
            if self.moe is not None:  # the warm-up's routing is not the workload's
                self.moe.counters.discard_device()
        log.info(kv("captured", bucket=Bk, greedy=greedy, attention=self.attention))
        return g

    def capture_all(self) -> int:
        """Capture every bucket's greedy and sampling graphs now (server start) instead of on
        the first step that needs each; returns how many graphs are held."""
        if not self.use_graphs:
            return 0
        for bk in self.buckets.values():
            for greedy in (True, False):
                if bk.failed or greedy in bk.graphs:
                    continue
                g = self._capture(bk, greedy)
                if g is not None:
                    bk.graphs[greedy] = g
        return sum(len(b.graphs) for b in self.buckets.values())

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
            for b in self.buckets.values():
                b.graphs.clear()
                b.failed = False
            self._generation = gen
            log.info(kv("graphs_dropped", why="slot_cache_resized"))
        graph = None
        if self.use_graphs and not bk.failed:
            graph = bk.graphs.get(greedy)
            if graph is None and chain is None:  # (capturing would overwrite the ids a
                # chained step reads: that step runs eagerly, the next unchained one captures)
                graph = self._capture(bk, greedy)
                if graph is not None:
                    bk.graphs[greedy] = graph
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
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            self._forward(bk.size, attn, greedy)
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
        self._last = Pending(n, out, done, bridged)
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
        self.wait_s += time.perf_counter() - t0
        return out

    def drain(self) -> None:
        """Wait for the step in flight, if any, and forget it (its ids are not wanted)."""
        for p in list(self._open):
            self.collect(p)

    def replay_ms(self, n: int, iters: int = 50) -> float | None:
        """Device time of one replay of bucket n's greedy graph (inputs as last staged), or None
        when it has not been captured: the step's floor with no host work at all. The replays
        write the last staged rows' K/V and state again: for benchmarks, after their run."""
        bk = self.bucket(n)
        g = bk.graphs.get(True) if bk else None
        if g is None or self.bridge is not None:  # a bridged step needs its host worker's turn
            return None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        a.record()
        for _ in range(iters):
            g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / iters


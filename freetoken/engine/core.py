"""EngineCore: owns the model and the cache tensors; one `step()` = schedule, run, postprocess.

Synchronous and single-threaded by design; `AsyncEngine` runs it on a background thread and
bridges events to asyncio. Nothing here knows about HTTP.

Decode overlap: a decode-only step through the runner is launched and left in flight; the next
`step()` launches the step after it — the same requests, each fed the token the step in flight
samples, read on the device (`DecodeRunner.launch(chain=...)`) — before it reads the first
step's tokens and post-processes them, so the host's scheduling, staging and token handling
run while the GPU computes. It does so only when the scheduler plans that next step
(scheduler/overlap.py: certain up to stop tokens, its KV allocated). A request that stops
on a token while the step after it is in flight keeps that step's work: its KV and state
already cover the stop token, so it is committed with it (the step's own token is dropped).
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from freetoken.cache.tensors import Caches, KVPool, StateTensors
from freetoken.engine.cache_ops import CacheOps, HostStates, host_slots_for
from freetoken.engine.gpu_sampler import FAILED_ROW, sample_rows
from freetoken.engine.graph_runner import DecodeRunner, Pending
from freetoken.engine.isolation import GRAPH_POISONED, fail_request, isolate, retry_poisoned
from freetoken.engine.stats import EngineStats
from freetoken.engine.step_inputs import decode_row, forward_batch, row_sampling
from freetoken.engine.warm_up import Warmup
from freetoken.experts.bridge import BridgeError
from freetoken.experts.runtime import MoERuntime, ResizeError
from freetoken.log import get_logger, kv
from freetoken.models.qwen import QwenMoE
from freetoken.sampler import RequestSampler, RowFailure
from freetoken.scheduler.finish import accept_token, token_event
from freetoken.scheduler.overlap import schedule_ahead
from freetoken.scheduler.request import Request
from freetoken.scheduler.scheduler import BatchItem, Scheduler
from freetoken.types.api import AdmissionError, GenerateRequest
from freetoken.types.forward_batch import EAGER, ForwardBatch, MoEStep

log = get_logger("engine")
__all__ = ["EngineCore", "ResizeError"]  # ResizeError: what /ft/v1/control/experts answers 409 to


@dataclass
class _InFlight:
    """A decode step launched and not post-processed yet: its items in row order, the state
    ops to run after it, the runner's handle, when it was launched, and its tokens if they
    were read early (a request stopped while this step was in flight)."""

    items: list[BatchItem]
    post_ops: list
    pending: Pending
    t0: float
    tokens: list[int] | None = None


class EngineCore:
    def __init__(self, model: QwenMoE, eos_ids: list[int], kv_tokens: int = 32768,
                 state_slots: int = 64, max_running: int = 4, chunk_tokens: int = 512,
                 max_context: int | None = None, policy: str = "semantic",
                 decode_runner: bool | None = None, cuda_graph: bool = True,
                 state_host_mem: int | None = None, moe: MoERuntime | None = None,
                 kept_logits: int | None = None):
        """`decode_runner`: run decode-only steps through the static-buffer runner (default: on
        CUDA only; the CPU's eager path is the same math); `cuda_graph`: replay them from CUDA
        graphs (off: the runner runs them eagerly, for comparison). `state_host_mem`: bytes of
        the host tier for state snapshots (None: derived from free RAM, see `cache_ops`).
        `moe`: the model's expert runtime (None: every expert resident, nothing to manage).
        `kept_logits`: logits rows kept beside prompt-end snapshots so that a resent prompt
        computes nothing (`cache/logits.py`; None: `state_slots`, 0: off; hybrid models only;
        one row is `vocab` floats on the device)."""
        cfg = model.cfg
        self.model, self.cfg, self.eos_ids = model, cfg, list(eos_ids)
        self.moe = moe
        w = model.model.embed_tokens.weight
        self.device, self.dtype = w.device, w.dtype
        # one scratch KV slot and one scratch state slot past what the allocators hand out:
        # the decode runner's padding rows write there
        state = (StateTensors(cfg, state_slots + 1, self.dtype, self.device)
                 if cfg.has_linear_attention else None)
        self.caches = Caches(KVPool(cfg, kv_tokens + 1, self.dtype, self.device), state)
        slot_bytes = StateTensors.bytes_per_slot(cfg, self.dtype) if state else 0
        host_slots = host_slots_for(state_host_mem, slot_bytes, state_slots) if state else 0
        self.cache_ops = CacheOps(state, HostStates(state, host_slots) if host_slots else None)
        if state:
            host = self.cache_ops.host
            log.info(kv("state_host_tier", slots=host_slots, mb=host_slots * slot_bytes // 2**20,
                        slot_kb=slot_bytes // 1024, pinned=self.device.type == "cuda",
                        chunk_slots=host.chunk_slots if host else 0, fill="background"))
        n_logits = (state_slots if kept_logits is None else kept_logits) if state else 0
        self.sched = Scheduler(kv_tokens, state_slots, state is not None, max_running,
                               chunk_tokens, policy, host_slots, logits_slots=n_logits)
        self._kept: torch.Tensor | None = None  # [n_logits, V], made by the first row kept
        self._n_kept = n_logits
        if decode_runner is None:
            decode_runner = self.device.type == "cuda"
        self.runner = (DecodeRunner(model, self.caches, max_running, scratch_kv=kv_tokens,
                                    scratch_state=state_slots if state is not None else None,
                                    use_graphs=cuda_graph, moe=moe)
                       if decode_runner else None)
        # a lone request must always fit in the KV pool, so the context never exceeds it
        self.max_context = min(max_context or cfg.max_position_embeddings, kv_tokens)
        self.stats = EngineStats()
        self._inflight: _InFlight | None = None
        self._ahead_failed: tuple[list[Request], Exception] | None = None
        self.device_sampler = self.device.type == "cuda"  # batched gpu_sampler, else per row
        self._t_done = 0.0  # when the last step's tokens were read (overlapped steps' time)
        self.steps_ahead = 0  # decode steps launched before the previous one's tokens were read
        self.warmup = Warmup(self)  # idle-time warm-up tasks (engine/warm_up.py), none planned
        log.info(kv("ready", kv_tokens=kv_tokens, state_slots=state_slots if state else 0,
                    max_running=max_running, chunk=chunk_tokens, max_context=self.max_context,
                    kv_mb=KVPool.bytes_per_token(cfg, self.dtype) * kv_tokens // 2**20))

    def warm_up(self) -> float:
        """Every warm-up task now, blocking: kernels compiled and graphs captured
        (engine/warm_up.py; `ft serve` instead runs them while idle). Returns the seconds."""
        dt = self.warmup.run_all()
        graphs = self.runner.graphs_held() if self.runner is not None else 0
        log.info(kv("warm_up", seconds=f"{dt:.1f}", graphs=graphs, blocking=True))
        return dt

    def drop_bridge(self, e: BridgeError) -> None:
        """The CPU bridge failed: log it and serve on without it (the runner's steps run
        eagerly where a layer needs the CPU). The step that failed is lost: its requests fail
        (AsyncEngine), every other request goes on."""
        log.error(kv("cpu_bridge_failed", error=repr(e)[:300],
                     fallback="decode runner without the bridge (eager CPU branch)"))
        self._inflight = None
        if self.runner is not None:
            self.runner.drop_bridge()

    def _moe_step(self, kind: str, tokens: int) -> AbstractContextManager[MoEStep]:
        return self.moe.step(kind, tokens) if self.moe is not None else nullcontext(EAGER)

    def check(self, req: GenerateRequest) -> None:
        req.sampling.validate()
        n = len(req.input_ids)
        if n == 0:
            raise AdmissionError("the prompt is empty", "messages")
        if n + 1 > self.max_context:
            raise AdmissionError(f"the prompt has {n} tokens; the context holds {self.max_context} "
                                 f"(prompt plus at least one output token)", "messages",
                                 "context_length_exceeded")
        if n + req.sampling.max_tokens > self.max_context:
            raise AdmissionError(f"prompt ({n}) + max_tokens ({req.sampling.max_tokens}) exceeds "
                                 f"the context ({self.max_context})", "max_tokens",
                                 "context_length_exceeded")
        bad = [t for t in req.input_ids if not (0 <= t < self.cfg.vocab_size)]
        if bad:
            raise AdmissionError(f"token id {bad[0]} is outside the vocabulary "
                                 f"[0, {self.cfg.vocab_size})", "input_ids")

    def add(self, req: GenerateRequest, emit) -> None:
        self.check(req)
        r = Request(req, RequestSampler(req.sampling, self.eos_ids, self.device), emit)
        self.sched.add(r)

    def abort(self, rid: str) -> None:
        self.sched.abort(rid)

    def has_work(self) -> bool:
        return self.sched.has_work() or self._inflight is not None

    def step(self) -> None:
        """One engine step: schedule, run, postprocess. A failure of the CPU bridge drops the
        bridge (`drop_bridge`) and is raised for the step's requests; any other failure of a
        forward pass fails one request only (engine/isolation.py)."""
        try:
            self._step()
        except BridgeError as e:
            self.drop_bridge(e)
            raise
        if self.moe is not None and self.moe.reprofiler is not None:
            self.moe.reprofiler.at_safe_point()  # q* follows the measured bandwidths

    def _step(self) -> None:
        if self._inflight is not None:
            cur = self._inflight
            self._inflight = self._launch_ahead(cur)
            self._complete(cur)
            if self._ahead_failed is not None:  # the rows' states went past `cur`'s tokens
                reqs, e = self._ahead_failed
                self._ahead_failed = None
                isolate(self.sched, [(r, len(r.ids)) for r in reqs], e)
            return
        plan = self.sched.schedule()
        self.cache_ops.run(plan.pre_ops)
        items = plan.items
        if not items:
            return
        # every row one token (a prompt's last token whose logits are kept runs eagerly)
        decode = all(i.n == 1 and i.wants_logits and i.keep_logits is None for i in items)
        t0 = time.perf_counter()
        rows = None
        if self.runner is not None and decode:
            rows = [decode_row(it) for it in items]
            if not self.runner.fits(rows):
                rows = None
        fed = [it for it in items if it.n > 0]  # n == 0: sampled from kept logits, no forward
        try:
            if rows is not None and self._may_overlap():
                # left in flight: the next step() launches the step after it, then reads its ids
                self._inflight = _InFlight(items, plan.post_ops, self.runner.launch(rows), t0)
                return
            # (`auto` times its choice over decode steps of any width)
            with (self._moe_step("decode" if decode else "prefill", sum(i.n for i in items))
                  if fed else nullcontext(EAGER)) as st:
                if rows is not None:
                    toks = self.runner.step(rows)  # one host read: the sampled ids
                else:
                    logits = (self.model(self._batch(fed, st), self.caches)  # [R, V]
                              if fed else None)
                    want, rows_ = self._logit_rows(items, logits)
                    toks = self._sample(want, rows_)
        except BridgeError:
            self.sched.discard(items)  # the slots its snapshots and kept logits were to take
            raise
        except Exception as e:  # noqa: BLE001  (one request's failure: engine/isolation.py)
            self.cache_ops.run(plan.post_ops)
            self.sched.discard(items)
            isolate(self.sched, [(it.req, it.start + it.n) for it in items], e)
            return
        self._t_done = time.perf_counter()
        dt = self._t_done - t0
        self.cache_ops.run(plan.post_ops)
        # a decode row feeds the last sampled token; every other token fed is prefill (a
        # prompt's, or a preempted request's again), also a prompt's 1-token last chunk
        n_decode = sum(1 for i in items if i.n == 1 and i.req.num_generated > 0)
        self.stats.on_step(dt, prefill_tokens=sum(i.n for i in items) - n_decode,
                           decode_tokens=n_decode)
        row = 0
        for it in items:
            self.sched.after_forward(it)
            if it.wants_logits:
                self._on_token(it, toks[row])
                row += 1

    def _may_overlap(self) -> bool:
        """Whether decode steps may be left in flight: always, except while `auto`'s guard
        times its phases (each step then runs alone)."""
        return self.moe is None or self.moe.settled

    def _launch_ahead(self, cur: _InFlight) -> _InFlight | None:
        """Launch the step after `cur` (in flight) when the scheduler plans one
        (scheduler/overlap.py); its rows chain on `cur`'s sampled ids. None otherwise."""
        if cur.tokens is not None or not self._may_overlap():
            return None
        plan = schedule_ahead(self.sched, cur.items, self.max_context)
        if plan is None:
            return None
        t0 = time.perf_counter()
        rows = [decode_row(it, ahead=True) for it in plan.items]
        if not self.runner.fits(rows):
            plan.rollback(self.sched)
            return None
        try:
            pending = self.runner.launch(rows, chain=plan.chain)
        except BridgeError:
            raise
        except Exception as e:  # noqa: BLE001  (isolated once `cur` is post-processed)
            plan.rollback(self.sched)
            self._ahead_failed = ([it.req for it in plan.items], e)
            return None
        self.steps_ahead += 1
        return _InFlight(plan.items, self.sched.cache.take_ops(), pending, t0)

    def _complete(self, cur: _InFlight) -> None:
        """Read a launched decode step's tokens and post-process it (as `step` does after a
        synchronous forward); rows of requests aborted or finished meanwhile are dropped."""
        toks = cur.tokens if cur.tokens is not None else self.runner.collect(cur.pending)
        # a step launched while the previous one ran is charged from that one's end: the
        # statistics' busy time is wall time, not launch-to-tokens summed over overlapping steps
        now = time.perf_counter()
        dt = now - max(cur.t0, self._t_done)
        self._t_done = now
        self.cache_ops.run(cur.post_ops)
        running = {id(r) for r in self.sched.running}
        live = [(it, t) for it, t in zip(cur.items, toks) if id(it.req) in running]
        self.stats.on_step(dt, prefill_tokens=0, decode_tokens=len(live))
        for it, tok in live:
            self.sched.after_forward(it)
            self._on_token(it, tok)

    def _settle_ahead(self, r: Request) -> None:
        """`r` stops: if the step in flight has a row of it, that row fed the stop token and
        advanced r's KV and state past it — wait for the step and count the token computed, so
        that the prefix committed with the state is the one the state covers."""
        ahead = self._inflight
        if ahead is None or not any(it.req is r for it in ahead.items):
            return
        if ahead.tokens is None:
            ahead.tokens = self.runner.collect(ahead.pending)
        r.computed += 1

    def _logit_rows(self, items: list[BatchItem], logits: torch.Tensor | None
                    ) -> tuple[list[BatchItem], torch.Tensor]:
        """The items that sample this step and their logits `[R, V]`, in item order: a fed
        item's row of `logits` (which holds a row per item that wants or keeps logits,
        `forward_batch`), an unfed one's kept row. Rows to keep are written to their slot."""
        want, picked, j = [], [], 0
        for it in items:
            if it.n == 0:
                assert self._kept is not None and it.logits_from is not None
                want.append(it)
                picked.append(self._kept[it.logits_from])
                continue
            if not (it.wants_logits or it.keep_logits is not None):
                continue
            assert logits is not None
            row, j = logits[j], j + 1
            if it.keep_logits is not None:
                if self._kept is None:
                    self._kept = torch.empty((self._n_kept, row.shape[-1]), dtype=row.dtype,
                                             device=row.device)
                self._kept[it.keep_logits] = row
            if it.wants_logits:
                want.append(it)
                picked.append(row)
        out = torch.stack(picked) if picked else torch.empty(0, device=self.device)
        return want, out

    def _sample(self, items: list[BatchItem], logits: torch.Tensor) -> list[int]:
        """Next token of every row: with `device_sampler` (CUDA) one batched call of the device
        sampler (the same function the decode runner replays, so seeds draw the same tokens
        either way); on the CPU each request's own sampler. A row that cannot be sampled is
        FAILED_ROW or its exception: it fails alone (`_on_token`)."""
        if not self.device_sampler:
            out: list = []
            for i, it in enumerate(items):
                try:
                    out.append(it.req.sampler.sample(logits[i], it.req.num_generated))
                except Exception as e:  # noqa: BLE001  (this row alone fails: see _on_token)
                    out.append(e)
            return out
        rows = [row_sampling(it) for it in items]
        return sample_rows(logits, rows, self.device)

    def _batch(self, items: list[BatchItem], moe: MoEStep) -> ForwardBatch:
        return forward_batch(items, moe, self.device, self.caches.state is not None)

    def _on_token(self, it: BatchItem, tok: int) -> None:
        r = it.req
        if tok == GRAPH_POISONED:  # a replayed graph's failure, not r's: re-run alone
            retry_poisoned(self.sched, r, it.start + it.n)
            return
        if tok == FAILED_ROW:  # (the device sampler's)
            tok = RowFailure("the model computed non-finite logits for this request")
        if isinstance(tok, Exception):  # its row could not be sampled: it fails, the batch goes on
            fail_request(self.sched, r, tok)
            return
        reason, first = accept_token(r, tok, self.max_context)  # scheduler/finish.py's rules
        if first:
            self.stats.on_first_token(r.t_first_token - r.t_arrival, r.prompt_len, r.cached_tokens)
        if reason:
            self._settle_ahead(r)
            self.sched.finish(r)
            r.finished = True
            log.info(kv("finish", rid=r.rid, prompt=r.prompt_len, cached=r.cached_tokens,
                        kv_match=r.kv_match, resume_tier=r.state_tier,
                        reuse=r.reuse_reason if r.kv_match > r.cached_tokens else None,
                        lost=r.lost or None, generated=r.num_generated, reason=reason))
        r.emit(token_event(r, tok, reason))

    def settle(self) -> None:
        """Make this a safe point for replacing buffers: the decode step left in flight (if
        any) is read and post-processed, and the runner holds no launched step."""
        cur, self._inflight = self._inflight, None
        if cur is not None:
            self._complete(cur)
        if self.runner is not None:
            self.runner.drain()

    def resize_experts(self, slots: int | None = None, rate: float | None = None,
                       mem: int | None = None) -> dict:
        """Re-budget the GPU expert cache without a restart (`MoERuntime.resize`). Runs
        between steps (the engine thread's safe point); a failed allocation leaves the old
        cache serving and raises `ResizeError`."""
        if self.moe is None:
            raise AdmissionError("this server runs without an expert slot cache "
                                 "(--moe-backend fused); nothing to re-budget", "slots")
        self.settle()
        return self.moe.resize(slots, rate, mem)

    def snapshot_stats(self) -> dict:
        out = self.stats.summary()
        out["cache"] = self.sched.stats()
        experts = self.moe.stats() if self.moe is not None else None
        if experts is not None:
            out["experts"] = experts
        out["warmup"] = self.warmup.stats()
        return out

"""EngineCore: owns the model and the cache tensors; one `step()` = schedule, run, postprocess.

Synchronous and single-threaded by design; `AsyncEngine` runs it on a background thread and
bridges events to asyncio. Nothing here knows about HTTP, and nothing here plans: the
scheduler allocates every KV slot and state op (`schedule`, `schedule_ahead`), applies the stop
rules and finishes requests (scheduler/finish.py); the engine runs the plan — the state ops,
the forward (eager: engine/eager.py; a decode-only step through the decode runner, possibly
left in flight: engine/in_flight.py) — and emits the events.
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext

from freetoken.cache.tensors import Caches, KVPool, StateTensors
from freetoken.engine.cache_ops import CacheOps, HostStates, host_slots_for
from freetoken.engine.eager import EagerStep
from freetoken.engine.gpu_sampler import FAILED_ROW
from freetoken.engine.graph_runner import DecodeRunner
from freetoken.engine.in_flight import DecodeOverlap, InFlight
from freetoken.engine.isolation import GRAPH_POISONED, fail_request, isolate, retry_poisoned
from freetoken.engine.stats import EngineStats
from freetoken.engine.step_inputs import decode_row
from freetoken.engine.warm_up import Warmup
from freetoken.experts.bridge import BridgeError
from freetoken.experts.runtime import MoERuntime, ResizeError
from freetoken.log import get_logger, kv
from freetoken.models.qwen import QwenMoE
from freetoken.sampler import RequestSampler, RowFailure
from freetoken.scheduler.finish import postprocess, token_event
from freetoken.scheduler.plan import BatchItem, StepPlan
from freetoken.scheduler.request import Request
from freetoken.scheduler.scheduler import Scheduler
from freetoken.types.api import AdmissionError, GenerateRequest
from freetoken.types.forward_batch import EAGER, MoEStep

log = get_logger("engine")
__all__ = ["EngineCore", "ResizeError"]  # ResizeError: what /ft/v1/control/experts answers 409 to


class EngineCore:
    def __init__(self, model: QwenMoE, eos_ids: list[int], kv_tokens: int = 32768,
                 state_slots: int = 64, max_running: int = 4, chunk_tokens: int = 512,
                 max_context: int | None = None, policy: str = "semantic",
                 decode_runner: bool | None = None, cuda_graph: bool = True,
                 state_host_mem: int | None = None, moe: MoERuntime | None = None,
                 kept_logits: int | None = None, decode_attention: str = "auto"):
        """`decode_runner`: run decode-only steps through the static-buffer runner (default: on
        CUDA only; the CPU's eager path is the same math); `cuda_graph`: replay them from CUDA
        graphs (off: the runner runs them eagerly, for comparison). `state_host_mem`: bytes of
        the host tier for state snapshots (None: derived from free RAM, see `cache_ops`).
        `moe`: the model's expert runtime (None: every expert resident, nothing to manage).
        `kept_logits`: logits rows kept beside prompt-end snapshots so that a resent prompt
        computes nothing (`cache/logits.py`; None: `state_slots`, 0: off; models with linear
        attention only; one row is `vocab` floats on the device). `decode_attention`: the
        runner's paged attention, auto | flashinfer | triton (engine/attention_build.py)."""
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
        if decode_runner is None:
            decode_runner = self.device.type == "cuda"
        self.runner = (DecodeRunner(model, self.caches, max_running, scratch_kv=kv_tokens,
                                    scratch_state=state_slots if state is not None else None,
                                    use_graphs=cuda_graph, attention=decode_attention,
                                    moe=moe)
                       if decode_runner else None)
        # a lone request must always fit in the KV pool, so the context never exceeds it
        self.max_context = min(max_context or cfg.max_position_embeddings, kv_tokens)
        self.stats = EngineStats()
        self._t_decode_end: float | None = None  # when the last decode-only step ended
        self.eager = EagerStep(model, self.caches, n_logits,
                               device_sampler=self.device.type == "cuda")
        self.overlap = DecodeOverlap(self.runner, self.sched, self.max_context,
                                     settled=lambda: moe is None or moe.settled)
        self.warmup = Warmup(self)  # idle-time warm-up tasks (engine/warm_up.py), none planned
        log.info(kv("ready", kv_tokens=kv_tokens, state_slots=state_slots if state else 0,
                    max_running=max_running, chunk=chunk_tokens, max_context=self.max_context,
                    kept_logits=n_logits,
                    kv_mb=KVPool.bytes_per_token(cfg, self.dtype) * kv_tokens // 2**20))

    def close(self) -> None:
        """Release the threads the core started (process shutdown, after the last step): the
        CPU bridges' workers and the state host tier's filler. The core runs no step after."""
        if self.moe is not None:
            self.moe.close()
        if self.cache_ops.host is not None:
            self.cache_ops.host.close()

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
        self.overlap.current = None
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
        self.cache_ops.busy(True)

    def abort(self, rid: str) -> None:
        self.sched.abort(rid)
        self.cache_ops.busy(self.has_work())

    def has_work(self) -> bool:
        return self.sched.has_work() or self.overlap.current is not None

    @property
    def steps_ahead(self) -> int:
        """Decode steps launched before the previous one's tokens were read."""
        return self.overlap.steps_ahead

    def step(self) -> None:
        """One engine step: schedule, run, postprocess. A failure of the CPU bridge drops the
        bridge (`drop_bridge`) and is raised for the step's requests; any other failure of a
        forward pass fails one request only (engine/isolation.py)."""
        t0, wait0, dec0 = time.perf_counter(), self.overlap.wait_s, self.stats.decode_tokens
        pf0 = self.stats.prefill_tokens
        try:
            self._step()
        except BridgeError as e:
            self.drop_bridge(e)
            raise
        t1 = time.perf_counter()
        self.cache_ops.busy(self.has_work())
        if self.stats.decode_tokens > dec0 and self.stats.prefill_tokens == pf0:
            # a decode-only step: its split (the gap counts only from a decode step's end)
            gap = t0 - self._t_decode_end if self._t_decode_end is not None else 0.0
            self.stats.on_decode_phases(t1 - t0, self.overlap.wait_s - wait0, gap)
            self._t_decode_end = t1
        else:
            self._t_decode_end = None
        if self.moe is not None and self.moe.reprofiler is not None:
            self.moe.reprofiler.at_safe_point()  # q* follows the measured bandwidths

    def _step(self) -> None:
        if self.overlap.current is not None:
            self._complete(self.overlap.advance())  # launches the step after it, if planned
            failed = self.overlap.take_failed()  # that launch failed: states went past `cur`
            if failed is not None:
                isolate(self.sched, [(r, len(r.ids)) for r in failed[0]], failed[1])
            return
        plan = self.sched.schedule()
        self.cache_ops.run(plan.pre_ops)
        if plan.items:
            self._run(plan)

    def _run(self, plan: StepPlan) -> None:
        """Run a planned step: through the decode runner when every row is one token and fits
        (left in flight when it may overlap), else eagerly; then postprocess."""
        items = plan.items
        # every row one token (a prompt's last token whose logits are kept runs eagerly)
        decode = all(i.n == 1 and i.wants_logits and i.keep_logits is None for i in items)
        t0 = time.perf_counter()
        rows = [decode_row(it) for it in items] if self.runner is not None and decode else None
        if rows is not None and not self.runner.fits(rows):
            rows = None
        fed = any(it.n > 0 for it in items)  # n == 0: sampled from kept logits, no forward
        try:
            if rows is not None and self.overlap.settled():
                self.overlap.leave(items, plan.post_ops, rows, t0)  # read by the next step()
                return
            # (`auto` times its choice over decode steps of any width)
            with (self._moe_step("decode" if decode else "prefill", sum(i.n for i in items))
                  if fed else nullcontext(EAGER)) as st:
                toks = self.runner.step(rows) if rows is not None else self.eager.run(items, st)
        except BridgeError:
            self.sched.discard(items)  # the slots its snapshots and kept logits were to take
            raise
        except Exception as e:  # noqa: BLE001  (one request's failure: engine/isolation.py)
            self.cache_ops.run(plan.post_ops)
            self.sched.discard(items)
            isolate(self.sched, [(it.req, it.start + it.n) for it in items], e)
            return
        self.overlap.t_done = time.perf_counter()
        self.cache_ops.run(plan.post_ops)
        # a decode row feeds the last sampled token; every other token fed is prefill (a
        # prompt's, or a preempted request's again), also a prompt's 1-token last chunk
        n_decode = sum(1 for i in items if i.n == 1 and i.req.num_generated > 0)
        self.stats.on_step(self.overlap.t_done - t0, decode_tokens=n_decode,
                           prefill_tokens=sum(i.n for i in items) - n_decode)
        self._postprocess(items, toks)

    def _complete(self, cur: InFlight) -> None:
        """Read a launched decode step's tokens and post-process it (as `_run` does after a
        synchronous forward); rows of requests aborted or finished meanwhile are dropped."""
        toks, dt = self.overlap.collect(cur)
        self.cache_ops.run(cur.post_ops)
        running = {id(r) for r in self.sched.running}
        live = [(it, t) for it, t in zip(cur.items, toks) if id(it.req) in running]
        self.stats.on_step(dt, prefill_tokens=0, decode_tokens=len(live))
        self._postprocess([it for it, _ in live], [t for _, t in live])

    def _postprocess(self, items: list[BatchItem], toks: list) -> None:
        """The scheduler applies the stop rules and finishes who ends (scheduler/finish.py);
        each token goes out as an event. A row that could not be sampled (FAILED_ROW from the
        device sampler, an exception from the CPU one) fails its request alone."""
        bad = RowFailure("the model computed non-finite logits for this request")
        toks = [t if isinstance(t, BaseException) or t != FAILED_ROW else bad for t in toks]
        # a replayed graph's failure, not the request's: it re-runs alone, eagerly
        # (one token per item that wants logits: rows mid-prefill sample nothing)
        poisoned = {i for i, t in enumerate(toks)
                    if not isinstance(t, BaseException) and t == GRAPH_POISONED}
        if poisoned:
            wanting = [it for it in items if it.wants_logits]
            gone = {id(wanting[i]) for i in poisoned}
            for i in sorted(poisoned):
                retry_poisoned(self.sched, wanting[i].req, wanting[i].start + wanting[i].n)
            items = [it for it in items if id(it) not in gone]
            toks = [t for i, t in enumerate(toks) if i not in poisoned]
        for s in postprocess(self.sched, items, toks, self.max_context, self.overlap.ran_ahead):
            r = s.req
            if isinstance(s.token, BaseException):
                fail_request(self.sched, r, s.token)
                continue
            if s.first:
                self.stats.on_first_token(r.t_first_token - r.t_arrival, r.prompt_len,
                                          r.cached_tokens)
            r.emit(token_event(r, s.token, s.reason))

    def settle(self) -> None:
        """Make this a safe point for replacing buffers: the decode step left in flight (if
        any) is read and post-processed, and the runner holds no launched step."""
        cur, self.overlap.current = self.overlap.current, None
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

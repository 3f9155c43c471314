"""Elastic VRAM: rebuild the expert cache, the KV pool and the recurrent-state pool for a new
budget while serving.

`ElasticVram.rebuild(expert_slots, kv_tokens)` runs on the engine thread between two steps
(the safe point: `EngineCore.settle` has read the step in flight). It never reloads the host
expert pool and never restarts: the slot cache is re-budgeted in place (`MoERuntime.resize`),
the KV pool is re-allocated at the new size with every live token copied over, and the decode
runner drops its graphs and attention plans (`DecodeRunner.rebind_kv`), which capture again at
the next step of each bucket. Requests in flight only wait: their KV is moved, not dropped.

KV shrink: evictable prefixes of the radix cache go first (LRU); what is still held is
compacted below the new size (`SlotAllocator.compaction`) and every slot id holder — radix
nodes and running requests' rows — is relabelled. A pool that cannot hold the live tokens is
refused. The recurrent-state pool (models with linear attention, engine/elastic_state.py) is
resized the same way: every running request's working state and every pinned snapshot stays,
other snapshots leave by the cache's own eviction rule (spilled to the host tier when it has
room worth giving), the rest are compacted below the new size.

All or nothing: the shrinking part goes first (it frees memory), then the growing part; new
buffers are allocated before anything changes, so a failed allocation leaves that part as it
was, and a failure of the second part undoes the first. `ResizeError` then says what still
serves. `replan(free_bytes)` reads the engine's state, asks the planner (engine/vram_plan.py)
and rebuilds when it says so; the watcher (engine/vram_watch.py) calls it on a timer.
Each decision is one `ft.vram` log line.
"""
from __future__ import annotations

import threading
import time

import torch

from freetoken.cache.tensors import KVPool, StateTensors
from freetoken.engine import elastic_state
from freetoken.engine.vram_plan import VramKnobs, VramPlan, VramState, plan
from freetoken.experts.runtime import ResizeError
from freetoken.log import get_logger, kv
from freetoken.types.api import AdmissionError

log = get_logger("vram")
_OOM = (torch.OutOfMemoryError, RuntimeError)


def new_kv_pool(cfg, num_slots: int, dtype: torch.dtype, device: torch.device) -> KVPool:
    """The KV pool allocation of a rebuild (a seam: tests inject an allocation failure)."""
    return KVPool(cfg, num_slots, dtype, device)


class ElasticVram:
    """The rebuild and re-plan of one `EngineCore` (see the module docstring).

    `kv_floor`: tokens the KV pool never goes below (default: the core's context, which a
    lone request must always fit); `kv_cap`: tokens it never grows past (default: every
    running request at the full context). `state_floor`: state slots the automatic re-plan
    never goes below (default: two per running request, a working state and one snapshot);
    `state_cap`: what it grows the state pool back to (default: its size at start,
    `--state-slots`). `rebuilding` is set while a rebuild runs (the async engine answers new
    requests 503 past its wait)."""

    def __init__(self, core, knobs: VramKnobs | None = None, kv_floor: int | None = None,
                 kv_cap: int | None = None, min_expert_slots: int | None = None,
                 max_expert_slots: int | None = None, state_floor: int | None = None,
                 state_cap: int | None = None) -> None:
        self.core, self.knobs = core, knobs or VramKnobs()
        # the automatic re-plan never grows the expert cache past this (None: the pool); a
        # `ft ctl vram --expert-slots N` sets it to N
        self.max_expert_slots = max_expert_slots
        self.kv_floor = max(kv_floor or 0, core.max_context)
        self.kv_cap = max(kv_cap or core.sched.max_running * core.max_context, self.kv_floor)
        moe = core.moe
        self.has_experts = moe is not None and moe.cache is not None
        # one decode step routes up to max_running * top_k experts per layer: keep them
        self.min_expert_slots = min_expert_slots or (
            min(self.expert_pool, core.sched.max_running * moe.top_k) if self.has_experts
            else 0)
        self.has_state = core.caches.state is not None
        self.state_cap = (state_cap or elastic_state.state_slots(core)) if self.has_state else 0
        self.state_floor = (min(self.state_cap, state_floor or 2 * core.sched.max_running)
                            if self.has_state else 0)
        self.rebuilding = threading.Event()
        self.rebuilds = self.failures = 0
        self.last: dict | None = None
        self._failed: tuple | None = None  # the sizes of the last failed re-plan

    # -- reading ---------------------------------------------------------------------------

    @property
    def expert_pool(self) -> int:
        st = self.core.moe.store
        return st.num_layers * st.num_experts

    @property
    def kv_tokens(self) -> int:
        return self.core.sched.kv_alloc.num_slots

    @property
    def expert_slots(self) -> int:
        return self.core.moe.cache.num_slots if self.has_experts else 0

    @property
    def state_slots(self) -> int:
        return elastic_state.state_slots(self.core)

    def kv_live(self) -> int:
        """KV tokens live requests hold (locked in the tree or in their rows past it)."""
        sched = self.core.sched
        return sched.cache.protected_size + sum(len(r.row) - r.tree_len for r in sched.running)

    def state(self, free_bytes: int) -> VramState:
        core = self.core
        return VramState(
            free_bytes=free_bytes, expert_slots=self.expert_slots,
            expert_pool=self.expert_pool if self.has_experts else 0,
            slot_bytes=core.moe.store.expert_bytes if self.has_experts else 1,
            kv_tokens=self.kv_tokens,
            kv_token_bytes=KVPool.bytes_per_token(core.cfg, core.dtype),
            kv_floor=self.kv_floor, kv_live=self.kv_live(), kv_cap=self.kv_cap,
            min_expert_slots=self.min_expert_slots if self.has_experts else 0,
            max_expert_slots=self.max_expert_slots, state_slots=self.state_slots,
            state_slot_bytes=(StateTensors.bytes_per_slot(core.cfg, core.dtype)
                              if self.has_state else 0),
            state_floor=self.state_floor, state_live=elastic_state.state_live(core),
            state_cap=self.state_cap)

    # -- deciding --------------------------------------------------------------------------

    def replan(self, free_bytes: int) -> dict | None:
        """Engine thread: plan for `free_bytes` free on the device and rebuild when the
        planner says so. Never raises for a failed rebuild (it is logged and rolled back)."""
        p = plan(self.state(free_bytes), self.knobs)
        if p is None or (p.expert_slots, p.kv_tokens, p.state_slots) == self._failed:
            return None  # (a plan that just failed is not retried until the plan changes)
        try:
            out = self._rebuild(p)
        except (ResizeError, AdmissionError):
            self._failed = (p.expert_slots, p.kv_tokens, p.state_slots)
            return None
        self._failed = None
        return out

    def poll(self, read_free) -> dict | None:
        """Engine thread (the watcher's tick): read the free memory now and `replan`."""
        try:
            free = int(read_free())
        except Exception as e:  # noqa: BLE001  (a failed reading skips this round)
            log.warning(kv("read_failed", error=repr(e)[:200]))
            return None
        return self.replan(free)

    def rebuild(self, expert_slots: int | None = None, kv_tokens: int | None = None,
                state_slots: int | None = None) -> dict:
        """`ft ctl vram`: rebuild for the sizes given (None: keep). Raises `AdmissionError`
        for sizes out of range and `ResizeError` when it could not allocate or the live
        states do not fit (rolled back)."""
        slots = self.expert_slots if expert_slots is None else expert_slots
        tokens = self.kv_tokens if kv_tokens is None else kv_tokens
        if expert_slots is not None and not self.has_experts:
            raise AdmissionError("this server runs without an expert slot cache "
                                 "(--moe-backend fused)", "expert_slots")
        if self.has_experts and not 1 <= slots <= self.expert_pool:
            raise AdmissionError(f"the expert cache must hold between 1 and "
                                 f"{self.expert_pool} slots (got {slots})", "expert_slots")
        if not self.kv_floor <= tokens <= 2**31:
            raise AdmissionError(f"the KV pool must hold at least {self.kv_floor} tokens "
                                 f"(the context) (got {tokens})", "kv_tokens")
        if state_slots is not None and not self.has_state:
            raise AdmissionError("this model has no recurrent-state pool", "state_slots")
        if state_slots is not None and not 1 <= state_slots <= 2**20:
            raise AdmissionError(f"the state pool must hold between 1 and {2**20} slots "
                                 f"(got {state_slots})", "state_slots")
        out = self._rebuild(VramPlan(slots, tokens, "ctl", state_slots=state_slots))
        if expert_slots is not None:  # the operator's budget: the watcher keeps to it
            self.max_expert_slots = expert_slots
        if state_slots is not None:
            self.state_cap = state_slots
            self.state_floor = min(self.state_floor, state_slots)
        return out

    # -- rebuilding ------------------------------------------------------------------------

    def _rebuild(self, p: VramPlan) -> dict:
        core = self.core
        old = (self.expert_slots, self.kv_tokens, self.state_slots)
        st = old[2] if p.state_slots is None else p.state_slots
        t0 = time.perf_counter()
        self.rebuilding.set()
        try:
            core.settle()
            parts = [("experts", old[0], p.expert_slots), ("kv", old[1], p.kv_tokens),
                     ("state", old[2], st)]
            parts = [x for x in parts if x[1] != x[2]]
            parts.sort(key=lambda x: x[2] >= x[1])  # shrinks first: they free memory
            done: list[tuple[str, int, int]] = []
            try:
                for part in parts:
                    self._apply(part[0], part[2])
                    done.append(part)
            except ResizeError as e:
                self.failures += 1
                undone = self._undo(done)
                log.warning(kv("rebuild_failed", reason=p.reason, expert_slots=p.expert_slots,
                               kv_tokens=p.kv_tokens, state_slots=st, error=str(e)[:200],
                               rolled_back=undone, serving_slots=self.expert_slots,
                               serving_kv=self.kv_tokens, serving_state=self.state_slots))
                raise
        finally:
            if core.device.type == "cuda":  # what was given up goes back to the driver
                torch.cuda.empty_cache()
            self.rebuilding.clear()
        self.rebuilds += 1
        ms = (time.perf_counter() - t0) * 1e3
        self.last = {"reason": p.reason, "expert_slots": self.expert_slots,
                     "kv_tokens": self.kv_tokens, "state_slots": self.state_slots,
                     "previous_expert_slots": old[0], "previous_kv_tokens": old[1],
                     "previous_state_slots": old[2], "ms": round(ms, 1)}
        log.info(kv("rebuild", reason=p.reason, free_mb=p.free_bytes // 2**20,
                    expert_slots=f"{old[0]}->{self.expert_slots}",
                    kv_tokens=f"{old[1]}->{self.kv_tokens}",
                    state_slots=f"{old[2]}->{self.state_slots}", ms=f"{ms:.1f}",
                    running=len(core.sched.running)))
        return dict(self.last)

    def _undo(self, done: list[tuple[str, int, int]]) -> bool:
        """Undo the parts of a failed rebuild already applied (latest first)."""
        for name, before, _ in reversed(done):
            try:
                self._apply(name, before)
            except ResizeError as e:  # still serving, at the new size of this part
                log.error(kv("rollback_failed", part=name, keep=_size(self, name),
                             error=str(e)[:200]))
                return False
        return True

    def _apply(self, part: str, n: int) -> None:
        if part == "experts":
            self.core.moe.resize(slots=n)
        elif part == "state":
            elastic_state.resize_states(self.core, n)
        else:
            resize_kv(self.core, n)

    def stats(self) -> dict:
        return {"expert_slots": self.expert_slots, "kv_tokens": self.kv_tokens,
                "kv_live": self.kv_live(), "kv_floor": self.kv_floor, "kv_cap": self.kv_cap,
                "state_slots": self.state_slots, "state_live": elastic_state.state_live(self.core),
                "state_floor": self.state_floor, "state_cap": self.state_cap,
                "rebuilds": self.rebuilds, "failures": self.failures, "last": self.last}


def _size(e: ElasticVram, part: str) -> int:
    return {"experts": e.expert_slots, "kv": e.kv_tokens, "state": e.state_slots}[part]


def resize_kv(core, n: int) -> None:
    """Re-allocate `core`'s KV pool for `n` tokens (plus the runner's scratch slot) at a safe
    point, keeping every live token (see the module docstring). Raises `ResizeError` with the
    old pool serving when the live tokens do not fit or the allocation fails."""
    sched, caches = core.sched, core.caches
    alloc, old_pool = sched.kv_alloc, caches.kv
    old = alloc.num_slots
    if n < alloc.num_used:  # cached prefixes nobody holds go first
        sched.cache.evict(alloc.num_used - n)
        core.cache_ops.run(sched.cache.take_ops())
    if n < alloc.num_used:
        raise ResizeError(f"live requests hold {alloc.num_used} KV tokens; a pool of {n} "
                          f"cannot; still serving with {old}")
    src, dst = alloc.compaction(n)  # [M], [M]
    try:
        pool = new_kv_pool(core.cfg, n + 1, core.dtype, core.device)
    except _OOM as e:
        log.warning(kv("kv_alloc_failed", old=old, asked=n, error=type(e).__name__))
        raise ResizeError(f"could not allocate a KV pool of {n} tokens ({e}); "
                          f"still serving with {old}") from None
    keep = min(old, n)
    s_d, d_d = src.to(core.device), dst.to(core.device)
    for new_t, old_t in zip(pool.k + pool.v, old_pool.k + old_pool.v):
        new_t[:keep] = old_t[:keep]
        if src.numel():
            new_t[d_d] = old_t[s_d]
    # relabel every holder of a moved slot id: radix nodes, running requests' rows
    if src.numel():
        remap = torch.arange(old, dtype=torch.long)
        remap[src] = dst
        for node in sched.cache.radix.nodes():
            if node.value.numel():
                node.value = remap[node.value]
        for r in sched.running:
            if r.row.numel():
                r.row = remap[r.row]
    alloc.resize(n, src, dst)
    caches.kv = pool
    if core.runner is not None:
        core.runner.rebind_kv(n)
    log.info(kv("kv_resized", old=old, new=n, moved=int(src.numel()), live=alloc.num_used,
                mb=KVPool.bytes_per_token(core.cfg, core.dtype) * n // 2**20))

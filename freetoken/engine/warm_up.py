"""Warm-up that never blocks serving (issue #24 item 2, #20 item 6).

The server answers as soon as the weights are in place. What a first request would otherwise
pay for — Triton kernels compiled for each new prefill shape (their block sizes follow the
token count's power of two: `gdn.py`, `moe_grouped.py`), the path of a chunk that follows a
cached prefix (an agent's next turn), flashinfer plans, CUDA graph captures
— happens in small tasks that `AsyncEngine` runs one at a time while the engine is idle, at
the safe point between steps: a request that arrives waits for at most the one task running
(each is one prefill step, or one bucket's capture). A bucket not captured yet when a request
needs it is captured in that request's first step of the bucket (`DecodeRunner.launch`), so a
capture never stalls anyone for more than that step. Kernels come from the persistent compile
cache (`freetoken/kernels/compile_cache.py`): on a restart the tasks load binaries and compile
nothing.

A warm-up request yields to real work: before each of its steps it asks `should_yield`
(`AsyncEngine`: a request is waiting in the engine's inbox; a control call such as
`/v1/stats` waits for the task instead) and, if so, is
aborted after the step in flight and queued again in front (with a fresh prompt, so its
prefill shape is compiled whole), so a request that arrives waits for one warm-up step, not a
whole task (on a restart the `decode` task's steps were what the first token waited for).

When the decode runner's attention build ends (engine/plan_switch.py), the next idle turn
switches the plan and queues every bucket's capture again, on the new plan.

`EngineCore.warm_up()` runs every task now, blocking (benchmarks and tests that want a warm
engine before they time anything). Each task logs `ft.warmup: task ... seconds=`; the plan's
progress is in /v1/stats under `warmup`. Warm-up steps leave the step statistics as they were
(prefill tokens, TTFT), and their prompts stay in the prefix cache as any finished request's.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from freetoken.experts.bridge import BridgeError
from freetoken.log import get_logger, kv
from freetoken.types.api import GenerateRequest, SamplingParams

log = get_logger("warmup")
# the "decode" task's prompt: a short chat turn's shape class (9-16 tokens, not a multiple of
# 16: Triton specialises integer arguments on `% 16` and `== 1`, block sizes follow the next
# power of two), so the first task loads the kernels the first short request needs
DECODE_PROMPT = 13
SMALL = 512  # prefill shapes up to this many tokens go before the wider buckets' captures
# a "prefix" task's first chunk: the tokens its measured chunk finds cached before it
PREFIX = 16


class _Yielded(Exception):
    """A warm-up request gave way to real work (queued again)."""


@dataclass(frozen=True)
class Task:
    kind: str  # "prefill" (one prompt of `size` tokens), "prefix" (`size` new tokens after
    # PREFIX cached ones: an agent's next turn on its cached context), "decode" (a short
    # prompt, then `size` decode steps: the first launch of the decode path), "capture" (one
    # decode bucket)
    size: int
    greedy: bool = True

    @property
    def name(self) -> str:
        if self.kind != "capture":
            return f"{self.kind}:{self.size}"
        return f"capture:{self.size}:{'greedy' if self.greedy else 'sampling'}"


def prefill_shapes(chunk: int, max_prompt: int, threshold: int | None) -> list[int]:
    """The prefill token counts that reach distinct kernels: every power of two up to the
    chunk, each with its odd neighbour (Triton specialises integer arguments on divisibility
    by 16), the prefill stream's threshold and the token just below it, and the longest chunk;
    none under 2 (a 1-token prompt is a decode step) or above `max_prompt`."""
    out = set()
    k = 2
    while k <= chunk:
        out.update((k, k + 1))
        k *= 2
    out.add(min(chunk, max_prompt))  # the longest chunk a prompt can make
    if threshold is not None and threshold <= chunk:
        out.update((threshold - 1, threshold))
    return sorted(n for n in out if 2 <= n <= min(chunk, max_prompt))


def prefix_shapes(shapes: list[int], chunk: int) -> list[int]:
    """The new-token counts warmed after a cached prefix: each short class once and a whole
    chunk. A prompt's last token runs as its own step (its logits are kept), so n new tokens
    feed n - 1 then 1: a power of two 2^j feeds 2^j - 1 (the common case, not a multiple of
    16), and chunk + 1 feeds one whole chunk (a long prompt's later chunks). A chunk after a
    prefix attends through another kernel than a first chunk (layers/step_context.py
    `attend`), so a first start's cold path waited there: 8.0 s in the second 8k chunk of the
    H200's 32k TTFT (2026-12-04), and an agent turn of 41 new tokens on 41k cached ones had an
    18.8 s TTFT (issue #20 item 6)."""
    small = [n for n in shapes if n > 2 and n & (n - 1) == 0 and n <= SMALL]
    return sorted(set(small) | {chunk + 1})


def plan_tasks(core) -> list[Task]:
    """Every warm-up task for `core`, most urgent first: a short request's decode steps (on
    CUDA its first step captures the batch-1 greedy graph), the short prefill shapes and the
    same after a cached prefix, the other graphs, the long prefill shapes (and the longest
    after a prefix)."""
    st = core.moe.streamer if core.moe is not None else None
    threshold = st.threshold if st is not None and st.wants(1 << 30)[0] else None
    chunk = core.sched.chunk_tokens
    shapes = prefill_shapes(chunk, core.max_context - 2, threshold)
    decode = [Task("decode", 2)] if core.max_context >= DECODE_PROMPT + 3 else []
    prefixed = [n for n in prefix_shapes(shapes, chunk) if PREFIX + n + 2 <= core.max_context]
    return (decode + [Task("prefill", n) for n in shapes if n <= SMALL]
            + [Task("prefix", n) for n in prefixed if n <= SMALL] + capture_tasks(core)
            + [Task("prefill", n) for n in shapes if n > SMALL]
            + [Task("prefix", n) for n in prefixed if n > SMALL])


def capture_tasks(core) -> list[Task]:
    """Each decode bucket's greedy and sampling capture (none when the runner has no
    graphs)."""
    if core.runner is None or not core.runner.use_graphs:
        return []
    return [Task("capture", b, g) for b in sorted(core.runner.buckets) for g in (True, False)]


class Warmup:
    """The warm-up tasks of one engine and what they did (see the module docstring)."""

    def __init__(self, core):
        self.core = core
        self.tasks: deque[Task] = deque()
        self.done: list[dict] = []
        self.yields = 0  # warm-up requests that gave way to real work (and were queued again)
        self.seconds = 0.0
        self._t_plan: float | None = None
        self._running = False  # a task is running now (on the engine thread)
        # whether real work waits (AsyncEngine sets it: its inbox is not empty); a warm-up
        # request then gives way at its next step
        self.should_yield: Callable[[], bool] = lambda: False

    def plan(self) -> int:
        """Queue every task (`plan_tasks`); returns how many."""
        self.tasks = deque(plan_tasks(self.core))
        self._t_plan = time.perf_counter()
        log.info(kv("plan", tasks=len(self.tasks),
                     prefill=",".join(str(t.size) for t in self.tasks if t.kind == "prefill"),
                     prefix=",".join(str(t.size) for t in self.tasks if t.kind == "prefix"),
                     captures=sum(t.kind == "capture" for t in self.tasks)))
        return len(self.tasks)

    @property
    def pending(self) -> int:
        """Tasks not finished yet, the one running included, and an attention switch due
        (an idle turn makes it)."""
        runner = self.core.runner
        due = runner is not None and runner.switch_due()
        return len(self.tasks) + self._running + due

    def run_one(self) -> bool:
        """Run the next task (the caller's engine has no other work); False when none is
        left. A CPU bridge failing in it is dropped (`EngineCore.drop_bridge`) and the
        warm-up goes on: the server serves on without it (issue #20). An attention switch
        due goes first: the graphs are then captured again, on the new plan."""
        if self._switch():
            return True
        if not self.tasks:
            return False
        self._running = True
        try:
            self._run(self.tasks.popleft())
        finally:
            self._running = False
        return True

    def _switch(self) -> bool:
        """Make a due attention switch (module docstring); whether one was due."""
        runner = self.core.runner
        if runner is None or not runner.switch_due():
            return False
        runner.drain()  # (idle: nothing is in flight)
        if runner.at_safe_point() and self._t_plan is not None:
            held = {t for t in self.tasks if t.kind == "capture"}
            again = [t for t in capture_tasks(self.core) if t not in held]
            self.tasks.extendleft(reversed(again))
            log.info(kv("recapture", tasks=len(again), attention=runner.attention))
        return True

    def _run(self, task: Task) -> None:
        core = self.core
        t0 = time.perf_counter()
        result = "ok"
        try:
            with core.stats.muted():  # warm-up steps are not the workload's
                if task.kind == "capture":
                    if core.runner is None or not core.runner.capture_bucket(task.size,
                                                                             task.greedy):
                        result = "skipped"
                    self._check_bridge()
                elif task.kind == "decode":
                    self._request(DECODE_PROMPT, task.size + 1, len(self.done) + self.yields)
                elif task.kind == "prefix":
                    self._request(PREFIX + task.size, 1, len(self.done) + self.yields,
                                  first_chunk=PREFIX)
                else:
                    self._request(task.size, 1, len(self.done) + self.yields)
        except BridgeError as e:
            result = f"bridge_dropped:{type(e).__name__}"
        except _Yielded:
            result = "yielded"
            self.yields += 1
            self.tasks.appendleft(task)
        dt = time.perf_counter() - t0
        self.seconds += dt
        if result != "yielded":
            self.done.append({"task": task.name, "seconds": round(dt, 3), "result": result})
        log.info(kv("task", name=task.name, seconds=f"{dt:.2f}", result=result,
                    left=len(self.tasks)))
        if not self.tasks:
            wall = time.perf_counter() - (self._t_plan or t0)
            log.info(kv("done", tasks=len(self.done), seconds=f"{self.seconds:.1f}",
                        wall=f"{wall:.1f}"))

    def run_all(self) -> float:
        """Plan (unless planned) and run every task now, after the attention build (if one
        runs) has ended and the runner switched to its plan; returns their seconds."""
        if self.core.runner is not None:
            self.core.runner.finish_build()
        if not self.tasks and not self.done:
            self.plan()
        t0 = self.seconds
        while self.run_one():
            pass
        return self.seconds - t0

    def _request(self, n: int, max_tokens: int, seed: int, first_chunk: int = 0) -> None:
        """One request of `n` prompt tokens and `max_tokens` outputs, run to its end, or until
        `should_yield` before one of its steps: then it is aborted, the step in flight read
        (`EngineCore.settle`), and `_Yielded` raised. `first_chunk`: its first step feeds only
        that many tokens (the engine is idle: the scheduler's chunk budget is this request's),
        so the next chunk runs after a cached prefix."""
        core = self.core
        V = core.cfg.vocab_size
        start = 1 + (seed * 97) % (V - 1)  # a prompt of its own: no prefix match shortens it
        ids = [1 + (start + i) % (V - 1) for i in range(n)]
        rid = f"ft-warm-up-{seed}"
        core.add(GenerateRequest(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                     ignore_eos=True), request_id=rid),
                 lambda ev: None)
        budget = core.sched.chunk_tokens
        try:
            while core.has_work():
                if self.should_yield():
                    raise _Yielded
                core.sched.chunk_tokens, first_chunk = first_chunk or budget, 0
                core.step()
        except _Yielded:
            core.sched.abort(rid)
            core.settle()
            raise
        except BaseException:  # (a BridgeError: `step` dropped the bridge already)
            core.sched.abort(rid)
            raise
        finally:
            core.sched.chunk_tokens = budget

    def _check_bridge(self) -> None:
        runner = self.core.runner
        br = runner.bridge if runner is not None else None
        if br is not None and br.failed:  # a capture's warm-up run failed the worker
            e = BridgeError(f"the worker failed during capture: {br.failure!r}")
            self.core.drop_bridge(e)
            raise e

    def stats(self) -> dict:
        """/v1/stats `warmup`: tasks left and done, seconds spent, the slowest tasks, the
        decode attention plan and the one being built to replace it (None when none is), and
        the graphs held and capture seconds (lazy captures in request steps included)."""
        runner = self.core.runner
        slow = sorted(self.done, key=lambda d: -d["seconds"])[:5]
        return {"pending": self.pending, "done": len(self.done), "yields": self.yields,
                "seconds": round(self.seconds, 3), "slowest": slow,
                "attention": runner.attention if runner is not None else None,
                "attention_building": runner.building() if runner is not None else None,
                "graphs": runner.graphs_held() if runner is not None else 0,
                "capture_seconds": round(runner.capture_s, 3) if runner is not None else 0.0}

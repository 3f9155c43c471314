"""Warm-up before serving: the first requests must not pay for kernel compilation and graph
capture (tens of seconds on a fresh GPU process), and a CPU bridge that fails there must not
keep the server from coming up (issue #20)."""
from __future__ import annotations

import time

from freetoken.engine.stats import EngineStats
from freetoken.experts.bridge import BridgeError
from freetoken.log import get_logger, kv
from freetoken.types.api import GenerateRequest, SamplingParams

log = get_logger("engine")


def warm_up(core) -> float:
    """Before serving: one tiny request through prefill and decode (kernels compile on
    first use: tens of seconds on a fresh GPU process), then every decode graph captured,
    so the first user request does not pay for them. Leaves no request running and the
    step statistics empty; its few tokens stay in the prefix cache as any finished
    request's would. Returns the seconds it took.

    A CPU bridge whose worker fails here (or a capture that leaves it failed) is dropped
    and the warm-up runs again without it: the server comes up on the eager CPU branch
    rather than not at all (issue #20)."""
    t0 = time.perf_counter()
    for attempt in range(2):
        try:
            graphs = _once(core)
            break
        except BridgeError:  # `step` dropped the bridge already
            core.sched.abort("ft-warm-up")
            if attempt:
                raise
    core.stats = EngineStats()
    dt = time.perf_counter() - t0
    log.info(kv("warm_up", seconds=f"{dt:.1f}", graphs=graphs))
    return dt


def _once(core) -> int:
    n = min(16, core.max_context - 3)
    ids = [1 + i % (core.cfg.vocab_size - 1) for i in range(n)]
    core.add(GenerateRequest(ids, SamplingParams(max_tokens=2, temperature=0.0,
                                                 ignore_eos=True), request_id="ft-warm-up"),
             lambda ev: None)
    while core.has_work():
        core.step()
    if core.runner is None:
        return 0
    graphs = core.runner.capture_all()
    br = core.runner.bridge
    if br is not None and br.failed:  # a capture's warm-up run failed the worker
        core.drop_bridge(BridgeError(f"the worker failed during capture: {br.failure!r}"))
        graphs = core.runner.capture_all()
    return graphs

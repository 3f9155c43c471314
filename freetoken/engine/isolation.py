"""No request can fail another (issue 22): what the engine does when one row of a step fails.

- A row that cannot be sampled (non-finite logits: `RowFailure` from the CPU sampler,
  `gpu_sampler.FAILED_ROW` from the device one) fails its own request (`fail_request`); the
  other rows of the step take their tokens as usual.
- A forward pass that raises (`isolate`) fails nobody at once when it computed several
  requests: their working states may be half updated, so each is dropped back to its cached
  prefix and re-run alone (`Scheduler.retry_alone`) past the step that failed. The request
  whose failure follows it when it runs alone is the culprit and fails; the others recompute
  the same tokens and rejoin the batch. A failed step of one request fails that request.

- A replayed CUDA graph that fails is nobody's fault. One that raises (`GraphFault`, from
  `DecodeRunner.launch`) may have half written its rows' KV and state, so every row of the step
  is re-run alone from its cached prefix, eagerly, blaming no one; one that returns a row
  poisoned (`GRAPH_POISONED`, from `DecodeRunner.collect`) has that row's request re-run the
  same way. The runner has dropped its graphs and decodes eagerly from then on (one
  `ft.engine: graph_fault` line); a row that fails again when run alone is its own culprit.

The engine keeps serving either way. A `BridgeError` is not handled here (EngineCore.step).
"""
from __future__ import annotations

from freetoken.log import get_logger, kv
from freetoken.sampler import RowFailure
from freetoken.scheduler.request import Request
from freetoken.scheduler.scheduler import Scheduler

log = get_logger("engine")
GRAPH_POISONED = -2  # a row's token from a replayed graph that poisoned it (not a vocab id)


class GraphFault(RuntimeError):
    """A replayed decode graph raised: the step's rows may be half written; the runner has
    dropped its graphs (`DecodeRunner._graph_fault`)."""


def retry_poisoned(sched: Scheduler, r: Request, until: int) -> None:
    """A replayed graph poisoned `r`'s row of a step that reached `until`: `r` recomputes it
    alone, eagerly (the graphs are gone); it fails only if it fails there too."""
    sched.retry_alone(r, until)


def fail_request(sched: Scheduler, r: Request, err: BaseException) -> None:
    """`r` alone fails with `err` (its client gets an error in its API's shape)."""
    sched.abort(r.rid)
    r.finished = True
    log.warning(kv("row_failed", rid=r.rid, error=repr(err)[:200]))
    r.emit(err)  # type: ignore[arg-type]


def isolate(sched: Scheduler, failed: list[tuple[Request, int]], err: Exception) -> None:
    """A forward pass over `failed` (each request with the position its rows reached) raised
    `err`; see the module docstring."""
    running = {id(r) for r in sched.running}
    live = [(r, end) for r, end in failed if id(r) in running]
    if isinstance(err, GraphFault):  # the graph's failure, not a request's: nobody is blamed
        for r, end in reversed(live):
            sched.retry_alone(r, end)
        return
    if len(live) == 1:
        r = live[0][0]
        fail_request(sched, r, RowFailure(f"the forward pass of this request failed: {err!r}"))
        return
    log.warning(kv("step_failed_isolating", rows=len(live), error=repr(err)[:200],
                   rids=",".join(r.rid for r, _ in live)[:300]))
    for r, end in reversed(live):  # front of the queue, in batch order
        sched.retry_alone(r, end)

"""Replay a workload against an endpoint, keeping its concurrency, and collect per-turn metrics.

Every turn is an asyncio task that waits for the turns in its `after`, sleeps its `delay_s`, and
sends its recorded body with the output length forced. So W3's sibling sub-agents go out
together (40 ms apart) and the parent's next turn waits for both, as the harness does.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from freetoken.log import kv
from workloads.client import TurnResult, force_output, sampling_of, send_turn
from workloads.convert import to_api
from workloads.log import log
from workloads.spec import Turn, Workload

PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}


@dataclass
class WorkloadResult:
    workload: str
    version: str
    api: str
    endpoint: str
    turns: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(t.error is None for t in self.turns)

    @property
    def mean_decode_tps(self) -> float | None:
        rates = [t.decode_tps for t in self.turns if t.decode_tps is not None]
        return statistics.fmean(rates) if rates else None

    def rates_by_sampling(self) -> dict[str, float]:
        """Mean decode tok/s of the turns of each sampling (`client.sampling_of`)."""
        by: dict[str, list[float]] = {}
        for t in self.turns:
            if t.decode_tps is not None:
                by.setdefault(t.sampling, []).append(t.decode_tps)
        return {k: statistics.fmean(v) for k, v in by.items()}

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.workload, "version": self.version, "api": self.api,
                "endpoint": self.endpoint, "wall_s": self.wall_s,
                "mean_decode_tps": self.mean_decode_tps,
                "turns": [t.to_json() for t in self.turns]}


def url_for(endpoint: str, api: str) -> str:
    """`endpoint` may be the server root or end in `/v1`."""
    base = endpoint.rstrip("/")
    base = base.removesuffix("/v1")
    return base + PATHS[api]


def _headers(turn: Turn, api: str, api_key: str | None) -> dict[str, str]:
    h = {k: v for k, v in turn.headers.items()
         if api == "anthropic" or not k.lower().startswith("anthropic")}
    key = api_key or "dummy"
    if api == "anthropic":
        h.update({"x-api-key": key, "anthropic-version": h.get("anthropic-version",
                                                                "2023-06-01")})
    else:
        h["Authorization"] = f"Bearer {key}"
    return h


def request_body(turn: Turn, api: str, model: str | None) -> dict[str, Any]:
    """The exact JSON sent for `turn` on surface `api`."""
    body = to_api(turn.body, turn.api, api)
    if model:
        body = {**body, "model": model}
    return force_output(body, turn.output_tokens, api)


async def run_workload_async(workload: Workload, endpoint: str, api: str | None = None, *,
                             model: str | None = None, api_key: str | None = None,
                             timeout_s: float = 1800.0, progress: bool = False,
                             ) -> WorkloadResult:
    """Replay `workload` on `endpoint` (surface `api`, default the workload's own)."""
    api = api or workload.api
    url = url_for(endpoint, api)
    res = WorkloadResult(workload.name, workload.version, api, endpoint)
    done = {t.id: asyncio.Event() for t in workload.turns}
    bar = tqdm(total=len(workload.turns), desc=workload.name, unit="req", disable=not progress)
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    timeout = httpx.Timeout(timeout_s, connect=30.0)

    async def one(turn: Turn, client: httpx.AsyncClient, r: TurnResult) -> None:
        for dep in turn.after:
            await done[dep].wait()
        if turn.delay_s:
            await asyncio.sleep(turn.delay_s)
        await send_turn(client, url, api, request_body(turn, api, model),
                        _headers(turn, api, api_key), r, t0)
        log.debug(kv("turn", workload=workload.name, turn=turn.id, ttft=r.ttft_s,
                     tps=r.decode_tps, prompt=r.prompt_tokens, cached=r.cached_tokens,
                     out=r.output_tokens))
        bar.update(1)
        done[turn.id].set()

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        res.turns = [TurnResult(t.id, t.session, t.group, t.output_tokens,
                                sampling=sampling_of(t.body)) for t in workload.turns]
        await asyncio.gather(*(one(t, client, r) for t, r in zip(workload.turns, res.turns)))
    bar.close()
    res.wall_s = time.perf_counter() - t0
    log.info(kv("workload_done", name=workload.name, api=api, wall_s=round(res.wall_s, 2),
                decode_tps=res.mean_decode_tps, errors=sum(t.error is not None
                                                           for t in res.turns)))
    return res


def run_workload(workload: Workload, endpoint: str, api: str | None = None, *,
                 model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 1800.0, progress: bool = False) -> WorkloadResult:
    """Blocking wrapper of `run_workload_async` (call it outside a running event loop)."""
    return asyncio.run(run_workload_async(workload, endpoint, api, model=model, api_key=api_key,
                                          timeout_s=timeout_s, progress=progress))


def summarize(results: dict[str, WorkloadResult]) -> dict[str, dict]:
    """Per workload: mean decode tok/s, its sampling, W1's at the same sampling, and their
    ratio (decode stability of W2–W4; 1.0 means agent context costs nothing in decode speed).
    The ratio is only taken at equal sampling (`top_p` alone costs ~35% of decode speed on
    the CPU): where W1 ran at no turn of the workload's sampling it is None, and both
    samplings and rates are stated (`stability_vs_w1_other_sampling`, not comparable)."""
    w1 = results["W1"].rates_by_sampling() if "W1" in results else {}
    w1_mean = results["W1"].mean_decode_tps if "W1" in results else None
    out: dict[str, dict] = {}
    for name, r in results.items():
        rate, mine = r.mean_decode_tps, r.rates_by_sampling()
        same = {k: v / w1[k] for k, v in mine.items() if w1.get(k)}
        ratio = statistics.fmean(same.values()) if same else None
        out[name] = {"mean_decode_tps": rate, "sampling": sorted(mine),
                     "w1_sampling": sorted(w1),
                     "w1_same_sampling_tps": (statistics.fmean(w1[k] for k in same)
                                              if same else None),
                     "stability_vs_w1": ratio,
                     "stability_vs_w1_other_sampling": (rate / w1_mean if ratio is None and
                                                        rate is not None and w1_mean else None)}
    return out

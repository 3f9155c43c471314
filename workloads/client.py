"""One streamed request: force the output length, read the SSE stream, time every delta.

Forcing: `max_tokens = min_tokens = N` with `ignore_eos: true` (FreeToken, vLLM, SGLang),
`n_predict = N` (llama.cpp) and `max_completion_tokens = N` where the harness sent that field.
Servers ignore fields they do not know, so all are sent on both surfaces.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from freetoken.log import kv
from workloads.log import log


@dataclass
class TurnResult:
    """Timings are seconds since the workload started; rates are tokens per second."""

    turn_id: str
    session: str
    group: str
    expected_output_tokens: int
    start: float = 0.0
    first_token: float | None = None
    end: float = 0.0
    output_tokens: int = 0
    deltas: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    last_token: float | None = None
    sampling: str = ""  # `sampling_of(body)`: decode rates compare only at equal sampling


    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def decode_tps(self) -> float | None:
        """(tokens after the first) / (time from first to last delta)."""
        if self.first_token is None or self.last_token is None or self.output_tokens < 2:
            return None
        span = self.last_token - self.first_token
        return (self.output_tokens - 1) / span if span > 0 else None

    @property
    def recomputed_tokens(self) -> int | None:
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens - (self.cached_tokens or 0)

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(ttft_s=self.ttft_s, decode_tps=self.decode_tps,
                 recomputed_tokens=self.recomputed_tokens)
        return d


def sampling_of(body: dict[str, Any]) -> str:
    """The sampling fields that change decode cost, as the server defaults them (top_p on the
    CPU costs ~35% of decode speed): `temperature=T top_p=P top_k=K`."""
    def num(k: str, default: float) -> float:
        v = body.get(k)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default
    return f"temperature={num('temperature', 1.0):g} top_p={num('top_p', 1.0):g} " \
           f"top_k={num('top_k', 0):g}"



def force_output(body: dict[str, Any], n: int, api: str) -> dict[str, Any]:
    out = dict(body, max_tokens=n, min_tokens=n, ignore_eos=True, n_predict=n, stream=True)
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = n
    if api == "openai":
        out["stream_options"] = {"include_usage": True}
    return out


def _openai_delta(ev: dict[str, Any], r: TurnResult) -> bool:
    if ev.get("usage"):
        u = ev["usage"]
        r.prompt_tokens = u.get("prompt_tokens", r.prompt_tokens)
        r.output_tokens = u.get("completion_tokens") or r.output_tokens
        details = u.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            r.cached_tokens = details["cached_tokens"]
    for ch in ev.get("choices") or []:
        d = ch.get("delta") or {}
        if d.get("content") or d.get("reasoning_content") or d.get("reasoning") or \
                d.get("tool_calls"):
            return True
    return False


def _anthropic_delta(ev: dict[str, Any], r: TurnResult) -> bool:
    kind = ev.get("type")
    usage = (ev.get("message") or {}).get("usage") if kind == "message_start" else ev.get("usage")
    if usage:
        if "input_tokens" in usage:
            # Anthropic counts cache hits outside input_tokens; the prompt is their sum.
            cached = usage.get("cache_read_input_tokens") or 0
            r.prompt_tokens = (usage["input_tokens"] + cached +
                               (usage.get("cache_creation_input_tokens") or 0))
            r.cached_tokens = cached
        if usage.get("output_tokens"):
            r.output_tokens = usage["output_tokens"]
    return kind == "content_block_delta"


async def send_turn(client: httpx.AsyncClient, url: str, api: str, body: dict[str, Any],
                    headers: dict[str, str], result: TurnResult, t0: float) -> TurnResult:
    """POST `body` to `url` as a stream and fill `result` (errors are recorded, not raised)."""
    result.start = time.perf_counter() - t0
    usage_out = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if ev.get("type") == "error" or ("error" in ev and "choices" not in ev):
                    raise RuntimeError(f"stream error: {ev.get('error')}")
                before = result.output_tokens
                got = (_openai_delta if api == "openai" else _anthropic_delta)(ev, result)
                if result.output_tokens != before:
                    usage_out = result.output_tokens
                if got:
                    now = time.perf_counter() - t0
                    result.first_token = result.first_token or now
                    result.last_token = now
                    result.deltas += 1
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        log.warning(kv("turn_error", turn=result.turn_id, error=result.error))
    result.end = time.perf_counter() - t0
    if not usage_out:
        result.output_tokens = result.deltas
    return result

"""Rolling engine statistics for /v1/stats: throughput, TTFT, cache hit ratio, and
`prefill_tokens_computed` / `decode_tokens_computed` (every token the engine fed since start,
never windowed: a prompt served twice from scratch counts twice, a re-sent one resumed from
cache once, an exact repeat sampled from kept logits not at all)."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class EngineStats:
    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self._steps: deque[tuple[float, float, int, int]] = deque()  # (t, dt, prefill, decode)
        self._ttft: deque[float] = deque(maxlen=256)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.requests = 0
        self.prefill_tokens = 0  # every token fed outside decode rows, since the start
        self.decode_tokens = 0
        # where a decode step's wall time goes, summed since the start (clients take deltas):
        # `step_s` inside EngineCore.step, of which `wait_s` blocked on the device's tokens,
        # and `between_s` from one decode step's end to the next one's start (the engine
        # thread's loop: its inbox, other threads holding the GIL)
        self.phases = {"steps": 0, "step_s": 0.0, "wait_s": 0.0, "between_s": 0.0}
        self._lock = threading.Lock()
        self._muted = 0  # inside `muted()`: the steps are not the workload's

    @contextmanager
    def muted(self) -> Iterator[None]:
        """Steps run inside are not counted (warm-up tasks). The object stays the one readers
        hold: `/v1/stats`, read from the server's thread while a warm-up task runs on the
        engine's, sees the workload's figures (a stand-in object swapped in for the task
        read as all zeros: the H200's served `decode_phases` of session 16)."""
        self._muted += 1
        try:
            yield
        finally:
            self._muted -= 1

    def on_step(self, dt: float, prefill_tokens: int, decode_tokens: int) -> None:
        if self._muted:
            return
        now = time.time()
        with self._lock:
            self._steps.append((now, dt, prefill_tokens, decode_tokens))
            self.prefill_tokens += prefill_tokens
            self.decode_tokens += decode_tokens
            while self._steps and self._steps[0][0] < now - self.window_s:
                self._steps.popleft()

    def on_decode_phases(self, step_s: float, wait_s: float, between_s: float) -> None:
        """One decode-only step's split (see `phases`)."""
        if self._muted:
            return
        with self._lock:
            ph = self.phases
            ph["steps"] += 1
            ph["step_s"] += step_s
            ph["wait_s"] += wait_s
            ph["between_s"] += between_s

    def on_first_token(self, ttft: float, prompt: int, cached: int) -> None:
        if self._muted:
            return
        with self._lock:
            self._ttft.append(ttft)
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            self.requests += 1

    def summary(self) -> dict:
        with self._lock:
            steps = list(self._steps)
            ttft = sorted(self._ttft)
            phases = dict(self.phases)
        busy = sum(s[1] for s in steps)
        pf = sum(s[2] for s in steps)
        dc = sum(s[3] for s in steps)
        dec_time = sum(s[1] for s in steps if s[2] == 0)
        dec_tok = sum(s[3] for s in steps if s[2] == 0)
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_tokens_computed": self.prefill_tokens,
            "decode_tokens_computed": self.decode_tokens,
            "cache_hit_ratio": round(self.cached_tokens / self.prompt_tokens, 4)
            if self.prompt_tokens else 0.0,
            "prefill_tokens_per_s": round(pf / busy, 2) if busy else 0.0,
            "decode_tokens_per_s": round(dec_tok / dec_time, 2) if dec_time else 0.0,
            "tokens_per_s_window": round((pf + dc) / busy, 2) if busy else 0.0,
            "ttft_p50_s": round(ttft[len(ttft) // 2], 4) if ttft else None,
            "ttft_mean_s": round(sum(ttft) / len(ttft), 4) if ttft else None,
            "decode_phases": {k: round(v, 6) if isinstance(v, float) else v
                              for k, v in phases.items()},
        }

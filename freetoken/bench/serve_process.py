"""`ft serve` as a subprocess for the end-to-end benchmarks: start it, time start → ready (the
first 200 from /v1/models) and split that time into phases from the server's own log lines:

  load       `ft.model: loaded ... seconds=` minus the bandwidth profile inside it
  profile    `ft.experts: bw_profile_measured seconds=` (a first hybrid/auto start on a GPU)
  warm_up    `ft.engine: warm_up seconds=` (kernel compilation and graph captures, when
             `--warm-up blocking` runs them before serving)
  other      the rest: interpreter and imports, tokenizer, HTTP server start; of it, from
             `ft.server: startup_phases`, `imports` (process start to the build),
             `tokenizer`, `engine_build` (KV and state pools, the decode runner),
             `warm_up_plan` and `elastic`

and, outside start → ready, `warm_up_idle`: the seconds of the warm-up tasks the server ran
while idle after it was ready (`ft.warmup: done ... seconds=`; the default `--warm-up idle`).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

_LINES = {
    "load": re.compile(r"ft\.model: loaded .*?seconds=([0-9.]+)"),
    "profile": re.compile(r"ft\.experts: bw_profile_measured seconds=([0-9.]+)"),
    "warm_up": re.compile(r"ft\.engine: warm_up seconds=([0-9.]+)"),
}
_IDLE = re.compile(r"ft\.warmup: done .*?seconds=([0-9.]+)")
# `ft.server: startup_phases before_s= resolve_s= load_s= tokenizer_s= engine_s= ...`: the
# parts of a start outside the weight load (cli/build.py StartMarks)
_STARTUP = re.compile(r"ft\.server: startup_phases (.*)")
_STARTUP_PARTS = {"before": "imports", "tokenizer": "tokenizer", "engine": "engine_build",
                  "warm_up": "warm_up_plan", "elastic": "elastic"}
_WEIGHTS = re.compile(r"ft\.checkpoint: (?:ftw_)?loaded .*?(?:read_s|in_place_s)=([0-9.]+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_phases(log_text: str) -> dict[str, float]:
    """Seconds per phase found in a server log (missing phases are absent)."""
    out: dict[str, float] = {}
    for name, rx in _LINES.items():
        m = rx.findall(log_text)
        if m:
            out[name] = float(m[-1])
    if "load" in out and "profile" in out:
        out["load"] = max(0.0, out["load"] - out["profile"])
    m = _IDLE.findall(log_text)
    if m:
        out["warm_up_idle"] = float(m[-1])
    m = _WEIGHTS.findall(log_text)
    if m:
        out["weights_read"] = float(m[-1])
    m = _STARTUP.findall(log_text)
    if m:
        fields = dict(f.split("=", 1) for f in m[-1].split() if "=" in f)
        for key, name in _STARTUP_PARTS.items():
            try:
                out[name] = float(fields[f"{key}_s"])
            except (KeyError, ValueError):
                pass
    return out


@dataclass
class ServerProcess:
    """`python -m freetoken.cli serve --model MODEL --port P ARGS...`; log in `log_path`."""

    model: str
    args: list[str] = field(default_factory=list)
    log_path: Path = Path("serve.log")
    env: dict[str, str] | None = None
    port: int = 0
    proc: subprocess.Popen | None = None
    t_start: float = 0.0
    ready_s: float | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = self.port or free_port()
        cmd = [sys.executable, "-m", "freetoken.cli", "serve", "--model", self.model,
               "--port", str(self.port), *self.args]
        env = dict(os.environ, **(self.env or {}))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self._log.write("$ " + " ".join(cmd) + "\n")
        self._log.flush()
        self.t_start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 1800.0) -> float:
        """Seconds from process start to the first 200 of /v1/models; raises with the log's
        tail when the server exits or the timeout passes first."""
        assert self.proc is not None
        deadline = self.t_start + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ft serve exited with {self.proc.returncode} before ready; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.endpoint + "/v1/models", timeout=2.0).status_code == 200:
                    self.ready_s = time.perf_counter() - self.t_start
                    return self.ready_s
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"ft serve not ready after {timeout_s:.0f} s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def phases(self) -> dict[str, float]:
        out = parse_phases(self.log_text())
        if self.ready_s is not None:
            known = sum(v for k, v in out.items() if k in _LINES)
            out["other"] = max(0.0, self.ready_s - known)
            out["ready"] = self.ready_s
        return out

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stats(self) -> dict:
        """/v1/stats, or {} when the server cannot answer (the report then says so)."""
        try:
            r = httpx.get(self.endpoint + "/v1/stats", timeout=30.0)
            r.raise_for_status()
            return r.json()
        except httpx.HTTPError:
            return {}

    def first_token_s(self, prompt: str = "Say hello.", max_tokens: int = 8) -> float:
        """Seconds from sending one streamed chat request to its first content byte."""
        body = {"model": "m", "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": prompt}]}
        t0 = time.perf_counter()
        with httpx.stream("POST", self.endpoint + "/v1/chat/completions", json=body,
                          timeout=600.0) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                for choice in json.loads(line[5:]).get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
                        return time.perf_counter() - t0  # a generated token, not the role
        return time.perf_counter() - t0

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # our own session: the server only
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

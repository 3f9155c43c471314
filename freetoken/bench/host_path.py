"""The host side of a decode step on its own, against an emulated device: whether the host path
of `ft bench decode` (the `generate` loop), of the server's EngineCore, and of the whole served
stack (AsyncEngine's thread, the HTTP route, SSE, the client in another process) keeps up
with a device step of `device_ms`.

The decode runner's forward is replaced by a write of the sampled ids (nothing computed) and
each launched step "finishes" `device_ms` after the later of its launch and the previous
step's finish (an in-order stream); collecting a step sleeps until then, the GIL released, as
`cudaEventSynchronize` does. A path that keeps up decodes at `device_ms` a token; above it the
host is the bottleneck (on the H200, `fused` at 20 layers is ~2.2 ms a step, launch-bound).

Runs on any machine (no GPU): `scripts/profile_decode.py --host-path 2.2`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager

from freetoken.bench import decode_drivers as dd

_CLIENT = r'''
import httpx, json, sys, time
url, n = sys.argv[1], int(sys.argv[2])
body = {"model": "m", "stream": True, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
        "temperature": 0, "messages": [{"role": "user", "content": "Count."}]}
ts = []
with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
    for line in r.iter_lines():
        if line.startswith("data:") and line.strip() != "data: [DONE]":
            for ch in json.loads(line[5:]).get("choices") or []:
                d = ch.get("delta") or {}
                if d.get("content") or d.get("reasoning_content"):
                    ts.append(time.perf_counter())
k = min(20, len(ts) // 4)
print(json.dumps({"tokens": len(ts),
                  "ms": 1e3 * (ts[-1] - ts[k]) / max(1, len(ts) - 1 - k) if ts else None}))
'''


@contextmanager
def emulated_device(device_ms: float):
    """The decode runner with its forward stubbed and its steps timed as described above."""
    from freetoken.engine.graph_runner import DecodeRunner

    clock = {"free_at": 0.0}
    fwd, launch, collect = DecodeRunner._forward, DecodeRunner.launch, DecodeRunner.collect

    def stub(self, Bk, attn, greedy):
        self.out_ids[:Bk].fill_(5)

    def timed_launch(self, rows, chain=None):
        p = launch(self, rows, chain)
        clock["free_at"] = max(time.perf_counter(), clock["free_at"]) + device_ms / 1e3
        p.finish_at = clock["free_at"]
        return p

    def timed_collect(self, p):
        wait = getattr(p, "finish_at", 0.0) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return collect(self, p)

    DecodeRunner._forward, DecodeRunner.launch = stub, timed_launch
    DecodeRunner.collect = timed_collect
    try:
        yield
    finally:
        DecodeRunner._forward, DecodeRunner.launch, DecodeRunner.collect = fwd, launch, collect


def _steps_ms(driver, prompt: list[int], n: int) -> float:
    driver.start(prompt, n + 40)
    for _ in range(10):
        driver.step()
    t0 = time.perf_counter()
    for _ in range(n):
        driver.step()
    dt = time.perf_counter() - t0
    driver.close()
    return 1e3 * dt / n


def served_http_ms(model, rt, n: int) -> dict:
    """One forced stream of n tokens through the whole served stack (the tiny model needs the
    Qwen3 tokenizer's ids: `tiny_config(vocab=151936)`); ms a token after the first 20, and
    the engine's `decode_phases` split over the stream."""
    import socket
    import threading

    import uvicorn

    from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir
    from freetoken.engine.async_engine import AsyncEngine
    from freetoken.engine.core import EngineCore
    from freetoken.server import create_app

    core = EngineCore(model, [2], kv_tokens=262144, state_slots=64, max_running=4,
                      chunk_tokens=512, decode_runner=True, cuda_graph=False, moe=rt)
    eng = AsyncEngine(core, None, "tiny")  # type: ignore[arg-type]
    app = create_app(eng, ChatTokenizer.from_dir(qwen3_tokenizer_dir()), api_key=None,
                     served_model_names=["m"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        lifespan="off"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.01)
    try:
        url = f"http://127.0.0.1:{port}"
        subprocess.run([sys.executable, "-c", _CLIENT, url, "40"], capture_output=True,
                       check=False)
        a = dict(core.stats.phases)
        out = subprocess.run([sys.executable, "-c", _CLIENT, url, str(n)], capture_output=True,
                             text=True, check=False)
        b = core.stats.phases
        res = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {
            "error": out.stderr[-500:]}
        k = max(1, b["steps"] - a["steps"])
        res["phases_ms"] = {x: round(1e3 * (b[x] - a[x]) / k, 3)
                            for x in ("step_s", "wait_s", "between_s")}
        return res
    finally:
        srv.should_exit = True
        th.join(5)
        eng.shutdown()


def host_path(device_ms: float, n: int = 400, http: bool = True) -> dict:
    """ms a token of each path over the emulated device (see the module docstring)."""
    cfg = dd.tiny_config(vocab=151936)
    prompt = list(range(10, 42))
    out: dict = {"device_ms": device_ms}
    with emulated_device(device_ms):
        for name in ("bench", "served-core"):
            model, rt = dd.build(cfg, "fused")
            drv = (dd.BenchSteps(model, rt) if name == "bench"
                   else dd.CoreSteps(model, rt, served=True))
            out[name] = round(_steps_ms(drv, prompt, n), 3)
        if http:
            model, rt = dd.build(cfg, "fused")
            out["served-http"] = served_http_ms(model, rt, n)
    return out

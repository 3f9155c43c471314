"""A front door stops cleanly on SIGINT / SIGTERM: exit status 0, one `ft.server: stopped`
line, no traceback, and no abort from a thread left inside the engine.

Bug caught (H200, 2026-12-02, `ft serve` stopped by Ctrl-C while its idle warm-up ran a step):
uvicorn re-raised the SIGINT after its graceful shutdown, so `ft serve` ended in a
KeyboardInterrupt traceback and the interpreter exited under the engine thread
(`terminate called without an active exception`: exit 134); SIGTERM killed the process before
any cleanup. Now both front doors stop the engine after its current step and join its threads
(server/lifecycle.py, `AsyncEngine.shutdown`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from freetoken.bench.serve_process import ServerProcess, free_port


def _stream_some(url: str, out: dict) -> None:
    """A streamed chat request that is still running when the signal arrives."""
    body = {"model": "m", "stream": True, "max_tokens": 400, "min_tokens": 400,
            "ignore_eos": True, "messages": [{"role": "user", "content": "Count."}]}
    out["chunks"] = 0
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    json.loads(line[5:])
                    out["chunks"] += 1
    except httpx.HTTPError as e:  # the stream cut by the shutdown is an allowed ending
        out["error"] = repr(e)


def _check_clean(rc: int, log: str, front: str, sig: str) -> None:
    assert rc == 0, f"exit status {rc}:\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]
    assert "terminate called" not in log, log[-3000:]
    assert f"ft.server: stopped front={front} signals={sig}" in log, log[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_cleanly_mid_stream(tiny_chat_dir, tmp_path, sig) -> None:
    srv = ServerProcess(str(tiny_chat_dir), ["--dtype", "float32"], tmp_path / "serve.log",
                        env={"OMP_NUM_THREADS": "1"})
    srv.start()
    try:
        srv.wait_ready(240)
        out: dict = {}
        th = threading.Thread(target=_stream_some, args=(srv.endpoint, out))
        th.start()
        t0 = time.perf_counter()
        while out.get("chunks", 0) < 3 and time.perf_counter() - t0 < 60:
            time.sleep(0.05)
        assert out.get("chunks", 0) >= 3, "the stream never started"
        assert srv.proc is not None
        os.killpg(srv.proc.pid, sig)
        rc = srv.proc.wait(60)
        th.join(60)
    finally:
        srv.stop()
    _check_clean(rc, srv.log_text(), "serve", sig.name)
    assert out.get("status") == 200


def test_agent_proxy_stops_cleanly(tiny_chat_dir, tmp_path) -> None:
    port = free_port()
    log = tmp_path / "proxy.log"
    with open(log, "w") as f:
        p = subprocess.Popen(
            [sys.executable, "-m", "freetoken.cli", "agent-proxy", "--model", str(tiny_chat_dir),
             "--port", str(port), "--dtype", "float32", "--metrics", str(tmp_path / "m.jsonl")],
            stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        t0 = time.perf_counter()
        while True:
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.perf_counter() - t0 < 240, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/proxy/stats", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        os.killpg(p.pid, signal.SIGINT)
        rc = p.wait(60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    _check_clean(rc, log.read_text(), "agent-proxy", "SIGINT")

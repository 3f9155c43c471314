"""The agent proxy's own cost, against a fast local fake upstream (each server in its own
process, all on 127.0.0.1).

- added latency per request: median wall time of sequential non-streamed requests through the
  proxy minus direct to the upstream, for a small body and a Claude Code-sized one (the first
  request of the recorded cc_try1 trace, 78 kB, translated Anthropic -> OpenAI); floor 2 ms.
  Direct, proxy and a bare forwarder are asked in turn (interleaved), in `--rounds` rounds;
  the figure is the median of the rounds' differences (the machine is shared: check `uptime`).
- streaming overhead at a decode-like pace: a stream of N events sent every `--pace-ms`; the
  extra time the whole stream takes through the proxy, as a share of it; floor 1%.
- relay capacity: events/s the proxy relays when the upstream sends as fast as it can (how far
  above any decode rate the proxy sits).

    python scripts/bench_proxy.py [--requests 300] [--rounds 3] [--events 1000] [--pace-ms 5]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _chunk(i: int) -> bytes:
    return ("data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1,
                                   "model": "m", "choices": [{"index": 0, "delta": {
                                       "content": f"tok{i} "}, "finish_reason": None}]})
            + "\n\n").encode()


def upstream(port: int) -> None:
    """A raw ASGI fake: JSON answers at once; streams of `n` chunks every `pace` seconds."""
    import asyncio

    import uvicorn

    done = json.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "finish_reason": "stop", "message": {
                           "role": "assistant", "content": "ok"}}],
                       "usage": {"prompt_tokens": 10, "completion_tokens": 1,
                                 "total_tokens": 11}}).encode()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        req = json.loads(body or b"{}")
        if not req.get("stream"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": done})
            return
        n, pace = int(req.get("n_events", 100)), float(req.get("pace_s", 0))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        t0 = time.perf_counter()
        for i in range(n):
            await send({"type": "http.response.body", "body": _chunk(i), "more_body": True})
            if pace:
                await asyncio.sleep(max(0.0, t0 + (i + 1) * pace - time.perf_counter()))
        await send({"type": "http.response.body",
                    "body": b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'
                            b"\n\ndata: [DONE]\n\n"})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")


def proxy(port: int, up_port: int) -> None:
    import logging

    import uvicorn

    from freetoken.proxy.app import create_proxy_app
    from freetoken.proxy.config import ProxyConfig

    logging.getLogger("ft").setLevel(logging.WARNING)
    cfg = ProxyConfig(upstream=f"http://127.0.0.1:{up_port}", upstream_api="openai")
    uvicorn.run(create_proxy_app(cfg), host="127.0.0.1", port=port, log_level="error",
                lifespan="off")


def trivial(port: int, up_port: int) -> None:
    """The floor of any Python proxy here: starlette + httpx forwarding the bytes, nothing else."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    held: dict[str, httpx.AsyncClient] = {}

    async def fwd(request):
        c = held.get("c") or held.setdefault("c", httpx.AsyncClient())
        r = await c.post(f"http://127.0.0.1:{up_port}/v1/chat/completions",
                         content=await request.body(), headers={"content-type": "application/json"})
        return Response(r.content, media_type="application/json")

    app = Starlette(routes=[Route("/v1/chat/completions", fwd, methods=["POST"]),
                            Route("/health", lambda r: Response("ok"))])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")


def inprocess_cpu_ms(body: dict, path: str, n: int) -> float:
    """CPU time of the proxy's own work per request: the ASGI app called directly, upstream
    answered by an in-memory transport (no sockets, no scheduling noise)."""
    import asyncio
    import logging

    from freetoken.proxy.app import create_proxy_app
    from freetoken.proxy.config import ProxyConfig

    logging.getLogger("ft").setLevel(logging.WARNING)
    done = json.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "finish_reason": "stop", "message": {
                           "role": "assistant", "content": "ok"}}],
                       "usage": {"prompt_tokens": 10, "completion_tokens": 1}}).encode()
    client = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda r: httpx.Response(200, content=done)))
    app = create_proxy_app(ProxyConfig(upstream="http://up", upstream_api="openai"),
                           client=client)
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2), "headers": [(b"content-type", b"application/json")]}

    async def one() -> None:
        msgs = [{"type": "http.request", "body": raw, "more_body": False}]
        sent: list[dict] = []

        async def receive() -> dict:
            if msgs:
                return msgs.pop()
            await asyncio.sleep(3600)
            return {}

        async def send(m: dict) -> None:
            sent.append(m)

        await app(scope, receive, send)
        assert sent[0]["status"] == 200, sent

    async def run(k: int) -> None:
        for _ in range(k):
            await one()

    asyncio.run(run(20))
    t = time.process_time()
    asyncio.run(run(n))
    return (time.process_time() - t) / n * 1000


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _wait(url: str) -> None:
    t0 = time.time()
    while time.time() - t0 < 30:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def _interleaved(c: httpx.Client, targets: list[tuple[str, bytes]], n: int
                 ) -> list[list[float]]:
    """`n` sequential requests to each target, round-robin with a rotating order, so a change
    of load on a shared machine hits every target alike. Bodies are sent pre-encoded."""
    out: list[list[float]] = [[] for _ in targets]
    hdr = {"content-type": "application/json"}
    for i in range(n):
        for j in range(len(targets)):
            k = (i + j) % len(targets)
            url, raw = targets[k]
            t = time.perf_counter()
            r = c.post(url, content=raw, headers=hdr)
            out[k].append(time.perf_counter() - t)
            assert r.status_code == 200, r.text[:200]
    return out


def _stream(c: httpx.Client, url: str, body: dict) -> tuple[float, int]:
    t = time.perf_counter()
    n = 0
    with c.stream("POST", url, json=body) as r:
        for line in r.iter_lines():
            n += line.startswith("data:")
    return time.perf_counter() - t, n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--events", type=int, default=1000)
    ap.add_argument("--pace-ms", type=float, default=5.0)
    ap.add_argument("--burst-events", type=int, default=20000)
    a = ap.parse_args()
    load0 = os.getloadavg()
    up_port, px_port, tr_port = _port(), _port(), _port()
    procs = [mp.Process(target=upstream, args=(up_port,), daemon=True),
             mp.Process(target=proxy, args=(px_port, up_port), daemon=True),
             mp.Process(target=trivial, args=(tr_port, up_port), daemon=True)]
    for p in procs:
        p.start()
    direct, via = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{px_port}"
    base = f"http://127.0.0.1:{tr_port}"
    _wait(direct)
    _wait(via + "/health")
    _wait(base + "/health")
    small = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    rec = json.loads((ROOT / "tests/data/harness_traces/claude_code/cc_try1.jsonl")
                     .read_text().splitlines()[0])
    cc = {**rec["body"], "stream": False}
    rows = []
    try:
        with httpx.Client(timeout=120) as c:
            for name, path, body in (("small OpenAI body", "/v1/chat/completions", small),
                                     ("Claude Code body (78 kB, translated)", "/v1/messages",
                                      cc)):
                up = direct + "/v1/chat/completions"
                raw = json.dumps(body).encode()  # the fake upstream ignores what it is sent
                targets = [(up, raw), (base + "/v1/chat/completions", raw), (via + path, raw)]
                _interleaved(c, targets, 20)  # warm up all three
                added, parts = [], []
                cpu0, bare0 = _cpu_s(procs[1].pid), _cpu_s(procs[2].pid)
                for _ in range(a.rounds):
                    d, b, v = (statistics.median(x) * 1000
                               for x in _interleaved(c, targets, a.requests))
                    added.append(v - d)
                    parts.append((d, b, v))
                cpu = (_cpu_s(procs[1].pid) - cpu0) / (a.requests * a.rounds) * 1000
                bare = (_cpu_s(procs[2].pid) - bare0) / (a.requests * a.rounds) * 1000
                d, b, v = (statistics.median(x) for x in zip(*parts))
                rows.append((f"added latency, {name}", f"{statistics.median(added):.2f} ms",
                             "< 2 ms",
                             (f"direct {d:.2f} ms, via proxy {v:.2f} ms, via a bare "
                              f"starlette+httpx forwarder {b:.2f} ms (median over {a.rounds} "
                              f"rounds of the medians of {a.requests} interleaved requests; "
                              f"rounds: {', '.join(f'{x:.2f}' for x in added)})")))
                rows.append((f"proxy process CPU per request, {name}", f"{cpu:.2f} ms", "-",
                             (f"user+system time of the proxy process / requests (uvicorn and "
                              f"both HTTP hops included); the bare forwarder's: {bare:.2f} ms, "
                              f"so the proxy's own share {cpu - bare:.2f} ms (steadier than wall "
                              f"time on a loaded machine)")))
                own = inprocess_cpu_ms(body, path, a.requests)
                rows.append((f"proxy's own work per request, {name}", f"{own:.2f} ms", "< 2 ms",
                             "CPU time, ASGI app called in-process, in-memory upstream"))
            paced = {**small, "stream": True, "n_events": a.events, "pace_s": a.pace_ms / 1000}
            td, nd = _stream(c, direct + "/v1/chat/completions", paced)
            tv, nv = _stream(c, via + "/v1/chat/completions", paced)
            assert nd == nv, (nd, nv)
            rows.append((f"stream overhead, {a.events} events every {a.pace_ms:g} ms",
                         f"{(tv / td - 1) * 100:.2f} %", "< 1 %",
                         f"direct {td:.3f} s, via proxy {tv:.3f} s"))
            burst = {**small, "stream": True, "n_events": a.burst_events, "pace_s": 0}
            td, _ = _stream(c, direct + "/v1/chat/completions", burst)
            tv, _ = _stream(c, via + "/v1/chat/completions", burst)
            rows.append(("relay capacity (upstream as fast as it can)",
                         f"{a.burst_events / tv:,.0f} events/s", "> 1000 events/s",
                         f"direct {a.burst_events / td:,.0f} events/s"))
    finally:
        for p in procs:
            p.terminate()
    load1 = os.getloadavg()
    print(f"load average (1, 5, 15 min) at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, "
          f"at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} on {os.cpu_count()} cores")
    print("| measure | figure | floor | detail |\n|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

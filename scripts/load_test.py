"""Load and hostile-client test of `ft serve`, on loopback only, bounded in count and time.

  python scripts/load_test.py                 # spawns `ft serve --model demo-random` on a free port
  python scripts/load_test.py --url http://127.0.0.1:8000   # an already running server

Phases (each prints one table row: what was measured, the figure, and its floor or bound):
  concurrency   N streaming chats at once: all complete with well-formed SSE; TTFT, tok/s
  disconnects   M streams dropped after their first token: slots freed (stats.running = 0)
  never-read    K streams whose client never reads: aborted after --stall-timeout
  slow          header and body dribblers: closed after the header/body timeouts, while a
                normal request is still served
  flood         more idle connections than --max-connections: 503s, then service recovers
  fairness      a short request admitted beside a long prompt: its time to first token
A phase that fails prints FAIL and the script exits 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from urllib.parse import urlsplit

import httpx

USER = [{"role": "user", "content": "Count from one to ten."}]
JSON = {"content-type": "application/json"}


def chat(max_tokens: int, stream: bool = True, messages: list | None = None) -> dict:
    return {"model": "m", "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            "temperature": 0, "messages": messages or USER}


async def running(c: httpx.AsyncClient) -> int:
    s = (await c.get("/v1/stats")).json()
    return int(s.get("cache", {}).get("running", 0)) + int(s.get("cache", {}).get("waiting", 0))


async def wait_idle(c: httpx.AsyncClient, limit_s: float) -> float | None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if await running(c) == 0:
            return time.perf_counter() - t0
        await asyncio.sleep(0.1)
    return None


async def one_stream(c: httpx.AsyncClient, body: dict, drop_after_first: bool = False
                     ) -> tuple[bool, float, float, int]:
    """(well formed, time to first token, total time, content chunks)."""
    t0 = time.perf_counter()
    ttft, chunks, last = 0.0, 0, ""
    async with c.stream("POST", "/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            return False, 0.0, 0.0, 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if last == "[DONE]":
                break
            choices = json.loads(last).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                chunks += 1
                if not ttft:
                    ttft = time.perf_counter() - t0
                    if drop_after_first:
                        return True, ttft, 0.0, chunks
    return last == "[DONE]", ttft, time.perf_counter() - t0, chunks


def row(name: str, figure: str, bound: str, ok: bool) -> bool:
    print(f"| {name:<12} | {figure:<52} | {bound:<30} | {'ok' if ok else 'FAIL'} |", flush=True)
    return ok


async def concurrency(c: httpx.AsyncClient, n: int, tokens: int) -> bool:
    t0 = time.perf_counter()
    res = await asyncio.gather(*(one_stream(c, chat(tokens)) for _ in range(n)))
    wall = time.perf_counter() - t0
    good = [r for r in res if r[0]]
    ttft = sorted(r[1] for r in good) or [0.0]
    toks = sum(r[3] for r in good)
    return row("concurrency", f"{len(good)}/{n} ok, TTFT p50 {statistics.median(ttft):.2f} s "
               f"p95 {ttft[max(0, -(-len(ttft) * 95 // 100) - 1)]:.2f} s, "
               f"{toks / wall:.1f} chunk/s",
               f"all {n} well-formed", len(good) == n)


async def disconnects(c: httpx.AsyncClient, n: int) -> bool:
    await asyncio.gather(*(one_stream(c, chat(4096), drop_after_first=True) for _ in range(n)))
    freed = await wait_idle(c, 10)
    return row("disconnects", f"{n} dropped; all slots free after "
               f"{'never' if freed is None else f'{freed:.2f} s'}", "< 10 s", freed is not None)


def raw_request(host: str, port: int, body: dict, rcvbuf: int = 4096) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, port))
    data = json.dumps(body).encode()
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: "
              f"application/json\r\ncontent-length: {len(data)}\r\n\r\n".encode() + data)
    return s


async def never_read(c: httpx.AsyncClient, host: str, port: int, n: int, stall_s: float) -> bool:
    socks = [raw_request(host, port, chat(1 << 20)) for _ in range(n)]
    await asyncio.sleep(1.0)
    busy = await running(c)
    freed = await wait_idle(c, stall_s + 180)
    for s in socks:
        s.close()
    return row("never-read", f"{n} clients, {busy} running at 1 s; freed after "
               f"{'never' if freed is None else f'{freed + 1:.1f} s'}",
               f"stall timeout {stall_s:g} s + buffers", freed is not None)


async def slow(c: httpx.AsyncClient, host: str, port: int, n_head: int, n_body: int,
               header_s: float, body_s: float) -> bool:
    heads = [socket.create_connection((host, port)) for _ in range(n_head)]
    bodies = [socket.create_connection((host, port)) for _ in range(n_body)]
    for s in heads:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
    for s in bodies:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: "
                  "application/json\r\ncontent-length: 1000\r\n\r\n{".encode())
    t0 = time.perf_counter()
    served = (await c.post("/v1/chat/completions", json=chat(8, False))).status_code == 200
    closed_at = {}
    pending = {s: k for k, group in (("head", heads), ("body", bodies)) for s in group}
    for s in pending:
        s.setblocking(False)
    while pending and time.perf_counter() - t0 < max(header_s, body_s) + 10:
        for s in list(pending):
            try:
                if s.recv(4096) == b"":
                    closed_at.setdefault(pending.pop(s), []).append(time.perf_counter() - t0)
            except BlockingIOError:
                pass
            except OSError:
                closed_at.setdefault(pending.pop(s), []).append(time.perf_counter() - t0)
        await asyncio.sleep(0.05)
    for s in heads + bodies:
        s.close()
    h, b = max(closed_at.get("head", [99])), max(closed_at.get("body", [99]))
    return row("slow", f"{n_head} header / {n_body} body dribblers closed by {h:.1f} / "
               f"{b:.1f} s; normal request {'served' if served else 'NOT served'}",
               f"{header_s:g} / {body_s:g} s (+1 s)", not pending and served
               and h < header_s + 1.5 and b < body_s + 1.5)


async def flood(c: httpx.AsyncClient, host: str, port: int, n: int) -> bool:
    socks, refused = [], 0
    for _ in range(n):
        s = socket.create_connection((host, port))
        socks.append(s)
    await asyncio.sleep(0.5)
    for s in socks:
        s.setblocking(False)
        try:
            if s.recv(4096).startswith(b"HTTP/1.1 503"):
                refused += 1
        except (BlockingIOError, OSError):
            pass
    for s in socks:
        s.close()
    await asyncio.sleep(0.5)
    ok = (await c.post("/v1/chat/completions", json=chat(4, False))).status_code == 200
    return row("flood", f"{n} idle connections: {refused} got 503; afterwards "
               f"{'served' if ok else 'NOT served'}", "503s past the cap, then 200",
               refused > 0 and ok)


async def fairness(c: httpx.AsyncClient, long_tokens: int) -> bool:
    alone = (await one_stream(c, chat(4)))[1]
    long_msg = [{"role": "user", "content": "lorem ipsum " * (long_tokens // 2)}]
    long_task = asyncio.create_task(one_stream(c, chat(4, messages=long_msg)))
    await asyncio.sleep(0.3)
    beside = (await one_stream(c, chat(4)))[1]
    long_ttft = (await long_task)[1]
    return row("fairness", f"short TTFT alone {alone:.2f} s, beside a {long_tokens}-token prompt "
               f"{beside:.2f} s (long's TTFT {long_ttft:.2f} s)", "informational (scheduler)",
               True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main_async(a: argparse.Namespace, url: str) -> bool:
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    async with httpx.AsyncClient(base_url=url, headers=JSON, timeout=120) as c:
        ok = True
        print("| phase | figure | bound | result |\n|---|---|---|---|")
        ok &= await concurrency(c, a.concurrency, a.tokens)
        ok &= await disconnects(c, a.disconnects)
        ok &= await never_read(c, host, port, a.never_read, a.stall_timeout)
        ok &= await slow(c, host, port, a.dribblers, max(1, a.dribblers // 5), a.header_timeout,
                         a.body_timeout)
        ok &= await flood(c, host, port, a.flood)
        ok &= await fairness(c, a.long_prompt)
        return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (loopback only)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--disconnects", type=int, default=8)
    p.add_argument("--never-read", type=int, default=4)
    p.add_argument("--dribblers", type=int, default=50)
    p.add_argument("--flood", type=int, default=200)
    p.add_argument("--long-prompt", type=int, default=4000)
    p.add_argument("--stall-timeout", type=float, default=5.0)
    p.add_argument("--header-timeout", type=float, default=3.0)
    p.add_argument("--body-timeout", type=float, default=3.0)
    p.add_argument("--max-connections", type=int, default=64)
    p.add_argument("--budget-s", type=float, default=600, help="the whole run's time limit")
    a = p.parse_args()
    proc = None
    url = a.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([
            sys.executable, "-m", "freetoken.cli", "serve", "--model", "demo-random", "--host",
            "127.0.0.1", "--port", str(port), "--max-running", "8",
            "--stall-timeout", str(a.stall_timeout), "--header-timeout", str(a.header_timeout),
            "--body-timeout", str(a.body_timeout), "--max-connections", str(a.max_connections)])
        t0 = time.time()
        while time.time() - t0 < 300:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
    if urlsplit(url).hostname not in ("127.0.0.1", "localhost", "::1"):
        print("refusing a non-loopback server", file=sys.stderr)
        return 2
    try:
        ok = asyncio.run(asyncio.wait_for(main_async(a, url), a.budget_s))
    except TimeoutError:
        print(f"FAIL: the run exceeded --budget-s {a.budget_s:g}")
        ok = False
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

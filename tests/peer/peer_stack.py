"""The real peer behind the proxy: llama-cpp-python's server (`python -m llama_cpp.server`, from
the separate venv `scripts/install_peer.sh` builds) on the tiny Qwen3 GGUF, and `ft agent-proxy
--upstream URL` (the CLI, default flags) in front of it, each its own process.

`PEER_SKIP` is the reason the suite skips (None when llama_cpp imports from the peer venv).
The peer runs with `--verbose`: its stderr has llama.cpp's own reuse counter, one
`Llama.generate: N prefix-match hit, remaining M prompt tokens to eval` line per request that
found a cached prefix (`peer_prefix_hits`).
"""
from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import httpx

from freetoken.envs import FT_PEER_VENV

ROOT = Path(__file__).parents[2]
PEER_VENV = Path(FT_PEER_VENV.get() or Path.home() / ".cache" / "freetoken" / "peer")
PEER_PY = PEER_VENV / "bin" / "python"
ALIAS = "tiny-qwen3"


def _peer_skip() -> str | None:
    if not PEER_PY.exists():
        return (f"no peer venv at {PEER_VENV} (scripts/install_peer.sh builds llama-cpp-python "
                "there; FT_PEER_VENV overrides)")
    p = subprocess.run([str(PEER_PY), "-c", "import llama_cpp.server.app, gguf"],
                       capture_output=True, text=True, check=False, timeout=60)
    if p.returncode:
        return (f"llama_cpp not importable from {PEER_PY} (scripts/install_peer.sh): "
                f"{p.stderr.strip().splitlines()[-1:] or p.returncode}")
    return None


PEER_SKIP = _peer_skip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@lru_cache(maxsize=1)
def tiny_model() -> tuple[Path, Path]:
    """(HF checkpoint dir, GGUF path), built once and kept under the peer venv, keyed by the
    builder's source (a changed builder builds anew)."""
    from tiny_qwen3 import build_checkpoint

    from freetoken.chat import qwen3_tokenizer_dir

    src = (Path(__file__).parent / "tiny_qwen3.py").read_bytes()
    d = PEER_VENV / "models" / f"tiny-qwen3-{hashlib.sha256(src).hexdigest()[:12]}"
    gguf = d / "tiny-qwen3.gguf"
    if not gguf.exists():
        build_checkpoint(d / "hf", Path(qwen3_tokenizer_dir()))
        subprocess.run([str(PEER_PY), str(Path(__file__).parent / "tiny_qwen3.py"),
                        str(d / "hf"), str(gguf) + ".tmp"], check=True, timeout=300)
        os.replace(str(gguf) + ".tmp", gguf)
    return d / "hf", gguf


def _wait(url: str, proc: subprocess.Popen, what: str, log: Path, timeout_s: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer {url} in {timeout_s} s: {log.read_text()[-3000:]}")


@dataclass
class Proc:
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


def start_peer(gguf: Path, logdir: Path, n_ctx: int = 32768) -> Proc:
    port = free_port()
    log = logdir / f"peer-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(PEER_PY), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias",
           ALIAS, "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx),
           "--n_threads", "1", "--n_threads_batch", "1", "--n_batch", "2048", "--verbose",
           "True"]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    p = Proc(proc, f"http://127.0.0.1:{port}", log)
    try:
        _wait(p.url + "/v1/models", proc, "llama_cpp.server", log, 120)
    except Exception:
        p.stop()
        raise
    return p


def start_proxy(upstream: str, logdir: Path, *extra: str) -> Proc:
    """`ft agent-proxy --upstream URL` with its default flags (output cap, --upstream-api
    both); its metrics JSONL in `logdir`."""
    port = free_port()
    log = logdir / f"proxy-{port}.log"
    cmd = [sys.executable, "-m", "freetoken.cli", "agent-proxy", "--upstream", upstream,
           "--port", str(port), "--metrics", str(logdir / f"proxy-{port}.jsonl"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    p = Proc(proc, f"http://127.0.0.1:{port}", log)
    try:
        _wait(p.url + "/health", proc, "ft agent-proxy", log, 120)
    except Exception:
        p.stop()
        raise
    return p


def metrics(proxy: Proc) -> list[dict]:
    import json

    f = proxy.log.with_suffix(".jsonl")
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens")


def peer_prefix_hits(peer: Proc) -> list[tuple[int, int]]:
    """(matched, remaining) per request, from the peer's own log."""
    return [(int(a), int(b)) for a, b in _HIT.findall(peer.log.read_text())]

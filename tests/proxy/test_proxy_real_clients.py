"""The real Claude Code CLI and mini-swe-agent, driven through `ft agent-proxy` (native mode) in
front of a real `ft serve` app (scripted FakeEngine, real Qwen3 tokenizer), configured only by
what `ft launch` prints. Skipped unless the harnesses are installed
(`scripts/install_harnesses.sh`, or on PATH). About 40 s on the dev machine."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from server_helpers import FakeEngine, Server

from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir
from freetoken.proxy.app import create_proxy_app
from freetoken.proxy.config import ProxyConfig
from freetoken.proxy.launch import Limits, plan_for
from freetoken.server import create_app

PREFIX = Path(os.environ.get("FT_HARNESS_PREFIX",
                             Path.home() / ".cache" / "freetoken" / "harnesses"))


def _find(name: str, local: Path) -> str | None:
    return shutil.which(name) or (str(local) if local.is_file() else None)


CLAUDE = _find("claude", PREFIX / "npm" / "node_modules" / ".bin" / "claude")
MINI = _find("mini", PREFIX / "mini-venv" / "bin" / "mini")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tok = ChatTokenizer.from_dir(qwen3_tokenizer_dir())
    engine = FakeEngine(tok, max_context=262144)
    serve = Server(create_app(engine, tok, api_key=None, served_model_names=["fake"]))
    metrics = tmp_path_factory.mktemp("m") / "records.jsonl"
    cfg = ProxyConfig(native_url=serve.url, caps={"*": 256}, metrics_path=str(metrics))
    proxy = Server(create_proxy_app(cfg, tok, "qwen3"))
    yield engine, proxy, metrics
    proxy.stop()
    serve.stop()


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _env(plan_env: dict[str, str], home: Path) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM")}
    return {**keep, "HOME": str(home), **plan_env}


@pytest.mark.skipif(CLAUDE is None, reason="Claude Code CLI not installed "
                    "(scripts/install_harnesses.sh)")
def test_claude_code_print_and_continue(stack, tmp_path) -> None:
    engine, proxy, metrics = stack
    engine.reset()
    engine.script = lambda req: "Hello from the fake engine."
    before = len(_records(metrics))
    plan = plan_for("claude", proxy.url, Limits(context=200000, output=256))
    env = {**_env(plan.env, tmp_path / "home"), "IS_SANDBOX": "1"}
    (tmp_path / "home").mkdir()
    work = tmp_path / "repo"
    work.mkdir()
    outs = []
    for args in (["-p", "Say hi."], ["-p", "--continue", "Say it again."],
                 ["-p", "--continue", "Once more."]):
        p = subprocess.run([CLAUDE, *args, "--output-format", "json",
                            "--dangerously-skip-permissions"], check=False, cwd=work, env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
        out = json.loads(p.stdout)
        assert out["is_error"] is False and "fake engine" in out["result"], out
        outs.append(out)
    recs = [r for r in _records(metrics)[before:] if r["path"] == "/v1/messages"]
    assert recs and all(r["status"] == 200 and r["error"] is None for r in recs)
    assert {r["harness"] for r in recs} == {"claude_code"}
    main = [r for r in recs if r["prompt_tokens"] and r["prompt_tokens"] > 5000]
    assert len(main) >= 3
    # --continue re-sends the same system text (model pinned by ft launch): nearly all reused
    for prev, cur in itertools.pairwise(main):
        assert cur["cached_tokens"] >= 0.95 * prev["prompt_tokens"], (prev, cur)
    assert all(r["max_tokens_sent"] <= 256 for r in recs)


@pytest.mark.skipif(MINI is None, reason="mini-swe-agent not installed "
                    "(scripts/install_harnesses.sh)")
def test_mini_swe_agent_runs_to_submission(stack, tmp_path) -> None:
    engine, proxy, metrics = stack
    engine.reset()
    tok = engine.tok

    def script(req) -> str:
        steps = tok.decode(req.input_ids).count("<|im_start|>assistant") - 1
        cmd = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" if steps >= 2 else f"echo step{steps}"
        call = json.dumps({"name": "bash", "arguments": {"command": cmd}})
        return (f"THOUGHT: step {steps}.\n\n```mswea_bash_command\n{cmd}\n```\n"
                f"<tool_call>\n{call}\n</tool_call>")

    engine.script = script
    before = len(_records(metrics))
    plan = plan_for("mini", proxy.url, Limits(context=32768, output=256, model="fake"))
    env = _env(plan.env, tmp_path)
    traj = tmp_path / "traj.json"
    p = subprocess.run([MINI, "-m", "openai/fake", "-t", "Print step numbers, then submit.",
                        "-y", "--exit-immediately", "-o", str(traj)], check=False, cwd=tmp_path,
                       env=env,
                       capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    info = json.loads(traj.read_text())["info"]
    assert info["exit_status"] == "Submitted", info
    recs = _records(metrics)[before:]
    assert len(recs) >= 3 and {r["harness"] for r in recs} == {"swe_agent"}
    assert [r["edit_kind"] for r in recs][1:] == ["append"] * (len(recs) - 1)
    assert httpx.get(proxy.url + "/proxy/stats").json()["harnesses"]["swe_agent"]["errors"] == 0

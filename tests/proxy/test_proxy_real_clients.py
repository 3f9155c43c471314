"""The real Claude Code CLI, OpenCode, OpenClaw and mini-swe-agent, driven through
`ft agent-proxy` (native mode) in front of a real `ft serve` app (scripted FakeEngine, real Qwen3
tokenizer), configured only by what `ft launch` prints or writes. Skipped unless the harnesses
are installed (`scripts/install_harnesses.sh`, or on PATH). About 40 s each on the dev machine."""
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
from freetoken.proxy.launch import Limits, find_harness, harness_bin_dir, plan_for
from freetoken.server import create_app

PREFIX = harness_bin_dir().parent  # scripts/install_harnesses.sh's PREFIX (FT_HARNESS_PREFIX)
CLAUDE = find_harness("claude")
MINI = find_harness("mini")
OPENCODE = find_harness("opencode")
OPENCLAW = find_harness("openclaw")
CODEX = find_harness("codex")
NODE24_BIN = PREFIX / "node24" / "node_modules" / ".bin"  # OpenClaw needs Node >= 24.16
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
    # exactly what `ft launch mini --write DIR` writes and prints (issue 28: the printed
    # command ignored mini.yaml, and `-c mini.yaml` alone crashed)
    cfg = tmp_path / "cfg"
    env = _env(_written_env("mini", proxy.url, cfg), tmp_path)
    traj = tmp_path / "traj.json"
    p = subprocess.run([MINI, "-c", "mini.yaml", "-c", env["FREETOKEN_MINI_CONFIG"], "-t",
                        "Print step numbers, then submit.", "-y", "--exit-immediately", "-o",
                        str(traj)], check=False, cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    info = json.loads(traj.read_text())["info"]
    assert info["exit_status"] == "Submitted", info
    recs = _records(metrics)[before:]
    assert len(recs) >= 3 and {r["harness"] for r in recs} == {"swe_agent"}
    assert [r["edit_kind"] for r in recs][1:] == ["append"] * (len(recs) - 1)
    assert httpx.get(proxy.url + "/proxy/stats").json()["harnesses"]["swe_agent"]["errors"] == 0


def _written_env(harness: str, proxy_url: str, cfg: Path) -> dict[str, str]:
    """What `ft launch HARNESS --write DIR` writes, read back from its .env file."""
    from freetoken.cli import main

    assert main(["launch", harness, "--proxy", proxy_url, "--write", str(cfg)]) == 0
    env = {}
    for line in (cfg / f"{harness}.env").read_text().splitlines():
        k, v = line.removeprefix("export ").split("=", 1)
        env[k] = json.loads(v)
    if "PATH" in env:  # "PREFIX/bin:$PATH", expanded as the shell would
        env["PATH"] = env["PATH"].replace("$PATH", os.environ.get("PATH", ""))
    return env


def _turn_records(metrics: Path, before: int, harness: str) -> list[dict]:
    recs = [r for r in _records(metrics)[before:] if r["path"] == "/v1/chat/completions"]
    assert recs and all(r["status"] == 200 and r["error"] is None for r in recs), recs
    assert {r["harness"] for r in recs} == {harness}
    return recs


@pytest.mark.skipif(OPENCODE is None, reason="OpenCode not installed "
                    "(scripts/install_harnesses.sh)")
def test_opencode_run_and_continue(stack, tmp_path) -> None:
    # catches: a config `ft launch opencode` writes that OpenCode rejects, a stream it cannot
    # parse (it exits 0 with no text then), or a --continue that re-prefills the whole prompt
    engine, proxy, metrics = stack
    engine.reset()
    engine.script = lambda req: "Hello from the fake engine."
    before = len(_records(metrics))
    env = _env(_written_env("opencode", proxy.url, tmp_path / "cfg"), tmp_path / "home")
    model = json.loads((tmp_path / "cfg" / "opencode.json").read_text())["model"]
    work = tmp_path / "repo"
    work.mkdir()
    # the README's form first (`opencode run "hi"`: the model from the written config), then
    # the printed one (`-m MODEL`)
    for args in (["Say hi."], ["-m", model, "--continue", "Say it again."]):
        p = subprocess.run([OPENCODE, "run", *args], check=False, cwd=work,
                           env=env, capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
        assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
        assert "fake engine" in p.stdout, (p.stdout[-2000:], p.stderr[-2000:])
    recs = _turn_records(metrics, before, "opencode")
    main = [r for r in recs if r["prompt_tokens"] > 3000]  # the title request is small
    assert len(main) == 2, recs
    assert main[1]["edit_kind"] == "append"
    assert main[1]["cached_tokens"] >= 0.95 * main[0]["prompt_tokens"], main
    assert all(r["max_tokens_sent"] <= 256 for r in recs)


@pytest.mark.skipif(OPENCLAW is None, reason="OpenClaw not installed "
                    "(scripts/install_harnesses.sh)")
@pytest.mark.skipif(not (NODE24_BIN / "node").is_file() and shutil.which("node") is None,
                    reason="no Node for OpenClaw")
def test_openclaw_two_messages_one_session(stack, tmp_path) -> None:
    # catches: an openai-completions config OpenClaw rejects, and a second message that loses
    # reuse (each request re-appends the trailing internal-context turn: the edit must land on
    # the cut point the adapter predicted)
    engine, proxy, metrics = stack
    engine.reset()
    engine.script = lambda req: "Hello from the fake engine."
    before = len(_records(metrics))
    env = _env(_written_env("openclaw", proxy.url, tmp_path / "cfg"), tmp_path / "home")
    env["PATH"] = f"{NODE24_BIN}:{env.get('PATH', '')}"
    work = tmp_path / "repo"
    work.mkdir()
    for msg in ("Say hi.", "Say it again."):
        p = subprocess.run([OPENCLAW, "agent", "--local", "--session-id", "ft-test", "-m", msg],
                           check=False, cwd=work, env=env, capture_output=True, text=True,
                           timeout=180, stdin=subprocess.DEVNULL)
        assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
        assert "fake engine" in p.stdout, (p.stdout[-2000:], p.stderr[-2000:])
    recs = _turn_records(metrics, before, "openclaw")
    assert len(recs) == 2, recs
    assert recs[1]["session"] == recs[0]["session"]
    assert recs[1]["edit_kind"] == "edit" and recs[1]["predicted_hit"] is True, recs[1]
    assert recs[1]["cached_tokens"] >= 0.9 * recs[0]["prompt_tokens"], recs


@pytest.mark.skipif(CODEX is None, reason="Codex CLI not installed "
                    "(scripts/install_harnesses.sh)")
def test_codex_exec_tool_call_and_resume(stack, tmp_path) -> None:
    # catches: /v1/responses missing (Codex 0.171 retries five times and exits), events Codex
    # cannot parse, a function_call it cannot run, and a resumed turn that loses reuse
    engine, proxy, metrics = stack
    engine.reset()
    n = [0]

    def script(req) -> str:
        n[0] += 1
        if n[0] == 1:
            return ('<think>\nlook\n</think>\n\nChecking.<tool_call>\n{"name": "exec_command", '
                    '"arguments": {"cmd": "echo hi-from-tool"}}\n</tool_call>')
        return "All done: hello from the fake engine."

    engine.script = script
    before = len(_records(metrics))
    env = _env(_written_env("codex", proxy.url, tmp_path / "cfg"), tmp_path / "home")
    (tmp_path / "home").mkdir()
    work = tmp_path / "repo"
    work.mkdir()
    for args in (["say hi"], ["resume", "--last", "again"]):
        p = subprocess.run([CODEX, "exec", "--skip-git-repo-check", *args], check=False,
                           cwd=work, env=env, capture_output=True, text=True, timeout=180,
                           stdin=subprocess.DEVNULL)
        assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
        assert "hello from the fake engine" in p.stdout, (p.stdout[-2000:], p.stderr[-2000:])
    out = p.stdout + p.stderr
    recs = [r for r in _records(metrics)[before:] if r["harness"] == "codex"]
    assert len(recs) == 3 and all(r["status"] == 200 for r in recs), recs
    assert "hi-from-tool" in engine.tok.decode(engine.requests[1].input_ids), out[-2000:]
    assert [r["edit_kind"] for r in recs] == ["new", "append", "append"]
    for prev, cur in itertools.pairwise(recs):
        assert cur["cached_tokens"] >= 0.95 * prev["prompt_tokens"], (prev, cur)

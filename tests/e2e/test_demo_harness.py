"""A real harness (mini-swe-agent from PyPI) against the trained demo model through a real
`ft agent-proxy` process, configured only by what `ft launch mini` gives: the model calls
`bash`, mini runs it, the model answers after the result (quoting it) and submits.

Skipped when mini-swe-agent is not installed (`scripts/install_harnesses.sh`, or on PATH).
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from freetoken.cli.proxy import free_port
from freetoken.models.demo import demo_model_dir
from freetoken.proxy.launch import Limits, harness_bin_dir, plan_for

PREFIX = harness_bin_dir().parent  # scripts/install_harnesses.sh's PREFIX
MINI = shutil.which("mini") or (str(PREFIX / "mini-venv" / "bin" / "mini")
                                if (PREFIX / "mini-venv" / "bin" / "mini").is_file() else None)
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MINI is None, reason="mini-swe-agent not installed "
                                 "(scripts/install_harnesses.sh)")]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory):
    """`ft agent-proxy --model <trained demo>` as its own process; (url, metrics file)."""
    model = demo_model_dir(tmp_path_factory.mktemp("models"))
    metrics = tmp_path_factory.mktemp("m") / "proxy.jsonl"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    log = open(metrics.with_suffix(".log"), "w")  # noqa: SIM115 (lives as long as the process)
    p = subprocess.Popen([sys.executable, "-m", "freetoken.cli", "agent-proxy", "--model",
                          str(model), "--port", str(port), "--metrics", str(metrics),
                          "--device", "cpu"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert p.poll() is None, metrics.with_suffix(".log").read_text()[-3000:]
            try:
                if httpx.get(url + "/proxy/stats", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "ft agent-proxy did not come up"
            time.sleep(0.5)
        yield url, metrics
    finally:
        p.terminate()
        p.wait(30)
        log.close()


def test_mini_runs_a_tool_and_answers_after_its_result(proxy, tmp_path: Path) -> None:
    url, metrics = proxy
    work = tmp_path / "repo"
    work.mkdir()
    (work / "README.md").write_text("# Hello demo\n\nA tiny project for the demo model.\n")
    (work / "main.py").write_text("print('hi')\n")
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    plan = plan_for("mini", url, Limits(context=32768, output=256, model="demo"))
    env = {**{k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM")},
           "HOME": str(tmp_path), **plan.env}
    traj = tmp_path / "traj.json"
    # mini's own config plus a step limit: a model that never submits ends in seconds, not
    # at the 600 s timeout
    p = subprocess.run([MINI, "-c", "mini.yaml", "-c", "agent.step_limit=6", "-m", "openai/demo",
                        "-t", "list the files", "-y", "--exit-immediately", "-o", str(traj)],
                       check=False, cwd=work, env=env, capture_output=True, text=True,
                       timeout=600, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    data = json.loads(traj.read_text())
    assert data["info"]["exit_status"] == "Submitted", data["info"]
    msgs = data["messages"]
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    recs = [r for r in recs if r["path"] == "/v1/chat/completions"]
    assert recs and all(r["status"] == 200 and r["error"] is None for r in recs), recs
    assert all(r["finish"] != "length" for r in recs), recs  # every turn ended by itself
    for prev, r in itertools.pairwise(recs):  # each later turn re-uses the previous prompt
        assert r["cached_tokens"] >= 0.95 * prev["prompt_tokens"], (prev, r)
    calls = [json.loads(c["function"]["arguments"])["command"]
             for m in msgs if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    assert calls and calls[-1] == "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", calls
    if len(calls) < 2:
        # the shipped model is undertrained (docs/models.md): its first turn sometimes submits
        pytest.xfail(f"the model submitted without running a command first: {calls}")
    # a round trip: mini ran the model's first command, the model answered after its output
    roles = [m["role"] for m in msgs]
    first_result = roles.index("tool")
    assert json.loads(msgs[first_result]["content"]).keys() >= {"returncode", "output"}
    assert "assistant" in roles[first_result + 1:], roles

"""scripts/demo_claude_tasks.py's `on_task`: whether an executed call does what a short task
asks (the stricter count printed beside issue 27's pass rate). Cases from the v5 demo's real
runs (2026-12-04): a listing answered by a Read, a read answered by `date`, a read of the named
file that failed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "demo_claude_tasks.py"


@pytest.fixture(scope="module")
def on_task():
    spec = importlib.util.spec_from_file_location("demo_claude_tasks", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.on_task


def _bash(c: str) -> dict:
    return {"name": "Bash", "input": {"command": c, "description": "d"}}


def _read(p: str) -> dict:
    return {"name": "Read", "input": {"file_path": p}}


@pytest.mark.parametrize("task, calls, executed, want", [
    ("list the files", [_bash("ls")], [True], True),
    ("What files are here?", [_bash("ls -la")], [True], True),
    ("list files", [_read("/tmp/umbra/README.md")], [True], False),
    ("what does README say", [_bash("cat README.md")], [True], True),
    ("What does README.md say?", [_bash("ls")], [True], False),
    ("read main.py", [_read("/work/rocket-graph/main.py")], [False], False),
    ("read main.py", [_read("/tmp/x/main.py")], [True], True),
    ("cat main.py", [_bash("date")], [True], False),
    ("show me notes.txt", [_bash("cat notes.txt")], [True], True),
    ("run `git status`", [_bash("git status")], [True], True),
    ("run `python3 --version`", [_bash("python3 -V")], [True], False),
    ("run `git status`", [_bash("ls"), _bash("git status")], [True, False], False),
])
def test_on_task(on_task, task, calls, executed, want) -> None:
    assert on_task(task, calls, executed) is want

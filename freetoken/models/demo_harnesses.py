"""The harnesses the demo model's training data imitates (freetoken/models/demo_data.py):
for each, the recorded trace its first request comes from, its API shape, and how it calls its
tools and formats their results (Claude Code: Bash/Read/Write, from data v6 Bash/Write: its
reads `cat` in the shell, `Task.read_by_shell`; OpenCode: bash/read/write;
OpenClaw: ls/read/exec/write; Codex: exec_command; mini-swe-agent: its `bash` tool, or its text
protocol finished by `MINI_DONE`)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from freetoken.models.demo_tasks import Task


@dataclass(frozen=True)
class Harness:
    name: str
    trace: str  # path under TRACES
    seq: int  # the request whose system prompt, tools and first user message are used
    api: str  # "anthropic" | "openai" | "responses"
    calls: Callable[[Task, str], tuple[str, dict[str, Any]]]  # (task, cwd) -> (tool, args)
    result: Callable[[Task, str], str]  # the tool output as this harness sends it back


def _cc_call(t: Task, cwd: str) -> tuple[str, dict[str, Any]]:
    if t.kind == "read" and not t.read_by_shell:
        return "Read", {"file_path": f"{cwd}/{t.path}"}
    if t.kind == "write":
        return "Write", {"file_path": f"{cwd}/{t.path}", "content": t.content}
    return "Bash", {"command": t.command, "description": t.description}


def _cc_result(t: Task, cwd: str) -> str:
    if t.kind == "read" and not t.read_by_shell:
        return "".join(f"{i}\t{line}\n" for i, line in enumerate(t.output.split("\n"), 1))
    if t.kind == "write":
        return f"File created successfully at: {cwd}/{t.path}"
    return t.output.rstrip("\n")


def _oc_call(t: Task, cwd: str) -> tuple[str, dict[str, Any]]:
    if t.kind == "read":
        return "read", {"filePath": f"{cwd}/{t.path}"}
    if t.kind == "write":
        return "write", {"content": t.content, "filePath": f"{cwd}/{t.path}"}
    return "bash", {"command": t.command, "description": t.description}


def _oc_result(t: Task, cwd: str) -> str:
    if t.kind == "read":
        lines = t.output.split("\n")
        body = "".join(f"{i}: {line}\n" for i, line in enumerate(lines, 1))
        return (f"<path>{cwd}/{t.path}</path>\n<type>file</type>\n<content>\n{body}\n"
                f"(End of file - total {len(lines)} lines)\n</content>")
    if t.kind == "write":
        return "Wrote file successfully."
    return t.output


def _ocl_call(t: Task, cwd: str) -> tuple[str, dict[str, Any]]:
    if t.kind == "list":
        return "ls", ({"path": t.path} if t.path else {})
    if t.kind == "read":
        return "read", {"path": t.path}
    if t.kind == "write":
        return "write", {"path": t.path, "content": t.content}
    return "exec", {"command": t.command, "title": t.description}


def _ocl_result(t: Task, cwd: str) -> str:
    if t.kind == "write":
        return f"Successfully wrote {len(t.content.encode())} bytes to {t.path}"
    return t.output.rstrip("\n")


def _bash_call(t: Task, cwd: str) -> tuple[str, dict[str, Any]]:
    return "bash", {"command": t.command}


def _mini_tool_result(t: Task, cwd: str) -> str:
    return json.dumps({"returncode": 0, "output": t.output}, indent=2)


def _mini_text_result(t: Task, cwd: str) -> str:
    return f"<returncode>0</returncode>\n<output>\n{t.output}</output>"


def _codex_call(t: Task, cwd: str) -> tuple[str, dict[str, Any]]:
    return "exec_command", {"cmd": t.command}


def _codex_result(t: Task, cwd: str) -> str:
    return (f"Chunk ID: 0\nWall time: 0.0 seconds\nProcess exited with code 0\n"
            f"Original token count: {len(t.output) // 4}\nOutput:\n{t.output}")


HARNESSES: dict[str, Harness] = {h.name: h for h in (
    Harness("claude_code", "claude_code/cc_try1.jsonl", 1, "anthropic", _cc_call, _cc_result),
    Harness("opencode", "opencode/oc_try1.jsonl", 2, "openai", _oc_call, _oc_result),
    Harness("openclaw", "openclaw/ocl_try1.jsonl", 1, "openai", _ocl_call, _ocl_result),
    Harness("mini_tool", "mini_swe_agent/mini_tool.jsonl", 1, "openai", _bash_call,
            _mini_tool_result),
    Harness("mini_text", "mini_swe_agent/mini_text.jsonl", 1, "openai", _bash_call,
            _mini_text_result),
    Harness("codex", "codex/codex_responses.jsonl", 1, "responses", _codex_call,
            _codex_result),
)}
MINI_DONE = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

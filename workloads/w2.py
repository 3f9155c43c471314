"""W2: the SWE-bench-style issue through OpenCode (OpenAI chat shape), 3 tool-calling turns.

Request shape as recorded from OpenCode 1.18.33: its real system prompt and 9 tools, `max_tokens`
8192, `tool_choice: auto`, streaming with usage, `x-session-id`/`x-session-affinity` headers.
History as OpenCode re-sends it: earlier `reasoning_content` kept, `content: ""` where the model
sent none, tool-call arguments re-serialised without spaces, read results in `<path>`/`<content>`
blocks with `N: ` line numbers.
"""
from __future__ import annotations

import json
import random
from typing import Any

from workloads.build import b62_id, compact, hex_id, numbered, shrink_text, shrink_tools, thinking
from workloads.harness_shapes import shapes
from workloads.issue import make_issue, source_file, test_run
from workloads.spec import Scale, Turn, Workload

VERSION = "1"
# Token budgets: system prompt cut (tiny only), tool outputs, and per-turn replies.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"system": 400, "tools": ("bash", "read", "edit"), "desc": 40, "src": 250,
             "pytest": 200, "out": (8, 16, 32)},
    "full": {"system": None, "tools": None, "desc": None, "src": 7000, "pytest": 3000,
             "out": (320, 260, 900)},
}
ROOT = "/testbed"


def _call(rng: random.Random, name: str, args: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """(as streamed by the server, as OpenCode puts it back into history)."""
    cid = f"call_{hex_id(rng, 24)}"
    fn = {"id": cid, "type": "function", "function": {"name": name}}
    sent = {**fn, "function": {"name": name, "arguments": json.dumps(args)}}
    kept = {**fn, "function": {"name": name, "arguments": compact(args)}}
    return sent, kept


def build_w2(scale: Scale = "full", seed: int = 0) -> Workload:
    """Three requests of one OpenCode session: read the module, run the tests, edit the fix."""
    size = SIZES[scale]
    sh = shapes("opencode")
    rng = random.Random(f"w2-{seed}")
    issue = make_issue(seed)
    system = sh["system"] if size["system"] is None else shrink_text(sh["system"], size["system"])
    tools = sh["tools"] if size["tools"] is None else shrink_tools(sh["tools"], size["tools"],
                                                                  size["desc"])
    params = {k: v for k, v in sh["params"].items()}
    ses = f"ses_{hex_id(rng, 12)}{b62_id(rng, 14)}"
    headers = {"x-session-id": ses, "x-session-affinity": ses}
    src = source_file(issue, seed, size["src"])
    steps = [
        ("I'll start by reading the module named in the issue.", "read",
         {"filePath": f"{ROOT}/{issue.src_path}"},
         f"<path>{ROOT}/{issue.src_path}</path>\n" + numbered(src, "oc")),
        ("", "bash", {"command": f"python -m pytest {issue.tests_path} -x -q",
                      "description": "Run the module's tests"},
         test_run(issue, seed, size["pytest"], passing=False)),
        ("The clamp drops the sign; I'll recurse on the magnitude instead.", "edit",
         {"filePath": f"{ROOT}/{issue.src_path}", "oldString": issue.old,
          "newString": issue.new}, "Edit applied successfully."),
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": issue.text}]
    turns: list[Turn] = []
    for i, ((text, tool, args, result), n_out) in enumerate(zip(steps, size["out"]), 1):
        sent, kept = _call(rng, tool, args)
        reason = thinking(rng, max(1, n_out - 40))
        body = {**params, "messages": json.loads(json.dumps(messages)), "tools": tools}
        reply = {"role": "assistant", "content": text or None, "reasoning_content": reason,
                 "tool_calls": [sent]}
        turns.append(Turn(f"T{i}", ses, "openai", body, n_out,
                          after=(f"T{i - 1}",) if i > 1 else (), group="main",
                          headers=headers, reply=reply))
        messages += [{"role": "assistant", "content": text, "reasoning_content": reason,
                      "tool_calls": [kept]},
                     {"role": "tool", "tool_call_id": kept["id"], "content": result}]
    return Workload("W2", VERSION, scale, seed, "SWE-bench-style issue through OpenCode",
                    tuple(turns))

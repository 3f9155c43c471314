"""The recorded first requests the demo model's training conversations start from
(`demo_data`): a harness's request as `tests/data/harness_traces/` holds it, its task sentence
and working directory replaced, Codex's Responses body as the chat body it amounts to, and the
plain lines of the recorded prompts (file contents for the read tasks)."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

from freetoken.envs import harness_traces_dir
from freetoken.models.demo_harnesses import HARNESSES, Harness

RECORDED_CWD = "/home/dev/project"
_RECORDED_TASK = re.compile(r"Explore this repo:[^\n\"]*?summarize\.")


def recorded_body(h: Harness, traces: Path | None = None) -> dict[str, Any]:
    """The request `h` names in the recorded traces (`traces`: default
    `envs.harness_traces_dir()`)."""
    with open((traces or harness_traces_dir()) / h.trace, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec["seq"] == h.seq:
                return dict(rec["body"])
    raise KeyError(f"{h.trace} has no request seq={h.seq}")


def responses_to_openai(body: dict[str, Any]) -> dict[str, Any]:
    """A Codex Responses body as the chat body it amounts to: developer items become system
    messages, `input_text` parts joined, function tools kept (hosted tools and namespaces
    dropped: the template cannot render them)."""
    msgs: list[dict[str, Any]] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": body["instructions"]})
    for it in body.get("input") or []:
        if it.get("type") != "message":
            continue
        text = "\n".join(p.get("text", "") for p in it.get("content") or [])
        role = "system" if it["role"] == "developer" else it["role"]
        if role == "system" and msgs and msgs[-1]["role"] == "system":
            msgs[-1]["content"] += "\n\n" + text
        else:
            msgs.append({"role": role, "content": text})
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description",
                                                                "parameters") if k in t}}
             for t in body.get("tools") or [] if t.get("type") == "function"]
    return {"messages": msgs, "tools": tools}


def _replace_task(obj: Any, task_text: str, cwd: str) -> Any:
    """The recorded body with its task sentence (the last one wins for Codex, whose task is a
    whole user message) and working directory replaced."""
    s = json.dumps(obj, ensure_ascii=False)
    s = s.replace(RECORDED_CWD, cwd).replace("<project>", cwd)
    s = _RECORDED_TASK.sub(lambda _m: json.dumps(task_text, ensure_ascii=False)[1:-1], s)
    return json.loads(s)


def base_request(h: Harness, task_text: str, cwd: str,
                 traces: Path | None = None) -> dict[str, Any]:
    body = recorded_body(h, traces)
    if h.api == "responses":
        body = responses_to_openai(body)
        body["messages"][-1]["content"] = task_text
    keep = {k: body[k] for k in ("system", "tools", "thinking", "messages") if k in body}
    return _replace_task(copy.deepcopy(keep), task_text, cwd)


def corpus_lines(traces: Path | None = None) -> list[str]:
    """Plain lines of the recorded system prompts (20-90 characters, no markup): file contents
    for the read tasks."""
    seen: set[str] = set()
    for h in HARNESSES.values():
        body = recorded_body(h, traces)
        system = body.get("system", "")
        texts = [system] if isinstance(system, str) else [b.get("text", "") for b in system]
        texts += [m["content"] for m in body.get("messages", [])
                  if isinstance(m.get("content"), str)]
        for t in texts:
            for line in t.split("\n"):
                line = line.strip()
                if 20 <= len(line) <= 90 and not re.search(r"[<>{}`|\\]", line):
                    seen.add(line)
    return sorted(seen)

"""W3: the W2 issue through Claude Code (Anthropic shape) with two concurrent sub-agents.

Request shape as recorded from Claude Code 2.1.197: the billing-header + SDK + main system blocks,
24 tools (21 for sub-agents), `thinking: adaptive` (disabled for sub-agents), `context_management`,
`output_config`, `metadata`, the agent-types `role: system` message after the first user message,
thinking blocks with signatures kept in history, and one `cache_control` breakpoint moved to the
last block of the last user message on every request. The main session reads, delegates two
sub-agents that start together (second one 40 ms later) and run in parallel while the parent
waits, then tests and edits; at full scale the sessions grow to about 64k (main) and 57k tokens
(each sub-agent).
"""
from __future__ import annotations

import copy
import random
import uuid
from typing import Any

from workloads.build import b62_id, numbered, shrink_text, shrink_tools, thinking
from workloads.content import prose, sized
from workloads.harness_shapes import shapes
from workloads.issue import Issue, grep_output, make_issue, source_file, test_run, tests_file
from workloads.spec import Scale, Turn, Workload
from workloads.tokens import request_tokens

VERSION = "1"
SIBLING_GAP_S = 0.040
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"main_target": 1800, "sub_target": 1400, "cut": 120, "desc": 12, "sig": 24,
             "tools": ("Agent", "Bash", "Read", "Edit"), "sub_tools": ("Bash", "Read"),
             "main_out": (8, 8, 24, 8, 8, 32, 8, 16), "sub_out": (16, 16, 16, 16, 24)},
    "full": {"main_target": 62500, "sub_target": 57000, "cut": None, "desc": None, "sig": 120,
             "tools": None, "sub_tools": None,
             "main_out": (220, 160, 480, 240, 160, 900, 200, 700),
             "sub_out": (180, 150, 170, 200, 650)},
}
# Shares of a session's growth budget taken by each tool output (the rest is replies).
_MAIN_SHARES = {"grep": 0.05, "src": 0.30, "fail": 0.12, "tests": 0.34, "pass": 0.12}
_SUB_SHARES = (0.32, 0.32, 0.12, 0.16)
_NUMBERED = 0.86  # `N\t` line prefixes of a read add ~16% tokens to the file itself


def _breakpoint(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy with Claude Code's single moving `cache_control` on the last user block."""
    out = copy.deepcopy(messages)
    for m in out:
        if isinstance(m["content"], list):
            for b in m["content"]:
                b.pop("cache_control", None)
    last = next(m for m in reversed(out) if m["role"] == "user")
    last["content"][-1]["cache_control"] = {"type": "ephemeral"}
    return out


class _Session:
    """One Claude Code conversation: accumulates messages and emits its turns."""

    def __init__(self, sid: str, prefix: str, params: dict[str, Any], system: list[Any],
                 tools: list[Any], messages: list[dict[str, Any]], headers: dict[str, str],
                 group: str, rng: random.Random, sig: int) -> None:
        self.sid, self.prefix, self.params, self.group = sid, prefix, params, group
        self.system, self.tools, self.messages, self.headers = system, tools, messages, headers
        self.rng, self.sig, self.last = rng, sig, ""
        self.turns: list[Turn] = []

    def body(self) -> dict[str, Any]:
        return {**self.params, "system": self.system, "tools": self.tools,
                "messages": _breakpoint(self.messages)}

    def step(self, n_out: int, text: str, calls: list[tuple[str, dict[str, Any]]],
             after: tuple[str, ...] = (), delay_s: float = 0.0) -> list[str]:
        """Emit one request whose recorded reply is thinking + `text` + `calls`; append the
        reply to history and return the tool_use ids (results come via `results`)."""
        blocks: list[dict[str, Any]] = []
        if self.params.get("thinking", {}).get("type") != "disabled":
            blocks.append({"type": "thinking", "thinking": thinking(self.rng, max(1, n_out - 60)),
                           "signature": b62_id(self.rng, self.sig)})
        if text:
            blocks.append({"type": "text", "text": text})
        ids = [f"toolu_{b62_id(self.rng, 24)}" for _ in calls]
        blocks += [{"type": "tool_use", "id": i, "name": n, "input": a}
                   for i, (n, a) in zip(ids, calls)]
        tid = f"{self.prefix}{len(self.turns) + 1}"
        deps = after or ((self.last,) if self.last else ())
        self.turns.append(Turn(tid, self.sid, "anthropic", self.body(), n_out, deps, delay_s,
                               self.group, dict(self.headers),
                               {"role": "assistant", "content": blocks}))
        self.messages.append({"role": "assistant", "content": copy.deepcopy(blocks)})
        self.last = tid
        return ids

    def results(self, ids: list[str], contents: list[Any]) -> None:
        blocks = []
        for i, c in zip(ids, contents):
            b: dict[str, Any] = {"tool_use_id": i, "type": "tool_result", "content": c}
            if isinstance(c, str):
                b["is_error"] = False
            blocks.append(b)
        self.messages.append({"role": "user", "content": blocks})


def _budget(target: int, first: dict[str, Any], outs: tuple[int, ...]) -> int:
    return max(40, target - request_tokens(first) - sum(outs) - 60 * len(outs))


def build_w3(scale: Scale = "full", seed: int = 0) -> Workload:
    size = SIZES[scale]
    sh = shapes("claude_code")
    rng = random.Random(f"w3-{seed}")
    issue = make_issue(seed)
    cut = size["cut"]

    def shrink(text: str) -> str:
        return text if cut is None else shrink_text(text, cut)

    def pick(tools: list[Any], keep: tuple[str, ...] | None) -> list[Any]:
        return tools if keep is None else shrink_tools(tools, keep, size["desc"])

    system = sh["system"][:2] + [{**sh["system"][2], "text": shrink(sh["system"][2]["text"])}]
    sub_system = sh["sub_system"][:2] + [{**sh["sub_system"][2],
                                          "text": shrink(sh["sub_system"][2]["text"])}]
    headers = {
        **sh["headers"],
        "X-Claude-Code-Session-Id": str(uuid.UUID(int=rng.getrandbits(128))),
    }
    reminder = {"type": "text", "text": sh["reminder"]}
    main = _Session(headers["X-Claude-Code-Session-Id"], "M", sh["params"], system,
                    pick(sh["tools"], size["tools"]),
                    [{"role": "user", "content": [reminder, {"type": "text", "text": issue.text}]},
                     {"role": "system", "content": shrink(sh["agent_types"])}],
                    headers, "main", rng, size["sig"])
    mo = size["main_out"]
    left = _budget(size["main_target"], main.body(), mo)
    share = {k: int(v * left) for k, v in _MAIN_SHARES.items()}

    ids = main.step(mo[0], "I'll find where the parser is defined and used.",
                    [("Bash", {"command": f"grep -rn \"{issue.func}\" src tests",
                               "description": "Find parser definition and callers"})])
    main.results(ids, [grep_output(issue, seed, share["grep"])])
    ids = main.step(mo[1], "", [("Read", {"file_path": f"/testbed/{issue.src_path}"})])
    main.results(ids, [numbered(source_file(issue, seed, int(share["src"] * _NUMBERED)), "cc")])
    prompts = ((f"Find every caller of {issue.func} under src/ and report how each one handles "
               f"negative values. Quote file:line for each."),
               (f"Run the test suite for {issue.module} and neighbouring modules, and summarise "
               f"the failures that involve negative inputs."))
    agent_ids = main.step(mo[2], "I'll delegate two independent checks in parallel.",
                          [("Agent", {"description": f"Sub task {k + 1}", "prompt": p,
                                      "subagent_type": "general-purpose"})
                           for k, p in enumerate(prompts)])
    reports = [_sub_agent(k, p, issue, seed, size, sh, sub_system, headers, main.last,
                          random.Random(f"w3-sub{k}-{seed}"), reminder, shrink)
               for k, p in enumerate(prompts)]
    subs = [r[0] for r in reports]
    main.results(agent_ids, [[{"type": "text", "text": rep},
                              {"type": "text", "text": f"agentId: a{b62_id(rng, 16).lower()} "
                               f"(use SendMessage with to: 'a{k}', summary: '<5-10 word recap>' "
                               f"to continue this agent)\n<usage>subagent_tokens: "
                               f"{size['sub_target']}\ntool_uses: 4\nduration_ms: "
                               f"{rng.randint(20000, 90000)}</usage>"}]
                             for k, (_, rep) in enumerate(reports)])
    joined = tuple(s.last for s in subs)
    ids = main.step(mo[3], "", [("Bash", {"command": f"python -m pytest {issue.tests_path} -q",
                                          "description": "Run tests"})], after=joined)
    main.results(ids, [test_run(issue, seed, share["fail"], passing=False)])
    ids = main.step(mo[4], "", [("Read", {"file_path": f"/testbed/{issue.tests_path}"})])
    main.results(ids, [numbered(tests_file(issue, seed, int(share["tests"] * _NUMBERED)), "cc")])
    ids = main.step(mo[5], "The clamp drops the sign; fix it and add a regression test.",
                    [("Edit", {"file_path": f"/testbed/{issue.src_path}",
                               "old_string": issue.old, "new_string": issue.new})])
    main.results(ids, [f"The file /testbed/{issue.src_path} has been updated successfully."])
    ids = main.step(mo[6], "", [("Bash", {"command": f"python -m pytest {issue.tests_path} -v",
                                          "description": "Re-run tests verbosely"})])
    main.results(ids, [test_run(issue, seed, share["pass"], passing=True)])
    main.step(mo[7], f"Fixed `{issue.func}`: negative inputs keep their sign; tests pass.", [])
    turns = main.turns[:3] + [t for pair in zip(*(s.turns for s in subs)) for t in pair] + \
        main.turns[3:]
    return Workload("W3", VERSION, scale, seed, "SWE-bench-style issue through Claude Code with "
                    "two concurrent sub-agents", tuple(turns))


def _sub_agent(k: int, prompt: str, issue: Issue, seed: int, size: dict[str, Any],
               sh: dict[str, Any], system: list[Any], headers: dict[str, str], parent: str,
               rng: random.Random, reminder: dict[str, Any],
               shrink: Any) -> tuple[_Session, str]:
    """Sub-agent k: 4 tool steps and a final report; returns the session and its report."""
    tools = sh["sub_tools"] if size["sub_tools"] is None else shrink_tools(
        sh["sub_tools"], size["sub_tools"], size["desc"])
    # Sub-agents send the parent's session header but are conversations of their own.
    s = _Session(f"{headers['X-Claude-Code-Session-Id']}:sub{k + 1}", f"S{k + 1}.",
                 sh["sub_params"], system,
                 tools, [{"role": "user", "content": [reminder, {"type": "text", "text": prompt}]},
                         {"role": "system", "content": shrink(sh["sub_skills"])}],
                 headers, "fanout", rng, size["sig"])
    so = size["sub_out"]
    left = _budget(size["sub_target"], s.body(), so)
    a, b, g, f = (int(x * left) for x in _SUB_SHARES)
    neighbours = [f"src/pkg/{issue.module}_{w}.py" for w in ("compat", "io")]
    ids = s.step(so[0], "", [("Read", {"file_path": f"/testbed/{neighbours[0]}"})],
                 after=(parent,), delay_s=k * SIBLING_GAP_S)
    s.results(ids, [numbered(source_file(issue, seed * 10 + k, int(a * _NUMBERED),
                                         tag=f"sub{k}a"), "cc")])
    ids = s.step(so[1], "", [("Read", {"file_path": f"/testbed/{neighbours[1]}"})])
    s.results(ids, [numbered(source_file(issue, seed * 10 + k, int(b * _NUMBERED),
                                         tag=f"sub{k}b"), "cc")])
    ids = s.step(so[2], "", [("Bash", {"command": f"grep -rn \"{issue.func}(\" src",
                                       "description": "Find call sites"})])
    s.results(ids, [grep_output(issue, seed * 10 + k + 1, g)])
    ids = s.step(so[3], "", [("Bash", {"command": "python -m pytest tests -q -x",
                                       "description": "Run the suite"})])
    s.results(ids, [test_run(issue, seed * 10 + k + 1, f, passing=False)])
    report = sized(prose(rng), max(4, so[4] - 8), at_line=False)
    s.step(so[4], report, [])
    return s, report

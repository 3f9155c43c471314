"""W4: an email/calendar assistant through OpenClaw (OpenAI chat shape), 13 fixed steps.

Request shape as recorded from OpenClaw 2026.9.6: its real system prompt (workspace files
injected under `# Project Context`) and 12 core tools plus the mail/calendar plugin tools this
agent needs, `max_completion_tokens`, streaming with usage, no session header. At full scale the
system prompt + tools floor is ~24.5k tokens (the assistant's MEMORY.md fills the difference).
OpenClaw's edit behaviour is reproduced exactly: every request ends with the rolling
`<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>` user message, which the next step removes before
appending the new assistant/tool messages and then re-appends; user messages carry a wall-clock
stamp; tool-call ids lose their underscores in history; arguments are re-serialised compact.
"""
from __future__ import annotations

import json
import random
from typing import Any

from workloads.build import compact, hex_id, shrink_text, shrink_tools, thinking
from workloads.content import calendar_rows, email_body, inbox_rows, memory_notes, person, sized
from workloads.harness_shapes import shapes
from workloads.spec import Scale, Turn, Workload
from workloads.tokens import request_tokens

VERSION = "1"
TRAILING_MARK = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"floor": None, "cut": 250, "desc": 6, "tools": ("edit",),
             "memory": 60, "inbox": 60, "mail": 40, "cal": 50,
             "out": (4, 4, 4, 8, 8, 16, 24, 4, 8, 4, 16, 8, 32)},
    "full": {"floor": 24500, "cut": None, "desc": None, "tools": None, "memory": None,
             "inbox": 1800, "mail": 1000, "cal": 1500,
             "out": (180, 120, 120, 150, 220, 380, 420, 150, 160, 120, 420, 200, 260)},
}


def _fn(name: str, desc: str, props: dict[str, Any], req: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "required": req, "properties": props}}}


def _s(desc: str) -> dict[str, str]:
    return {"type": "string", "description": desc}


MAIL_TOOLS = [
    _fn("email_search", "Search the user's mailbox (Gmail query syntax). Returns id, from, "
        "subject, date, unread, labels per message; newest first.",
        {"query": _s("Gmail search query, e.g. is:unread newer_than:2d."),
         "max": {"type": "integer", "minimum": 1, "description": "Max results; default 20."}},
        ["query"]),
    _fn("email_read", "Read one message or a whole thread as plain text with headers.",
        {"id": _s("Message or thread id from email_search."),
         "thread": {"type": "boolean", "description": "Return the whole thread."}}, ["id"]),
    _fn("email_draft", "Create a reply draft; never sends. Returns draftId.",
        {"replyTo": _s("Message id being answered."), "body": _s("Plain-text body."),
         "cc": {"type": "array", "items": {"type": "string"}}}, ["replyTo", "body"]),
    _fn("email_send", "Send a message or an existing draft. Requires explicit user intent.",
        {"to": _s("Recipient address."), "subject": _s("Subject."), "body": _s("Body."),
         "draftId": _s("Send this draft instead.")}, []),
    _fn("calendar_list", "List events in a window or matching a query (primary calendar).",
        {"from": _s("ISO date/time, inclusive."), "to": _s("ISO date/time, exclusive."),
         "query": _s("Free-text match on title/attendees.")}, []),
    _fn("calendar_create", "Create an event; invites attendees unless notify=false.",
        {"title": _s("Title."), "start": _s("ISO start."), "end": _s("ISO end."),
         "attendees": {"type": "array", "items": {"type": "string"}},
         "notify": {"type": "boolean"}}, ["title", "start", "end"]),
    _fn("calendar_update", "Move or edit an existing event by id; notifies attendees.",
        {"id": _s("Event id."), "start": _s("New ISO start."), "end": _s("New ISO end."),
         "title": _s("New title.")}, ["id"]),
]


def _system(sh: dict[str, Any], size: dict[str, Any], tools: list[Any], rng: random.Random,
            ) -> str:
    """The recorded system prompt with MEMORY.md injected as one more workspace file, sized
    so that system + tools reach the scale's floor."""
    base = sh["system"] if size["cut"] is None else shrink_text(sh["system"], size["cut"])
    if size["floor"] is None:
        memory = sized(memory_notes(rng), size["memory"])
    else:
        have = request_tokens({"messages": [{"role": "system", "content": base}], "tools": tools})
        memory = sized(memory_notes(rng), max(1, size["floor"] - have - 12))
    block = f"## /home/dev/project/MEMORY.md\n{memory}\n"
    at = base.find("## /home/dev/project/SOUL.md")
    return base[:at] + block + base[at:] if at >= 0 else base + "\n" + block


def build_w4(scale: Scale = "full", seed: int = 0) -> Workload:
    size = SIZES[scale]
    sh = shapes("openclaw")
    rng = random.Random(f"w4-{seed}")
    core = sh["tools"] if size["tools"] is None else shrink_tools(sh["tools"], size["tools"],
                                                                 size["desc"])
    mail = MAIL_TOOLS if size["desc"] is None else shrink_tools(
        MAIL_TOOLS, tuple(t["function"]["name"] for t in MAIL_TOOLS), size["desc"])
    tools = core + mail
    system = _system(sh, size, tools, rng)
    params = dict(sh["params"])
    trailing = {"role": "user", "content": [{"type": "text", "text": sh["trailing"]}]}
    boss, boss_addr = person(rng)

    def user(stamp: str, text: str) -> dict[str, Any]:
        return {"role": "user", "content": f"[Mon 2026-11-30 {stamp} UTC] {text}\n\n"
                                           f"{sh['runtime']}"}

    def mail_text(topic: str) -> str:
        return sized(email_body(rng, topic), size["mail"])

    steps: list[tuple[str, str, dict[str, Any], str] | str] = [
        ("", "email_search", {"query": "is:unread newer_than:2d", "max": 25},
         sized(inbox_rows(rng), size["inbox"])),
        ("", "email_read", {"id": "m1003"}, mail_text("Q3 budget review")),
        ("", "email_read", {"id": "m1007"}, mail_text("offsite logistics")),
        ("", "calendar_list", {"from": "2026-11-30", "to": "2026-12-05"},
         sized(calendar_rows(rng), size["cal"])),
        ("Booking the budget review for Wednesday 10:00.", "calendar_create",
         {"title": "Q3 budget review", "start": "2026-12-02T10:00:00Z",
          "end": "2026-12-02T11:00:00Z", "attendees": [boss_addr]},
         '{"ok":true,"id":"evt_0042","htmlLink":"https://calendar.example/e/evt_0042"}'),
        ("", "email_draft", {"replyTo": "m1007", "body": "Thursday works; I booked Room 4B."},
         f'{{"ok":true,"draftId":"d_{hex_id(rng, 10)}"}}'),
        "Inbox triaged: 2 need you, budget review booked Wed 10:00, offsite reply drafted.",
        ("", "calendar_list", {"query": f"1:1 {boss.split()[0]}"},
         sized(calendar_rows(rng), size["cal"] // 3)),
        ("", "calendar_update", {"id": "evt_0007", "start": "2026-12-03T09:00:00Z",
                                 "end": "2026-12-03T09:30:00Z"},
         '{"ok":true,"id":"evt_0007","notified":2}'),
        ("", "email_read", {"id": "m1011", "thread": True}, mail_text("roadmap sync")),
        ("Sending the agenda now.", "email_send",
         {"to": boss_addr, "subject": "Agenda for Thursday 1:1",
          "body": "1. Q3 budget\n2. Offsite\n3. Hiring loop"},
         f'{{"ok":true,"id":"m{rng.randint(2000, 9999)}","threadId":"m1011"}}'),
        ("", "edit", {"path": "MEMORY.md", "edits": [{"oldText": "## Standing rules",
                                                      "newText": f"## Standing rules\n- "
                                                      f"{boss} prefers mornings for 1:1s."}]},
         "Successfully replaced 1 block(s) in MEMORY.md."),
        f"Moved the 1:1 with {boss} to Thu 09:00, sent the agenda and noted the preference.",
    ]
    history: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        user("08:02", "Triage my inbox from the last two days, book anything that needs a "
             "meeting and draft replies where I owe one.")]
    turns: list[Turn] = []
    for i, (step, n_out) in enumerate(zip(steps, size["out"]), 1):
        if i == 8:
            history.append(user("08:19", f"Move my 1:1 with {boss} to Thursday morning, send "
                                         f"the agenda, and remember the preference."))
        body = {**params, "messages": json.loads(json.dumps(history + [trailing])),
                "tools": tools}
        reason = thinking(rng, max(1, n_out - 50))
        if isinstance(step, str):
            reply = {"role": "assistant", "content": step, "reasoning_content": reason}
            history.append({"role": "assistant", "content": step, "reasoning_content": reason})
        else:
            text, name, args, result = step
            cid = f"call_{hex_id(rng, 24)}"
            reply = {"role": "assistant", "content": text or None, "reasoning_content": reason,
                     "tool_calls": [{"id": cid, "type": "function", "function": {
                         "name": name, "arguments": json.dumps(args)}}]}
            kept = cid.replace("_", "")
            history += [{"role": "assistant", "content": text or None,
                         "reasoning_content": reason,
                         "tool_calls": [{"id": kept, "type": "function", "function": {
                             "name": name, "arguments": compact(args)}}]},
                        {"role": "tool", "content": result, "tool_call_id": kept}]
        turns.append(Turn(f"T{i}", "w4", "openai", body, n_out,
                          after=(f"T{i - 1}",) if i > 1 else (), group="main", reply=reply))
    return Workload("W4", VERSION, scale, seed, "email/calendar agent through OpenClaw",
                    tuple(turns))


def system_floor_tokens(w: Workload) -> int:
    """Tokens of the system prompt + tools (the part every step shares)."""
    b = w.turns[0].body
    return request_tokens({"messages": b["messages"][:1], "tools": b["tools"]})

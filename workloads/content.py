"""Deterministic generated content: source files, test runs, grep hits, prose, mail, calendar.

Every generator takes a `random.Random` and yields lines forever; `sized` cuts such a stream to
an exact Qwen3 token budget. Same seed, same bytes: nothing here reads the clock or the machine.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

from workloads.tokens import count_tokens, truncate_to_tokens

NOUNS = ("duration", "token", "buffer", "session", "record", "window", "schedule", "payload",
         "segment", "offset", "cursor", "budget", "interval", "header", "channel", "bucket",
         "registry", "snapshot", "ledger", "quota", "policy", "anchor", "frame", "manifest")
VERBS = ("parse", "normalize", "merge", "resolve", "compute", "validate", "render", "split",
         "encode", "decode", "flush", "collect", "reconcile", "expand", "clamp", "format")
ADJS = ("stale", "negative", "empty", "nested", "partial", "overlapping", "unicode", "signed",
        "trailing", "duplicate", "cached", "lazy", "missing", "implicit", "zero-length")
FIRST = ("Maya", "Jonas", "Priya", "Lukas", "Amara", "Tomás", "Hana", "Oliver", "Sofia", "Wei",
         "Elena", "Kwame", "Ines", "Ravi", "Greta", "Mateo")
LAST = ("Okafor", "Lindqvist", "Ramanathan", "Becker", "Nakamura", "Alvarez", "Novak", "Chen",
        "Moreau", "Haddad", "Kowalski", "Silva", "Andersen", "Rossi")
TOPICS = ("Q3 budget review", "vendor contract renewal", "offsite logistics", "hiring loop",
          "launch checklist", "board deck", "security audit", "customer escalation",
          "roadmap sync", "travel approval", "design critique", "invoice dispute")


def ident(rng: random.Random) -> str:
    return f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"


def sentence(rng: random.Random) -> str:
    a, b, c = rng.choice(NOUNS), rng.choice(NOUNS), rng.choice(ADJS)
    forms = (f"The {a} path handles {c} {b} values before the {rng.choice(NOUNS)} is built.",
             f"If the {a} is {c}, `{ident(rng)}` returns early and the {b} stays unchanged.",
             f"We check {rng.randint(2, 64)} cases of {c} {a} input against the {b} table.",
             f"Note that {a} and {b} are compared after the {rng.choice(VERBS)} step, not before.",
             f"So the result is {rng.randint(10, 999)} when the {c} {a} wraps around once.")
    return rng.choice(forms)


def prose(rng: random.Random) -> Iterator[str]:
    while True:
        yield " ".join(sentence(rng) for _ in range(rng.randint(2, 5)))


def python_source(rng: random.Random, module: str) -> Iterator[str]:
    """A plausible Python module: imports, then functions and classes without end."""
    yield f'"""{module}: {rng.choice(VERBS)} and {rng.choice(VERBS)} {rng.choice(NOUNS)}s."""'
    yield "from __future__ import annotations"
    yield ""
    yield "from dataclasses import dataclass"
    while True:
        yield ""
        name, arg = ident(rng), rng.choice(NOUNS)
        if rng.random() < 0.25:
            adj = rng.choice(ADJS).replace("-", "_")
            cls = "".join(w.capitalize() for w in (*adj.split("_"), rng.choice(NOUNS)))
            yield f"\n@dataclass\nclass {cls}:"
            yield f'    """{sentence(rng)}"""\n'
            for _ in range(rng.randint(2, 5)):
                yield f"    {rng.choice(NOUNS)}: {rng.choice(('int', 'str', 'float', 'bool'))}"
            yield f"\n    def {name}(self, {arg}: int) -> int:"
        else:
            yield f"\ndef {name}({arg}: str, *, strict: bool = False) -> int:"
        yield f'    """{sentence(rng)}\n\n    {sentence(rng)}\n    """'
        for _ in range(rng.randint(2, 7)):
            v, k = rng.choice(NOUNS), rng.randint(0, 4096)
            yield rng.choice((f"    {v} = int({arg}) + {k}",
                              f"    if {v} < {k}:\n        raise ValueError('{v} below {k}')",
                              f"    for item in {v}s:\n        {v} = max({v}, item - {k})",
                              f"    {v} = {arg}.strip().lower()  # {k}"))
        yield f"    return {rng.choice(NOUNS)}"


def pytest_module(rng: random.Random, module: str) -> Iterator[str]:
    yield f"import pytest\n\nfrom pkg.{module} import *  # noqa: F403\n"
    while True:
        name, case = ident(rng), rng.randint(-500, 500)
        yield f"\n@pytest.mark.parametrize(\"value\", [{case}, {case + 7}, {case * 3}])"
        adj = rng.choice(ADJS).replace("-", "_")
        yield f"def test_{name}_{adj}(value: int) -> None:"
        yield f"    assert {name}(str(value)) == {rng.randint(0, 999)}"


def pytest_run(rng: random.Random, module: str, failures: int) -> Iterator[str]:
    """`pytest -x -q`-style output: progress, `failures` tracebacks, summary; then more
    traceback detail without end (a verbose `-vv` run)."""
    n = rng.randint(80, 400)
    yield "============================= test session starts =============================="
    yield "platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0\nrootdir: /testbed"
    yield f"collected {n} items\n"
    for i in range(0, n, 40):
        marks = "".join("F" if rng.random() < failures / n else "." for _ in range(40))
        yield f"tests/test_{module}.py {marks} [{min(100, (i + 40) * 100 // n):3d}%]"
    yield "\n=================================== FAILURES ==================================="
    while True:
        name = ident(rng)
        yield f"_____________________ test_{name}[{rng.randint(-99, 99)}] _____________________"
        yield f"\n    def test_{name}(value: int) -> None:\n>       assert {name}(str(value)) == 0"
        yield f"E       AssertionError: assert {rng.randint(1, 999)} == 0"
        yield f"E        +  where {rng.randint(1, 999)} = {name}('{rng.randint(-99, 99)}')"
        yield f"\nsrc/pkg/{module}.py:{rng.randint(10, 900)}: in {name}"
        yield f"    {rng.choice(NOUNS)} = int(value) + {rng.randint(0, 99)}"
        yield f"E   ValueError: {rng.choice(NOUNS)} below {rng.randint(0, 99)}\n"


def pytest_summary(rng: random.Random, module: str, failed: int, passed: int) -> str:
    fails = "\n".join(f"FAILED tests/test_{module}.py::test_{ident(rng)} - AssertionError"
                      for _ in range(failed))
    return (f"=========================== short test summary info ============================\n"
            f"{fails}\n"
            f"===================== {failed} failed, {passed} passed in "
            f"{rng.uniform(0.5, 9):.2f}s =====================")


def grep_hits(rng: random.Random, needle: str) -> Iterator[str]:
    while True:
        path = f"src/pkg/{rng.choice(NOUNS)}_{rng.choice(NOUNS)}.py"
        where = f"{path}:{rng.randint(1, 1200)}:"  # draw order kept: outputs are seeded
        yield f"{where}    {rng.choice(NOUNS)} = {needle}({rng.choice(NOUNS)})"


def person(rng: random.Random) -> tuple[str, str]:
    f, la = rng.choice(FIRST), rng.choice(LAST)
    return f"{f} {la}", f"{f.lower()}.{la.lower()}@northwind.example"


def inbox_rows(rng: random.Random) -> Iterator[str]:
    i = 0
    while True:
        i += 1
        name, addr = person(rng)
        labels = '"INBOX","IMPORTANT"' if rng.random() < 0.3 else '"INBOX"'
        yield (f'{{"id":"m{1000 + i}","from":"{name} <{addr}>","subject":"{rng.choice(TOPICS)}'
               f'","date":"2026-11-{rng.randint(20, 30)}T{rng.randint(6, 22):02d}:'
               f'{rng.randint(0, 59):02d}:00Z","unread":{str(rng.random() < 0.6).lower()},'
               f'"labels":[{labels}]}}')


def email_body(rng: random.Random, topic: str) -> Iterator[str]:
    name, addr = person(rng)
    yield f"From: {name} <{addr}>\nTo: Dana Whitfield <dana@northwind.example>"
    yield f"Subject: {topic}\nDate: Mon, 30 Nov 2026 0{rng.randint(6, 9)}:12:44 +0000\n"
    yield "Hi Dana,\n"
    while True:
        day, minute = rng.choice(("Tue", "Wed", "Thu")), rng.choice(("00", "30"))
        yield rng.choice(((f"Could we move the {topic} discussion to {day} at "
                          f"{rng.randint(9, 16)}:{minute}?"),
                          (f"The numbers for {rng.choice(TOPICS)} came in at "
                          f"{rng.randint(10, 99)}k, {rng.randint(2, 30)}% over plan."),
                          (f"{person(rng)[0]} asked whether the {rng.choice(TOPICS)} still needs "
                          f"sign-off before Friday."),
                          "> " + sentence(rng), ""))


def calendar_rows(rng: random.Random) -> Iterator[str]:
    i = 0
    while True:
        i += 1
        day, hour = rng.randint(30, 34), rng.randint(8, 17)
        date = f"2026-11-{day}" if day <= 30 else f"2026-12-{day - 30:02d}"
        yield (f'{{"id":"evt_{i:04d}","title":"{rng.choice(TOPICS)}","start":"{date}T{hour:02d}'
               f':00:00Z","end":"{date}T{hour + 1:02d}:00:00Z","attendees":["{person(rng)[1]}",'
               f'"{person(rng)[1]}"],"location":"{rng.choice(("Room 4B", "Zoom", "HQ lobby"))}"}}')


def memory_notes(rng: random.Random) -> Iterator[str]:
    """Workspace memory of an assistant: contacts, standing rules, dated facts."""
    yield "# MEMORY.md - Durable Facts and Decisions\n\n## Contacts"
    for _ in range(40):
        name, addr = person(rng)
        pref = rng.choice(("mornings", "afternoons", "async email", "short calls"))
        yield f"- {name} <{addr}>: {rng.choice(TOPICS)}; prefers {pref}"
    yield "\n## Standing rules"
    while True:
        how = rng.choice(("Always", "Never", "Usually"))
        act = rng.choice(("cc", "decline", "accept", "flag", "archive"))
        yield (f"- 2026-{rng.randint(1, 11):02d}-{rng.randint(1, 28):02d}: {how} {act} mail "
               f"about {rng.choice(TOPICS)} from {person(rng)[0]}. {sentence(rng)}")


def sized(lines: Iterator[str], tokens: int, *, at_line: bool = True) -> str:
    """Join lines from the stream until the text reaches `tokens` Qwen3 tokens, then cut it to
    at most `tokens` (at a line end when `at_line`)."""
    text, chars = "", max(16, tokens * 3)
    while True:
        parts = [text] if text else []
        total = len(text)
        while total < chars:
            line = next(lines)
            parts.append(line)
            total += len(line) + 1
        text = "\n".join(parts)
        if count_tokens(text) >= tokens:
            return truncate_to_tokens(text, tokens, at_line=at_line)
        chars = total * 2

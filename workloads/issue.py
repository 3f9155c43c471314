"""The SWE-bench-style issue that W2 (OpenCode) and W3 (Claude Code) both work on.

One seeded scenario: a repository module with a bug, its test file, the issue text, and the
tool outputs an agent sees while fixing it (grep, file reads, a failing then a passing test run).
Sizes are token budgets; the harness-specific wrapping (line numbers, tool-result shapes) is left
to each workload.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from workloads.content import (
    grep_hits,
    ident,
    pytest_module,
    pytest_run,
    pytest_summary,
    python_source,
    sized,
)


@dataclass(frozen=True)
class Issue:
    repo: str
    module: str
    func: str
    text: str
    src_path: str
    tests_path: str
    old: str
    new: str


def make_issue(seed: int) -> Issue:
    rng = random.Random(f"issue-{seed}")
    module = f"{ident(rng).split('_')[1]}s"
    func = f"parse_{module[:-1]}"
    old = "    value = int(text)\n    if value < 0:\n        return 0"
    new = f"    value = int(text)\n    if value < 0:\n        return -{func}(text[1:])"
    text = (f"{func}() silently clamps negative inputs to 0\n\n"
            f"### Description\n`{func}(\"-15\")` returns `0` instead of `-15`. This regressed in "
            f"4.2.0; callers that subtract offsets now get wrong totals.\n\n"
            f"### Steps to reproduce\n"
            f"```python\n>>> from pkg.{module} import {func}\n>>> {func}(\"-15\")\n0\n```\n\n"
            f"### Expected\n`-15`, as in 4.1.x. Please fix it and add a regression test; the "
            f"existing suite in tests/test_{module}.py should keep passing.")
    return Issue("northwind/pkg", module, func, text, f"src/pkg/{module}.py",
                 f"tests/test_{module}.py", old, new)


def source_file(issue: Issue, seed: int, tokens: int, tag: str = "src") -> str:
    """The module under repair (or, with another `tag`, a neighbouring module), with the buggy
    function placed a third of the way in."""
    rng = random.Random(f"{tag}-{seed}")
    body = sized(python_source(rng, issue.module), tokens)
    if tag != "src":
        return body
    lines = body.split("\n")
    at = len(lines) // 3
    buggy = [f"\ndef {issue.func}(text: str) -> int:", f'    """Parse a {issue.module[:-1]}."""',
             issue.old, "    return value"]
    return "\n".join(lines[:at] + buggy + lines[at:])


def tests_file(issue: Issue, seed: int, tokens: int) -> str:
    return sized(pytest_module(random.Random(f"tests-{seed}"), issue.module), tokens)


def grep_output(issue: Issue, seed: int, tokens: int) -> str:
    return sized(grep_hits(random.Random(f"grep-{seed}"), issue.func), tokens)


def test_run(issue: Issue, seed: int, tokens: int, *, passing: bool) -> str:
    """A failing `pytest` run, or a passing `pytest -v` run, of about `tokens` tokens."""
    rng = random.Random(f"pytest-{seed}-{passing}")
    if passing:
        body = sized(_verbose_passes(rng, issue), max(1, tokens - 30))
        n = body.count(" PASSED")
        rule = "=" * 27
        return body + f"\n\n{rule} {n} passed in 4.07s {rule}"
    body = sized(pytest_run(rng, issue.module, 3), max(1, tokens - 80))
    return body + "\n" + pytest_summary(rng, issue.module, 3, rng.randint(80, 300))


def _verbose_passes(rng: random.Random, issue: Issue) -> Iterator[str]:
    yield "============================= test session starts =============================="
    yield "platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0 -- /usr/bin/python3"
    yield f"rootdir: /testbed\ncollected {rng.randint(300, 900)} items\n"
    i = 0
    while True:
        i += 1
        yield (f"{issue.tests_path}::test_{ident(rng)}[{rng.randint(-500, 500)}] PASSED"
               f" [{min(99, i // 9):3d}%]")

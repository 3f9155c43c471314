"""docs/benchmarks.md is a reference, not a journal (issue #21, Docs): at most 200 lines, one
section per benchmark, each with the command that produces it (a fenced block), the date of its
figures (or "Not measured") and a pointer to the journal; every journal page it links exists.
The history stays verbatim under docs/journal/. Bug it catches: the page growing back into a
dated log (it was 1,199 lines, then 353 with session narratives) that nobody can read for the
current figure."""
from __future__ import annotations

import re
from pathlib import Path

from tests.structure.test_import_layers import ROOT

DOC = ROOT / "docs" / "benchmarks.md"
MAX_LINES = 200


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def problems(doc: Path) -> list[str]:
    text = doc.read_text()
    out = []
    if len(text.splitlines()) > MAX_LINES:
        out.append(f"{len(text.splitlines())} lines (at most {MAX_LINES}: move history to "
                   "docs/journal/)")
    secs = sections(text)
    if not secs:
        out.append("no `## ` sections")
    for title, body in secs.items():
        if "```" not in body:
            out.append(f"{title}: no command block")
        if not re.search(r"20\d\d-\d\d-\d\d|Not measured", body):
            out.append(f"{title}: no date")
        if "journal" not in body and "Not measured" not in body:
            out.append(f"{title}: no journal pointer")
    for link in re.findall(r"\]\((journal/[^)]+)\)", text):
        if not (doc.parent / link).exists():
            out.append(f"broken journal link {link}")
    return out


def test_benchmarks_is_a_short_reference() -> None:
    bad = problems(DOC)
    assert not bad, "docs/benchmarks.md:\n" + "\n".join(bad)
    assert len(list((ROOT / "docs" / "journal").glob("20*.md"))) >= 4


def test_the_checker_finds_a_journal_page(tmp_path) -> None:
    (tmp_path / "journal").mkdir()
    good = "# B\n\n## `ft bench x`\n\n```\nft bench x\n```\n\n2026-12-03 ([j](journal/a.md))\n"
    (tmp_path / "journal" / "a.md").write_text("x")
    doc = tmp_path / "b.md"
    doc.write_text(good)
    assert problems(doc) == []
    doc.write_text(good + "\n## a session's run\n\nsome prose\n" + "line\n" * 200)
    assert len(problems(doc)) == 4  # too long, and the new section has no command/date/journal

"""docs/architecture.md's layer table is the layering tests/structure/test_import_layers.py
enforces (`LAYERS`): every package the table names sits in the layer of its row, and every
layer of `LAYERS` has its row naming each of its packages. Bug it catches: the doc and the
enforced order drifting apart (issue 21 found 3 of 10 of the doc's claims false)."""
from __future__ import annotations

import re

from tests.structure.test_import_layers import LAYERS, ROOT, layer_of

ROW = re.compile(r"^\| (\d+) \| ([^|]+) \|")


def _table() -> dict[int, list[str]]:
    rows: dict[int, list[str]] = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            paths = re.findall(r"`([^`]+)`", m.group(2))
            rows[int(m.group(1))] = [p.removesuffix(".py").replace("/", ".") for p in paths]
    return rows


def test_the_docs_layer_table_is_the_enforced_layering() -> None:
    rows = _table()
    assert sorted(rows) == list(range(len(LAYERS))), sorted(rows)
    for i, modules in rows.items():
        assert modules, f"row {i} names no package"
        for mod in modules:
            assert layer_of(mod) == i, f"docs/architecture.md puts {mod} in layer {i}; " \
                                       f"LAYERS has it in {layer_of(mod)}"
        for name in LAYERS[i]:
            assert any(m == name or m.startswith(name + ".") for m in modules), \
                f"layer {i}'s {name} is missing from its row in docs/architecture.md"

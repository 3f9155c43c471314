"""The `EngineClient` Protocol (types/api.py) lists every member the server reads of the engine
it fronts (issue #21 rewrite rule): `engine.X`, `st.engine.X`, `self.engine.X` and
`getattr(<...>engine, "X", ...)` anywhere in freetoken/server. And the engine the CLI builds
(`AsyncEngine`) has each of them. Bug it catches: the server reaching for an engine member no
contract names (`rebuild_vram`, read by /ft/v1/control/vram, was missing), so a second engine
(the proxy's, a fake) cannot know what to provide."""
from __future__ import annotations

import ast
from pathlib import Path

from freetoken.engine.async_engine import AsyncEngine
from freetoken.types.api import EngineClient
from tests.structure.test_import_layers import ROOT


def _is_engine(node: ast.AST) -> bool:
    s = ast.unparse(node)
    return s == "engine" or s.endswith(".engine")


def engine_members_read(paths: list[Path]) -> dict[str, str]:
    """member -> one file reading it."""
    out: dict[str, str] = {}
    for p in paths:
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) \
                    and _is_engine(n.value):
                out.setdefault(n.attr, p.name)
            elif isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("getattr",
                                                                              "hasattr") \
                    and len(n.args) >= 2 and _is_engine(n.args[0]) \
                    and isinstance(n.args[1], ast.Constant):
                out.setdefault(n.args[1].value, p.name)
    return out


def protocol_members() -> set[str]:
    return {n for n in vars(EngineClient) if not n.startswith("_")} \
        | set(EngineClient.__annotations__)


def test_the_protocol_names_every_member_the_server_reads() -> None:
    read = engine_members_read(sorted((ROOT / "freetoken" / "server").rglob("*.py")))
    assert {"max_context", "start", "resize_experts"} <= set(read)  # the scan sees reads
    missing = {m: f for m, f in read.items() if m not in protocol_members()}
    assert not missing, f"engine members the server reads but EngineClient lacks: {missing}"


def test_the_served_engine_has_every_member() -> None:
    members = protocol_members() - set(EngineClient.__annotations__)  # methods
    assert not [m for m in members if not callable(getattr(AsyncEngine, m, None))]
    attrs = set(EngineClient.__annotations__)  # set in AsyncEngine.__init__ or by cli/build
    src = (ROOT / "freetoken" / "engine" / "async_engine.py").read_text() \
        + (ROOT / "freetoken" / "cli" / "build.py").read_text()
    assert not [a for a in attrs if f".{a} =" not in src and f".{a}:" not in src
                and f"def {a}" not in src]


def test_the_scan_finds_planted_reads(tmp_path) -> None:
    p = tmp_path / "r.py"
    p.write_text('st.engine.stats()\nx = getattr(self.engine, "rebuild_vram", None)\n'
                 'engine.max_context\nother.thing\n')
    assert set(engine_members_read([p])) == {"stats", "rebuild_vram", "max_context"}

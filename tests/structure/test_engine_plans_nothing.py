"""The scheduler plans every step; the engine executes (issue #21, item 3).

No module of freetoken/engine allocates KV, edits what a request holds (its KV row, computed
prefix, tree node, state slot, tokens) or applies a stop rule: those are the scheduler's
(`Scheduler.schedule`, `scheduler/overlap.py:schedule_ahead`, `scheduler/finish.py`). Bug it
catches: `EngineCore._launch_ahead` allocating the overlapped step's KV and appending to its
requests' rows, and `_on_token` holding the stop rules and counting `computed` itself.
"""
from __future__ import annotations

import ast

from tests.structure.test_import_layers import ROOT

# what a request holds (scheduler/request.py) and only the scheduler writes
HOLDINGS = {"row", "computed", "tree_len", "node", "state_slot", "ids", "num_generated",
            "snap_points", "prompt_len"}
# the scheduler's decisions
PLANNING_CALLS = {"alloc_kv", "accept_token", "is_stop", "ends_by_length_next"}
EXEMPT = {
    # the single-request oracle keeps its own loop and stop rule, independent of the
    # scheduler it is tested against
    "generate.py": {"is_stop"},
    # the KV pool's compaction at a safe point renumbers every slot a request holds
    "elastic.py": {"row"},
    # and the state pool's compaction renumbers the state slot a running request holds
    "elastic_state.py": {"state_slot"},
}


def planning_in(tree: ast.AST) -> list[tuple[str, str]]:
    """(what, source) of every write of a holding and every planning call in `tree`."""
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for x in ast.walk(t):
                if isinstance(x, ast.Attribute) and x.attr in HOLDINGS \
                        and isinstance(x.ctx, ast.Store):
                    out.append((x.attr, ast.unparse(node)))
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in PLANNING_CALLS:
                out.append((name, ast.unparse(node)))
            if isinstance(f, ast.Attribute) and f.attr == "append" \
                    and isinstance(f.value, ast.Attribute) and f.value.attr in HOLDINGS:
                out.append((f.value.attr, ast.unparse(node)))
    return out


def test_the_engine_plans_nothing() -> None:
    bad = []
    for p in sorted((ROOT / "freetoken" / "engine").glob("*.py")):
        allowed = EXEMPT.get(p.name, set())
        bad += [f"{p.name}: {src}" for what, src in planning_in(ast.parse(p.read_text()))
                if what not in allowed]
    assert not bad, "planning in the engine (the scheduler's job):\n" + "\n".join(bad)


def test_the_finder_finds_planted_planning() -> None:
    """The checker itself can fail: each planted form is found, reads are not."""
    src = ("r.row = torch.cat([r.row, s])\nr.computed += 1\nit.req.ids.append(t)\n"
           "sched.cache.alloc_kv(3)\naccept_token(r, t, 9)\nx = r.computed + r.row[0]\n")
    assert [w for w, _ in planning_in(ast.parse(src))] == ["row", "computed", "ids",
                                                            "alloc_kv", "accept_token"]


def tuple_messages(tree: ast.AST) -> list[str]:
    """`<...>inbox.put((...))`: an untyped message into an engine inbox."""
    return [ast.unparse(n) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("put", "put_nowait") and ast.unparse(n.func.value).endswith("inbox")
            and n.args and isinstance(n.args[0], ast.Tuple)]


def test_the_thread_bridge_sends_typed_messages() -> None:
    """AsyncEngine's inbox carries `Add`/`Abort`/`Call`/`Stop` records (issue #21 target:
    "thread bridge with typed inbox messages"), not ("op", a, b) tuples unpacked by position."""
    bad = [f"{p.relative_to(ROOT)}: {s}" for top in ("freetoken", "tests")
           for p in sorted((ROOT / top).rglob("*.py"))
           for s in tuple_messages(ast.parse(p.read_text(), str(p)))]
    assert not bad, "untyped inbox messages:\n" + "\n".join(bad)
    assert tuple_messages(ast.parse('self._inbox.put(("stop", None, None))'))

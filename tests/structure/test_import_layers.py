"""Package layering: no import cycle between packages, and the bottom layer imports nothing above.

Walks every module's imports with `ast` (imports inside functions count, `if TYPE_CHECKING:`
blocks do not: they never run). A package is `freetoken.X`, `kernels.X`, `workloads` or
`harness_adapters`. Bug it catches: `cache/policy.py` importing `Anchor` from `engine.api` while
`engine` imports `cache` (the cycle issue 9 found), or any new one like it.
"""
from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("freetoken", "kernels", "workloads", "harness_adapters")
# the bottom layer and what it may import (besides the standard library and third parties)
BOTTOM = {"freetoken.types": set(), "freetoken.log": set()}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in TOPS:
        return None
    return ".".join(parts[:2]) if parts[0] in ("freetoken", "kernels") and len(parts) > 1 \
        else parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[str]:
    """Absolute names of every module `path` imports at run time."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for sub in node.body for n in ast.walk(sub)}
    mod = module_name(path)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".")[: None if path.name == "__init__.py" else -1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            out.append(base)
            out += [f"{base}.{a.name}" for a in node.names]  # `from freetoken import engine`
    return out


def package_graph() -> dict[str, dict[str, str]]:
    """package -> {imported package: one module that imports it (for the failure message)}."""
    graph: dict[str, dict[str, str]] = {}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            src = package_of(module_name(path))
            if src is None:
                continue
            edges = graph.setdefault(src, {})
            for target in imported_modules(path):
                dst = package_of(target)
                exists = dst and ((ROOT / dst.replace(".", "/")).exists()
                                  or (ROOT / (dst.replace(".", "/") + ".py")).exists())
                if dst and dst != src and exists:
                    edges.setdefault(dst, f"{path.relative_to(ROOT)} imports {target}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative-free DFS; the graph is small)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in graph.get(v, {}):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (c := visit(w)):
                return c
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (c := visit(v)):
            return c
    return None


def test_no_import_cycle_between_packages() -> None:
    graph = package_graph()
    cycle = find_cycle(graph)
    why = [] if cycle is None else [graph[a][b] for a, b in itertools.pairwise(cycle)]
    assert cycle is None, "package import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(why)


def test_bottom_layer_imports_nothing_above_it() -> None:
    graph = package_graph()
    for pkg, allowed in BOTTOM.items():
        extra = {d: w for d, w in graph.get(pkg, {}).items() if d not in allowed}
        assert not extra, f"{pkg} must import no project package: {extra}"


def test_cycle_finder_finds_a_planted_cycle() -> None:
    """The checker itself can fail: a two-package loop and a three-package loop are found."""
    assert find_cycle({"a": {"b": ""}, "b": {"a": ""}}) == ["a", "b", "a"]
    c = find_cycle({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}})
    assert c is not None and c[0] == c[-1] and set(c) == {"a", "b", "c"}
    assert find_cycle({"a": {"b": ""}, "b": {}, "c": {"a": "", "b": ""}}) is None

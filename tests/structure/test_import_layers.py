"""Package layering: no import cycle between packages or files, the layer order (LAYERS, the
table of docs/architecture.md) with `TYPE_CHECKING` imports counted, and the bottom layer
importing nothing above.

Walks every module's imports with `ast` (imports inside functions count, and so do
`if TYPE_CHECKING:` blocks: a type import is a dependency all the same, issue #21 acceptance
2). A package is `freetoken.X`, `freetoken.kernels.X`, `workloads` or `harness_adapters`. Bug it
catches: `cache/policy.py` importing `Anchor` from `engine.api` while `engine` imports `cache`
(the cycle issue 9 found), or any new one like it.
"""
from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("freetoken", "workloads", "harness_adapters")
KERNELS = "freetoken.kernels"
# the bottom layer and what it may import (besides the standard library and third parties)
BOTTOM = {"freetoken.types": set(), "freetoken.log": set()}


def package_of(module: str) -> str | None:
    if (module + ".").startswith("freetoken.cli.options."):
        return "freetoken.cli.options"  # its own layer: the flag groups `bench` may import
    parts = module.split(".")
    if parts[0] not in TOPS:
        return None
    if (module + ".").startswith(KERNELS + ".") and len(parts) > 2:
        return ".".join(parts[:3])  # freetoken.kernels.cpu, .triton, .dispatch, ...
    return ".".join(parts[:2]) if parts[0] == "freetoken" and len(parts) > 1 else parts[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_graph() -> dict[str, dict[str, str]]:
    """package -> {imported package: one module that imports it (for the failure message)}."""
    graph: dict[str, dict[str, str]] = {}
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            src = package_of(module_name(path))
            if src is None:
                continue
            edges = graph.setdefault(src, {})
            for target in all_imports(path):
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


# -- the layer order (issue #21, acceptance 1-2) --------------------------------------------------
# Every module belongs to one layer; a module imports only from its own layer or those below,
# `if TYPE_CHECKING:` imports included (a type import is a dependency all the same). From
# `freetoken/cli/`, `bench` may import only `cli/options.py` (the shared flag groups): the rest
# of `cli` is above `bench`.
LAYERS: list[tuple[str, ...]] = [
    ("freetoken.types", "freetoken.log", "freetoken.envs"),
    (KERNELS,),
    ("freetoken.cache", "freetoken.checkpoint", "freetoken.sampler", "freetoken.chat",
     "harness_adapters"),
    ("freetoken.experts",),
    ("freetoken.layers",),
    ("freetoken.models",),
    ("freetoken.scheduler",),
    ("freetoken.engine",),
    ("freetoken.server", "freetoken.proxy"),
    ("freetoken.cli.options",),
    ("freetoken.bench",),
    ("freetoken.cli",),
]


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest prefix naming `module` (None: not layered)."""
    best, rank = -1, None
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best:
                best, rank = len(n), i
    return rank


def all_imports(path: Path) -> list[str]:
    """Absolute names of every module `path` imports, `if TYPE_CHECKING:` blocks included."""
    tree = ast.parse(path.read_text(), str(path))
    mod = module_name(path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".")[: None if path.name == "__init__.py" else -1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            out.append(base)
            out += [f"{base}.{a.name}" for a in node.names]
    return out


def _project_modules() -> dict[str, Path]:
    return {module_name(p): p for top in TOPS for p in sorted((ROOT / top).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to (`from pkg import thing` names a module or an
    attribute of pkg), or None outside the project."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def layer_violations() -> list[str]:
    modules = _project_modules()
    bad = []
    for mod, path in modules.items():
        src = layer_of(mod)
        for target in all_imports(path):
            dst_mod = _resolve(target, modules)
            if dst_mod is None or dst_mod == mod:
                continue
            dst = layer_of(dst_mod)
            rel = path.relative_to(ROOT)
            if (mod + ".").startswith(KERNELS + ".") and dst_mod.startswith("freetoken") \
                    and not (dst_mod + ".").startswith(KERNELS + ".") \
                    and dst_mod != "freetoken.envs":
                bad.append(f"{rel} imports {dst_mod} (kernels import only freetoken.envs)")
            elif mod.startswith("harness_adapters") and dst_mod.startswith("freetoken") \
                    and layer_of(dst_mod) != 0 or (mod.startswith("harness_adapters")
                                                   and dst_mod in ("freetoken.log",
                                                                   "freetoken.envs")):
                bad.append(f"{rel} imports {dst_mod} (harness_adapters import only "
                           "freetoken.types)")
            elif mod.startswith("workloads") and dst_mod.startswith("freetoken") \
                    and dst_mod != "freetoken.log":
                bad.append(f"{rel} imports {dst_mod} (workloads import only the logger)")
            elif src is not None and dst is not None and dst > src:
                bad.append(f"{rel} imports {dst_mod} (layer {LAYERS[dst][0]} above "
                           f"{LAYERS[src][0]})")
    return bad


def file_circle() -> list[str] | None:
    """One circle of project files importing each other (TYPE_CHECKING included), or None."""
    modules = _project_modules()
    graph: dict[str, dict[str, str]] = {}
    for mod, path in modules.items():
        edges = graph.setdefault(mod, {})
        for target in all_imports(path):
            dst = _resolve(target, modules)
            # a package's __init__ importing its own submodules is not a circle of files
            if dst and dst != mod and not (path.name == "__init__.py"
                                           and dst.startswith(mod + ".")):
                edges.setdefault(dst, "")
    return find_cycle(graph)


def test_layer_order() -> None:
    bad = layer_violations()
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_file_circle() -> None:
    circle = file_circle()
    assert circle is None, "files importing each other: " + " -> ".join(circle or [])


def test_layer_of_names_each_layer() -> None:
    """The checker itself: the rank of a few modules, and a planted upward import is found."""
    assert layer_of("freetoken.types.config") == 0
    assert layer_of("freetoken.kernels.triton.router") == 1
    assert layer_of("freetoken.cli.options") < layer_of("freetoken.bench.moe") \
        < layer_of("freetoken.cli.serve")
    assert layer_of("freetoken.experts.runtime") < layer_of("freetoken.models.qwen")
    assert layer_of("scripts.x") is None


# -- the team's layer picture (issue #21, acceptance 2) -------------------------------------------
# Rules the layer order alone does not give: the HTTP front doors sit above `experts` but never
# reach into it (they talk to the engine through `EngineClient`); `experts` sits below `models`
# and `layers` and never reaches up, by type either (the MoEHost protocol stands for the model).
FORBIDDEN: list[tuple[str, str]] = [
    ("freetoken.server", "freetoken.experts"),
    ("freetoken.proxy", "freetoken.experts"),
    ("freetoken.experts", "freetoken.models"),
    ("freetoken.experts", "freetoken.layers"),
]


def forbidden_imports(rules: list[tuple[str, str]]) -> list[str]:
    modules = _project_modules()
    bad = []
    for mod, path in modules.items():
        for src, dst_pkg in rules:
            if not (mod == src or mod.startswith(src + ".")):
                continue
            for target in all_imports(path):
                dst = _resolve(target, modules)
                if dst and (dst == dst_pkg or dst.startswith(dst_pkg + ".")):
                    bad.append(f"{path.relative_to(ROOT)} imports {dst} ({src} never imports "
                               f"{dst_pkg})")
    return bad


def test_server_never_imports_experts_and_experts_never_import_models() -> None:
    bad = forbidden_imports(FORBIDDEN)
    assert not bad, "\n".join(bad)


def test_forbidden_imports_finds_a_real_edge() -> None:
    """The checker itself can fail: an edge that exists (engine -> experts) is found."""
    assert any("freetoken/engine/core.py" in b
               for b in forbidden_imports([("freetoken.engine", "freetoken.experts")]))


# -- the module side takes only a block's parts from `experts` (issue #21: "models/loader.py
# builds the module only") --------------------------------------------------------------------
# `layers` and `models` may import from `experts` what an MoE block is made of: the backend
# contract, the FFN paths and the resident `FusedExperts`. The runtime (MoERuntime, the backend
# registry and classes, store, slot cache, bridge, ...) is composed with the module above both
# (cli/build.py `load_with_experts`), by type too. Bug it catches: the loader building the
# MoERuntime itself again (models/loader.py importing experts.runtime), which puts the
# composition inside `models` and lets the model own its runtime.
BLOCK_PARTS = {"freetoken.experts.base", "freetoken.experts.ffn", "freetoken.experts.fused"}
MODULE_SIDE = ("freetoken.layers", "freetoken.models")


def expert_imports_beyond(allowed: set[str], sources: tuple[str, ...] = MODULE_SIDE) -> list[str]:
    """'file imports module' for each import of `freetoken.experts` by `sources` outside
    `allowed` (`if TYPE_CHECKING:` blocks included)."""
    modules = _project_modules()
    bad = []
    for mod, path in modules.items():
        if not any(mod == s or mod.startswith(s + ".") for s in sources):
            continue
        for target in all_imports(path):
            dst = _resolve(target, modules)
            if dst and (dst + ".").startswith("freetoken.experts.") and dst not in allowed:
                bad.append(f"{path.relative_to(ROOT)} imports {dst}")
    return bad


def test_models_and_layers_import_no_expert_runtime() -> None:
    bad = expert_imports_beyond(BLOCK_PARTS)
    assert not bad, ("the module side imports the expert runtime (compose it in cli/build.py):\n"
                     + "\n".join(bad))


def test_expert_imports_beyond_finds_a_real_edge() -> None:
    """The checker itself can fail: with nothing allowed, the model's real imports of a
    block's parts are found (gpt_oss.py builds its blocks on `FusedExperts`)."""
    assert any("freetoken/models/gpt_oss.py imports freetoken.experts.fused" in b
               for b in expert_imports_beyond(set()))

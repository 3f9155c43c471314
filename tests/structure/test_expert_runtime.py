"""The expert backend is constructed, not assembled (issue #21, item 1 and acceptance 3).

- No modal `.active` flag in freetoken/experts or freetoken/engine: a backend's mode travels
  with the call (`MoEStep.mode`), never as a switch another object toggles.
- No expert runtime riding on the model: `moe_runtime`, `forward_hooks`, `_ft_private` appear
  nowhere in freetoken/.
- Nothing outside `MoERuntime.install`/`uninstall` (experts/runtime.py) assigns a block's
  `experts`, an attribute of a backend (`b.experts.x = ...`) or another object's `bridge`: a
  backend is built complete by `create_backend`, a model builds its own `self.experts`.
- The decode runner (engine/graph_*.py, decode_staging.py) imports no experts module: it asks
  the runtime it is given.

Bugs they catch: the installers of issue #21 (`experts/setup.py` and `cpu_bridge.attach_bridge`
setting `b.experts.*` and `e.bridge` after construction, `bridge.active` toggled by the graph
runner), and the benches nulling `b.experts.gate_up_proj` (now `FusedExperts.release_banks`).
"""
from __future__ import annotations

import ast
import re

from tests.structure.test_import_layers import ROOT, _project_modules, _resolve, all_imports

FREETOKEN = ROOT / "freetoken"
INSTALLER = FREETOKEN / "experts" / "runtime.py"  # MoERuntime.install / uninstall
RUNNER = ("graph_runner.py", "graph_capture.py", "graph_faults.py", "decode_staging.py")


def outside_assignments(tree: ast.AST) -> list[str]:
    """Assignments to `X.experts`, `X.experts.<attr>` or `X.bridge` where X is not `self`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for t in targets:
            for x in ast.walk(t):
                if not (isinstance(x, ast.Attribute) and isinstance(x.ctx, ast.Store)):
                    continue
                chain = ast.unparse(x).split(".")
                if chain[0] == "self" and len(chain) == 2:
                    continue  # an object's own attribute (`self.experts = FusedExperts(..)`)
                if chain[-1] in ("experts", "bridge") or "experts" in chain[1:-1]:
                    out.append(ast.unparse(node))
    return out


def test_no_active_flag_in_experts_or_engine() -> None:
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
           for pkg in ("experts", "engine") for p in sorted((FREETOKEN / pkg).rglob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"\.active\b", line)]
    assert not bad, "modal .active flags (the mode travels as MoEStep.mode):\n" + "\n".join(bad)


def test_no_runtime_rides_on_the_model() -> None:
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(FREETOKEN.rglob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"\b(moe_runtime|forward_hooks|_ft_private)\b", line)]
    assert not bad, "the expert runtime read off the model (EngineCore.moe holds it): " \
        + ", ".join(bad)


def test_only_the_runtime_installs_backends() -> None:
    bad = []
    for p in sorted(FREETOKEN.rglob("*.py")):
        found = outside_assignments(ast.parse(p.read_text(), str(p)))
        if p == INSTALLER:  # install / uninstall set each block's backend, once
            found = [s for s in found if not s.startswith("b.experts = ")]
        bad += [f"{p.relative_to(ROOT)}: {s}" for s in found]
    assert not bad, "a backend assembled from outside:\n" + "\n".join(bad)


def test_the_decode_runner_imports_no_experts_module() -> None:
    modules = _project_modules()
    bad = [f"{name} imports {dst}"
           for name in RUNNER
           for t in all_imports(FREETOKEN / "engine" / name)
           if (dst := _resolve(t, modules)) and dst.startswith("freetoken.experts")]
    assert not bad, "the decode runner must ask the MoERuntime instead:\n" + "\n".join(bad)


def test_every_backend_takes_the_step_with_the_call() -> None:
    """`ExpertBackend.forward(x, topk_ids, step, shared=None, act=None)` for every backend: the
    mode arrives with the call (no `layer` argument, no `forward_with_shared`)."""
    import inspect

    from freetoken.experts import registry
    from freetoken.experts.base import ExpertBackend

    classes = {ExpertBackend} | {c for c in vars(registry).values()
                                 if isinstance(c, type) and issubclass(c, ExpertBackend)}
    assert len(classes) >= 5  # base, fused, offload, split (cpu, hybrid), auto
    for c in classes:
        params = list(inspect.signature(c.forward).parameters)
        assert params[:6] == ["self", "x", "topk_ids", "step", "shared", "act"], (c, params)
        assert not hasattr(c, "forward_with_shared"), c


def test_the_finder_finds_planted_assemblies() -> None:
    """The checker itself can fail: each planted installer form is found, a model's own
    `self.experts` and reads are not."""
    src = ("b.experts.gate_up_proj = None\nblock.experts = OffloadExperts(1)\n"
           "e.bridge = br\nself.experts.cache = c\nself.experts = FusedExperts(1, 1, 1)\n"
           "x = b.experts.down_proj\nself.bridge = None\n")
    assert outside_assignments(ast.parse(src)) == [
        "b.experts.gate_up_proj = None", "block.experts = OffloadExperts(1)", "e.bridge = br",
        "self.experts.cache = c"]

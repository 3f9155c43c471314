"""The CLI composes the product without the lab: no module of `freetoken/cli/` imports
`freetoken.bench` (the dispatcher registers `ft bench` commands by module name, not by import),
and the routing hooks the product installs live below the benches. Bug it catches:
`cli/build.py` importing `bench.routing_trace` / `bench.route_trace` for `--record-routing`
and `--route-trace`, which made `ft serve` depend on the benchmark package (issue #21)."""
from __future__ import annotations

from tests.structure.test_import_layers import ROOT, _project_modules, _resolve, all_imports


def bench_importers_in_cli() -> list[str]:
    modules = _project_modules()
    bad = []
    for mod, path in modules.items():
        if not mod.startswith("freetoken.cli"):
            continue
        for target in all_imports(path):
            dst = _resolve(target, modules)
            if dst and (dst == "freetoken.bench" or dst.startswith("freetoken.bench.")):
                bad.append(f"{path.relative_to(ROOT)} imports {dst}")
    return bad


def test_cli_does_not_import_the_benches() -> None:
    bad = bench_importers_in_cli()
    assert not bad, "the CLI imports bench modules:\n" + "\n".join(bad)


def test_the_routing_hooks_are_importable_from_the_benches_too() -> None:
    """bench modules keep their import surface: the moved hooks are the same objects."""
    from freetoken.bench import route_trace, routing_trace
    from freetoken.models import routing_hooks as h

    assert routing_trace.attach_recorder is h.attach_recorder
    assert routing_trace.RoutingRecorder is h.RoutingRecorder
    assert route_trace.trace_path is h.trace_path
    assert route_trace.install_serve_trace is h.install_serve_trace
    assert route_trace.TraceRouter is h.TraceRouter and route_trace.install_trace is h.install_trace

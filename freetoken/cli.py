"""`ft` command line: thin argument parsing; each subcommand lives in its package.

Every subcommand module exposes `register(subparsers)` which adds its parser and sets
`func=<callable(args) -> int>` as the default. `ft bench X` subcommands register on the
`bench` sub-parser the same way.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# (module, attribute) pairs; a module that is missing or fails to import is reported only when
# its command is used, so one broken optional part never takes down the whole CLI.
_COMMANDS = [
    "freetoken.engine.cli_generate",
    "freetoken.server.cli_serve",
    "freetoken.server.cli_ctl",
    "freetoken.proxy.cli_proxy",
]
_BENCH_COMMANDS = [
    "freetoken.engine.cli_bench_decode",
    "freetoken.experts.cli_bench",
    "freetoken.experts.cli_bench_bw",
    "workloads.cli_bench",
    "freetoken.bench.anchors",
]


def _register_all(modules: list[str], sub: argparse._SubParsersAction) -> None:
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            # a third-party package is missing (e.g. a GPU image without starlette): keep every
            # other command working and say what to install when this one is used
            _unavailable(sub, name.rsplit(".", 1)[-1].removeprefix("cli_"), str(e.name))
            continue
        mod.register(sub)


def _unavailable(sub: argparse._SubParsersAction, command: str, missing: str) -> None:
    def fail(_args: argparse.Namespace) -> int:
        print(f"ft: this command needs the Python package {missing!r}; "
              f"install FreeToken with its dependencies (pip install -e .)", file=sys.stderr)
        return 2

    p = sub.add_parser(command.replace("bench_", ""), help=f"(unavailable: needs {missing})",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=fail)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ft", description="FreeToken: MoE inference for one machine")
    p.add_argument("--log-level", default=os.environ.get("FT_LOG_LEVEL", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)
    _register_all(_COMMANDS, sub)
    bench = sub.add_parser("bench", help="benchmarks (decode, bw, routing, workload, ...)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _register_all(_BENCH_COMMANDS, bench_sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from freetoken.log import setup_logging

    setup_logging(args.log_level)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`ft` command line: thin argument parsing; each subcommand lives in its package.

Every subcommand module exposes `register(subparsers)` which adds its parser and sets
`func=<callable(args) -> int>` as the default. `ft bench X` subcommands register on the
`bench` sub-parser the same way.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from freetoken.envs import FT_LOG_LEVEL

# Subcommand modules. A module listed here that does not exist is a packaging error and fails
# `ft` at once; a module whose *third-party* dependency is missing (a GPU image without
# starlette) is reported only when its command is used, so the other commands keep working.
_COMMANDS = [
    "freetoken.cli.generate",
    "freetoken.cli.serve",
    "freetoken.cli.ctl",
    "freetoken.cli.proxy",
    "freetoken.cli.launch",
    "freetoken.cli.convert",
]
_BENCH_COMMANDS = [
    "freetoken.bench.cli_decode",
    "freetoken.bench.cli_prefill",
    "freetoken.bench.cli_routing",
    "freetoken.bench.cli_bw",
    "workloads.cli_bench",
    "freetoken.bench.cli_anchors",
    "freetoken.bench.cli_checkpoint",
    "freetoken.bench.cli_bench_serve",
    "freetoken.bench.cli_load",
    "freetoken.bench.cli_elastic",
]


def _register_all(modules: list[str], sub: argparse._SubParsersAction) -> None:
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and (name == e.name or name.startswith(e.name + ".")):
                raise ImportError(f"ft: subcommand module {name!r} is missing") from e
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


# The light commands, by name: run as `ft NAME ...` they register only their own parser. The
# full parser imports every subcommand module and through them torch and matplotlib (5.2 s
# for `eval "$(ft launch claude)"` on the 2-core dev machine; 0.3 s with its module alone).
_LIGHT = {"launch": "freetoken.cli.launch", "agent-proxy": "freetoken.cli.proxy",
          "ctl": "freetoken.cli.ctl"}


def _command_of(argv: list[str]) -> str | None:
    """The subcommand `argv` names (after `--log-level X`); None for an option such as -h."""
    it = iter(argv)
    for a in it:
        if a == "--log-level":
            next(it, None)
        elif not a.startswith("--log-level="):
            return None if a.startswith("-") else a
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """ft's parser; given the command line, only the named command's when it is a light one
    (`_LIGHT`), else every command's (`ft --help` lists them all)."""
    p = argparse.ArgumentParser(prog="ft", description="FreeToken: MoE inference for one machine")
    p.add_argument("--log-level", default=FT_LOG_LEVEL.get())
    sub = p.add_subparsers(dest="command", required=True)
    light = _LIGHT.get(_command_of(argv or []) or "")
    if light is not None:
        _register_all([light], sub)
        return p
    _register_all(_COMMANDS, sub)
    bench = sub.add_parser("bench", help="benchmarks (decode, bw, routing, workload, ...)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _register_all(_BENCH_COMMANDS, bench_sub)
    return p


def main(argv: list[str] | None = None) -> int:
    import os

    from freetoken.cli import malloc
    from freetoken.kernels import compile_cache

    try:  # first of all: before any thread has an arena of its own (cli/malloc.py)
        mem = malloc.apply(os.environ)
    except ValueError as e:
        print(f"ft: {e}", file=sys.stderr)
        return 2

    # before any subcommand module (and through it Triton or flashinfer) is imported
    cache = compile_cache.configure()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    from freetoken.log import get_logger, kv, setup_logging

    setup_logging(args.log_level)
    get_logger("cli").info(kv("malloc", **malloc.log_fields(mem)))
    get_logger("warmup").info(kv("compile_cache", dir=cache["dir"], set=",".join(cache["set"]),
                                 kept=",".join(cache["kept"]) or None,
                                 late=",".join(cache["late"]) or None))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

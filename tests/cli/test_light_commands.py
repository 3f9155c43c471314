"""`ft launch`, `ft agent-proxy` and `ft ctl` start without the heavy subcommand modules. Bug
this catches: every `ft` command built the whole parser, importing every subcommand module and
through them torch and matplotlib, so `eval "$(ft launch claude)"` took 5.2 s on the 2-core dev
machine (0.5 s now) and every proxy start paid the same."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken.cli import _command_of, build_parser

ROOT = Path(__file__).parents[2]

_PROBE = """
import sys
from freetoken.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:  # --help
    rc = e.code
print("RESULT", rc, "torch" in sys.modules, "matplotlib" in sys.modules)
"""


@pytest.mark.parametrize("argv", [
    ["launch", "codex", "--proxy", "http://127.0.0.1:9"],
    ["--log-level", "warning", "agent-proxy", "--help"],
    ["ctl", "--help"],
])
def test_light_commands_import_neither_torch_nor_matplotlib(tmp_path: Path, argv) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
           "FT_HARNESS_PREFIX": str(tmp_path / "none")}
    r = subprocess.run([sys.executable, "-c", _PROBE, *argv], env=env, capture_output=True,
                       check=False, text=True, timeout=120)
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT"))
    assert line.split()[1:] == ["0", "False", "False"], (r.stdout[-2000:], r.stderr[-2000:])


def test_a_light_command_gets_its_own_parser_and_the_rest_get_all() -> None:
    assert _command_of(["launch", "claude"]) == "launch"
    assert _command_of(["--log-level", "debug", "ctl", "stats"]) == "ctl"
    assert _command_of(["--log-level=debug", "agent-proxy"]) == "agent-proxy"
    assert _command_of(["-h"]) is None and _command_of([]) is None
    one = build_parser(["launch", "codex"])
    assert one.parse_args(["launch", "codex"]).command == "launch"
    with pytest.raises(SystemExit):  # only launch's parser was built
        one.parse_args(["bench", "bw"])
    full = build_parser([])
    choices = full._subparsers._group_actions[0].choices
    assert {"generate", "serve", "ctl", "agent-proxy", "launch", "convert", "bench"} <= set(choices)
    assert full.parse_args(["ctl", "stats"]).command == "ctl"

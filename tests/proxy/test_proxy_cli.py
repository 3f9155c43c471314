"""`ft agent-proxy` configuration and `ft launch` output."""
from __future__ import annotations

import argparse
import json

import pytest

from freetoken.cli import build_parser, main
from freetoken.cli.proxy import build_config
from freetoken.proxy.config import ProxyConfig, parse_caps
from freetoken.proxy.launch import Limits, plan_for


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["agent-proxy", *argv])


def test_demo_gets_a_default_cap_and_other_models_none() -> None:
    assert build_config(_args(), "http://e").caps == {"*": 256}
    assert build_config(_args("--model", "/m"), "http://e").caps == {}
    cfg = build_config(_args("--upstream", "http://u", "--output-cap", "512",
                             "--output-cap", "claude_code=64", "--step", "drop_metadata=off"),
                       None)
    assert cfg.caps == {"*": 512, "claude_code": 64} and cfg.cap_for("opencode") == 512
    assert cfg.cap_for("claude_code") == 64 and cfg.steps == {"drop_metadata": False}


def test_bad_configuration_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        ProxyConfig()
    with pytest.raises(ValueError, match="positive"):
        ProxyConfig(upstream="http://u", caps={"*": 0})
    with pytest.raises(ValueError, match="HARNESS=N"):
        parse_caps(["claude=lots"])
    with pytest.raises(SystemExit):
        _args("--upstream", "http://u", "--model", "demo")


def test_launch_claude_pins_the_model_and_never_tells_the_cap() -> None:
    plan = plan_for("claude", "http://p:1/", Limits(context=65536, output=16384))
    env = plan.env
    assert env["ANTHROPIC_BASE_URL"] == "http://p:1"
    pinned = {env[k] for k in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                               "ANTHROPIC_DEFAULT_SONNET_MODEL",
                               "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")}
    assert pinned == {"claude-opus-4-8"}
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "65536"
    settings = json.loads(plan.files[".claude/settings.json"])
    assert settings["model"] == "claude-opus-4-8" and settings["env"] == env


def test_launch_cli_dry_run_and_write(tmp_path, capsys) -> None:
    assert main(["launch", "opencode", "--proxy", "http://127.0.0.1:9", "--write",
                 str(tmp_path)]) == 0  # nothing listens on :9: default limits
    assert "opencode.env" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "opencode.json").read_text())
    model = cfg["provider"]["ft"]["models"]["ft-local"]
    assert cfg["provider"]["ft"]["options"]["baseURL"] == "http://127.0.0.1:9/v1"
    assert model["limit"] == {"context": 200000, "output": 32000}
    assert str(tmp_path / "opencode.json") in (tmp_path / "opencode.env").read_text()
    assert main(["launch", "claude", "--dry-run", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    assert "export CLAUDE_CODE_MAX_OUTPUT_TOKENS='2048'" in out
    assert "[1m]" in out and "export ANTHROPIC_MODEL='claude-opus-4-8'" in out

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


def test_keepalive_interval_is_what_the_docs_say() -> None:
    """Issue 28: OpenAI streams sent keep-alives every 10 s where the docs said 5 s. The
    proxy's default (`--ping-s`, ProxyConfig) and ft serve's (KEEPALIVE_S) are the 5 s that
    docs/proxy.md and docs/server.md state."""
    import dataclasses
    from pathlib import Path

    from freetoken.server.sse import KEEPALIVE_S

    field = {f.name: f for f in dataclasses.fields(ProxyConfig)}["ping_s"]
    assert KEEPALIVE_S == field.default == _args("--upstream", "http://u").ping_s == 5.0
    docs = Path(__file__).parents[2] / "docs"
    proxy_md = " ".join((docs / "proxy.md").read_text().split())
    assert "`--ping-s` seconds (5)" in proxy_md and "every 5 s" in proxy_md
    assert "keep-alive every 5 s" in " ".join((docs / "server.md").read_text().split())

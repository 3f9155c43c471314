"""What points each harness at the proxy, as environment variables and config files.

Everything here keeps prompts stable across runs: one pinned model name (Claude Code writes the
model name into its system text and Bash tool description, and `[1m]` changes it), the billing
header off (`CLAUDE_CODE_ATTRIBUTION_HEADER=0`), the real context and output limits (so Claude
Code neither assumes 200K nor asks for 64000 tokens, and OpenCode not 32000), no telemetry.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PINNED_CLAUDE_MODEL = "claude-opus-4-8"
DUMMY_KEY = "sk-ft-local"
HARNESSES = ("claude", "opencode", "openclaw", "mini")


@dataclass
class Limits:
    """Context and output limits told to the harness; `model` is what the harness asks for."""

    context: int = 200000
    output: int | None = None
    model: str = "ft-local"


@dataclass
class LaunchPlan:
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # relative path -> content
    command: str = ""
    notes: list[str] = field(default_factory=list)

    def shell(self) -> str:
        lines = [f"export {k}={_q(v)}" for k, v in self.env.items()]
        lines += [f"# {n}" for n in self.notes]
        if self.command:
            lines.append(f"# then run: {self.command}")
        return "\n".join(lines)


def _q(v: str) -> str:
    return "'" + v.replace("'", "'\"'\"'") + "'"


def claude(proxy: str, lim: Limits) -> LaunchPlan:
    model = PINNED_CLAUDE_MODEL
    env = {
        "ANTHROPIC_BASE_URL": proxy, "ANTHROPIC_API_KEY": DUMMY_KEY,
        "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model, "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(lim.context),
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(lim.context),
        "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
    }
    if lim.output:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(lim.output)
    settings = {"model": model, "env": env}
    return LaunchPlan(env, {".claude/settings.json": json.dumps(settings, indent=2) + "\n"},
                      f"claude --model {model}",
                      [(f"model pinned to {model} (never {model}[1m]): the system text stays "
                       "the same across --continue")])


def opencode(proxy: str, lim: Limits) -> LaunchPlan:
    limit: dict[str, Any] = {"context": lim.context, "output": lim.output or 4096}
    cfg = {"$schema": "https://opencode.ai/config.json", "autoupdate": False,
           "share": "disabled", "model": f"ft/{lim.model}", "small_model": f"ft/{lim.model}",
           "provider": {"ft": {"npm": "@ai-sdk/openai-compatible", "name": "FreeToken",
                               "options": {"baseURL": proxy + "/v1", "apiKey": DUMMY_KEY},
                               "models": {lim.model: {"name": lim.model, "reasoning": True,
                                                      "tool_call": True, "limit": limit}}}}}
    return LaunchPlan({"OPENCODE_CONFIG": "opencode.json"},
                      {"opencode.json": json.dumps(cfg, indent=2) + "\n"},
                      f"opencode run -m ft/{lim.model} '...'",
                      ["limit.output keeps OpenCode from asking for 32000 tokens"])


def openclaw(proxy: str, lim: Limits) -> LaunchPlan:
    cfg = {"agents": {"defaults": {"model": {"primary": f"ft/{lim.model}"}}},
           "models": {"mode": "replace", "providers": {"ft": {
               "baseUrl": proxy + "/v1", "apiKey": DUMMY_KEY, "api": "openai-completions",
               "models": [{"id": lim.model, "name": lim.model, "reasoning": True,
                           "input": ["text"], "cost": {"input": 0, "output": 0, "cacheRead": 0,
                                                       "cacheWrite": 0},
                           "contextWindow": lim.context, "maxTokens": lim.output or 8192}]}}}}
    return LaunchPlan({"OPENCLAW_CONFIG_PATH": "openclaw.json"},
                      {"openclaw.json": json.dumps(cfg, indent=2) + "\n"},
                      "openclaw agent --local -m '...'")


def mini(proxy: str, lim: Limits) -> LaunchPlan:
    env = {"OPENAI_API_BASE": proxy + "/v1", "OPENAI_BASE_URL": proxy + "/v1",
           "OPENAI_API_KEY": DUMMY_KEY, "MSWEA_COST_TRACKING": "ignore_errors",
           "MSWEA_CONFIGURED": "true"}
    yaml = (f"model:\n  model_name: openai/{lim.model}\n  model_kwargs:\n"
            f"    max_tokens: {lim.output or 4096}\n    api_base: {proxy}/v1\n")
    return LaunchPlan(env, {"mini.yaml": yaml}, f"mini -m openai/{lim.model} -y",
                      ["litellm sends no max_tokens unless told; mini.yaml sets it"])


BUILDERS = {"claude": claude, "opencode": opencode, "openclaw": openclaw, "mini": mini}


def plan_for(harness: str, proxy: str, lim: Limits) -> LaunchPlan:
    if harness not in BUILDERS:
        raise ValueError(f"unknown harness {harness!r}; known: {list(BUILDERS)}")
    return BUILDERS[harness](proxy.rstrip("/"), lim)

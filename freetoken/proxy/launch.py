"""What points each harness at the proxy, as environment variables and config files.

Everything here keeps prompts stable across runs: one pinned model name (Claude Code writes the
model name into its system text and Bash tool description, and `[1m]` changes it), the billing
header off (`CLAUDE_CODE_ATTRIBUTION_HEADER=0`), the real context and output limits (so Claude
Code neither assumes 200K nor asks for 64000 tokens, and OpenCode not 32000), no telemetry.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetoken.envs import FT_HARNESS_PREFIX

PINNED_CLAUDE_MODEL = "claude-opus-4-8"
DUMMY_KEY = "sk-ft-local"
HARNESSES = ("claude", "opencode", "openclaw", "mini", "codex")
MINI_CONFIG_ENV = "FREETOKEN_MINI_CONFIG"  # ft-model.yaml, for `mini -c mini.yaml -c "$..."`
CODEX_KEY_ENV = "FREETOKEN_CODEX_KEY"  # the variable Codex's provider entry reads its key from
DIR = "{dir}"  # stands for the config directory in env values and commands until rendered


def config_dir(harness: str) -> Path:
    """Where `eval "$(ft launch H)"` writes H's files: $XDG_CONFIG_HOME/freetoken/launch/H."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "freetoken" / "launch" / harness


def harness_bin_dir() -> Path:
    """PREFIX/bin of scripts/install_harnesses.sh (FT_HARNESS_PREFIX, default
    $XDG_CACHE_HOME/freetoken/harnesses)."""
    prefix = FT_HARNESS_PREFIX.get()
    if not prefix:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        prefix = str(Path(base) / "freetoken" / "harnesses")
    return Path(prefix) / "bin"


def find_harness(binary: str) -> str | None:
    """The harness binary on PATH, else the one scripts/install_harnesses.sh installed."""
    found = shutil.which(binary)
    if found:
        return found
    local = harness_bin_dir() / binary
    return str(local) if local.is_file() and os.access(local, os.X_OK) else None


@dataclass
class Limits:
    """Context and output limits told to the harness; `model` is what the harness asks for."""

    context: int = 200000
    output: int | None = None
    model: str = "ft-local"
    cap: int | None = None  # the proxy's output cap for this harness, if any


@dataclass
class LaunchPlan:
    """`files` are written into one directory; `{dir}` in env values and the command stands
    for it (`rendered` substitutes the real path)."""

    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # relative path -> content
    command: str = ""
    notes: list[str] = field(default_factory=list)
    binary: str = ""

    def rendered(self, d: Path) -> LaunchPlan:
        ds = str(d.resolve())
        sub = lambda v: v.replace(DIR, ds)
        return LaunchPlan({k: sub(v) for k, v in self.env.items()},
                          {k: sub(v) for k, v in self.files.items()}, sub(self.command),
                          list(self.notes), self.binary)

    def write(self, d: Path) -> list[Path]:
        out = []
        for rel, text in self.files.items():
            f = d / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
            out.append(f)
        return out

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
    # the env alone configures Claude Code; settings.json holds the same for `--settings`
    return LaunchPlan(env, {".claude/settings.json": json.dumps(settings, indent=2) + "\n"},
                      f"claude --model {model}",
                      [(f"model pinned to {model} (never {model}[1m]): the system text stays "
                       "the same across --continue")], "claude")


def opencode(proxy: str, lim: Limits) -> LaunchPlan:
    out = lim.cap or lim.output or 4096  # OpenCode sends limit.output as its max_tokens
    limit: dict[str, Any] = {"context": lim.context, "output": out}
    cfg = {"$schema": "https://opencode.ai/config.json", "autoupdate": False,
           "share": "disabled", "model": f"ft/{lim.model}", "small_model": f"ft/{lim.model}",
           "provider": {"ft": {"npm": "@ai-sdk/openai-compatible", "name": "FreeToken",
                               "options": {"baseURL": proxy + "/v1", "apiKey": DUMMY_KEY},
                               "models": {lim.model: {"name": lim.model, "reasoning": True,
                                                      "tool_call": True, "limit": limit}}}}}
    # no update check, no models.dev fetch, no sharing: runs offline and the same every time
    env = {"OPENCODE_CONFIG": f"{DIR}/opencode.json", "OPENCODE_DISABLE_AUTOUPDATE": "1",
           "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_SHARE": "1"}
    return LaunchPlan(env,
                      {"opencode.json": json.dumps(cfg, indent=2) + "\n"},
                      f"opencode run -m ft/{lim.model} '...'",
                      [(f"limit.output = {out}: OpenCode asks for that many tokens per reply "
                       "(32000 unless told)")], "opencode")


def openclaw(proxy: str, lim: Limits) -> LaunchPlan:
    cfg = {"agents": {"defaults": {"model": {"primary": f"ft/{lim.model}"}}},
           "models": {"mode": "replace", "providers": {"ft": {
               "baseUrl": proxy + "/v1", "apiKey": DUMMY_KEY, "api": "openai-completions",
               "models": [{"id": lim.model, "name": lim.model, "reasoning": True,
                           "input": ["text"], "cost": {"input": 0, "output": 0, "cacheRead": 0,
                                                       "cacheWrite": 0},
                           "contextWindow": lim.context, "maxTokens": lim.output or 8192}]}}}}
    return LaunchPlan({"OPENCLAW_CONFIG_PATH": f"{DIR}/openclaw.json",
                       "OPENCLAW_NO_AUTO_UPDATE": "1"},
                      {"openclaw.json": json.dumps(cfg, indent=2) + "\n"},
                      "openclaw agent --local --session-id NAME -m '...'",
                      [("the same --session-id continues a conversation; OpenClaw needs "
                        "Node >= 24.16")], "openclaw")


def mini(proxy: str, lim: Limits) -> LaunchPlan:
    env = {"OPENAI_API_BASE": proxy + "/v1", "OPENAI_BASE_URL": proxy + "/v1",
           "OPENAI_API_KEY": DUMMY_KEY, "MSWEA_COST_TRACKING": "ignore_errors",
           "MSWEA_CONFIGURED": "true", MINI_CONFIG_ENV: f"{DIR}/ft-model.yaml"}
    out = lim.cap or lim.output or 4096
    yaml = (f"model:\n  model_name: openai/{lim.model}\n  model_kwargs:\n"
            f"    max_tokens: {out}\n    api_base: {proxy}/v1\n")
    # mini merges every -c in order and uses its built-in mini.yaml only when none is given:
    # name it first, then this file's model section on top (alone it has no agent templates);
    # the file is also exported as $FREETOKEN_MINI_CONFIG, so the README's command needs no path
    return LaunchPlan(env, {"ft-model.yaml": yaml},
                      f'mini -c mini.yaml -c "${MINI_CONFIG_ENV}" -y -t \'...\'',
                      [f"litellm sends no max_tokens unless told; ft-model.yaml sets {out}"],
                      "mini")


def codex(proxy: str, lim: Limits) -> LaunchPlan:
    """Codex (0.171: Responses API only) through a provider entry in CODEX_HOME/config.toml,
    as in the recorded session's config (tests/data/harness_traces/codex)."""
    toml = "\n".join([
        "# written by ft launch codex: Codex against ft agent-proxy (Responses API)",
        f'model = "{lim.model}"', 'model_provider = "ft"',
        f"model_context_window = {lim.context}",  # (0.171 has no output-limit setting)
        "check_for_update_on_startup = false", "",
        "[model_providers.ft]", 'name = "FreeToken"', f'base_url = "{proxy}/v1"',
        f'env_key = "{CODEX_KEY_ENV}"', 'wire_api = "responses"', "",
        "[analytics]", "enabled = false", ""])
    env = {"CODEX_HOME": DIR, CODEX_KEY_ENV: DUMMY_KEY}
    return LaunchPlan(env, {"config.toml": toml}, "codex exec '...'  (or: codex)",
                      [("CODEX_HOME is this directory: Codex keeps its sessions there too "
                       "(codex exec resume --last continues one)")], "codex")


BUILDERS = {"claude": claude, "opencode": opencode, "openclaw": openclaw, "mini": mini,
            "codex": codex}


def plan_for(harness: str, proxy: str, lim: Limits) -> LaunchPlan:
    if harness not in BUILDERS:
        raise ValueError(f"unknown harness {harness!r}; known: {list(BUILDERS)}")
    return BUILDERS[harness](proxy.rstrip("/"), lim)

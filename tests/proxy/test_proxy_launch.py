"""`ft launch` as the README prints it (`eval "$(ft launch H)"`), the limits it discovers from
the upstream's own dialect, and the upstream probe. Regressions (issue 28): the eval form
pointed at config files it never wrote (OpenCode `UnknownError`, OpenClaw "No route-compatible
authentication source"), mini's printed command ignored its config (and `-c` alone crashed),
OpenCode was told 32000 output tokens while the note said the limit kept it from asking that,
`ft launch` read the context only from `context_length` (told Claude Code 200k against
llama-server's 40960), and `--upstream-api both` forwarded Anthropic clients into a 404."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_helpers import Server
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from freetoken.cli import build_parser
from freetoken.cli.proxy import build_config
from freetoken.proxy.app import create_proxy_app
from freetoken.proxy.config import ProxyConfig
from freetoken.proxy.launch import Limits, plan_for
from freetoken.proxy.probe import limits_from_models, limits_from_props

ROOT = Path(__file__).parents[2]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _eval(harness: str, tmp: Path, *extra: str, show: str) -> tuple[str, str]:
    """Run `eval "$(ft launch H ...)"` in bash, then print `show` (shell words); returns
    (what ft launch printed, what `show` printed)."""
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp / "cfg"), "PYTHONPATH": str(ROOT),
           "FT_HARNESS_PREFIX": str(tmp / "none")}
    ft = (f"{sys.executable} -m freetoken.cli launch {harness} --proxy http://127.0.0.1:9 "
          + " ".join(extra))
    printed = subprocess.run(["bash", "-c", ft], env=env, capture_output=True, text=True,
                             check=True).stdout
    shown = subprocess.run(["bash", "-c", f'eval "$({ft} 2>/dev/null)" && {show}'], env=env,
                           capture_output=True, text=True, check=True).stdout
    return printed, shown


def test_eval_form_writes_what_it_points_at(tmp_path) -> None:
    d = tmp_path / "cfg" / "freetoken" / "launch"
    printed, shown = _eval("opencode", tmp_path, show='cat "$OPENCODE_CONFIG"')
    cfg = json.loads(shown)
    assert cfg["provider"]["ft"]["options"]["baseURL"] == "http://127.0.0.1:9/v1"
    assert f"{d / 'opencode' / 'opencode.json'}" in printed and "# then run: opencode" in printed
    _, shown = _eval("openclaw", tmp_path, show='cat "$OPENCLAW_CONFIG_PATH"')
    assert json.loads(shown)["models"]["providers"]["ft"]["apiKey"]
    printed, shown = _eval("codex", tmp_path, show='cat "$CODEX_HOME/config.toml"; '
                           'echo "KEY=$FREETOKEN_CODEX_KEY"')
    toml = tomllib.loads(shown.split("KEY=")[0])
    prov = toml["model_providers"][toml["model_provider"]]
    assert prov["wire_api"] == "responses" and prov["base_url"] == "http://127.0.0.1:9/v1"
    assert shown.split("KEY=")[1].strip(), "the provider's env_key is exported"
    assert "codex exec" in printed
    printed, _ = _eval("claude", tmp_path, show="true")
    assert "export ANTHROPIC_BASE_URL='http://127.0.0.1:9'" in printed
    assert "not found on PATH" in printed or "not found" not in printed


def test_mini_command_uses_its_config_on_top_of_the_builtin(tmp_path) -> None:
    printed, shown = _eval("mini", tmp_path, show='echo "$OPENAI_API_BASE"; '
                           'echo "$FREETOKEN_MINI_CONFIG"')
    cmd = next(line for line in printed.splitlines() if line.startswith("# then run:"))
    path = tmp_path / "cfg" / "freetoken" / "launch" / "mini" / "ft-model.yaml"
    # mini uses its built-in mini.yaml only when no -c is given: name it, then ours on top
    assert '-c mini.yaml -c "$FREETOKEN_MINI_CONFIG"' in cmd, cmd
    assert "max_tokens:" in path.read_text()
    assert shown.split() == ["http://127.0.0.1:9/v1", str(path)]


def test_write_dir_stays(tmp_path, capsys) -> None:
    from freetoken.cli import main

    assert main(["launch", "codex", "--proxy", "http://127.0.0.1:9", "--write",
                 str(tmp_path)]) == 0
    env = dict(line.removeprefix("export ").split("=", 1)
               for line in (tmp_path / "codex.env").read_text().splitlines())
    assert json.loads(env["CODEX_HOME"]) == str(tmp_path.resolve())
    assert (tmp_path / "config.toml").is_file()


def test_opencode_and_mini_are_told_the_cap() -> None:
    oc = json.loads(plan_for("opencode", "http://p", Limits(context=40960, output=10240,
                                                            cap=256)).files["opencode.json"])
    assert oc["provider"]["ft"]["models"]["ft-local"]["limit"] == {"context": 40960,
                                                                   "output": 256}
    mini = plan_for("mini", "http://p", Limits(output=10240, cap=512)).files["ft-model.yaml"]
    assert "max_tokens: 512" in mini
    # Claude Code is told the room, never the cap (its own limit reached is an error there)
    cc = plan_for("claude", "http://p", Limits(context=40960, output=10240, cap=256)).env
    assert cc["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "10240"


def test_limits_in_each_engines_dialect() -> None:
    assert limits_from_models({"data": [{"id": "a", "context_length": 65536}]})[:2] == (65536,
                                                                                        None)
    assert limits_from_models({"data": [{"id": "v", "max_model_len": 32768}]})[0] == 32768
    llama = {"data": [{"id": "q.gguf", "meta": {"n_ctx_train": 262144, "n_ctx": 40960}}]}
    assert limits_from_models(llama) == (40960, None, "q.gguf")
    assert limits_from_models({"data": []}) == (None, None, None)
    assert limits_from_props({"default_generation_settings": {
        "n_ctx": 40960, "params": {"n_predict": -1}}}) == (40960, None)


def _llama_like() -> Server:
    """An upstream with llama.cpp's dialect and no /v1/messages."""
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        if not body.get("messages"):
            return JSONResponse({"error": {"message": "messages required"}}, 400)
        extra = ({"timings": {"cache_n": 7, "prompt_n": 2}}
                 if "with-timings" in json.dumps(body["messages"]) else {})
        return JSONResponse({**extra, "id": "c1", "object": "chat.completion", "model": "q",
                             "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                 "role": "assistant", "content": "hello from upstream"}}],
                             "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                       "total_tokens": 12}})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "q.gguf", "object": "model",
                                                         "meta": {"n_ctx_train": 262144}}]})

    async def props(request: Request) -> JSONResponse:
        return JSONResponse({"default_generation_settings": {"n_ctx": 40960}})

    return Server(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                    Route("/v1/models", models), Route("/props", props)]))


def test_proxy_probes_and_translates_for_a_missing_messages_surface(tmp_path) -> None:
    up = _llama_like()
    proxy = Server(create_proxy_app(ProxyConfig(upstream=up.url, caps={"*": 8192},
                                                metrics_path=str(tmp_path / "m.jsonl"))))
    try:
        r = httpx.post(proxy.url + "/v1/messages", json={
            "model": "x", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"] == "hello from upstream"
        lim = httpx.get(proxy.url + "/proxy/stats").json()["upstream_limits"]
        assert lim["surfaces"] == {"anthropic": False}
        assert lim["context"] == 40960 and lim["model"] == "q.gguf"
        from freetoken.cli.launch import _ask_proxy

        assert _ask_proxy(proxy.url, "claude")[0] == 40960  # what ft launch tells Claude Code
        # no cache counter upstream: reuse unknown, not 0; llama.cpp's timings.cache_n read
        st = httpx.get(proxy.url + "/proxy/stats").json()["harnesses"]["generic"]
        assert st["cached_unknown"] == 1 and st["cached_ratio"] is None
        httpx.post(proxy.url + "/v1/chat/completions", json={
            "model": "x", "max_tokens": 99999, "messages": [{"role": "user",
                                                          "content": "with-timings"}]})
        recs = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
        assert recs[0]["cached_tokens"] is None and recs[0]["max_tokens_sent"] == 50
        assert recs[1]["cached_tokens"] == 7
        assert recs[1]["max_tokens_requested"] == 99999 and recs[1]["max_tokens_sent"] == 8192
    finally:
        proxy.stop()
        up.stop()


def test_the_upstream_is_probed_at_start_and_later_if_it_was_not_up(tmp_path) -> None:
    """`ft agent-proxy --upstream` probes before serving (issue 28 item 7: "probed at
    start"), so the proxy's /v1/models has the upstream's limits before any request; an
    upstream not up yet leaves the probe to the first request instead of caching nothing."""
    from freetoken.cli.proxy import free_port

    up = _llama_like()
    try:
        app = create_proxy_app(ProxyConfig(upstream=up.url, caps={"*": 8192},
                                           metrics_path=str(tmp_path / "m.jsonl")))
        info = app.app.state.proxy.probe_at_start()
        assert info is not None and app.app.state.proxy.info is info
        assert info.surfaces == {"anthropic": False} and info.context == 40960
    finally:
        up.stop()
    down = create_proxy_app(ProxyConfig(upstream=f"http://127.0.0.1:{free_port()}",
                                        metrics_path=str(tmp_path / "n.jsonl")))
    assert down.app.state.proxy.probe_at_start() is None
    assert down.app.state.proxy.info is None  # asked again at the first request


def test_upstream_mode_has_a_default_cap_and_metrics_honour_xdg(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = build_parser().parse_args(["agent-proxy", "--upstream", "http://u"])
    cfg = build_config(args, None)
    assert cfg.caps == {"*": 8192}
    assert cfg.metrics_path == str(tmp_path / "freetoken" / "proxy.jsonl")
    doc = (ROOT / "docs" / "proxy.md").read_text()
    assert "8192 with `--upstream`" in doc


def test_ttft_counts_from_the_first_token_not_the_first_chunk() -> None:
    """Regression: upstream TTFT read 14-104 ms for 7,000-token prompts: it was taken at the
    OpenAI role-only first chunk (sent before prefill) or any first event."""
    from freetoken.proxy.probe import carries_token

    role = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                           "content": ""}}]})
    tok = json.dumps({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    call = json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    assert not carries_token("openai", None, role) and not carries_token("openai", None,
                                                                        "[DONE]")
    assert carries_token("openai", None, tok) and carries_token("openai", None, call)
    assert not carries_token("anthropic", "message_start", "{}")
    assert not carries_token("anthropic", "content_block_start", "{}")
    assert carries_token("anthropic", "content_block_delta", "{}")


def _no_limits_upstream() -> Server:
    """llama-cpp-python's dialect: /v1/models names the model, no limits anywhere; a prompt
    that does not fit gets its server's 400 (llama_cpp/server/errors.py's wording)."""
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        if "long" in json.dumps(body["messages"]):
            return JSONResponse({"error": {
                "message": "This model's maximum context length is 2048 tokens. However, you "
                           "requested 3100 tokens (3000 in the messages, 100 in the "
                           "completion). Please reduce the length of the messages or "
                           "completion.", "type": "invalid_request_error",
                "param": "messages", "code": "context_length_exceeded"}}, 400)
        return JSONResponse({"id": "c1", "object": "chat.completion", "model": "m",
                             "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                 "role": "assistant", "content": "ok"}}],
                             "usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                       "total_tokens": 10}})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model",
                                                         "owned_by": "me"}]})

    return Server(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                    Route("/v1/models", models)]))


def test_context_learned_from_the_upstreams_context_error(tmp_path) -> None:
    from freetoken.cli.launch import _ask_proxy
    from freetoken.proxy.probe import context_from_error

    assert context_from_error("Requested tokens (3000) exceed context window of 2048") == 2048
    assert context_from_error("upstream: messages required") is None
    up = _no_limits_upstream()
    proxy = Server(create_proxy_app(ProxyConfig(upstream=up.url, metrics_path=None)))
    try:
        msg = {"model": "m", "max_tokens": 100}
        ok = httpx.post(proxy.url + "/v1/messages", json={**msg, "messages": [
            {"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text
        assert _ask_proxy(proxy.url, "claude")[0] is None  # nothing to discover yet
        r = httpx.post(proxy.url + "/v1/messages", json={**msg, "messages": [
            {"role": "user", "content": "long"}]})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert "2048" in r.json()["error"]["message"]
        assert _ask_proxy(proxy.url, "claude")[0] == 2048  # what ft launch tells Claude Code
    finally:
        proxy.stop()
        up.stop()


def test_eval_form_finds_a_harness_the_install_script_put_off_path(tmp_path) -> None:
    """README: `scripts/install_harnesses.sh` installs into PREFIX/bin, off PATH, and
    `eval "$(ft launch H)" && H` runs it: the eval'd env puts PREFIX/bin on PATH."""
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    fake = prefix / "bin" / "codex"
    fake.write_text("#!/bin/sh\necho installed-codex\n")
    fake.chmod(0o755)
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"  # no harness on it
    env = {"PATH": path, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
           "PYTHONPATH": str(ROOT), "FT_HARNESS_PREFIX": str(prefix)}
    ft = f"{sys.executable} -m freetoken.cli launch codex --dry-run"
    out = subprocess.run(["bash", "-c", f'eval "$({ft})" && command -v codex && codex'],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(fake), "installed-codex"], out
    printed = subprocess.run(["bash", "-c", ft], env=env, capture_output=True, text=True,
                             check=True).stdout
    assert "not found" not in printed
    (prefix / "bin" / "codex").unlink()  # not installed: the note names the script
    printed = subprocess.run(["bash", "-c", ft], env=env, capture_output=True, text=True,
                             check=True).stdout
    assert "scripts/install_harnesses.sh installs it" in printed
    assert "export PATH" not in printed


_FAKE = """#!{py}
# a stand-in for the harness: every config it is pointed at must exist
import os, sys
args = sys.argv[1:]
for i, a in enumerate(args[:-1]):
    if a == "-c" and args[i + 1] != "mini.yaml" and "=" not in args[i + 1]:
        assert os.path.isfile(args[i + 1]), args[i + 1]
for var in ("OPENCODE_CONFIG", "OPENCLAW_CONFIG_PATH", "FREETOKEN_MINI_CONFIG"):
    if var in os.environ:
        assert os.path.isfile(os.environ[var]), (var, os.environ[var])
if os.path.basename(sys.argv[0]) == "mini":  # mini reads no config from the env: -c it
    assert os.environ.get("FREETOKEN_MINI_CONFIG") in args, args
if "CODEX_HOME" in os.environ:
    assert os.path.isfile(os.path.join(os.environ["CODEX_HOME"], "config.toml"))
print("RAN", os.path.basename(sys.argv[0]), *args)
"""


def test_readme_launch_lines_run_as_printed(tmp_path) -> None:
    """Every `eval "$(ft launch H)" && COMMAND` line of README.md and docs/proxy.md, run in
    bash as printed (`ft` on PATH, the harness a stand-in in the install script's PREFIX/bin,
    off PATH, no proxy running): the eval'd env finds the harness, and every config file the
    command or the env names exists. Regression (issue 28): mini's README command ignored the
    config `ft launch mini` wrote."""
    import re

    prefix, bindir = tmp_path / "prefix", tmp_path / "ftbin"
    (prefix / "bin").mkdir(parents=True)
    bindir.mkdir()
    for name in ("claude", "opencode", "openclaw", "mini", "codex"):
        f = prefix / "bin" / name
        f.write_text(_FAKE.replace("{py}", sys.executable))
        f.chmod(0o755)
    ft = bindir / "ft"
    ft.write_text(f'#!/bin/sh\nexec {sys.executable} -m freetoken.cli "$@"\n')
    ft.chmod(0o755)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path),
           "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "PYTHONPATH": str(ROOT),
           "FT_HARNESS_PREFIX": str(prefix)}
    seen = set()
    for doc in ("README.md", "docs/proxy.md"):
        for line in (ROOT / doc).read_text().splitlines():
            m = re.match(r'eval "\$\(ft launch (\w+)\)" && (.*?)(?:\s+#.*)?$', line)
            if not m:
                continue
            harness, cmd = m.groups()
            p = subprocess.run(["bash", "-c", f'eval "$(ft launch {harness})" && {cmd}'],
                               check=False, env=env, capture_output=True, text=True,
                               timeout=60)
            assert p.returncode == 0, (doc, line, p.stdout, p.stderr)
            runs = [x for x in p.stdout.splitlines() if x.startswith("RAN ")]
            assert runs and all(x.split()[1] == cmd.split()[0] for x in runs), (line, p.stdout)
            seen.add(harness)
    assert seen == {"claude", "opencode", "openclaw", "mini", "codex"}, seen

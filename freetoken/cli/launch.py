"""`ft launch claude|opencode|openclaw|mini|codex [--proxy URL] [--write DIR] [--dry-run]`:
point a harness at the proxy. `eval "$(ft launch H)"` writes H's config files into
`config_dir(H)` ($XDG_CONFIG_HOME/freetoken/launch/H), exports the variables that point at
them, and prints the command to run (as a comment); `--write DIR` writes the files and an
`H.env` into DIR instead. Limits come from the running proxy (its upstream's context and
output room in whatever dialect the upstream reports them, its output cap for that harness)
unless given or unreachable."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ADAPTER_OF = {"claude": "claude_code", "opencode": "opencode", "openclaw": "openclaw",
              "mini": "swe_agent", "codex": "codex"}


def register(subparsers: argparse._SubParsersAction) -> None:
    from freetoken.proxy.launch import HARNESSES

    p = subparsers.add_parser("launch", help="write the config and print the env that point "
                              "a harness at ft agent-proxy")
    p.add_argument("harness", choices=HARNESSES)
    p.add_argument("--proxy", default="http://127.0.0.1:8080")
    p.add_argument("--dry-run", action="store_true",
                   help="do not ask the proxy for its limits; use defaults")
    p.add_argument("--write", default=None, metavar="DIR",
                   help="write the config files and HARNESS.env there (default: "
                        "$XDG_CONFIG_HOME/freetoken/launch/HARNESS, env printed)")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--max-output", type=int, default=None)
    p.set_defaults(func=run_launch)


def _ask_proxy(url: str, harness: str) -> tuple[int | None, int | None, int | None, str | None]:
    """(context, output room, cap, model name) from a running proxy, None where unknown."""
    import httpx

    from freetoken.proxy.probe import limits_from_models

    try:
        with httpx.Client(timeout=3) as c:
            models = c.get(url + "/v1/models").json()
            st = c.get(url + "/proxy/stats").json()
    except (httpx.HTTPError, ValueError):
        print(f"# proxy at {url} not reachable: default limits", file=sys.stderr)
        return None, None, None, None
    caps = st.get("caps") or {}
    cap = caps.get(ADAPTER_OF[harness], caps.get("*"))
    up: dict[str, Any] = st.get("upstream_limits") or {}  # what the proxy probed at start
    ctx, out, name = limits_from_models(models if isinstance(models, dict) else {})
    return (up.get("context") or ctx, up.get("max_output") or out, cap,
            up.get("model") or name)


def run_launch(args: argparse.Namespace) -> int:
    from freetoken.proxy.launch import Limits, config_dir, find_harness, harness_bin_dir, plan_for

    url = args.proxy.rstrip("/")
    ctx = room = cap = name = None
    if not args.dry_run:
        ctx, room, cap, name = _ask_proxy(url, args.harness)
    context = args.context or ctx or 200000
    # Claude Code is told the model's own output room, never the proxy's cap: a reply the
    # proxy cuts at its cap ends as a normal turn, while one that reaches the client's own
    # limit is an error there ("response exceeded the N output token maximum"). OpenCode,
    # mini and Codex send their limit as max_tokens: they are told the cap.
    output = args.max_output or room or min(32000, max(1024, context // 4))
    plan = plan_for(args.harness, url, Limits(context=context, output=output,
                                              model=name or "ft-local", cap=cap))
    if cap:
        plan.notes.append(f"the proxy caps each reply at {cap} tokens and ends it as a "
                          "normal turn (ft agent-proxy --output-cap)")
    d = Path(args.write) if args.write else config_dir(args.harness)
    plan = plan.rendered(d)
    env = dict(plan.env)
    found = find_harness(plan.binary)
    if found and Path(found).parent == harness_bin_dir():  # installed by the script, off PATH
        env["PATH"] = f"{harness_bin_dir()}:$PATH"
    elif not found:
        plan.notes.append(f"{plan.binary} not found on PATH or in {harness_bin_dir()}: "
                          "scripts/install_harnesses.sh installs it")
    written = plan.write(d)
    if args.write:
        (d / f"{args.harness}.env").write_text("".join(
            f"export {k}={json.dumps(v)}\n" for k, v in env.items()))  # PATH expands
        print(f"wrote {', '.join([*plan.files, args.harness + '.env'])} to {d}; "
              f"then: . {d}/{args.harness}.env && {plan.command}")
        return 0
    lines = [f"export {k}={_shell_value(k, v)}" for k, v in env.items()]
    lines.append(f"# ft launch {args.harness}: wrote {', '.join(str(f) for f in written)}")
    lines += [f"# {n}" for n in plan.notes]
    lines.append(f"# then run: {plan.command}")
    print("\n".join(lines))
    return 0


def _shell_value(key: str, v: str) -> str:
    from freetoken.proxy.launch import _q

    return json.dumps(v) if key == "PATH" else _q(v)  # PATH: expanded by the shell

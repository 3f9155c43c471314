"""`ft launch claude|opencode|openclaw|mini [--proxy URL] [--dry-run | --write DIR]`: print (or
write) what points a harness at the proxy. Limits come from the running proxy (its model's
context, its output cap for that harness) unless given or unreachable."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ADAPTER_OF = {"claude": "claude_code", "opencode": "opencode", "openclaw": "openclaw",
              "mini": "swe_agent"}


def register(subparsers: argparse._SubParsersAction) -> None:
    from freetoken.proxy.launch import HARNESSES

    p = subparsers.add_parser("launch", help="print or write the env/config that points a "
                              "harness at ft agent-proxy")
    p.add_argument("harness", choices=HARNESSES)
    p.add_argument("--proxy", default="http://127.0.0.1:8080")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--dry-run", action="store_true",
                   help="do not ask the proxy for its limits; print defaults")
    g.add_argument("--write", default=None, metavar="DIR", help="write the config files there")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--max-output", type=int, default=None)
    p.set_defaults(func=run_launch)


def _ask_proxy(url: str, harness: str) -> tuple[int | None, int | None, str | None]:
    import httpx

    try:
        with httpx.Client(timeout=3) as c:
            models = c.get(url + "/v1/models").json().get("data") or []
            st = c.get(url + "/proxy/stats").json()
    except (httpx.HTTPError, ValueError):
        print(f"# proxy at {url} not reachable: default limits", file=sys.stderr)
        return None, None, None
    caps = st.get("caps") or {}
    cap = caps.get(ADAPTER_OF[harness], caps.get("*"))
    ctx = models[0].get("context_length") if models else None
    return ctx, cap, (models[0].get("id") if models else None)


def run_launch(args: argparse.Namespace) -> int:
    from freetoken.proxy.launch import Limits, plan_for

    url = args.proxy.rstrip("/")
    ctx = cap = name = None
    if not args.dry_run:
        ctx, cap, name = _ask_proxy(url, args.harness)
    context = args.context or ctx or 200000
    # the harness is told the model's own output room, never the proxy's cap: a reply the
    # proxy cuts at its cap ends as a normal turn, while one that reaches the client's own
    # limit is an error in Claude Code ("response exceeded the N output token maximum")
    output = args.max_output or min(32000, max(1024, context // 4))
    plan = plan_for(args.harness, url, Limits(context=context, output=output,
                                              model=name or "ft-local"))
    if cap:
        plan.notes.append(f"the proxy caps each reply at {cap} tokens and ends it as a "
                          "normal turn (ft agent-proxy --output-cap)")
    if args.write:
        d = Path(args.write)
        for rel, text in plan.files.items():
            f = d / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
        env = dict(plan.env)
        for k, v in env.items():  # config paths relative to DIR
            if v in plan.files:
                env[k] = str((d / v).resolve())
        (d / f"{args.harness}.env").write_text(
            "".join(f"export {k}={json.dumps(v)}\n" for k, v in env.items()))
        print(f"wrote {', '.join([*plan.files, args.harness + '.env'])} to {d}; "
              f"then: . {d}/{args.harness}.env && {plan.command}")
        return 0
    print(plan.shell())
    for rel, text in plan.files.items():
        print(f"# --- {rel} (ft launch {args.harness} --write DIR writes it) ---")
        print("\n".join("# " + line for line in text.splitlines()))
    return 0

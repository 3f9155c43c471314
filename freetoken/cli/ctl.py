"""`ft ctl`: control a running `ft serve` (re-budget the GPU expert cache, rebuild the expert
cache and KV pool together, read stats)."""
from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ctl", help="control a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None,
                   help="the server's key (visible in `ps`: prefer --api-key-file or FT_API_KEY)")
    p.add_argument("--api-key-file", default=None, help="read the key from this file")
    sub = p.add_subparsers(dest="ctl_command", required=True)
    e = sub.add_parser("experts", help="re-budget the GPU expert cache without a restart")
    g = e.add_mutually_exclusive_group(required=True)
    g.add_argument("--slots", type=int)
    g.add_argument("--rate", type=float, help="fraction of the expert pool")
    g.add_argument("--mem", type=int, help="bytes")
    e.set_defaults(func=_experts)
    v = sub.add_parser("vram", help="rebuild the expert cache, the KV pool and the state "
                                    "pool now (elastic VRAM)")
    v.add_argument("--expert-slots", type=int, default=None)
    v.add_argument("--kv-tokens", type=int, default=None)
    v.add_argument("--state-slots", type=int, default=None,
                   help="device recurrent-state slots (models with linear attention)")
    v.set_defaults(func=_vram)
    s = sub.add_parser("stats", help="print /v1/stats")
    s.set_defaults(func=_stats)


def _headers(args: argparse.Namespace) -> dict[str, str]:
    import os

    from freetoken.server.front_options import api_key_from

    key = api_key_from(args, dict(os.environ), "ft ctl")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _experts(args: argparse.Namespace) -> int:
    import httpx

    body = {k: getattr(args, k) for k in ("slots", "rate", "mem") if getattr(args, k) is not None}
    r = httpx.post(args.url + "/ft/v1/control/experts", json=body, headers=_headers(args),
                   timeout=600)
    print(json.dumps(r.json(), indent=1))
    return 0 if r.status_code == 200 else 1


def _vram(args: argparse.Namespace) -> int:
    import httpx

    body = {k: getattr(args, k) for k in ("expert_slots", "kv_tokens", "state_slots")
            if getattr(args, k) is not None}
    r = httpx.post(args.url + "/ft/v1/control/vram", json=body, headers=_headers(args),
                   timeout=600)
    print(json.dumps(r.json(), indent=1))
    return 0 if r.status_code == 200 else 1


def _stats(args: argparse.Namespace) -> int:
    import httpx

    r = httpx.get(args.url + "/v1/stats", headers=_headers(args), timeout=30)
    print(json.dumps(r.json(), indent=1))
    return 0 if r.status_code == 200 else 1



"""The front door's command-line flags, the same for `ft serve` and `ft agent-proxy` (one
`Guard`, one set of knobs), and where keys come from: `--api-key`, `--api-key-file` or the
FT_API_KEY environment variable (at most one), and the same file form for any other key
(`--upstream-api-key-file`, `ft ctl --api-key-file`), so keys need not be on a command line
that `ps` shows."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken.envs import FT_API_KEY

if TYPE_CHECKING:
    from freetoken.server.limits import ServerLimits


def add_front_door_args(p: argparse.ArgumentParser, what: str = "server") -> None:
    """`--api-key`, `--api-key-file`, `--allowed-hosts` and the connection limits."""
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' or 'x-api-key: KEY' of every "
                        f"client of this {what} (visible in `ps`: prefer --api-key-file or the "
                        "FT_API_KEY environment variable)")
    p.add_argument("--api-key-file", default=None,
                   help="read that API key from this file (first line)")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated extra host names accepted in Host and Origin headers "
                        "('*' accepts any); localhost names and the bound address always are")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body")
    p.add_argument("--max-connections", type=int, default=512,
                   help="open connections past which new ones get 503 and are closed (after "
                        "evicting the oldest connection that has sent no request)")
    p.add_argument("--max-connections-per-client", type=int, default=256,
                   help="open connections from one client address past which new ones get 503")
    p.add_argument("--stall-timeout", type=float, default=30.0,
                   help="seconds a streaming client may take none of the bytes queued to it "
                        "before its request is aborted and its slot freed")
    p.add_argument("--stall-unread-kb", type=float, default=32,
                   help="KiB queued unread towards a streaming client past which its request "
                        "is aborted (its own receive buffer comes on top)")


def key_file(path: str, flag: str, prog: str = "ft") -> str:
    """The first line of `path` (SystemExit for an unreadable or empty file)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise SystemExit(f"{prog}: cannot read {flag}: {e}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise SystemExit(f"{prog}: {flag} {path} is empty")
    return key


def api_key_from(args: argparse.Namespace, environ: dict[str, str],
                 prog: str = "ft serve") -> str | None:
    """The key from --api-key, else --api-key-file, else FT_API_KEY; at most one may be given
    (SystemExit otherwise, or for an unreadable or empty file)."""
    given = [n for n, v in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file),
                            (FT_API_KEY.name, FT_API_KEY.get(environ))) if v]
    if len(given) > 1:
        raise SystemExit(f"{prog}: give the API key one way, not {' and '.join(given)}")
    if args.api_key_file:
        return key_file(args.api_key_file, "--api-key-file", prog)
    return args.api_key or FT_API_KEY.get(environ) or None


def other_key(value: str | None, path: str | None, flag: str, prog: str) -> str | None:
    """A key given as `--X` or `--X-file` (not both)."""
    if value and path:
        raise SystemExit(f"{prog}: give {flag} or {flag}-file, not both")
    return key_file(path, flag + "-file", prog) if path else value


def limits_from(args: argparse.Namespace) -> ServerLimits:
    from freetoken.server.limits import ServerLimits  # uvicorn: not on every `ft` start

    return ServerLimits(
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        max_body_bytes=int(args.max_body_mb * 2**20), max_connections=args.max_connections,
        max_connections_per_client=args.max_connections_per_client,
        stall_timeout_s=args.stall_timeout,
        stall_unread_bytes=int(args.stall_unread_kb * 1024), bound_host=args.host,
        allowed_hosts=[h.strip() for h in args.allowed_hosts.split(",") if h.strip()])

"""HTTP server of `ft serve`: OpenAI, Anthropic and native routes over an `EngineClient`.

`create_app` is imported on first use: `ft agent-proxy` and `ft launch` import this package's
light modules (front_options, auth) without the app, and through it torch."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from freetoken.server.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from freetoken.server.app import create_app

        return create_app
    raise AttributeError(f"module 'freetoken.server' has no attribute {name!r}")

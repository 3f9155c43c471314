"""HTTP server of `ft serve`: OpenAI, Anthropic and native routes over an `EngineClient`."""
from freetoken.server.app import create_app

__all__ = ["create_app"]

"""`ProxyConfig`: everything `ft agent-proxy` was told, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from harness_adapters.normalise import STEPS

DEMO_OUTPUT_CAP = 256  # demo-random never ends a reply on its own; the trained demo's safety net
# --upstream: an engine we do not know may never stop either (Claude Code asks for 64000);
# above the longest legitimate agent turn (a whole-file write, ~8k tokens), below a runaway
# that fills the context; docs/proxy.md "Output limits" gives the reasoning
UPSTREAM_OUTPUT_CAP = 8192


@dataclass
class ProxyConfig:
    """`upstream`: base URL of an OpenAI/Anthropic-compatible server (API mode), or None with
    `native_url` set (our engine, spoken to through /ft/v1/generate). `caps`: output cap per
    harness name, `"*"` for every harness without its own. `steps`: normalisation switches
    overriding the adapters' defaults. `fold_system`: 'auto' (fold mid-conversation system
    messages only when the chat template rejects them), 'keep' or 'fold'. `api_key`: the
    proxy's own key (its clients must send it; distinct from `upstream_api_key`, what the proxy
    sends on). The `*_timeout_s` fields bound each upstream request (see upstream.py)."""

    upstream: str | None = None
    upstream_api: str = "both"
    upstream_api_key: str | None = None
    native_url: str | None = None
    tokenizer_dir: str | None = None
    caps: dict[str, int] = field(default_factory=dict)
    steps: dict[str, bool] = field(default_factory=dict)
    metrics_path: str | None = None
    ping_s: float = 5.0
    force_harness: str | None = None
    fold_system: str = "auto"
    served_model_names: list[str] = field(default_factory=list)
    connect_timeout_s: float = 10.0
    first_byte_timeout_s: float = 300.0
    idle_timeout_s: float = 120.0
    total_timeout_s: float = 1800.0
    api_key: str | None = None
    max_sessions: int = 4096  # per-session metrics kept (LRU), see metrics.Metrics
    session_idle_s: float = 6 * 3600.0  # a session without a request this long is forgotten

    def __post_init__(self) -> None:
        if (self.upstream is None) == (self.native_url is None):
            raise ValueError("give exactly one of upstream (API mode) and native_url (our engine)")
        if self.upstream_api not in ("openai", "anthropic", "both"):
            raise ValueError(f"upstream_api must be openai, anthropic or both, not "
                             f"{self.upstream_api!r}")
        if self.fold_system not in ("auto", "keep", "fold"):
            raise ValueError(f"fold_system must be auto, keep or fold, not {self.fold_system!r}")
        for k, v in self.caps.items():
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"output cap for {k!r} must be a positive integer, got {v!r}")
        unknown = set(self.steps) - set(STEPS)
        if unknown:
            raise ValueError(f"unknown normalisation steps {sorted(unknown)}")
        if self.ping_s <= 0:
            raise ValueError("ping_s must be positive")
        for name in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s",
                     "total_timeout_s", "session_idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")

    @property
    def native(self) -> bool:
        return self.native_url is not None

    def cap_for(self, harness: str) -> int | None:
        return self.caps.get(harness, self.caps.get("*"))


def parse_caps(specs: list[str] | None) -> dict[str, int]:
    """`["256", "claude_code=1024"]` -> {"*": 256, "claude_code": 1024}."""
    out: dict[str, int] = {}
    for spec in specs or []:
        name, _, val = spec.rpartition("=")
        try:
            n = int(val)
        except ValueError:
            raise ValueError(f"--max-output-tokens {spec!r}: expected N or HARNESS=N") from None
        out[name or "*"] = n
    return out

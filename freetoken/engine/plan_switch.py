"""The decode runner's attention plan switched while serving (engine/attention_build.py).

The runner starts on the plan `attention_build.plan_attention` gives it (Triton while
flashinfer's module builds on its own thread). When the build ends, the switch happens at the
runner's next safe point, where no step of the runner is in flight: the launch of an unchained
step (`DecodeRunner.launch`), an idle capture, or an idle warm-up turn. The overlap stops
launching chained steps once a switch is due (engine/in_flight.py), so a long stream reaches
such a point after one more step. The switch loads the module (engine thread), drops every
graph and every bucket's plan (they read the old plan's buffers and kernels) and logs one
`ft.engine: attention_switch` line; each bucket is captured again on the new plan at its next
step, exactly as after a slot-cache resize. A build that failed, or a module that does not
load, keeps the plan the runner has and logs why (`attention_build_failed`,
`attention_load_failed`): never a crash, never a request failed.

`PlanSwitch` is a mixin of `DecodeRunner`: it uses `attention`, `buckets`, `_open`, `_pool`,
`_want_graphs`, `capturable`, `device` and `_drop_graphs`.
"""
from __future__ import annotations

import time

import torch

from freetoken.engine.attention_build import PlanBuild
from freetoken.log import get_logger, kv

log = get_logger("engine")


class PlanSwitch:
    attention: str  # the plan kind the runner decodes with now
    _build: PlanBuild | None  # the plan being built to replace it, if any
    attention_switches: int

    def building(self) -> str | None:
        """The plan kind being built, until the runner switched to it (or gave it up)."""
        return self._build.kind if self._build is not None else None

    def switch_due(self) -> bool:
        """A build has ended (ready or failed): the next safe point settles it."""
        return self._build is not None and self._build.state != "building"

    def at_safe_point(self) -> bool:
        """Settle a build that ended, if no step is in flight; True when the plan changed."""
        b = self._build
        if b is None or b.state == "building" or self._open:
            return False
        self._build = None
        if b.state == "failed":
            log.warning(kv("attention_build_failed", kind=b.kind, seconds=f"{b.seconds:.1f}",
                           error=repr(b.error)[:300], keeping=self.attention))
            return False
        t0 = time.perf_counter()
        try:
            b.load()
        except Exception as e:  # noqa: BLE001  (keep decoding on the plan we have)
            log.warning(kv("attention_load_failed", kind=b.kind, error=repr(e)[:300],
                           keeping=self.attention))
            return False
        old = self.attention
        dropped = self.switch_attention(b.kind)
        log.info(kv("attention_switch", old=old, new=b.kind, build_s=f"{b.seconds:.1f}",
                    load_s=f"{time.perf_counter() - t0:.2f}", graphs_dropped=dropped,
                    recapture="each bucket at its next step"))
        return True

    def finish_build(self, timeout: float | None = None) -> bool:
        """Wait for the build (a blocking warm-up, before serving), then settle it."""
        if self._build is None:
            return False
        self._build.wait(timeout)
        return self.at_safe_point()

    def switch_attention(self, kind: str) -> int:
        """Decode with plan `kind` from the next step (no step may be in flight): every graph
        and bucket plan dropped; returns how many graphs went."""
        assert not self._open, "switch plans only with no step in flight"
        dropped = self._drop_graphs()
        for b in self.buckets.values():
            b.attn = None
        self.attention = kind
        self.use_graphs = self._graphs_allowed()
        if self.use_graphs and self._pool is None and self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        self.attention_switches += 1
        return dropped

    def _graphs_allowed(self) -> bool:
        """Whether the steps may be captured: CUDA, graphs wanted (not turned off by a fault),
        every MoE layer capturable, and a plan that reads the device CSR (not `torch`)."""
        return (self._want_graphs and self.device.type == "cuda" and self.capturable
                and self.attention != "torch")

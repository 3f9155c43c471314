"""Carries out the state ops of a step plan on the state tensors, and holds the host tier.

The scheduler and the cache decide (`freetoken.cache.StateOp`: copy, reset, spill, restore); this
module is the only place that moves recurrent state between slots and tiers. Each op is one
copy per state tensor (conv and ssm of every linear layer), issued in plan order on the current
stream: a device slot a spill frees may be the destination of a later copy in the same list.

The host tier (`host_states.HostStates`) holds whole slots in chunks, pinned when the device is
CUDA (so spills and restores are async DMA) and plain memory otherwise, allocated in the
background after start; on the CPU the same copy code runs, which is what the tests exercise.
"""
from __future__ import annotations

from freetoken.cache import StateOp
from freetoken.cache.tensors import StateTensors
from freetoken.engine.host_states import HostStates
from freetoken.log import get_logger, kv

log = get_logger("engine")


def mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (0 where unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_slots_for(budget_bytes: int | None, slot_bytes: int, device_slots: int) -> int:
    """Host-tier slots for `--state-host-mem` (bytes; None: a quarter of the RAM free now, after
    the model and its expert pool are loaded, at most 16 x the device slots)."""
    if slot_bytes <= 0:
        return 0
    if budget_bytes is None:
        return min(mem_available() // 4 // slot_bytes, 16 * device_slots)
    return max(budget_bytes, 0) // slot_bytes


class CacheOps:
    """Executes `StateOp` lists against the device `StateTensors` and the `HostStates`."""

    def __init__(self, state: StateTensors | None, host: HostStates | None) -> None:
        self.state, self.host = state, host
        self.counts = {"copy": 0, "reset": 0, "spill": 0, "restore": 0}

    def busy(self, flag: bool) -> None:
        """Whether the engine has requests: the host tier's background fill waits while it
        does (engine/host_states.py)."""
        if self.host is not None:
            self.host.busy(flag)

    def run(self, ops: list[StateOp]) -> None:
        if not ops:
            return
        st = self.state
        assert st is not None, "state ops on a model without recurrent state"
        for op in ops:
            if op.kind == "copy":
                pairs = [(c[op.dst], c[op.src]) for c in st.conv + st.ssm]
            elif op.kind == "reset":
                for t in st.conv + st.ssm:
                    t[op.dst].zero_()
                self.counts["reset"] += 1
                continue
            elif op.kind == "spill":
                assert self.host is not None, "spill without a host tier"
                pairs = [(h, d[op.src]) for h, d in zip(self.host.views(op.dst),
                                                        st.conv + st.ssm)]
            elif op.kind == "restore":
                assert self.host is not None, "restore without a host tier"
                pairs = [(d[op.dst], h) for h, d in zip(self.host.views(op.src),
                                                        st.conv + st.ssm)]
            else:
                raise ValueError(f"unknown state op {op.kind!r}")
            # non_blocking from pinned memory is async DMA in stream order; a spill's source is
            # read before any later op (same stream) overwrites it
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            self.counts[op.kind] += 1
        log.debug(kv("state_ops", n=len(ops), kinds=",".join(o.kind for o in ops)))

"""The chunked host tier (`engine/host_states.py`): slot views against a plain reference,
chunk sizing against the pinned allocator's power-of-two rounding, the background fill and
on-demand allocation, and spill/restore through `CacheOps` bit for bit.

Bug it guards: pinning the whole tier at start-up (21 s of the H200 server's start-to-ready,
2026-12-02) and one `[N, ...]` pinned tensor per layer rounded up to a power of two."""
from __future__ import annotations

import threading
from typing import ClassVar

import pytest
import torch

from freetoken.cache import StateOp
from freetoken.engine.cache_ops import CacheOps
from freetoken.engine.host_states import HostStates, chunk_slots_for


class _FakeState:
    """Shapes and dtypes of a StateTensors (what HostStates reads): 2 conv + 2 ssm layers."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.conv = [torch.randn(n, 6, 3, generator=g).to(torch.bfloat16) for _ in range(2)]
        self.ssm = [torch.randn(n, 2, 4, 5, generator=g) for _ in range(2)]


@pytest.mark.parametrize("slot_bytes", [1, 63, 64, 1000, 31 * 2**20 + 7, 3 * 2**26 + 1])
def test_chunk_slots_fill_a_power_of_two_closely(slot_bytes: int) -> None:
    n = chunk_slots_for(slot_bytes)
    total = n * slot_bytes
    p = 1
    while p < total:
        p *= 2
    assert n >= 1 and total >= min(slot_bytes, 64 << 20) and (p - total) / p <= 0.05
    # the fewest such slots: one fewer either misses the target or wastes more
    if n > 1 and (n - 1) * slot_bytes >= 64 << 20:
        q = 1
        while q < (n - 1) * slot_bytes:
            q *= 2
        assert (q - (n - 1) * slot_bytes) / q > 0.05


def test_views_are_disjoint_aligned_and_hold_what_was_written() -> None:
    like = _FakeState(3)
    h = HostStates(like, 7, fill=False, chunk_target=1)  # slot_bytes > target: 1 slot a chunk
    assert h.chunk_slots >= 1 and h.chunks_ready == 0
    ref = {}
    for s in range(7):
        vs = h.views(s)
        assert [v.shape for v in vs] == [t.shape[1:] for t in like.conv + like.ssm]
        assert [v.dtype for v in vs] == [t.dtype for t in like.conv + like.ssm]
        assert all(v.data_ptr() % 64 == 0 for v in vs)
        ref[s] = [torch.full_like(v, float(s + 1 + k)) for k, v in enumerate(vs)]
        for v, r in zip(vs, ref[s]):
            v.copy_(r)
    for s in range(7):  # no slot overwrote another
        for v, r in zip(h.views(s), ref[s]):
            assert torch.equal(v, r)
    assert h.on_demand == h.chunks_ready == len(h._chunks)
    with pytest.raises(IndexError):
        h.views(7)


def test_background_fill_allocates_every_chunk_and_engine_thread_allocates_on_demand() -> None:
    like = _FakeState(2)
    h = HostStates(like, 40, fill=True, chunk_target=1)
    assert h.wait_filled(timeout=30)
    assert h.on_demand == 0 and h.chunks_ready == len(h._chunks) == 40 // h.chunk_slots
    h2 = HostStates(like, 40, fill=False, chunk_target=1)
    h2.views(39)
    assert h2.on_demand == 1 and h2.chunks_ready == 1


def test_concurrent_fill_and_views_allocate_each_chunk_once() -> None:
    like = _FakeState(2)
    h = HostStates(like, 64, fill=False, chunk_target=1)
    seen: list[list[int]] = [[] for _ in range(4)]

    def grab(k: int) -> None:
        for s in range(64):
            seen[k].append(h.views(s)[0].data_ptr())

    ts = [threading.Thread(target=grab, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(seen[k] == seen[0] for k in range(4))  # every thread saw the same buffers
    assert h.on_demand == len(h._chunks)


def test_spill_and_restore_round_trip_bit_for_bit() -> None:
    like = _FakeState(3)  # device slots 0..2
    h = HostStates(like, 5, fill=True)
    ops = CacheOps(like, h)
    want = [t[1].clone() for t in like.conv + like.ssm]
    ops.run([StateOp("spill", 1, 4)])  # device slot 1 -> host slot 4
    for t in like.conv + like.ssm:
        t[1].zero_()
    ops.run([StateOp("restore", 4, 2)])  # host slot 4 -> device slot 2
    for t, w in zip(like.conv + like.ssm, want):
        assert torch.equal(t[2], w)
    assert ops.counts["spill"] == ops.counts["restore"] == 1
    h.close()


def test_background_fill_survives_failed_allocations(monkeypatch) -> None:
    """A pinned allocation the driver refuses for a moment (on the H200: while the engine
    thread captured a graph in "global" mode) is retried; the fill thread used to die on it,
    leaving the rest of the tier to on-demand allocations in requests. Past its tries the fill
    stops and the chunks left still come on demand."""
    import freetoken.engine.host_states as hs

    monkeypatch.setattr(hs, "FILL_RETRY_S", 0.01)

    class Flaky(HostStates):
        fails: ClassVar[dict[int, int]] = {}

        def _alloc(self, nbytes: int) -> torch.Tensor:
            n = sum(c is not None for c in self._chunks)
            if self.fails.get(n, 0) > 0:
                self.fails[n] -= 1
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            return super()._alloc(nbytes)

    like = _FakeState(2)
    Flaky.fails = {3: 2}  # the 4th chunk fails twice, then succeeds
    h = Flaky(like, 40, fill=True, chunk_target=1)
    assert h.wait_filled(timeout=30) and h.on_demand == 0
    Flaky.fails = {2: hs.FILL_TRIES}  # the 3rd chunk never succeeds in the fill's tries
    h2 = Flaky(like, 40, fill=True, chunk_target=1)
    assert not h2.wait_filled(timeout=30) and h2.chunks_ready == 2
    h2.views(39)  # on demand, once the driver allows it again
    assert h2.on_demand == 1 and h2.chunks_ready == 3


def test_background_fill_waits_while_the_engine_has_requests() -> None:
    """Bug this catches: the fill allocating pinned chunks beside decode (each `cudaHostAlloc`
    of ~40 ms holds the driver the engine thread's launches need; paced at half the time, it
    took up to half of every served decode step in a server's first 30 s on the H200). While
    busy no chunk comes from the fill (a spill still gets its chunk on demand); once idle the
    fill completes."""
    like = _FakeState(2)
    h = HostStates(like, 40, fill=False, chunk_target=1)
    h.busy(True)
    h._thread = threading.Thread(target=h._fill, daemon=True)
    h._thread.start()
    h._thread.join(0.4)
    assert h.chunks_ready == 0 and h._thread.is_alive()
    h.views(5)  # a spill while busy: its chunk on demand
    assert h.chunks_ready == 1 and h.on_demand == 1
    h.busy(False)
    assert h.wait_filled(timeout=30) and h.paused_s >= 0.3
    h.close()


def test_the_engine_marks_the_tier_busy_from_admission_to_its_last_step(tiny_hf) -> None:
    from freetoken.engine.core import EngineCore
    from freetoken.models.loader import load_model
    from freetoken.types.api import GenerateRequest, SamplingParams

    model = load_model(tiny_hf("qwen3_5_moe"), dtype=torch.float32, progress=False)
    core = EngineCore(model, [], kv_tokens=256, state_slots=4, max_running=2, chunk_tokens=32,
                      state_host_mem=1 << 20)
    host = core.cache_ops.host
    assert host is not None and host._idle.is_set()
    seen = []
    core.add(GenerateRequest(list(range(3, 20)), SamplingParams(max_tokens=4, temperature=0.0,
                                                                ignore_eos=True),
                             request_id="a"), lambda ev: seen.append(host._idle.is_set()))
    assert not host._idle.is_set()
    while core.has_work():
        core.step()
    assert seen and not any(seen[:-1])  # idle only once the last token's step is done
    assert host._idle.is_set()
    core.add(GenerateRequest(list(range(3, 20)), SamplingParams(max_tokens=50), request_id="b"),
             lambda ev: None)
    core.step()
    core.abort("b")
    assert host._idle.is_set() == (not core.has_work())
    core.close()


def test_fills_still_running_are_stopped_at_exit() -> None:
    """The atexit hook stops every tier's fill: a fill thread inside `cudaHostAlloc` while the
    process tore its C++ runtime down aborted `ft bench prefill --ttft` and `ft bench elastic`
    at exit on the H200 (their engines were never closed)."""
    from freetoken.engine import host_states

    h = HostStates(_FakeState(2), 40, fill=False, chunk_target=1)
    h.busy(True)  # the fill waits for the engine to go idle: it is still running
    t = threading.Thread(target=h._fill, daemon=True)
    h._thread = t
    host_states._FILLING.add(h)
    t.start()
    t.join(0.2)
    assert t.is_alive()
    live = HostStates(_FakeState(2), 3, fill=True, chunk_target=1)  # registered by itself
    assert live in host_states._FILLING
    host_states._stop_fills()
    assert not t.is_alive() and h._thread is None and live._thread is None

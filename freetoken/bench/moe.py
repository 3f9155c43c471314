"""Decode benchmark in a real shape with random weights: every expert backend over one host
store, `fused` (all experts on the GPU) as the upper bound, each printed next to its floor.

The floor of one decode step is the expert bytes it must move from host memory: fetched
experts over the link at B_P, CPU-computed experts read at B_H (overlapped in hybrid), from the
cached `ft bench bw` profile. Routing is the random router of the random weights, or replayed
from a trace (`--route-trace`) to model a trained router's locality.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from freetoken.bench.link_meter import LinkMeter, nvml_rx_reader
from freetoken.bench.route_trace import TraceRouter, install_trace, uniform_trace  # noqa: F401
from freetoken.engine.generate import generate, private_runner
from freetoken.experts.auto import CANDIDATES, DISCARD, WINDOW
from freetoken.experts.runtime import MoERuntime, find_profile
from freetoken.experts.store import ExpertStore
from freetoken.models.qwen import QwenMoE
from freetoken.types.api import SamplingParams
from freetoken.types.config import MoEConfig

AUTO_WARM_ROUNDS = 3  # warm-up rounds `auto`'s guard gets to settle before a timed window
AUTO_WARM_MAX_STEPS = 512  # decode steps a round at most (a guard given a huge window)


@dataclass
class RunResult:
    backend: str
    tok_s: float
    hit_rate: float
    fetch_bytes_tok: float
    cpu_bytes_tok: float
    floor_tok_s: float | None
    note: str = ""  # where a decode step's time went (graph runner timers)
    # bytes a step the GPU received over PCIe by the driver's counter (bench/link_meter.py),
    # the independent check of fetch_bytes_tok; None without NVML
    nvml_bytes_tok: float | None = None
    # experts a step of the timed window: routed (hits + misses, distinct per layer), missed and
    # fetched, and the most a step can route (rows x MoE layers x top-k). Every step keeps
    # fetched <= misses <= routed <= route_bound (offload: fetched == misses); a row that breaks
    # it counted something that is not the window's decode steps (`count_checks`)
    routed_tok: float = 0.0
    misses_tok: float = 0.0
    fetched_tok: float = 0.0
    route_bound: int = 0


def install_backend(model: QwenMoE, store: ExpertStore, backend: str, opts: MoEConfig,
                    device: torch.device) -> MoERuntime:
    """A new expert runtime of `backend` over `store`, installed on every MoE block of
    `model`: `fused` copies every bank to the device (undo with drop_fused); the others build
    the slot cache. Its `cache` is None for `fused`."""
    return MoERuntime.build(model, replace(opts, backend=backend), device, store=store)


def replay_ms(runner, n: int, iters: int = 50) -> float | None:
    """Device time of one replay of bucket n's greedy graph (inputs as last staged), or None
    when it has not been captured: the step's floor with no host work at all. The replays
    write the last staged rows' K/V and state again: for benchmarks, after their run. They
    also route, fetch and count like decode steps (the graph holds the device counters): the
    counts pending before them are folded into the host counters first, theirs are dropped."""
    bk = runner.bucket(n)
    g = bk.graphs.get(True) if bk else None
    if g is None or runner.bridge is not None:  # a bridged step needs its host worker's turn
        return None
    counters = runner.moe.counters if runner.moe is not None else None
    if counters is not None:
        counters.sync()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    b.synchronize()
    if counters is not None:  # (issue 20 item 3: 51 replays counted into 127 decode steps)
        counters.discard_device()
    return a.elapsed_time(b) / iters


def step_note(runner, h0: tuple[float, float, int] | None, cuda_graph: bool) -> str:
    """Where `generate`'s decode steps went, from its runner's timers (`h0`: host_s, wait_s,
    steps before the run), and one graph replay alone timed; "" without a runner (the CPU).
    Runs after the counters' window: the replays route and fetch like decode steps."""
    if runner is None or h0 is None or runner.steps <= h0[2]:
        return ""
    k = runner.steps - h0[2]
    rep = replay_ms(runner, 1) if cuda_graph else None
    note = (f"host {1e3 * (runner.host_s - h0[0]) / k:.3f} ms/step, launch+wait "
            f"{1e3 * (runner.wait_s - h0[1]) / k:.3f} ms/step"
            + (f", graph replay alone {rep:.3f} ms" if rep else ""))
    br = runner.bridge
    if br is not None and br.steps_done:
        note += (f"; CPU branch {1e3 * br.busy_s / br.steps_done:.3f} ms/step computing,"
                 f" {1e3 * br.wait_go_s / br.steps_done:.3f} ms/step waiting for layers")
    return note


def drop_fused(rt: MoERuntime, model: QwenMoE, device: torch.device) -> None:
    """Release the device copies `install_backend(..., "fused", ...)` made."""
    rt.uninstall(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def decode_batch(model: QwenMoE, prompts: list[list[int]], n_tokens: int,
                 cuda_graph: bool, moe: MoERuntime | None = None,
                 on_start: Callable[[], None] | None = None) -> tuple[float, int]:
    """B requests decoding together through the engine: (decode tok/s summed over the rows,
    decode steps timed). Timing starts once every request has its first token, when
    `on_start` is called (the caller's counters then cover the decode steps alone). The
    engine step that emits the first tokens has launched the next decode step already, so
    the window holds one decode step fewer than engine steps: the steps it times are the
    runner's launches after `on_start`, a token of each of the B rows (in lockstep) apiece.
    (Counting engine steps put N-1 steps over the bytes of N-2.)"""
    from freetoken.engine.core import EngineCore
    from freetoken.types.api import GenerateRequest

    B, n = len(prompts), max(len(p) for p in prompts)
    core = EngineCore(model, [], kv_tokens=B * (n + n_tokens) + 64, state_slots=B + 4,
                      max_running=B, chunk_tokens=max(512, n), decode_runner=True,
                      cuda_graph=cuda_graph, moe=moe)
    if core.runner is not None:  # one attention plan timed: flashinfer's build ends first
        core.runner.finish_build()
    got = [0] * B

    def on(i: int):
        def emit(ev) -> None:
            got[i] += len(ev.token_ids)
        return emit

    for i, p in enumerate(prompts):
        core.add(GenerateRequest(p, SamplingParams(max_tokens=n_tokens, temperature=0.0,
                                                   ignore_eos=True), request_id=f"b{i}"), on(i))
    while core.has_work() and min(got) == 0:
        core.step()
    if on_start is not None:
        on_start()
    cuda = model.model.embed_tokens.weight.is_cuda
    if cuda:  # the step launched ahead is before the window: let it finish outside it
        torch.cuda.synchronize()
    runner = core.runner
    t0, start, steps = time.perf_counter(), sum(got), 0
    n0 = runner.steps if runner is not None else 0
    while core.has_work():
        core.step()
        steps += 1
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if runner is None:  # eager engine steps: each computes the tokens it emits
        return (sum(got) - start) / dt if dt > 0 else 0.0, steps
    steps = runner.steps - n0
    return B * steps / dt if dt > 0 else 0.0, steps


def bench_profile(model: QwenMoE, store: ExpertStore):
    """The bandwidth profile the floors use: the store format's, else (a quantized store
    without one) the dense dtype's, whose GB/s price the quantized bytes (`ft bench bw`
    measures dense pools only)."""
    return find_profile(model, store.format) or find_profile(model, store.dtype)


def warm_up(model: QwenMoE, rt: MoERuntime, prompt: list[int],
            prompts: list[list[int]] | None, cuda_graph: bool) -> int:
    """The untimed decode before a backend's timed window, at the timed run's width: through
    the engine with `prompts` when given (a batch), else `generate`. Every backend gets the
    decode steps `auto`'s guard needs to time each candidate and settle (its steady state is
    what the window measures), so that every row's window starts from the same state: the
    expert cache filled toward the decode's hot set, the replayed trace as far along, the
    bucket's graph captured. (Session 19 on the H200, replayed router: after 8 warm-up tokens
    hybrid decoded at 176 tok/s, after auto's 102 steps the same hybrid at 331.) Under `auto`
    at most AUTO_WARM_ROUNDS rounds of at most AUTO_WARM_MAX_STEPS until it settles (steps
    that capture graphs go untimed and need more). Returns the decode steps `auto`'s guard
    saw by the end of it (0 without a guard)."""
    guard = rt.guard
    n, window, discard = ((len(guard.order), guard.window, guard.discard) if guard is not None
                          else (len(CANDIDATES), WINDOW, DISCARD))
    need = min(AUTO_WARM_MAX_STEPS, n * (discard + window) + 8)
    for _ in range(AUTO_WARM_ROUNDS if guard is not None else 1):
        if guard is not None and guard.settled:
            break
        if prompts is not None:
            decode_batch(model, prompts, need, cuda_graph, moe=rt)
        else:
            generate(model, prompt, SamplingParams(max_tokens=need, temperature=0.0,
                                                   ignore_eos=True), [],
                     cuda_graph=cuda_graph, moe=rt)
    return guard.decode_steps if guard is not None else 0


def auto_note(guard, warm_steps: int) -> str:
    """The bench note of an `auto` row: the backend it settled on after how many warm-up
    decode steps (`warm_steps`: those it saw in the warm-up) and each candidate's ms/step as
    compared; or that it had not settled within the warm-up (the row then mixes its timing
    phases with its steady state)."""
    ms = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in (guard.compared or guard.times).items())
    if guard.settled_after is not None and guard.settled_after <= warm_steps:
        widths = ",".join(map(str, guard.widths)) or "none in common"
        return (f"auto: settled on {guard.choice} after {guard.settled_after} warm-up decode "
                f"steps (ms/step: {ms}; widths {widths}; profile's choice {guard.order[0]})")
    then = (f"settled on {guard.choice} inside the timed window" if guard.settled
            else f"still timing {guard.phase}")
    return (f"auto: NOT settled in the warm-up ({warm_steps} decode steps), {then}: the row "
            f"mixes its candidates (ms/step: {ms or 'none timed'})")


def run_backend(model: QwenMoE, store: ExpertStore, backend: str, opts: MoEConfig,
                device: torch.device, prompt: list[int], n_tokens: int, cuda_graph: bool = True,
                batch: int = 1, engine: bool = False) -> RunResult:
    """One backend's decode rate: batch 1 through `generate` unless `engine` (then, as every
    larger batch, through EngineCore as `ft serve` runs it)."""
    full = install_backend(model, store, backend, opts, device)
    rt = full if full.cache is not None else None  # (`fused`: no counters to read)
    sp = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    # B prompts of the same length, each a rotation of the first (no shared prefix)
    prompts = [prompt[i % len(prompt):] + prompt[:i % len(prompt)] for i in range(batch)]
    warm_steps = warm_up(model, full, prompt, prompts if batch > 1 or engine else None,
                         cuda_graph)
    # the counters cover the decode steps alone: taken when the first token is out (a
    # prefill's misses, and the hits of re-prefilling the warm-up's prompt, are not decode's)
    s0: dict = {}
    meter = LinkMeter(nvml_rx_reader(device.index or 0) if device.type == "cuda" else None)

    def start() -> None:
        if rt is not None and not s0:
            rt.counters.sync()
            s0.update({k: v for k, v in rt.counters.__dict__.items() if isinstance(v, int)})
            if device.type == "cuda":
                torch.cuda.synchronize()  # the meter's window starts with the device idle
            meter.start()

    if batch > 1 or engine:
        tok_s, steps = decode_batch(model, prompts, n_tokens, cuda_graph, moe=full,
                                    on_start=start)
        steps = max(1, steps)
        runner = h0 = None
    else:
        runner = private_runner(model)
        h0 = (runner.host_s, runner.wait_s, runner.steps) if runner else None
        res = generate(model, prompt, sp, [], on_token=lambda _t: start(),
                       cuda_graph=cuda_graph, moe=full)
        tok_s, steps = res.decode_tps, max(1, len(res.token_ids) - 1)
    # the window ends with the last timed step: what runs after it (the graph replays timed in
    # `step_note`) routes and fetches too, and counted in, it was 1.4x the fetches at 128 tokens
    if rt:
        rt.counters.sync()
    received = meter.stop()  # (after the sync above: the device has finished the window)
    d = {k: rt.counters.__dict__[k] - s0[k] for k in s0} if rt is not None else {}
    note = step_note(runner, h0, cuda_graph)
    hit = fb = cb = 0.0
    floor = None
    counts = (0.0, 0.0, 0.0)
    if rt is not None:
        routed = d["hits"] + d["misses"]
        hit = d["hits"] / routed if routed else 0.0
        # per decode step of the timed window (each step after the first token)
        fb, cb = d["fetch_bytes"] / steps, d["cpu_bytes"] / steps
        counts = (routed / steps, d["misses"] / steps, d["fetched"] / steps)
        prof = bench_profile(model, store)
        if prof is not None and (prof.b_p or not fb):
            bp = (prof.b_p or 1.0) * 1e9
            bh = prof.b_h * 1e9
            ran = full.guard.running if full.guard is not None else backend  # (auto's pick)
            t = max(fb / bp, cb / bh) if ran == "hybrid" else fb / bp + cb / bh
            floor = batch / t if t > 0 else None  # a step moves the bytes of all its rows
    if full.guard is not None:  # what `auto` ran: what it timed, when, what it kept
        note += ("; " if note else "") + auto_note(full.guard, warm_steps)
    if backend == "fused":
        drop_fused(full, model, device)
    return RunResult(backend, tok_s, hit, fb, cb, floor, note,
                     None if received is None else received / steps, *counts,
                     route_bound=batch * len(model.moe_blocks()) * model.cfg.top_k)

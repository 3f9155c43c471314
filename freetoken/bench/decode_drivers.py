"""The decode steps `ft bench decode` times and the ones `ft serve` runs, driven one step at a
time so that `freetoken.bench.step_ops` can count each step's ops and host syncs.

- `bench`: batch 1 as `generate` runs it on CUDA (the decode runner, step n+1 launched from
  step n's device ids before step n's token is read), here on any device: `generate` itself
  takes the runner on CUDA only, so this replays its loop over the same private caches.
- `engine`: `ft bench decode --path engine` (EngineCore sized for the run: max_running 1,
  a small KV pool).
- `served`: EngineCore as `ft serve` builds it (freetoken/cli/build.py): max_running 4
  (buckets 1, 2, 4), the server's KV pool (`kv_tokens`), 64 state slots, the state host
  tier, kept logits, a chat-sized prompt.

Written against today's engine; the profile script loads this file by path over an older
checkout too (e194b5d), where imports that moved are looked up and what the old expert
setup did differently comes from `LEGACY` (set by scripts/profile_decode.py).
"""
from __future__ import annotations

import inspect

import torch


def tiny_config(layers: int = 4, experts: int = 16, top_k: int = 4, vocab: int = 512):
    """The qwen3.6-35b-a3b layout (gated DeltaNet 3 : 1 gated attention, routed + shared
    experts) at a CPU test's size."""
    from freetoken.types.model_config import config_from_dict

    return config_from_dict({
        "model_type": "qwen3_5_moe_text", "vocab_size": vocab, "hidden_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_conv_kernel_dim": 4,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "num_experts": experts, "num_experts_per_tok": top_k, "full_attention_interval": 4,
        "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "dtype": "float32"})


def build(cfg, backend: str, device: str | torch.device = "cpu",
          dtype: torch.dtype = torch.float32, cache_rate: float = 0.37):
    """(model, expert runtime or None) with random weights: the banks in an ExpertStore and
    `backend` installed over it, as `ft bench decode --shape` does."""
    from freetoken.bench.moe import install_backend
    from freetoken.bench.random_model import random_model
    from freetoken.experts.store import ExpertStore

    device = torch.device(device)
    model = random_model(cfg, dtype, device, progress=False)
    blocks = model.moe_blocks()
    store = ExpertStore([b.experts.gate_up_proj.data for b in blocks],
                        [b.experts.down_proj.data for b in blocks], pin=device.type == "cuda")
    for b in blocks:
        if LEGACY is not None:
            LEGACY.release_banks(b)
        else:
            b.experts.release_banks()  # the store holds the only copy
    try:
        from freetoken.types.config import MoEConfig as Opts
    except ImportError:  # (e194b5d)
        from freetoken.experts.setup import MoEOptions as Opts
    rt = install_backend(model, store, backend, Opts(cache_rate=cache_rate), device)
    return model, rt


def cuda_path():
    """Point the kernels' switch at our Triton kernels for CPU tensors too (run by the
    interpreter: set TRITON_INTERPRET=1 before anything imports triton), with the paged
    attention cut to 2 splits: the launches a CUDA graph of the step holds, counted on the
    CPU (as tests/kernels/triton/engine/inventory.py does). Returns an undo callable."""
    import freetoken.kernels.triton.paged_attention as pa

    try:
        from freetoken.kernels import dispatch as sw
    except ImportError:  # (e194b5d: the switch lived in fast_ops)
        from freetoken.layers import fast_ops as sw
    orig, splits = sw.triton_for, pa.default_num_splits
    sw.triton_for = lambda x, name: sw.triton_module(name)
    pa.default_num_splits = lambda *a, **k: 2

    def undo() -> None:
        sw.triton_for, pa.default_num_splits = orig, splits

    return undo


def _triton_attention(runner) -> None:
    """The runner's paged attention on the Triton kernel (the CUDA path; a CPU runner runs
    torch's per-row attention otherwise)."""
    from freetoken.engine.attention_plans import TritonDecode  # noqa: F401

    runner.attention = "triton"


def install_uniform_routing(model, steps: int = 512, seed: int = 0) -> None:
    """`ft bench decode`'s `random` case (today's): every decode step routed by a trace drawn
    uniformly per token (K distinct experts of E), replayed by the trace router."""
    import numpy as np

    try:
        from freetoken.models.routing_hooks import TraceRouter, install_trace
    except ImportError:  # (e194b5d)
        from freetoken.bench.moe import TraceRouter, install_trace
    cfg = model.cfg
    L, E, K = len(model.moe_blocks()), cfg.num_experts, cfg.top_k
    g = np.random.default_rng(seed)
    t = np.argsort(g.random((steps, L, 1, E)), axis=-1)[..., :K]  # [steps, L, 1, K]
    install_trace(model, TraceRouter(t, E, K, model.model.embed_tokens.weight.device))


def _moe_kw(fn, rt) -> dict:
    return {"moe": rt} if "moe" in inspect.signature(fn).parameters else {}


def _settled(model, rt) -> bool:
    if LEGACY is not None:
        return LEGACY.settled(model, rt)
    return rt is None or rt.settled


def _prefill_step(rt, n: int):
    from contextlib import nullcontext

    if rt is not None and hasattr(rt, "step"):
        return rt.step("prefill", n)
    return nullcontext(None)


class BenchSteps:
    """`generate`'s decode loop through the decode runner (batch 1): `start(prompt)` prefills
    and launches the first step; each `step()` is one steady decode step of that loop (launch
    the next step chained on the device, read this one's token)."""

    def __init__(self, model, rt, graphs: bool = False, triton: bool = False):
        from freetoken.engine import generate as gen

        self.model, self.rt, self.graphs, self.triton = model, rt, graphs, triton
        self.gen = gen

    def start(self, prompt: list[int], max_tokens: int) -> None:
        from freetoken.engine.gpu_sampler import RowSampling, sample_rows
        from freetoken.sampler import RequestSampler
        from freetoken.types.api import SamplingParams
        from freetoken.types.forward_batch import ForwardBatch

        try:
            from freetoken.engine.decode_staging import DecodeRow
        except ImportError:  # (e194b5d)
            from freetoken.engine.graph_runner import DecodeRow
        model, gen = self.model, self.gen
        w = model.model.embed_tokens.weight
        priv = gen._private(model, len(prompt) + max_tokens, w.device, w.dtype)
        self.runner = priv.runner(model, self.graphs, *(
            [self.rt] if "moe" in inspect.signature(priv.runner).parameters else []))
        if self.triton:
            _triton_attention(self.runner)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.sampler = RequestSampler(sp, [], w.device)
        slots = torch.arange(priv.total, device=w.device)
        state = 0 if model.cfg.has_linear_attention else None
        batch = ForwardBatch.single(prompt, 0, slots[:len(prompt)], state, w.device)
        with _prefill_step(self.rt, len(prompt)) as st:
            if st is not None:
                batch.moe = st
            logits = model(batch, priv.caches)
        host_slots = torch.arange(priv.total)

        def params(n: int) -> RowSampling:
            return RowSampling(0.0, sp.top_k, sp.top_p, self.sampler.seed, n,
                               tuple(self.sampler.blocked_ids(n)))

        def row(n: int, token: int) -> DecodeRow:
            pos = len(prompt) + n - 1
            return DecodeRow(**vars(params(n)), token=token, position=pos, out_slot=pos,
                             state_slot=0 if state is not None else -1,
                             kv_slots=host_slots[: pos + 1])

        self.row = row
        self.out = [sample_rows(logits, [params(0)], w.device)[0]]
        assert _settled(model, self.rt), "an `auto` guard still timing: not the steady loop"
        self.pending = self.runner.launch([row(1, self.out[0])])

    def step(self) -> int:
        n = len(self.out)
        ahead = self.runner.launch([self.row(n + 1, 0)], chain=[0])
        tok = self.runner.collect(self.pending)[0]
        self.pending = ahead
        self.out.append(tok)
        self.sampler.is_stop(tok, len(self.out))
        return tok

    def close(self) -> None:
        self.runner.drain()


class CoreSteps:
    """EngineCore decode steps of one request: `served=True` sizes the core as `ft serve`
    does, else as `ft bench decode --path engine` does."""

    def __init__(self, model, rt, served: bool, graphs: bool = False, kv_tokens: int = 262144,
                 max_running: int = 4, triton: bool = False):
        self.model, self.rt, self.served, self.triton = model, rt, served, triton
        self.graphs, self.kv_tokens, self.max_running = graphs, kv_tokens, max_running

    def start(self, prompt: list[int], max_tokens: int) -> None:
        from freetoken.engine.core import EngineCore
        from freetoken.types.api import GenerateRequest, SamplingParams

        kw = _moe_kw(EngineCore.__init__, self.rt)
        if self.served:
            self.core = EngineCore(self.model, [2], kv_tokens=self.kv_tokens, state_slots=64,
                                   max_running=self.max_running, chunk_tokens=512,
                                   decode_runner=True, cuda_graph=self.graphs, **kw)
        else:
            n = len(prompt)
            self.core = EngineCore(self.model, [], kv_tokens=n + max_tokens + 64,
                                   state_slots=5, max_running=1, chunk_tokens=max(512, n),
                                   decode_runner=True, cuda_graph=self.graphs, **kw)
        if self.triton:
            _triton_attention(self.core.runner)
        elif hasattr(self.core.runner, "finish_build"):  # a server past its warm-up: on the
            self.core.runner.finish_build()  # final attention plan
        self.got: list[int] = []
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.core.add(GenerateRequest(prompt, sp, request_id="p0"),
                      lambda ev: self.got.extend(ev.token_ids))
        while not self.got:  # prefill up to the first token
            self.core.step()

    def step(self) -> None:
        self.core.step()

    def close(self) -> None:
        while self.core.has_work():
            self.core.step()
        if hasattr(self.core, "close"):
            self.core.close()


def count_steps(driver, prompt: list[int], steps: int, warm: int = 4, model=None):
    """(the StepLog of `steps` steady decode steps of `driver`, the tokens it produced): ops
    and host syncs counted by `freetoken.bench.step_ops` (the counter of this checkout, or of
    the one the caller loaded: `counter` module in the driver's globals)."""
    ops = _counter()
    from freetoken.engine.graph_runner import DecodeRunner

    with ops.counting(model or driver.model, DecodeRunner) as mode:
        driver.start(prompt, warm + steps + 8)
        for _ in range(warm):
            driver.step()
        mode.new_window()
        for _ in range(steps):
            driver.step()
        log = mode.new_window(steps)
    driver.close()
    return log


COUNTER = None  # the step_ops module to use (the profile script sets it for old checkouts)
# what differs in a checkout older than the expert runtime (e194b5d: banks released and `auto`'s
# guard read the old way); scripts/profile_decode.py sets it when counting one, None here
LEGACY = None


def _counter():
    if COUNTER is not None:
        return COUNTER
    from freetoken.bench import step_ops

    return step_ops

"""Where a decode step's time goes, per expert backend: torch.profiler over a few decode tokens
of the real shape with random weights (the model of `ft bench decode --shape`), printing the
ops by self CPU time and the CUDA time beside them. For finding host overhead, not for figures.

  python scripts/profile_decode.py --layers 4 --backends fused,offload --tokens 16
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freetoken.bench.moe import drop_fused, install_backend
from freetoken.bench.random_model import random_model
from freetoken.engine.generate import generate
from freetoken.experts.store import ExpertStore
from freetoken.types.api import SamplingParams
from freetoken.types.config import MoEConfig
from freetoken.types.presets import preset_config


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="qwen3.6-35b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--backends", default="fused,offload")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--sort", choices=["cpu", "device"], default="cpu",
                   help="cpu: host overhead by op; device: GPU kernels by time (the decode "
                        "runner run eagerly, so each kernel of the graph shows up)")
    p.add_argument("--prefill-tokens", type=int, default=0,
                   help="profile one prefill chunk of N tokens (fused: its kernels by device "
                        "time) instead of decode steps")
    p.add_argument("--route-trace", default=None,
                   help="'shared' (the recorded trace) or a .npy path: decode routes from it")
    p.add_argument("--prompt-len", type=int, default=32,
                   help="decode prompt length (1: almost no prefill in the profile)")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = preset_config(a.shape, a.layers)
    model = random_model(cfg, torch.bfloat16, device)
    blocks = model.moe_blocks()
    store = ExpertStore([b.experts.gate_up_proj.data for b in blocks],
                        [b.experts.down_proj.data for b in blocks], pin=device.type == "cuda")
    for b in blocks:
        b.experts = None
    prompt = list(range(100, 100 + a.prompt_len))
    if a.route_trace:
        import numpy as np

        from freetoken.bench.moe import TraceRouter, install_trace
        from freetoken.bench.route_trace import trace_path

        install_trace(model, TraceRouter(np.load(trace_path(a.route_trace)), cfg.num_experts,
                                         cfg.top_k, device))
    if a.prefill_tokens:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, cfg.vocab_size, (a.prefill_tokens,), generator=g).tolist()
        a.tokens = 1
    for be in a.backends.split(","):
        rt = install_backend(model, store, be, MoEConfig(cache_rate=0.37), device)
        sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
        chunk = max(2048, len(prompt))
        generate(model, prompt, sp, [], prefill_chunk=chunk, moe=rt)  # warm-up
        t0 = time.perf_counter()
        res = generate(model, prompt, sp, [], prefill_chunk=chunk, moe=rt)
        wall = time.perf_counter() - t0
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        graphs = a.sort == "cpu"
        generate(model, prompt, sp, [], cuda_graph=graphs,
                 prefill_chunk=chunk, moe=rt)  # warm the eager runner too
        with torch.profiler.profile(activities=acts) as prof:
            generate(model, prompt, sp, [], cuda_graph=graphs, prefill_chunk=chunk, moe=rt)
            if device.type == "cuda":
                torch.cuda.synchronize()
        print(f"\n=== {be}: {res.decode_tps:.1f} decode tok/s ({a.layers} layers; "
              f"{wall:.2f}s for {a.tokens} tokens incl. a {len(prompt)}-token prefill of "
              f"{res.prefill_seconds:.3f}s) ===", flush=True)
        sort = "self_cpu_time_total" if a.sort == "cpu" else "self_device_time_total"
        avg = prof.key_averages()
        if a.sort == "device":
            kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.device_time_total for e in kern) / 1e3
            print(f"{len(kern) / a.tokens:.0f} kernels and {busy / a.tokens:.3f} ms of GPU time "
                  f"per token (prefill included, {a.tokens} tokens)")
        print(avg.table(sort_by=sort, row_limit=a.rows, max_name_column_width=60))
        if be == "fused":
            drop_fused(rt, model, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

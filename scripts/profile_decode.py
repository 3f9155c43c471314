"""Where a decode step's time goes, per expert backend: torch.profiler over a few decode tokens
of the real shape with random weights (the model of `ft bench decode --shape`), printing the
ops by self CPU time and the CUDA time beside them. For finding host overhead, not for figures.

  python scripts/profile_decode.py --layers 4 --backends fused,offload --tokens 16

`--count`: count the work of one steady decode step instead (freetoken/bench/step_ops.py), for
`ft bench decode`'s loop (`bench`: `generate` through the decode runner), its `--path engine`
(`engine`) and the server's EngineCore (`served`: buckets 1/2/4, 262k KV tokens): ops inside
the captured region (per decoder layer) and outside it, host syncs by call site, Python calls
outside the graph; on CUDA also kernels, memcpys and CUDA runtime calls per step
(torch.profiler, graphs on) and ms per step. `--old DIR` counts a checkout of another commit
the same way (in a child process) and prints the per-layer differences:

  git worktree add /tmp/old e194b5d
  python scripts/profile_decode.py --count --old /tmp/old --backends fused,offload
  python scripts/profile_decode.py --count --shape qwen3.6-35b-a3b --layers 20   # on the H200

`--host-path MS`: the host side alone against an emulated device step of MS ms (any machine;
freetoken/bench/host_path.py): ms a token of the bench loop, the served EngineCore and the whole
served stack through HTTP.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--tree" in sys.argv:  # counting another checkout: its freetoken first, this one's counter
    sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1])
else:
    sys.path.insert(0, str(ROOT))


def _load(name: str, rel: str):
    """A module of THIS checkout by path (also when another checkout's freetoken is imported)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--count", action="store_true", help="count one decode step's work (above)")
    p.add_argument("--paths", default="bench,engine,served", help="--count: which step drivers")
    p.add_argument("--steps", type=int, default=8, help="--count: steady steps counted")
    p.add_argument("--route", choices=["random", "model"], default="random",
                   help="--count: `random` = today's bench (a uniform trace replayed), `model` "
                        "= the random router itself (the bench's `random` at e194b5d, and the "
                        "served random-weight model)")
    p.add_argument("--cuda-path", action="store_true",
                   help="--count on the CPU: our Triton kernels through the interpreter "
                        "(TRITON_INTERPRET=1), the launches a CUDA graph holds (slow)")
    p.add_argument("--old", default=None, help="--count: also count this checkout, and diff")
    p.add_argument("--tree", default=None, help=argparse.SUPPRESS)  # (the child of --old)
    p.add_argument("--json", default=None, help="--count: write the counts here")
    p.add_argument("--host-path", type=float, default=None, metavar="MS",
                   help="host path alone vs an emulated device step of MS ms")
    p.add_argument("--tiny", action="store_true",
                   help="--count: the shape's layout at a CPU test's size (default off CUDA)")
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
    if a.host_path is not None:
        from freetoken.bench.host_path import host_path

        print(json.dumps(host_path(a.host_path), indent=1))
        return 0
    if a.count:
        return count_main(a)
    return profile_main(a)


def profile_main(a: argparse.Namespace) -> int:
    import torch

    from freetoken.bench.moe import drop_fused, install_backend
    from freetoken.bench.random_model import random_model
    from freetoken.engine.generate import generate
    from freetoken.experts.store import ExpertStore
    from freetoken.types.api import SamplingParams
    from freetoken.types.config import MoEConfig
    from freetoken.types.presets import preset_config

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


class _Legacy:
    """A checkout from before the expert runtime (e194b5d): its benches released the banks
    by assignment and `auto`'s guard hung off the model."""

    @staticmethod
    def release_banks(block) -> None:
        block.experts.gate_up_proj = block.experts.down_proj = None

    @staticmethod
    def settled(model, rt) -> bool:
        guard = getattr(getattr(model, "moe_runtime", None), "guard", None)
        return guard is None or guard.settled


def count_here(a: argparse.Namespace) -> dict:
    """The counts of this process's freetoken (today's, or --tree's): {backend/path: {...}}."""
    import torch

    ops = _load("_ft_step_ops", "freetoken/bench/step_ops.py")
    dd = _load("_ft_decode_drivers", "freetoken/bench/decode_drivers.py")
    dd.COUNTER = ops
    import freetoken

    if importlib.util.find_spec("freetoken.experts.runtime") is None:  # no expert runtime yet
        dd.LEGACY = _Legacy()

    cuda = torch.cuda.is_available()
    if a.cuda_path and not cuda:
        dd.cuda_path()
    if a.tiny or not cuda:
        cfg = dd.tiny_config(layers=a.layers)
    else:
        from freetoken.types.presets import preset_config

        cfg = preset_config(a.shape, a.layers)
    dtype = torch.bfloat16 if cuda else torch.float32
    device = "cuda" if cuda else "cpu"
    prompt = list(range(100, 132))
    out: dict = {"tree": str(Path(freetoken.__file__).parents[1]), "device": device,
                 "layers": cfg.num_layers, "route": a.route, "runs": {}}
    for be in a.backends.split(","):
        model, rt = dd.build(cfg, be, device, dtype)
        if a.route == "random":
            dd.install_uniform_routing(model)
        tri = a.cuda_path and not cuda
        for path in a.paths.split(","):
            log = dd.count_steps(_driver(dd, model, rt, path, cuda, tri), prompt, a.steps)
            r = dict(log.summary())
            r["layers"] = {str(k): v for k, v in log.by_layer().items()}
            r["host_sites"] = {k: v / log.steps for k, v in log.host_sites().most_common(12)}
            r["sync_sites"] = {k: v / log.steps for k, v in log.sync_sites().most_common(12)}
            r["py_calls"] = dict(log.call_files(8))
            if cuda:  # graphs on: the counts above are outside the graph; these are the device's
                d = _driver(dd, model, rt, path, cuda, tri)
                d.start(prompt, 3 * a.steps + 40)
                for _ in range(8):
                    d.step()
                r["cuda"] = ops.cuda_counts(d.step, a.steps)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    d.step()
                torch.cuda.synchronize()
                r["ms_per_step"] = round(1e3 * (time.perf_counter() - t0) / a.steps, 3)
                d.close()
            out["runs"][f"{be}/{path}"] = r
        if be == "fused" and rt is not None and hasattr(rt, "uninstall"):
            rt.uninstall(model)
        model = rt = None
        if cuda:
            torch.cuda.empty_cache()
    return out


def _driver(dd, model, rt, path: str, cuda: bool, triton: bool):
    if path == "bench":
        return dd.BenchSteps(model, rt, graphs=cuda, triton=triton)
    return dd.CoreSteps(model, rt, served=path == "served", graphs=cuda, triton=triton)


def _row(tree: str, key: str, r: dict) -> str:
    line = (f"{tree:4} {key:16} {r['graph_ops_per_step']:9.1f} {r['host_ops_per_step']:8.1f} "
            f"{r['syncs_per_step']:6.1f} {r['host_py_calls_per_step']:8.1f}")
    if "cuda" in r:
        c, api = r["cuda"], r["cuda"]["runtime_calls_per_step"]
        line += (f" {c['kernels_per_step']:8.1f} {c['memcpy_per_step']:6.1f} "
                 f"{api.get('cudaGraphLaunch', 0):5.1f} {api.get('cudaLaunchKernel', 0):6.1f} "
                 f"{sum(v for k, v in api.items() if 'Synchronize' in k):5.1f} "
                 f"{c['device_ms_per_step']:7.3f} {r['ms_per_step']:7.3f}")
    return line


def _layer_diff(a: dict, b: dict) -> list[str]:
    from collections import Counter

    out = []
    na, nb = a["steps"], b["steps"]
    for layer in sorted(set(a["layers"]) | set(b["layers"]), key=int):
        # by op name: shapes differ with the pool sizes (a 262k-token KV pool vs 1k)
        ca = Counter({k: v / na for k, v in Counter(
            o.split("[")[0] for o in a["layers"].get(layer, [])).items()})
        cb = Counter({k: v / nb for k, v in Counter(
            o.split("[")[0] for o in b["layers"].get(layer, [])).items()})
        plus = {k: round(cb[k] - ca[k], 2) for k in set(ca) | set(cb) if cb[k] - ca[k] >= 0.5}
        minus = {k: round(ca[k] - cb[k], 2) for k in set(ca) | set(cb) if ca[k] - cb[k] >= 0.5}
        if plus or minus:
            out.append(f"    layer {layer}: {sum(ca.values()):.1f} -> {sum(cb.values()):.1f} ops;"
                       f" added {plus}; gone {minus}")
    return out


def count_main(a: argparse.Namespace) -> int:
    res = {"new": count_here(a)}
    if a.tree:  # the child of --old: hand the counts back
        Path(a.json).write_text(json.dumps(res["new"]))
        return 0
    if a.old:
        tmp = Path(a.json or "/tmp/profile_decode_counts.json").with_suffix(".old.json")
        argv = [x for x in sys.argv[1:] if x != "--old" and x != a.old]
        env = dict(os.environ, PYTHONPATH=a.old)
        subprocess.run([sys.executable, __file__, *argv, "--tree", a.old, "--json", str(tmp)],
                       env=env, check=True)
        res["old"] = json.loads(tmp.read_text())
    head = (f"{'tree':4} {'backend/path':16} {'graph ops':>9} {'host ops':>8} {'syncs':>6} "
            f"{'py calls':>8}")
    if res["new"]["device"] == "cuda":
        head += (f" {'kernels':>8} {'memcpy':>6} {'graph':>5} {'launch':>6} {'sync':>5} "
                 f"{'dev ms':>7} {'ms/step':>7}")
    print(f"per steady decode step ({res['new']['layers']} layers, route {a.route}, "
          f"{res['new']['device']}; graph = inside the runner's captured _forward)")
    print(head)
    for tree in ("old", "new"):
        for key, r in res.get(tree, {}).get("runs", {}).items():
            print(_row(tree, key, r))
    new = res["new"]["runs"]
    for key, r in new.items():
        print(f"\n{key}: host ops {r['host_sites']}\n  syncs {r['sync_sites']}"
              + (f"\n  CUDA runtime calls {r['cuda']['runtime_calls_per_step']}"
                 if "cuda" in r else ""))
    for be in a.backends.split(","):
        b, s_ = new.get(f"{be}/bench"), new.get(f"{be}/served")
        if b and s_:
            print(f"\n{be}: bench -> served, graph ops per layer (by name)")
            print("\n".join(_layer_diff(b, s_)) or "    the same")
    for key, r in res.get("old", {}).get("runs", {}).items():
        if key in new:
            print(f"\n{key}: old -> new, graph ops per layer (by name)")
            print("\n".join(_layer_diff(r, new[key])) or "    the same")
    if a.json:
        Path(a.json).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train the demo model: a tiny `qwen3_5_moe` on the synthetic agent transcripts of `demo_data`.

    python -m freetoken.models.demo_data --out data.xz --jobs 16   # data v6 (--data-version)
    python -m freetoken.models.train_demo --data data.xz --out OUT --budget-s 360   # GPU
    python -m freetoken.models.demo_trained OUT                    # -> demo_weights/

The data file's meta (`data_version`, `prompt_compaction`: v6 and demo-v2 unless
`demo_data --data-version` says otherwise) is recorded in train_meta.json as `data`; `ship`
copies its compaction into the manifest, which the server then applies.

The model is transformers' own `Qwen3_5MoeForCausalLM`, so what is trained is the reference the
engine is checked against. On CUDA its chunked gated delta rule is fla-core's Triton kernel
(`train_kernels`: checked against transformers' torch form before training, the torch form if
fla is missing or differs), under bf16 autocast with fp32 master weights; elsewhere the torch
form (`--dn-kernel torch` anywhere). Batches are one harness each, padded to a multiple of 64.

Compact vocabulary. The data uses a few thousand of the tokenizer's 151,669 ids. Training runs
over those (`used`, sorted) plus one shared row OTHER that stands for every unused id: the
softmax counts OTHER's logit `n_unused` times (`+ log(n_unused)`), which is exactly the full-
vocabulary softmax of a model whose unused `lm_head` rows all equal OTHER's. The embedding of
OTHER is trained by replacing a few prompt tokens with it (an unknown token in a real prompt
reads as OTHER). `freetoken.models.demo_weights` expands the result to the full vocabulary.

Reproducible from `--seed`: init on the CPU from the seed, batches from a seeded generator; the
step count is fixed by `--steps`, or planned once from `--budget-s` (the rate measured over the
first `--probe-steps`, per harness) and recorded, so `--steps N` reruns it. `--budget-s` also
stops a run by wall clock (the GPU machine's per-call limit); the steps it reached and the
count its schedule was set for (`planned_steps`) are both recorded. Every `--save-every` steps
(and at the end) OUT holds a complete result: compact.safetensors, used.npy, train_meta.json,
loss.json and (with matplotlib) loss.png.
"""
from __future__ import annotations

import argparse
import io
import json
import lzma
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

TRAIN_VERSION = 4  # v4: fla chunked DeltaNet on CUDA, --budget-s plan/stop, checkpoints, pad to 64
# how often each harness's batch comes up: Claude Code (the default `ft launch`, whose long prompt
# holds the most tools to tell apart) most, then mini (the end-to-end test); mini's short
# conversations (where reading the request is learnt first) are cheap steps
HARNESS_WEIGHTS = {"claude_code": 4.0, "mini_tool": 2.0, "mini_text": 2.0,
                   "mini_tool_short": 1.0, "mini_text_short": 1.0}
# linear, full, linear, full: a DeltaNet (with its short conv: the previous-token features) before
# each attention layer, so copying from the prompt (file names, tool output) is learnable.
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def model_config(vocab_size: int) -> dict[str, Any]:
    """The demo's transformers 5 config (`Qwen3_5MoeForCausalLM`), at `vocab_size` rows."""
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": len(LAYER_TYPES),
        "layer_types": list(LAYER_TYPES),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "dtype": "bfloat16",
    }


# ---- the data file: lzma(npz) of compact uint16 ids, uint8 masks, offsets, used ids, meta ----

def save_data(path: Path, samples: list[tuple[str, list[int], list[int]]],
              meta: dict[str, Any], preset: int = 6) -> None:
    """`samples`: (harness, full-vocab ids, mask)."""
    used = sorted({t for _, ids, _ in samples for t in ids})
    index = {t: i for i, t in enumerate(used)}
    assert len(used) + 1 < 65536
    ids = np.array([index[t] for _, s, _ in samples for t in s], dtype=np.uint16)
    mask = np.array([m for _, _, ms in samples for m in ms], dtype=np.uint8)
    lens = np.array([len(s) for _, s, _ in samples], dtype=np.int64)
    names = sorted({h for h, _, _ in samples})
    harness = np.array([names.index(h) for h, _, _ in samples], dtype=np.int64)
    buf = io.BytesIO()
    np.savez(buf, ids=ids, mask=mask, lens=lens, harness=harness,
             used=np.array(used, dtype=np.int64),
             meta=np.frombuffer(json.dumps({**meta, "harnesses": names}).encode(), np.uint8))
    path.write_bytes(lzma.compress(buf.getvalue(), preset=preset))


def load_data(path: Path) -> dict[str, Any]:
    z = np.load(io.BytesIO(lzma.decompress(path.read_bytes())))
    out = {k: z[k] for k in ("ids", "mask", "lens", "harness", "used")}
    out["meta"] = json.loads(bytes(z["meta"]).decode())
    out["offsets"] = np.concatenate([[0], np.cumsum(out["lens"])])
    return out


# ---- training ----

def build_model(vocab_rows: int, seed: int, pad_row: int | None = None):
    """transformers' model at the compact vocabulary, initialised on the CPU from `seed`.
    `pad_row`: the compact row of the pad id (an embedding row kept at zero), if it is used."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model_config(vocab_rows)
    cfg.update(pad_token_id=pad_row, bos_token_id=None, eos_token_id=None)  # full-vocab ids
    conf = AutoConfig.for_model(cfg.pop("model_type"), **{
        k: v for k, v in cfg.items() if k not in ("architectures", "dtype")})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    return model


def batches(data: dict[str, Any], seed: int, tokens_per_step: int):
    """Endless (harness-major) batches: each step one harness, as many of its samples as fit
    `tokens_per_step` at its longest length."""
    rng = np.random.default_rng(seed)
    names = data["meta"]["harnesses"]
    by_h = [np.flatnonzero(data["harness"] == h) for h in range(len(names))]
    w = np.array([HARNESS_WEIGHTS.get(n, 1.0) if len(by_h[i]) else 0.0
                  for i, n in enumerate(names)])
    while True:
        pool = by_h[rng.choice(len(names), p=w / w.sum())]
        longest = int(data["lens"][pool].max())
        b = max(1, min(256, tokens_per_step // longest))
        yield rng.choice(pool, size=min(b, len(pool)), replace=False), rng


def make_batch(data: dict[str, Any], idx, rng, other: int, unk_rate: float, pad_to: int = 64):
    """(inputs, targets, mask), each [B, L]: the samples `idx`, right-padded with OTHER (mask 0:
    a causal model's earlier positions never see the padding) to a multiple of `pad_to`, so
    the kernels meet few distinct lengths."""
    import torch

    lens = [int(data["lens"][i]) for i in idx]
    L = -(-max(lens) // pad_to) * pad_to
    ids = np.full((len(idx), L), other, dtype=np.int64)
    mask = np.zeros((len(idx), L), dtype=bool)
    for r, i in enumerate(idx):
        a, b = data["offsets"][i], data["offsets"][i + 1]
        ids[r, :b - a] = data["ids"][a:b]
        mask[r, :b - a] = data["mask"][a:b].astype(bool)
    # unknown tokens: a few prompt tokens read as OTHER (never a target, never a target's input)
    unk = (rng.random(ids.shape) < unk_rate) & ~mask
    unk[:, 1:] &= ~mask[:, :-1]
    unk[:, :-1] &= ~mask[:, 1:]
    inputs = np.where(unk, other, ids)
    return torch.from_numpy(inputs), torch.from_numpy(ids), torch.from_numpy(mask)


def loss_fn(model, inputs, targets, mask, log_n_other: float):
    """Mean cross-entropy of the masked targets; logits only where a target is predicted."""
    import torch

    hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state  # [B, L, H]
    pos = mask[:, 1:]  # token t is predicted at t-1
    h = hidden[:, :-1][pos]  # [N, H]
    logits = model.lm_head(h).float()  # [N, V']
    logits[:, -1] += log_n_other
    return torch.nn.functional.cross_entropy(logits, targets[:, 1:][pos])


def lr_at(step: int, total: int | None, base: float, warm: int) -> float:
    """Linear warm-up over `warm` steps (the same whatever the total, so a planned run and its
    `--steps` rerun agree), then cosine from `base` to `base / 10` at `total`."""
    if step < warm or total is None:
        return base * min(1.0, (step + 1) / warm)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm))))


def plan_steps(log: list[dict[str, Any]], skip: int, left_s: float, weights: dict[str, float]
               ) -> tuple[int, float]:
    """(steps, expected s/step) that fit `left_s` more seconds: each harness's mean step time
    over the probe steps past `skip` (the first ones compile), mixed by how often its batches
    come up (a harness the probe did not meet counts at the overall mean)."""
    rows = log[skip:]
    mean = float(np.mean([r["step_s"] for r in rows]))
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["harness"], []).append(r["step_s"])
    w = sum(weights.values())
    rate = sum(p / w * (float(np.mean(by[h])) if h in by else mean) for h, p in weights.items())
    rate *= 1.05  # a margin: a probe of a few dozen random batches under-reads the long ones
    return len(log) + max(1, int(left_s / rate)), rate


def save(out: Path, model, used, meta: dict[str, Any], log: list[dict[str, Any]]) -> None:
    """A complete result in `out` (overwritten at each checkpoint)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    # bf16: what ships (and under the 16 MiB a file the GPU machine sends back)
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(out / "compact.safetensors"))
    np.save(out / "used.npy", used)
    (out / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "loss.json").write_text(json.dumps(log) + "\n")


def train(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.time()
    from freetoken.models import train_kernels

    train_kernels.block_optional_kernels(args.dn_kernel)
    import torch

    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    kernel, dn_calls = train_kernels.use(args.dn_kernel, dev.type, args.autotune_configs)
    data = load_data(Path(args.data))
    used = data["used"]
    other = len(used)
    n_other = int(data["meta"]["vocab_size"]) - len(used)
    pad = np.flatnonzero(used == model_config(1)["pad_token_id"])
    model = build_model(other + 1, args.seed, int(pad[0]) if len(pad) else None)
    init_meta = None
    if args.init:  # a second stage: start from an earlier run's weights (same data file)
        from safetensors.torch import load_file

        assert np.array_equal(np.load(Path(args.init) / "used.npy"), used), "other data file"
        init = load_file(str(Path(args.init) / "compact.safetensors"))
        model.load_state_dict({k: v.float() for k, v in init.items()})
        init_meta = json.loads((Path(args.init) / "train_meta.json").read_text())
    names = data["meta"]["harnesses"]
    if args.harnesses:
        keep = [names.index(h) for h in args.harnesses.split(",")]
        data["harness"] = np.where(np.isin(data["harness"], keep), data["harness"], -1)
    present = {n: HARNESS_WEIGHTS.get(n, 1.0) for i, n in enumerate(names)
               if (data["harness"] == i).any()}
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0, eps=1e-8)
    gen = batches(data, args.seed, args.tokens_per_step)
    warm = 1 if args.init else args.warmup
    steps, planned, rate = args.steps, None, None
    log: list[dict[str, Any]] = []
    out = Path(args.out)
    budget = args.budget_s if args.budget_s else float("inf")

    def meta(complete: bool) -> dict[str, Any]:
        import transformers
        return {"train_version": TRAIN_VERSION, "seed": args.seed, "steps": len(log),
                "planned_steps": planned, "complete": complete, "lr": args.lr, "warmup": warm,
                "init": init_meta, "harnesses": args.harnesses, "budget_s": args.budget_s,
                "tokens_per_step": args.tokens_per_step, "unk_rate": args.unk_rate,
                "dn_kernel": kernel, "data": data["meta"], "seconds": round(time.time() - t0, 1),
                "first_loss": float(np.mean([r["loss"] for r in log[:5]])),
                "final_loss": float(np.mean([r["loss"] for r in log[-20:]])),
                "torch": torch.__version__, "transformers": transformers.__version__,
                "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}

    print(f"ft.train: start kernel={kernel} device={dev} budget_s={args.budget_s} "
          f"steps={steps} setup_s={time.time() - t0:.1f}", flush=True)
    step = 0
    while steps is None or step < steps:
        if time.time() - t0 > budget - args.reserve_s:  # the machine's limit comes first
            print(f"ft.train: wall_clock_stop step={step} planned={steps}", flush=True)
            planned, steps = steps, step
            break
        ts = time.time()
        idx, rng = next(gen)
        inputs, targets, mask = (t.to(dev, non_blocking=True) for t in make_batch(
            data, idx, rng, other, args.unk_rate))
        lr = lr_at(step, steps, args.lr, warm)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = loss_fn(model, inputs, targets, mask, math.log(n_other))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        el = time.time() - t0
        log.append({"step": step, "loss": loss.item(), "lr": lr, "tokens": int(inputs.numel()),
                    "harness": names[int(data["harness"][idx[0]])], "seconds": round(el, 2),
                    "step_s": round(time.time() - ts, 4)})
        if step == 1 and dn_calls[0] == 0:
            raise RuntimeError(f"the {kernel} kernel was installed but the model never called it")
        if steps is None and step == args.probe_steps:
            steps, rate = plan_steps(log, min(5, step // 2), budget - el - args.reserve_s,
                                     present)
            print(f"ft.train: plan s_per_step={rate:.3f} steps={steps} (rerun: --steps "
                  f"{steps})", flush=True)
        if step % args.print_every == 0 or step == 1:
            recent = float(np.mean([r["step_s"] for r in log[-args.print_every:]]))
            eta = (steps - step) * (rate or recent) if steps else None
            print(json.dumps({**log[-1], "recent_step_s": round(recent, 4),
                              "eta_s": eta and round(eta, 1)}), flush=True)
        if args.save_every and step % args.save_every == 0:
            save(out, model, used, meta(False), log)
    result = meta(True)
    save(out, model, used, result, log)
    try:
        from freetoken.models.loss_plot import plot_loss
        plot_loss(log, out / "loss.png")
    except ImportError as e:  # no matplotlib here: `demo_trained` plots it when shipping
        print(f"ft.train: no_loss_png reason={e}", flush=True)
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="fixed step count (a rerun)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock seconds for the whole run (setup included): plans the step "
                        "count after --probe-steps and stops, saved, before it runs out")
    p.add_argument("--reserve-s", type=float, default=8.0,
                   help="seconds of --budget-s kept for the last save")
    p.add_argument("--probe-steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--tokens-per-step", type=int, default=300000)
    p.add_argument("--unk-rate", type=float, default=0.003)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dn-kernel", choices=("auto", "fla", "torch"), default="auto")
    p.add_argument("--autotune-configs", type=int, default=1,
                   help="configs each fla kernel autotunes over (0: all; compiles take minutes)")
    p.add_argument("--init", default=None, help="an earlier run's --out to continue from")
    p.add_argument("--harnesses", default=None, help="train on these harnesses only (comma list)")
    p.add_argument("--print-every", type=int, default=25)
    p.add_argument("--save-every", type=int, default=500, help="checkpoint into --out (0: off)")
    args = p.parse_args(argv)
    if args.steps is None and args.budget_s is None:
        p.error("give --steps or --budget-s")
    train(args)


if __name__ == "__main__":
    main()

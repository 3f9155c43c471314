"""Train the demo model: a tiny `qwen3_5_moe` on the synthetic agent transcripts of `demo_data`.

    python -m freetoken.models.demo_data --out data.xz          # pre-tokenized transcripts
    python freetoken/models/train_demo.py --data data.xz --out OUT [--device cuda]

Self-contained on purpose (torch, numpy, transformers; no freetoken import), so the same file
runs on a GPU machine that has no freetoken: the model is transformers' own
`Qwen3_5MoeForCausalLM` in plain torch (its torch fallbacks of the gated DeltaNet, no fla or
causal_conv1d), so what is trained is the reference the engine is checked against.

Compact vocabulary. The data uses a few thousand of the tokenizer's 151,669 ids. Training runs
over those (`used`, sorted) plus one shared row OTHER that stands for every unused id: the
softmax counts OTHER's logit `n_unused` times (`+ log(n_unused)`), which is exactly the full-
vocabulary softmax of a model whose unused `lm_head` rows all equal OTHER's. The embedding of
OTHER is trained by replacing a few prompt tokens with it (an unknown token in a real prompt
reads as OTHER). `freetoken.models.demo_weights` expands the result to the full vocabulary.

Reproducible from `--seed`: init on the CPU from the seed, batches from a seeded generator; the
step count is fixed by `--steps` (or measured once from `--time-budget`, and recorded).
`--max-seconds` stops a run early by wall clock (the GPU machine's per-call limit); the steps it
reached and the count its schedule was set for (`planned_steps`) are both recorded.
"""
from __future__ import annotations

import argparse
import io
import json
import lzma
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

TRAIN_VERSION = 3  # v3: Claude Code's batches twice as often; a hard wall-clock stop
# how often each harness's batch comes up: Claude Code (the default `ft launch`, whose long prompt
# holds the most tools to tell apart) most, then mini (the end-to-end test)
HARNESS_WEIGHTS = {"claude_code": 4.0, "mini_tool": 2.0, "mini_text": 2.0}
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
              meta: dict[str, Any]) -> None:
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
    path.write_bytes(lzma.compress(buf.getvalue(), preset=6))


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


def make_batch(data: dict[str, Any], idx, rng, other: int, unk_rate: float):
    import torch

    lens = [int(data["lens"][i]) for i in idx]
    L = max(lens)
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

    hidden = model.model(input_ids=inputs).last_hidden_state  # [B, L, H]
    pos = mask[:, 1:]  # token t is predicted at t-1
    h = hidden[:, :-1][pos]  # [N, H]
    logits = model.lm_head(h).float()  # [N, V']
    logits[:, -1] += log_n_other
    return torch.nn.functional.cross_entropy(logits, targets[:, 1:][pos])


def train(args: argparse.Namespace) -> None:
    import torch

    for mod in ("fla", "causal_conv1d"):  # the plain-torch reference path, everywhere
        sys.modules[mod] = None  # type: ignore[assignment]
    data = load_data(Path(args.data))
    used = data["used"]
    other = len(used)
    n_other = int(data["meta"]["vocab_size"]) - len(used)
    pad = np.flatnonzero(used == model_config(1)["pad_token_id"])
    model = build_model(other + 1, args.seed, int(pad[0]) if len(pad) else None)
    if args.init:  # a second stage: start from an earlier run's weights (same data file)
        from safetensors.torch import load_file

        assert np.array_equal(np.load(Path(args.init) / "used.npy"), used), "other data file"
        init = load_file(str(Path(args.init) / "compact.safetensors"))
        model.load_state_dict({k: v.float() for k, v in init.items()})
    if args.harnesses:
        keep = [data["meta"]["harnesses"].index(h) for h in args.harnesses.split(",")]
        data["harness"] = np.where(np.isin(data["harness"], keep), data["harness"], -1)
    dev = torch.device(args.device)
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0, eps=1e-8)
    gen = batches(data, args.seed, args.tokens_per_step)
    steps, log = args.steps, []
    planned = None  # the step count the lr schedule was set for, when the wall clock cut it
    t0 = time.time()
    step, t6 = 0, 0.0
    while steps is None or step < steps:
        if time.time() - t0 > args.max_seconds:  # the machine's limit comes first: stop, save
            print(f"wall-clock stop at step {step} of {steps}", flush=True)
            planned, steps = steps, step
            break
        idx, rng = next(gen)
        inputs, targets, mask = (t.to(dev) for t in make_batch(data, idx, rng, other,
                                                               args.unk_rate))
        total = steps or args.probe_steps * 100
        warm = min(20, total // 10) if not args.init else 1
        lr = args.lr * (step + 1) / warm if step < warm else args.lr * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm))))
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
                    "harness": data["meta"]["harnesses"][int(data["harness"][idx[0]])],
                    "seconds": round(el, 2)})
        if step % args.print_every == 0 or step == 1:
            print(json.dumps(log[-1]), flush=True)
        if steps is None and step == 6:
            t6 = el
        if steps is None and step == args.probe_steps:
            # fix the step count once from the rate measured past the warm-up steps; recorded
            # for a rerun (--steps)
            rate = (el - t6) / (step - 6)
            steps = max(step + 1, step + int((args.time_budget - el) / rate))
            print(f"measured {rate:.3f} s/step -> {steps} steps", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    # bf16: what ships (and under the 16 MiB a file the GPU machine sends back)
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(out / "compact.safetensors"))
    np.save(out / "used.npy", used)
    meta = {"train_version": TRAIN_VERSION, "seed": args.seed, "steps": steps,
            "planned_steps": planned, "lr": args.lr,
            "init": args.init and json.loads((Path(args.init) / "train_meta.json").read_text()),
            "harnesses": args.harnesses,
            "tokens_per_step": args.tokens_per_step, "unk_rate": args.unk_rate,
            "data": data["meta"], "seconds": round(time.time() - t0, 1),
            "first_loss": float(np.mean([r["loss"] for r in log[:5]])),
            "final_loss": float(np.mean([r["loss"] for r in log[-20:]])),
            "torch": torch.__version__, "device": torch.cuda.get_device_name()
            if dev.type == "cuda" else "cpu"}
    import transformers

    meta["transformers"] = transformers.__version__
    (out / "train_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "loss.json").write_text(json.dumps(log) + "\n")
    print(json.dumps(meta), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=200.0,
                   help="without --steps: seconds to train, turned into a step count after "
                        "--probe-steps steps")
    p.add_argument("--probe-steps", type=int, default=20)
    p.add_argument("--max-seconds", type=float, default=float("inf"),
                   help="stop (and save) once training has run this long, whatever the steps")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--tokens-per-step", type=int, default=300000)
    p.add_argument("--unk-rate", type=float, default=0.003)
    p.add_argument("--device", default="cuda")
    p.add_argument("--init", default=None, help="an earlier run's --out to continue from")
    p.add_argument("--harnesses", default=None, help="train on these harnesses only (comma list)")
    p.add_argument("--print-every", type=int, default=25)
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()

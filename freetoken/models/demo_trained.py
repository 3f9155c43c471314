"""The trained demo model: its shipped weights (`demo_weights/`) and their expansion into a
full checkpoint.

`demo_weights/compact.safetensors` holds every tensor of the trained model (bf16) except that
`model.embed_tokens.weight` and `lm_head.weight` have one row per token the training data used
(`used_ids`, sorted full-vocabulary ids) plus a last shared row. At build time every other id
gets the shared row: that is the model `train_demo` trained (its softmax counted the shared
logit once per unused id), so the expansion is exact, and an unused id, all of whose logits
are equal to the shared one, never wins the argmax against a trained token that beats the
shared logit. `manifest.json` records the file's sha256, the data generator's version and seed,
the training run and, for data trained on compacted prompts, `prompt_compaction` (the version
the server then applies: `freetoken.chat.compaction`; the build copies the manifest into the
checkpoint as `demo_manifest.json`); the build refuses a file whose checksum differs.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from freetoken.models.loss_plot import plot_loss
from freetoken.models.train_demo import model_config

WEIGHTS_DIR = Path(__file__).resolve().parent / "demo_weights"
COMPACT = "compact.safetensors"
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def manifest(weights_dir: Path = WEIGHTS_DIR) -> dict[str, Any]:
    return json.loads((weights_dir / "manifest.json").read_text())


def trained_data(weights_dir: Path = WEIGHTS_DIR) -> tuple[int, str | None]:
    """(data version, prompt compaction) the weights were trained on (the manifest's
    `train.data`): what a test of these weights builds its held-out requests with, so the
    tests follow the shipped weights rather than the generator's newest version."""
    data = manifest(weights_dir)["train"]["data"]
    return int(data["data_version"]), data.get("prompt_compaction")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def trained_name(weights_dir: Path = WEIGHTS_DIR) -> str:
    return f"demo-qwen3_5_moe-trained-{manifest(weights_dir)['sha256'][:12]}"


def expand_vocab(compact: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """The full-vocabulary tensors from the compact ones (see the module docstring)."""
    used = compact["used_ids"].long()
    out = {k: v for k, v in compact.items() if k != "used_ids"}
    for name in VOCAB_TENSORS:
        rows = compact[name]  # [len(used) + 1, H]
        assert rows.shape[0] == len(used) + 1, name
        full = rows[-1:].expand(vocab_size, rows.shape[1]).clone()  # [V, H]
        full[used] = rows[:-1]
        out[name] = full
    return out


def trained_tensors(vocab: int, weights_dir: Path = WEIGHTS_DIR
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, full bf16 tensors over a `vocab`-row vocabulary) of the trained demo,
    checksum verified (ValueError otherwise)."""
    path = weights_dir / COMPACT
    want = manifest(weights_dir)["sha256"]
    got = sha256_file(path)
    if got != want:
        raise ValueError(f"{path}: sha256 {got} is not the manifest's {want}")
    config = {**model_config(vocab), "transformers_version": "5.24.0"}
    tensors = expand_vocab(load_file(str(path)), vocab)
    return config, {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}


def build_trained_demo(out_dir: Path, vocab: int,
                       write_checkpoint: Callable[[Path, dict, dict], None],
                       weights_dir: Path = WEIGHTS_DIR) -> None:
    """Write the trained demo (the weights in `weights_dir`: the shipped ones, or a `ship`
    output to try) into `out_dir` with demo.py's checkpoint writer (passed in: demo.py imports
    this module, not the other way round)."""
    config, tensors = trained_tensors(vocab, weights_dir)
    write_checkpoint(out_dir, config, tensors)
    (out_dir / "demo_manifest.json").write_text(json.dumps(manifest(weights_dir), indent=2)
                                                + "\n")


def ship(train_out: Path, weights_dir: Path = WEIGHTS_DIR) -> dict[str, Any]:
    """Turn a `train_demo` output directory into the shipped files: compact bf16 tensors with
    `used_ids`, manifest.json (checksum, versions, training record) and loss.png."""
    import numpy as np
    from safetensors.torch import save_file

    state = load_file(str(train_out / "compact.safetensors"))
    used = torch.from_numpy(np.load(train_out / "used.npy")).long()
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(state.items())}
    tensors["used_ids"] = used.to(torch.int32)
    weights_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(weights_dir / COMPACT), metadata={"format": "pt"})
    meta = json.loads((train_out / "train_meta.json").read_text())
    man = {"sha256": sha256_file(weights_dir / COMPACT), "bytes": (weights_dir / COMPACT)
           .stat().st_size, "used_ids": len(used), "train": meta}
    if meta.get("data", {}).get("prompt_compaction"):  # the server renders the model that cut
        man["prompt_compaction"] = meta["data"]["prompt_compaction"]
    (weights_dir / "manifest.json").write_text(json.dumps(man, indent=2) + "\n")
    plot_loss(json.loads((train_out / "loss.json").read_text()), weights_dir / "loss.png")
    return man


if __name__ == "__main__":
    import sys

    # python -m freetoken.models.demo_trained TRAIN_OUT [WEIGHTS_DIR (default: the package's)]
    dest = Path(sys.argv[2]) if len(sys.argv) > 2 else WEIGHTS_DIR
    print(json.dumps(ship(Path(sys.argv[1]), dest), indent=2))

"""Tuned launch configs as data: `freetoken/kernels/triton/configs/<gpu>.json`, one file per GPU
model, read at a kernel's first launch on that GPU and kept.

`<gpu>` is `torch.cuda.get_device_name()` lower-cased with every run of other characters than
letters and digits turned into `_` ("NVIDIA H200" -> `nvidia_h200.json`). A file maps a kernel
family to shape keys to configs:

    {"fused_moe_decode": {"H=2048,I=512": {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 256,
                                                       "num_warps": 4},
                                           "down": {...}},
                          "default": {...}}}

A lookup takes the exact shape key, else the family's `default`, else the caller's built-in
config; a part (`gate_up`, `down`) a file leaves out keeps the built-in one. A file that does
not parse, or names a part or key the kernel does not have, raises ValueError naming the file
at the first launch (never a silently ignored typo). `scripts/bench_triton_moe.py --sweep`
prints an entry for the GPU it ran on.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DECODE_KEYS = frozenset({"BLOCK_N", "BLOCK_K", "num_warps"})


def gpu_file_name(device_name: str) -> str:
    """The config file of a GPU model: "NVIDIA H200" -> "nvidia_h200.json"."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_") + ".json"


@functools.cache
def load_file(path: Path) -> dict:
    """The parsed config file at `path` ({} when there is none); cached per path."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"{path}: expected {{family: {{shape key: config}}}}")
    return data


def merge_config(builtin: dict[str, dict], tuned: dict, where: str) -> dict[str, dict]:
    """`builtin` with the parts `tuned` gives replaced key by key (values as ints)."""
    out = {part: dict(tiles) for part, tiles in builtin.items()}
    # a config that is not an object of parts fails as one unknown part
    for part, tiles in tuned.items() if isinstance(tuned, dict) else [("?", tuned)]:
        if part not in builtin or not isinstance(tiles, dict) or set(tiles) - DECODE_KEYS:
            raise ValueError(f"{where}: unknown part or key in {part}: {tiles!r} (parts "
                             f"{sorted(builtin)}, keys {sorted(DECODE_KEYS)})")
        out[part].update({k: int(v) for k, v in tiles.items()})
    return out


def lookup(family: str, shape_key: str, builtin: dict[str, dict], device_name: str | None,
           config_dir: Path = CONFIG_DIR) -> dict[str, dict]:
    """The config of `family` at `shape_key` for the GPU `device_name` (None: no GPU, the
    built-in config)."""
    if device_name is None:
        return builtin
    path = config_dir / gpu_file_name(device_name)
    entries = load_file(path).get(family, {})
    tuned = entries.get(shape_key, entries.get("default"))
    if tuned is None:
        return builtin
    return merge_config(builtin, tuned, f"{path} {family}.{shape_key}")

"""Random weights in a real shape, the values `ft bench checkpoint` writes
(bench/checkpoint_writer.py), and the same tensors made in memory at load time for a
`--format random` directory (config, tokenizer and the marker `ft_random_weights.json`, no
weight files): `ft serve` on a shape whose checkpoint does not fit the disk (Qwen3.6 at 40
layers is 71 GB; the H200 host has 64 GiB).

Speed: `torch.normal_` on bf16 runs at well under 100 MB/s. Matrices are windows of one random
block (`RandomBlock`), tensors larger than the block filled by window copies; norms, A_log and
dt_bias get the values a trained model has near.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from freetoken.checkpoint.ftw_write import ftw_order
from freetoken.checkpoint.host_buffer import HostArena, TensorSpec
from freetoken.checkpoint.layout import expected_runtime, int_tensors
from freetoken.log import get_logger, kv
from freetoken.types.model_config import ModelConfig

log = get_logger("model")
RANDOM_MARKER = "ft_random_weights.json"
# gpt-oss's MXFP4 experts: random e2m1 codes under e8m0 scales of 2^-9 .. 2^-7 (|w| <= 6·2^-7,
# about the N(0, 0.02) of the other matrices)
_MX_SCALE_LO, _MX_SCALE_SPAN = 118, 3
_STD = 0.02


class RandomBlock:
    """One random N(0, 0.02) block; `take(n, k)` is the k-th distinct contiguous window."""

    def __init__(self, dtype: torch.dtype, numel: int = 1 << 26, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n = numel
        self.data = (torch.randn(numel + 65536, generator=g) * _STD).to(dtype)

    def take(self, numel: int, k: int) -> Tensor:
        if numel <= self.n:
            off = (k * 7919) % 65536 + (k * 104729) % max(1, self.n - numel + 1)
            off = min(off, self.n + 65536 - numel)
            return self.data[off:off + numel]
        out = torch.empty(numel, dtype=self.data.dtype)
        for i, s in enumerate(range(0, numel, self.n)):
            m = min(self.n, numel - s)
            out[s:s + m].copy_(self.take(m, k * 31 + i))
        return out


def is_mx_name(name: str) -> bool:
    return name.endswith(("_blocks", "_scales"))


def mx_value(name: str, shape: tuple[int, ...], k: int) -> Tensor:
    """gpt-oss MXFP4 `*_blocks` (random codes) or `*_scales` (module constants) of `shape`."""
    g = torch.Generator().manual_seed(k)
    if name.endswith("_blocks"):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    return torch.randint(_MX_SCALE_LO, _MX_SCALE_LO + _MX_SCALE_SPAN, shape, dtype=torch.uint8,
                         generator=g)


def hash_table(shape: tuple[int, ...], experts: int, k: int) -> Tensor:
    """A random DeepSeek-V4 `tid2eid` [vocab, top_k]: a token's top_k experts distinct, int64."""
    g = torch.Generator().manual_seed(k)
    first = torch.randint(0, experts, (shape[0], 1), generator=g)
    return (first + torch.arange(shape[1])) % experts


def dsv4_constant(name: str) -> float | None:
    """DeepSeek-V4's hyper-connection biases / scales, sinks and compressor position biases
    as transformers initialises them (None: not one of them)."""
    if name.endswith(("_hc.base", "hc_head.hc_base", "position_bias", "self_attn.sinks")):
        return 0.0
    if name.endswith(("_hc.scale", "hc_head.hc_scale")):
        return 1.0
    return None


def random_value(name: str, shape: tuple[int, ...], cfg: ModelConfig, block: RandomBlock, k: int,
           dtype: torch.dtype) -> Tensor:
    if is_mx_name(name):
        return mx_value(name, shape, k)
    if name.endswith("tid2eid"):  # int64 whatever `dtype`
        return hash_table(shape, cfg.num_experts, k)
    fill = dsv4_constant(name)
    if fill is not None:
        return torch.full(shape, fill, dtype=dtype)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1, 16).log_().to(dtype)
    if name.endswith("dt_bias") or (name.endswith("norm.weight") and "linear_attn" in name):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("norm.bias"):  # GLM-5's indexer LayerNorm
        return torch.zeros(shape, dtype=dtype)
    if "norm" in name:
        return torch.full(shape, 0.0 if cfg.zero_centered_norm else 1.0, dtype=dtype)
    return block.take(math.prod(shape), k).view(shape)


def is_random_checkpoint(model_dir: str | Path) -> bool:
    """Whether `model_dir` was written by `write_checkpoint(fmt="random")` (no weight files)."""
    return (Path(model_dir) / RANDOM_MARKER).is_file()


def random_runtime_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype,
                           pin: bool = False, progress: bool = True) -> dict[str, Tensor]:
    """The runtime-named tensors `fmt="ftw"` writes for this shape and seed (the same values),
    made in the host arenas an FTW read fills (routed experts, the rest), then pinned in place
    when `pin`: what `read_weights` returns for a checkpoint on disk."""
    seed = int(json.loads((Path(model_dir) / RANDOM_MARKER).read_text()).get("seed", 0))
    stored = cfg.torch_dtype  # the values FTW stores; another `dtype` is a cast of them
    block = RandomBlock(stored, numel=min(1 << 26, cfg.vocab_size * cfg.hidden_size), seed=seed)
    torch.manual_seed(seed)
    shapes = expected_runtime(cfg)
    names = ftw_order(list(shapes))
    groups: dict[str, list[str]] = {"experts": [], "rest": []}
    for n in names:
        groups["experts" if ".mlp.experts." in n else "rest"].append(n)
    ints = int_tensors(cfg)  # deepseek_v4's tid2eid: int64, as FTW stores it
    arenas = {k: HostArena([TensorSpec(n, tuple(shapes[n]), torch.int64 if n in ints else dtype)
                            for n in v], k) for k, v in groups.items()}
    where = {n: a for a in arenas.values() for n in a.tensors}
    total = sum(a.nbytes for a in arenas.values())
    with tqdm(total=total, desc="random weights", unit="B", unit_scale=True,
              disable=not progress, leave=False) as bar:
        for k, n in enumerate(names):
            t = where[n].tensors[n]
            t.copy_(random_value(n, tuple(shapes[n]), cfg, block, k, stored))
            bar.update(t.numel() * t.element_size())
    if pin:
        for a in arenas.values():
            a.pin()
    out: dict[str, Tensor] = {}
    for a in arenas.values():
        out.update(a.tensors)
    log.info(kv("random_weights", dir=model_dir, tensors=len(out), gb=f"{total / 1e9:.2f}",
                seed=seed, pinned=pin and all(a.pinned for a in arenas.values() if a.nbytes)))
    return out

"""Read an HF safetensors checkpoint (single file or sharded) into runtime-named tensors.

Contract of `load_checkpoint`:
* Every file is memory-mapped (`safe_open`); only headers are read until validation passes.
* Validation comes first: every tensor `expected_tensors(cfg)` names must be present with its
  shape, else `CheckpointError` naming the tensor, the expected and found shape and the file.
  A layer's routed experts may be stored per expert (HF layout) or already fused as
  `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I]. Tensors the model
  does not use (`model.visual.*`, `mtp.*`, ...) are skipped with one log line. DeepSeek-V4's
  other namings (DeepSeek's released ones, `save_pretrained`'s) are read as transformers'
  names (`layout.disk_aliases`); its `tid2eid` tables come back int64.
* Returned names: the prefix normalised to `model.`, `lm_head.weight` top-level, experts as one
  bank per layer `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H] (rows 0..I-1 gate,
  I..2I-1 up) and `...down_proj` [E, H, I]; qwen3_next linear attention converted to the qwen3_5
  layout (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`). Every tensor has `dtype` and
  lives on `device`. Tied embeddings add no `lm_head.weight`.
* FP8 block-scaled checkpoints (`quantization_config` fp8, checkpoint/fp8.py): the routed
  experts come back as `freetoken.kernels.quant.QuantBank`s under the bank names (FP8 on the host);
  every other FP8 weight is dequantized with its `weight_scale_inv` into `dtype`.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import Tensor
from tqdm import tqdm

from freetoken.checkpoint import fp8
from freetoken.checkpoint.layout import (
    Shape,
    disk_aliases,
    expected_tensors,
    expert_bank_names,
    fp32_tensors,
    fused_expert_tensors,
    int_tensors,
    runtime_name,
)
from freetoken.checkpoint.split_fused import split_ba, split_qkvz
from freetoken.log import get_logger, kv
from freetoken.types.model_config import ExpertFormat, ModelConfig

log = get_logger("checkpoint")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The checkpoint does not match the model config (or cannot be read)."""


class TensorInfo(NamedTuple):
    file: Path
    shape: Shape
    key: str = ""  # the name in the file, when it is stored under another spelling


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, or the single file."""
    d = Path(model_dir)
    index = d / INDEX_FILE
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from None
        files = [d / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index} names shard {f.name}, which does not exist")
        return files
    if (d / SINGLE_FILE).exists():
        return [d / SINGLE_FILE]
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {d}")


def scan_headers(files: list[Path], cfg: ModelConfig | None = None) -> dict[str, TensorInfo]:
    """Name → (file, shape) from the safetensors headers only (no tensor data is read). With
    `cfg`, names a family spells otherwise on disk come back as `expected_tensors` names
    (`layout.disk_aliases`: DeepSeek-V4), their stored name in `key`."""
    found: dict[str, TensorInfo] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            keys = list(h.keys())
            alias = disk_aliases(cfg, keys) if cfg is not None else {}
            for key in keys:
                name = alias.get(key, key)
                if name in found:
                    raise CheckpointError(
                        f"tensor {name} is stored twice: {found[name].file.name} and {f.name}"
                        + (f" (as {key})" if key != name else ""))
                found[name] = TensorInfo(f, tuple(h.get_slice(key).get_shape()),
                                         key if key != name else "")
    return found


def resolve_expected(cfg: ModelConfig, found: dict[str, TensorInfo]) -> dict[str, Shape]:
    """`expected_tensors(cfg)`, with a layer's per-expert names swapped for the fused banks
    wherever the checkpoint stores that layer fused."""
    expected = expected_tensors(cfg)
    if cfg.model_type == "gpt_oss":  # its experts are always fused (checkpoint/gpt_oss.py)
        return expected
    for i in cfg.moe_layers:
        gate_up, down = expert_bank_names(cfg, i)
        if gate_up not in found and down not in found:
            continue
        per_expert = f"{cfg.weight_prefix}layers.{i}.{cfg.moe_module}.experts."
        expected = {
            k: v for k, v in expected.items()
            if not (k.startswith(per_expert) and k[len(per_expert)].isdigit())
        }
        expected.update(fused_expert_tensors(cfg, i))
    return expected


def _where_missing(model_dir: Path, name: str) -> str:
    """The file a missing tensor should have been in: its shard per the index, or the file."""
    index = model_dir / INDEX_FILE
    if index.exists():
        shard = json.loads(index.read_text())["weight_map"].get(name)
        return f"{model_dir / shard} (per {index.name})" if shard else str(index)
    return str(model_dir / SINGLE_FILE)


def validate(
    cfg: ModelConfig, found: dict[str, TensorInfo], model_dir: Path
) -> dict[str, Shape]:
    """Check names and shapes; returns the expected set. Raises `CheckpointError` on the
    first problem (with a count of the others), logs and ignores extra tensors."""
    expected = resolve_expected(cfg, found)
    missing = [n for n in expected if n not in found]
    if missing:
        name = missing[0]
        more = f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"tensor {name} is missing from {_where_missing(model_dir, name)}: expected shape "
            f"{list(expected[name])}, found none{more}"
        )
    for name, shape in expected.items():
        info = found[name]
        if info.shape != shape:
            raise CheckpointError(
                f"tensor {name} in {info.file}: expected shape {list(shape)}, found "
                f"{list(info.shape)} (config {cfg.model_type})"
            )
    extra = [n for n in found if n not in expected]
    if extra:
        groups = Counter(".".join(n.split(".")[:2]) for n in extra)
        log.info(kv("skip_unused", tensors=len(extra), groups=dict(groups.most_common(4))))
    return expected


class _Reader:
    """Open handles to every shard; `get(name)` reads one tensor and casts/moves it."""

    def __init__(self, stack: ExitStack, found: dict[str, TensorInfo], dtype: torch.dtype,
                 device: torch.device, bar: Any) -> None:
        self.found, self.dtype, self.device, self.bar = found, dtype, device, bar
        files = {info.file for info in found.values()}
        self.handles = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in files}
        self.done: set[str] = set()

    def raw(self, name: str) -> Tensor:
        info = self.found[name]
        t = self.handles[info.file].get_tensor(info.key or name)
        self.done.add(name)
        self.bar.update(1)
        return t

    def get(self, name: str, dtype: torch.dtype | None = None) -> Tensor:
        return self.raw(name).to(device=self.device, dtype=dtype or self.dtype).contiguous()


def _load_experts(cfg: ModelConfig, layer: int, rd: _Reader, out: dict[str, Tensor]) -> None:
    """Per-layer expert banks. E experts, I moe intermediate, H hidden."""
    disk_gate_up, disk_down = expert_bank_names(cfg, layer)
    gate_up_name, down_name = expert_bank_names(cfg, layer, prefix="model.")
    if disk_gate_up in rd.found:
        out[gate_up_name] = rd.get(disk_gate_up)  # [E, 2I, H]
        out[down_name] = rd.get(disk_down)  # [E, H, I]
        return
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gate_up = torch.empty(E, 2 * I, H, dtype=rd.dtype, device=rd.device)  # [E, 2I, H]
    down = torch.empty(E, H, I, dtype=rd.dtype, device=rd.device)  # [E, H, I]
    p = f"{cfg.weight_prefix}layers.{layer}.{cfg.moe_module}.experts."
    g, u, dn = cfg.expert_names  # gate_proj / up_proj / down_proj (kimi_linear: w1 / w3 / w2)
    for e in range(E):
        gate_up[e, :I].copy_(rd.raw(f"{p}{e}.{g}.weight"))  # [I, H]
        gate_up[e, I:].copy_(rd.raw(f"{p}{e}.{u}.weight"))  # [I, H]
        down[e].copy_(rd.raw(f"{p}{e}.{dn}.weight"))  # [H, I]
    out[gate_up_name], out[down_name] = gate_up, down


def _load_fused_linear_attn(cfg: ModelConfig, disk_prefix: str, rd: _Reader,
                            out: dict[str, Tensor]) -> None:
    rt = runtime_name(cfg, disk_prefix)
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    qkv, z = split_qkvz(rd.raw(f"{disk_prefix}in_proj_qkvz.weight"), Hk, Hv,
                        cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    b, a = split_ba(rd.raw(f"{disk_prefix}in_proj_ba.weight"), Hk, Hv)
    for name, t in (("in_proj_qkv", qkv), ("in_proj_z", z), ("in_proj_b", b), ("in_proj_a", a)):
        out[f"{rt}{name}.weight"] = t.to(device=rd.device, dtype=rd.dtype).contiguous()


def load_checkpoint(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    progress: bool = True,
    pin: bool = False,
    threads: int | None = None,
    stats: dict[str, Any] | None = None,
) -> dict[str, Tensor]:
    """Validate, then read every tensor the model needs, in runtime names (module docstring).
    Tensors stored in `dtype` are read in place into host arenas (st_inplace.py), which `pin`
    then registers with CUDA in place (only on a CPU `device`)."""
    from freetoken.checkpoint.st_inplace import InPlace

    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    found = scan_headers(files, cfg)
    expected = validate(cfg, found, model_dir)
    dev = torch.device(device)
    if cfg.model_type == "gpt_oss":
        return _load_gpt_oss(cfg, found, dtype, dev, progress)
    t0 = time.perf_counter()
    fp32 = fp32_tensors(cfg)  # kept in float32 whatever `dtype` is (deepseek's router)
    ints = int_tensors(cfg)  # int64 as stored (deepseek_v4's tid2eid)
    fmt = cfg.expert_format
    block = fmt.block if isinstance(fmt, ExpertFormat) and fmt.name == "fp8" else 0
    try:
        q8 = fp8.quantized_weights(found, expected, block) if block else {}
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    # the float32 and FP8 ones take the converting path below, never an in-place read
    plan = InPlace(cfg, {n: found[n].file for n in expected if n not in fp32 and n not in q8},
                   dict(expected), dtype, {i.key: n for n, i in found.items() if i.key})
    nbytes = sum(r.dest.numel() for r in plan.reads)
    with tqdm(total=nbytes, desc="reading weights", unit="B", unit_scale=True,
              disable=not progress or not nbytes, leave=False) as bar:
        out = {n: t.to(dev) for n, t in plan.read(threads, bar).items()}
    t_inplace = time.perf_counter() - t0
    with ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=len(expected) - len(plan.consumed),
                                       desc="converting weights", unit="t", leave=False,
                                       disable=not progress or len(plan.consumed) == len(expected)))
        rd = _Reader(stack, {n: found[n] for n in {*expected, *q8.values()}}, dtype, dev, bar)
        rd.done |= plan.consumed
        for i in cfg.moe_layers:
            names = expert_bank_names(cfg, i, prefix="model.")
            if names[0] in out:
                continue
            if block and expert_bank_names(cfg, i)[0] in rd.found:
                raise CheckpointError(f"layer {i}: FP8 experts stored as fused banks are not "
                                      "supported (per-expert tensors with weight_scale_inv are)")
            if q8:  # FP8, per expert
                try:
                    banks = fp8.load_fp8_experts(cfg, i, rd.raw, block)
                except ValueError as e:
                    raise CheckpointError(str(e)) from None
                out[names[0]], out[names[1]] = (b.to(dev) for b in banks)
            else:
                _load_experts(cfg, i, rd, out)
        for name, s in q8.items():  # every other FP8 weight: dequantized into `dtype`
            if name not in rd.done:
                out[runtime_name(cfg, name)] = fp8.dequantize_weight(
                    rd.raw(name), rd.raw(s), block, dtype).to(dev)
        if cfg.linear_fused_qkvz:
            for i in cfg.linear_attention_layers:
                _load_fused_linear_attn(cfg, f"{cfg.weight_prefix}layers.{i}.linear_attn.", rd, out)
        for name in expected:
            if name not in rd.done:  # everything not converted above is renamed as is
                keep = torch.float32 if name in fp32 else torch.int64 if name in ints else None
                out[runtime_name(cfg, name)] = rd.get(name, keep)
    t1 = time.perf_counter()
    if pin and dev.type == "cpu":
        plan.pin()
    if stats is not None:  # for `ft bench load`
        stats.update(bytes=sum(f.stat().st_size for f in files), read_s=t1 - t0,
                     in_place_s=t_inplace, post_s=time.perf_counter() - t1, direct=False,
                     pinned=bool(pin and dev.type == "cpu" and plan.consumed))
    log.info(kv("loaded", dir=model_dir, files=len(files), tensors=len(out), dtype=dtype,
                device=dev, skipped=len(found) - len(expected), in_place=len(plan.consumed),
                in_place_gb=f"{nbytes / 1e9:.2f}", in_place_s=f"{t_inplace:.2f}",
                seconds=f"{time.perf_counter() - t0:.2f}"))
    return out


def _load_gpt_oss(cfg: ModelConfig, found: dict[str, TensorInfo], dtype: torch.dtype,
                  dev: torch.device, progress: bool) -> dict[str, Tensor]:
    """gpt-oss: every tensor through the converting path (checkpoint/gpt_oss.py: the experts
    transposed and regrouped, or kept MXFP4)."""
    from freetoken.checkpoint.gpt_oss import runtime_tensors

    t0 = time.perf_counter()
    with ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=len(found), desc="converting weights", unit="t",
                                       leave=False, disable=not progress))
        rd = _Reader(stack, found, dtype, dev, bar)
        out = {n: t.to(dev) for n, t in runtime_tensors(cfg, rd.raw, dtype).items()}
    log.info(kv("loaded", family="gpt_oss", tensors=len(out), dtype=dtype, device=dev,
                experts=getattr(cfg.expert_format, "name", str(dtype)),
                seconds=f"{time.perf_counter() - t0:.2f}"))
    return out

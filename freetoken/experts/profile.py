"""The machine's measured bandwidth profile on disk, and the expert shapes it is keyed by.

`ft bench bw` measures and saves a `BandwidthProfile`; `configure_experts` loads the one for this
GPU, CPU, expert shape and dtype to choose the backend and q*. Profiles are JSON under
`$XDG_CACHE_HOME/freetoken/profiles/`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.experts.cost_model import BandwidthProfile
from freetoken.kernels.cpu.ext import cache_root, cpu_model
from freetoken.log import get_logger, kv
from freetoken.types.model_config import ExpertFormat, expert_nbytes

log = get_logger("experts")


@dataclass(frozen=True)
class ExpertShape:
    hidden: int
    inter: int
    experts: int
    top_k: int
    layers: int

    def expert_bytes(self, dtype: torch.dtype | ExpertFormat) -> int:
        return expert_nbytes(self.hidden, self.inter, dtype)


def _from_preset(name: str) -> ExpertShape:
    from freetoken.types.presets import preset_config

    cfg = preset_config(name)
    return ExpertShape(hidden=cfg.hidden_size, inter=cfg.moe_intermediate_size,
                       experts=cfg.num_experts, top_k=cfg.top_k, layers=len(cfg.moe_layers))


# the expert shapes bandwidth profiles are measured for: the presets' own dimensions
# (gpt-oss-20b's experts have gpt-oss-120b's dimensions, so it finds that profile)
SHAPES: dict[str, ExpertShape] = {name: _from_preset(name)
                                  for name in ("qwen3.6-35b-a3b", "gpt-oss-120b")}


def preset_format(name: str) -> torch.dtype | ExpertFormat:
    """The bank format a preset's checkpoint stores its experts in (gpt-oss: MXFP4; a dense
    preset: its dtype)."""
    from freetoken.types.presets import preset_config

    return preset_config(name).expert_format


def shape_for(cfg) -> tuple[str, ExpertShape]:
    """(profile name, expert shape) of a model config: a preset's name when its expert
    dimensions match one (the name `ft bench bw --shape` saves under), else "HxI"."""
    for name, sh in SHAPES.items():
        if (sh.hidden, sh.inter) == (cfg.hidden_size, cfg.moe_intermediate_size):
            return name, sh
    return (f"{cfg.hidden_size}x{cfg.moe_intermediate_size}",
            ExpertShape(hidden=cfg.hidden_size, inter=cfg.moe_intermediate_size,
                        experts=cfg.num_experts, top_k=cfg.top_k, layers=len(cfg.moe_layers)))


def profile_key(shape_name: str, dtype: torch.dtype | ExpertFormat) -> dict[str, str]:
    """A profile's key; a quantized expert format keys as e.g. "fp8-b128" (its expert bytes
    differ, and so do the CPU kernel's rates)."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    name = f"{dtype.name}-b{dtype.block}" if isinstance(dtype, ExpertFormat) else str(dtype)
    return {"gpu": gpu, "cpu": cpu_model(), "shape": shape_name, "dtype": name}


def profile_path(key: dict[str, str]) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "profiles" / f"bw-{key['shape']}-{digest}.json"


def save_profile(profile: BandwidthProfile) -> Path:
    path = profile_path(profile.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(profile), indent=2, sort_keys=True))
    tmp.replace(path)
    log.info(kv("bw_profile_saved", path=path))
    return path


def load_profile(key: dict[str, str]) -> BandwidthProfile | None:
    """The saved profile for exactly this key, or None (missing or unreadable)."""
    path = profile_path(key)
    try:
        data = json.loads(path.read_text())
        prof = BandwidthProfile(**data)
    except (OSError, ValueError, TypeError) as e:
        log.debug(kv("bw_profile_missing", path=path, reason=type(e).__name__))
        return None
    return prof if prof.key == key else None

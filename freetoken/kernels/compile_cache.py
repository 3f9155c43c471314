"""The persistent kernel compile cache: Triton, flashinfer, TorchInductor and torch C++/CUDA
extensions compile into `$XDG_CACHE_HOME/freetoken/kernels/<key>/` (default `~/.cache/...`),
so a restart of `ft serve` on the same machine compiles nothing (issue #24 item 2, #20 item 6).

`<key>` names the GPU model(s) and the versions of torch, Triton and flashinfer: a driver or
library upgrade, or another GPU, starts a fresh directory instead of reusing binaries built
for something else. Shapes key the entries inside it: Triton hashes each kernel's source,
signature, specialisation and constexprs; flashinfer names each JIT module by its template
parameters.

`configure()` must run before Triton or flashinfer is imported (flashinfer reads its
workspace at import): the `ft` dispatcher calls it first thing. It sets only what the user
has not set (an explicit `TRITON_CACHE_DIR` wins) and never imports torch, Triton or
flashinfer itself: the GPU model comes from the NVIDIA driver's /proc entries, the versions
from package metadata.
"""
from __future__ import annotations

import os
import re
import sys
from collections.abc import MutableMapping
from importlib import metadata
from pathlib import Path

# env var -> sub-directory of the keyed cache root
DIRS = {"TRITON_CACHE_DIR": "triton", "FLASHINFER_WORKSPACE_BASE": "flashinfer",
        "TORCHINDUCTOR_CACHE_DIR": "inductor", "TORCH_EXTENSIONS_DIR": "torch_extensions"}
_GPUS = Path("/proc/driver/nvidia/gpus")
CONFIGURED: dict | None = None  # what the last `configure()` did (for logs and tests)


def gpu_models(root: Path = _GPUS) -> list[str]:
    """The NVIDIA GPU models the driver lists (`Model:` of each information file), sorted and
    deduplicated; [] without an NVIDIA driver."""
    out = set()
    try:
        for info in root.glob("*/information"):
            for line in info.read_text(errors="replace").splitlines():
                if line.startswith("Model:"):
                    out.add(line.split(":", 1)[1].strip())
    except OSError:
        return []
    return sorted(out)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def cache_key(gpus: list[str] | None = None) -> str:
    """`<gpu>-torch<v>-triton<v>-flashinfer<v>`, filesystem-safe."""
    gpus = gpu_models() if gpus is None else gpus
    fi = _version("flashinfer-python")
    if fi == "none":
        fi = _version("flashinfer")
    raw = (f"{'+'.join(gpus) or 'nogpu'}-torch{_version('torch')}-triton{_version('triton')}"
           f"-flashinfer{fi}")
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", raw)


def cache_root(environ: MutableMapping[str, str] | None = None) -> Path:
    """`$XDG_CACHE_HOME/freetoken/kernels` (default `~/.cache/freetoken/kernels`)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "freetoken" / "kernels"


def configure(environ: MutableMapping[str, str] | None = None,
              gpus: list[str] | None = None) -> dict:
    """Point every kernel compile cache the user has not set at the keyed directory (created);
    returns (and keeps in CONFIGURED) `{dir, key, set, kept, late}`: `late` lists the kernel
    libraries imported before this ran (their caches may already be elsewhere)."""
    global CONFIGURED
    env = os.environ if environ is None else environ
    key = cache_key(gpus)
    root = cache_root(env) / key
    set_, kept = {}, {}
    for var, sub in DIRS.items():
        if env.get(var):
            kept[var] = env[var]
            continue
        path = root / sub
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only home: leave the library's own default
            continue
        env[var] = set_[var] = str(path)
    late = [m for m in ("triton", "flashinfer") if m in sys.modules]
    CONFIGURED = {"dir": str(root), "key": key, "set": set_, "kept": kept, "late": late}
    return CONFIGURED

"""Which OpenMP runtime the C++ CPU kernels link.

torch's wheels ship their own libgomp (torch/lib/libgomp*.so*). A kernel linked with plain
`-fopenmp` records the system's `libgomp.so.1`; where torch's copy carries that soname, the
loader reuses the copy torch already loaded, but where it is renamed (auditwheel's
`libgomp-<hash>.so.1`) the process ends up with two OpenMP runtimes: two sets of ICVs and
thread pools, and OMP_PROC_BIND places both pools' threads on the same cores. So the kernels
link torch's copy by name, with an rpath to it; `-z defs` makes a runtime too old for the
compiler's OpenMP calls fail the link (then `ext.build` falls back to the system runtime).
"""
from __future__ import annotations

from pathlib import Path

import torch


def torch_openmp_ldflags() -> list[str] | None:
    """Link flags for torch's bundled libgomp, or None when torch ships none."""
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(p.name for p in lib.glob("libgomp*.so*"))
    if not found:
        return None
    return [f"-L{lib}", f"-l:{found[0]}", f"-Wl,-rpath,{lib}", "-Wl,-z,defs"]


def openmp_runtimes() -> list[str]:
    """The OpenMP runtime files mapped into this process (Linux; [] elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f
                           if "libgomp" in ln or "libiomp" in ln or "libomp" in ln})
    except OSError:
        return []

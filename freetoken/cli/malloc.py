"""glibc malloc settings of an `ft` process, made at its start (issue 22): the most arenas,
and a fixed mmap threshold.

What the measurement found (docs/server.md "Memory: malloc", scripts/arena_rss.py): under
mixed traffic `ft serve --model demo` and `ft agent-proxy`'s engine grew 15-40 MB a minute
with glibc's defaults while the bytes in use stayed flat — the growth was free memory kept in
the heap (`malloc_trim` gave 214 MB of 940 back). The cause is glibc's *dynamic* mmap
threshold: once a large block (a CPU tensor: activations, logits rows) that had its own
mapping is freed, glibc raises the threshold to that size, so the next large blocks come from
the heap, whose freed space is reused only by blocks that fit it; prompts of other lengths
keep asking for sizes that do not, and the heap grows. A fixed threshold (`mallopt(
M_MMAP_THRESHOLD)`, which also turns the dynamic raise off) gives every block of at least
that size its own mapping, returned to the system when freed: RSS flat. The arena cap changed
nothing there (the processes have at most 6 threads), so it is off by default.

- `FT_MALLOC_MMAP_THRESHOLD` (freetoken/envs.py): bytes, default 0 (glibc's dynamic
  threshold); 131072 (glibc's initial value, kept fixed) bounds the heap. Not the default: in
  the closed-loop CPU demo mix it served 11-16% fewer requests (every block of 128 KiB or more
  mapped and unmapped), and the hot paths it touches on a GPU host (the CPU expert branch's
  host tensors) are not measured with it yet.
- `FT_MALLOC_ARENA_MAX`: the most arenas, default 0 (glibc's, 8 per core).

glibc's own `MALLOC_MMAP_THRESHOLD_` / `MALLOC_ARENA_MAX`, when set, win (applied at exec;
nothing is changed over them). The arena cap must come before the process starts threads (an
arena a thread has stays): `ft`'s entry point (`freetoken.cli.main`) applies both first of all.
Not glibc (no `mallopt`): nothing is set, and the start line says so (`applied=False`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Mapping
from dataclasses import dataclass

from freetoken.envs import FT_MALLOC_ARENA_MAX, FT_MALLOC_MMAP_THRESHOLD, EnvVar

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's malloc.h
# (ours, glibc's own variable, mallopt parameter, field of the start line)
SETTINGS = ((FT_MALLOC_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD,
             "mmap_threshold"),
            (FT_MALLOC_ARENA_MAX, "MALLOC_ARENA_MAX", M_ARENA_MAX, "arena_max"))


@dataclass(frozen=True)
class Setting:
    """One setting as the start made it: `value` (None: glibc's default, or glibc's own
    variable when `source` names it), and whether mallopt took it (`applied`)."""

    field: str
    value: int | None
    source: str
    applied: bool


def wanted(var: EnvVar, glibc_name: str, environ: Mapping[str, str]) -> tuple[int | None, str]:
    """The value to set and where it comes from; raises ValueError for a value that is not a
    non-negative integer."""
    if glibc_name in environ:
        return None, glibc_name
    n = var.value(environ)  # a count: an int >= 0, else ValueError naming the variable
    return (n or None), var.name


def apply(environ: Mapping[str, str]) -> list[Setting]:
    """Make every setting from `environ` (module docstring); ValueError before any is made
    when one is invalid."""
    asked = [(wanted(var, glibc, environ), param, field) for var, glibc, param, field in SETTINGS]
    libc = _libc()
    out = []
    for (n, source), param, field in asked:
        ok = n is not None and libc is not None and bool(libc.mallopt(param, n))
        out.append(Setting(field, n, source, ok))
    return out


def log_fields(settings: list[Setting]) -> dict[str, object]:
    """`mmap_threshold=131072 mmap_threshold_from=FT_MALLOC_MMAP_THRESHOLD ... applied=`."""
    fields: dict[str, object] = {}
    for s in settings:
        fields[s.field] = s.value if s.value is not None else "glibc_default"
        fields[f"{s.field}_from"] = s.source
    fields["applied"] = ",".join(s.field for s in settings if s.applied) or "none"
    return fields


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:  # not glibc
        return None

"""Every `FT_*` environment variable the package reads, declared once: name, default, meaning.

Read them through `VAR.get()` at the point of use (never at import time), so a test or a
launcher that sets one before the call is honoured. The kernels read `FT_CPU_ISA` from here
(the one freetoken module they import).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    doc: str

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        return (os.environ if environ is None else environ).get(self.name, self.default)


FT_API_KEY = EnvVar("FT_API_KEY", None,
                    "the API key `ft serve` requires (one source at a time: --api-key, "
                    "--api-key-file or this)")
FT_CPU_ISA = EnvVar("FT_CPU_ISA", "auto",
                    "the C++ CPU kernels' instruction set: auto, avx512bf16, avx512, avx2, "
                    "scalar, or torch (no C++ kernel)")
FT_LOG_LEVEL = EnvVar("FT_LOG_LEVEL", "INFO", "the `ft` commands' log level (--log-level)")
FT_HARNESS_PREFIX = EnvVar("FT_HARNESS_PREFIX", None,
                           "where scripts/install_harnesses.sh installs the harnesses and "
                           "`ft launch` finds them (default $XDG_CACHE_HOME/freetoken/harnesses)")

ALL = (FT_API_KEY, FT_CPU_ISA, FT_LOG_LEVEL, FT_HARNESS_PREFIX)

"""Every `FT_*` environment variable the package reads, declared once: name, default, kind,
meaning.

Read them through `VAR.get()` at the point of use (never at import time), so a test or a
launcher that sets one before the call is honoured. The kernels read `FT_CPU_ISA` from here
(the one freetoken module they import). `tests/structure/test_envs.py` checks that every
`FT_*` name in the sources is declared here and that nothing reads one past `EnvVar.get`.

Paths the environment can move have one resolver each here, with the default and the error
for a missing directory in one place: `routing_traces_dir()`, `harness_traces_dir()`.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

KINDS = ("text", "path", "count", "choice")  # count: an integer >= 0; choice: one of `choices`


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    doc: str
    kind: str = "text"
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError(f"{self.name}: choices go with kind 'choice' only")

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The raw value (the default when unset)."""
        return (os.environ if environ is None else environ).get(self.name, self.default)

    def value(self, environ: Mapping[str, str] | None = None) -> str | int | None:
        """The value checked against its kind (a count as an int); a value of the wrong kind
        raises ValueError naming the variable and what it takes."""
        raw = self.get(environ)
        if raw is None:
            return None
        if self.kind == "count":
            v = raw.strip()
            if not v.isdigit():
                raise ValueError(f"{self.name}={raw!r}: give an integer >= 0 ({self.doc})")
            return int(v)
        if self.kind == "choice" and raw not in self.choices:
            raise ValueError(f"{self.name}={raw!r}: give one of {', '.join(self.choices)}")
        return raw


FT_API_KEY = EnvVar("FT_API_KEY", None,
                    "the API key `ft serve` requires (one source at a time: --api-key, "
                    "--api-key-file or this)")
FT_CPU_ISA = EnvVar("FT_CPU_ISA", "auto",
                    "the C++ CPU kernels' instruction set: auto, avx512bf16, avx512, avx2, "
                    "scalar, or torch (no C++ kernel)", "choice",
                    ("auto", "avx512bf16", "avx512", "avx2", "scalar", "torch"))
FT_MALLOC_ARENA_MAX = EnvVar("FT_MALLOC_ARENA_MAX", "0",
                             "the most glibc malloc arenas an `ft` process keeps, set at its "
                             "start (0: glibc's default, 8 per core; glibc's own "
                             "MALLOC_ARENA_MAX wins when set): freetoken/cli/malloc.py",
                             "count")
FT_MALLOC_MMAP_THRESHOLD = EnvVar("FT_MALLOC_MMAP_THRESHOLD", "0",
                                  "bytes from which an `ft` process's allocations get their "
                                  "own mapping, fixed at its start (0, the default: glibc's "
                                  "dynamic threshold; 131072 keeps RSS flat under mixed "
                                  "traffic at 11-16% fewer requests on the CPU demo; glibc's "
                                  "own MALLOC_MMAP_THRESHOLD_ wins when set): "
                                  "freetoken/cli/malloc.py", "count")
FT_LOG_LEVEL = EnvVar("FT_LOG_LEVEL", "INFO", "the `ft` commands' log level (--log-level; "
                      "any case)")
FT_HARNESS_PREFIX = EnvVar("FT_HARNESS_PREFIX", None,
                           "where scripts/install_harnesses.sh installs the harnesses and "
                           "`ft launch` finds them (default $XDG_CACHE_HOME/freetoken/harnesses)",
                           "path")
FT_PEER_VENV = EnvVar("FT_PEER_VENV", None,
                      "the venv scripts/install_peer.sh builds llama-cpp-python into and "
                      "tests/peer runs it from (default ~/.cache/freetoken/peer)", "path")
FT_ROUTING_TRACES = EnvVar("FT_ROUTING_TRACES", None,
                           "the directory of the shared routing traces (`--route-trace "
                           "shared`): decode_routing.npy, prefill_routing.npy, meta.json "
                           "(default: the copy in the workloads package, "
                           "workloads/data/routing_traces)", "path")
FT_HARNESS_TRACES = EnvVar("FT_HARNESS_TRACES", None,
                           "the directory of the recorded harness traces (`ft bench anchors`' "
                           "default, the demo checkpoint's training data; default: the "
                           "checkout's tests/data/harness_traces)", "path")
# read by the test suite and its script, not by the package
FT_PROXY_E2E_ALL = EnvVar("FT_PROXY_E2E_ALL", None,
                          "1: tests/e2e/test_proxy_engine.py replays all seven harness traces "
                          "(about 160 s), not the default few")
FT_TEST_JOBS = EnvVar("FT_TEST_JOBS", "auto",
                      "scripts/test.sh's pytest-xdist workers (0: in this process, for -x or "
                      "--pdb); the script reads it")

ALL = (FT_API_KEY, FT_CPU_ISA, FT_MALLOC_ARENA_MAX, FT_MALLOC_MMAP_THRESHOLD, FT_LOG_LEVEL,
       FT_HARNESS_PREFIX, FT_PEER_VENV, FT_ROUTING_TRACES, FT_HARNESS_TRACES, FT_PROXY_E2E_ALL,
       FT_TEST_JOBS)


def routing_traces_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The shared routing traces' directory (a trained router's routing, replayed by
    `--route-trace shared`): `FT_ROUTING_TRACES`, else `data/routing_traces` of the installed
    `workloads` package (found through the import system, which does not import it). Raises
    FileNotFoundError, naming the directory and the variable, when it holds no
    decode_routing.npy."""
    def default() -> Path:
        spec = importlib.util.find_spec("workloads")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("the shared routing traces ship in the workloads package, "
                                    f"which is not installed: set {FT_ROUTING_TRACES.name}=DIR")
        return Path(next(iter(spec.submodule_search_locations))) / "data" / "routing_traces"

    return _data_dir(FT_ROUTING_TRACES, default, "decode_routing.npy", environ)


def harness_traces_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The recorded harness traces (one directory per harness of `.jsonl` files: `ft bench
    anchors`' default, the demo checkpoint's training data): `FT_HARNESS_TRACES`, else the
    checkout's tests/data/harness_traces (a checkout only: `tests` is not installed). Raises
    FileNotFoundError, naming the directory and the variable, when it holds no trace."""
    return _data_dir(FT_HARNESS_TRACES,
                     lambda: Path(__file__).resolve().parent.parent / "tests" / "data"
                     / "harness_traces", "*/*.jsonl", environ)


def _data_dir(var: EnvVar, default: Callable[[], Path], holds: str,
              environ: Mapping[str, str] | None) -> Path:
    given = var.get(environ)
    path = Path(given) if given else default()
    if not (path.is_dir() and next(path.glob(holds), None) is not None):
        raise FileNotFoundError(f"{path} holds no {holds}: set {var.name}=DIR to the "
                                "directory that does")
    return path

"""Builds and loads the C++ CPU kernels (freetoken/kernels/cpu/expert_kernel.cpp and
expert_tiles.cpp:
routed experts; expert_quant.cpp: routed experts over FP8 / MXFP4 banks; decode_ops.cpp:
decode-size linear layers and in-place decode attention;
bridge_kernel.cpp: the CPU branch of a captured decode step, bound in bridge_ops.py; simd.h,
expert_call.h: what they share), once per process.

The sources are compiled lazily at first use with torch.utils.cpp_extension.load (ninja, JIT),
into `<cache>/freetoken/ext/<isa>/<configuration key>/`; later processes load a finished build
directly (checkouts of other versions on the machine build beside it, never over it). The ISA
is read from the
CPU's feature flags and selects the compiler flags, hence the code path inside the source:
`avx512bf16`, `avx512`, `avx2` or `scalar`. `FT_CPU_ISA` overrides it (one of those names, or
`torch` to disable the kernel). If the build or load fails, `load_kernel()` returns None, logs
the reason once, and callers use the torch path.

The library exposes a plain C ABI called through ctypes: ctypes drops the GIL for the call, so
the CPU branch can run while a Python thread drives the GPU copy stream.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import threading
from pathlib import Path

import torch
from torch import Tensor

from freetoken.envs import FT_CPU_ISA
from freetoken.kernels.cpu.omp import openmp_runtimes, torch_openmp_ldflags
from freetoken.kernels.expert_act import ACT_CODES, ExpertAct, act_code
from freetoken.kernels.logs import get_logger, kv

log = get_logger("experts")

ISAS = ("avx512bf16", "avx512", "avx2", "scalar")
_ISA_FLAGS: dict[str, list[str]] = {
    "avx512bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                   "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
# Tokens per decode tile (simd.h's kNtMax per ISA): a call whose expert groups all have at most
# this many tokens takes the decode path (per-thread row blocks, stealing, timing); larger
# groups take the tiled path. tests/kernels/cpu checks this table against each build.
DECODE_TILE_TOKENS = {"avx512bf16": 3, "avx512": 3, "avx2": 2, "scalar": 2}
PREFETCH_HINTS = ("t0", "t1", "t2", "nta")  # order = the kernel's hint codes
_DIR = Path(__file__).parent
_SOURCES = [_DIR / "expert_kernel.cpp", _DIR / "expert_tiles.cpp", _DIR / "decode_ops.cpp",
            _DIR / "bridge_kernel.cpp", _DIR / "expert_quant.cpp"]
_HEADERS = [_DIR / "simd.h", _DIR / "expert_call.h", _DIR / "quant_simd.h"]


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/freetoken` (default `~/.cache/freetoken`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "freetoken"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """Feature flags of this CPU from /proc/cpuinfo (empty where it is unreadable); read once
    per process (`load_kernel` asks on every CPU kernel call: re-reading the file cost 6% of a
    CPU decode step of the demo model)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def detect_isa(flags: set[str] | frozenset[str] | None = None) -> str:
    """Best code path this CPU runs: the first of ISAS whose features are all present."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return "scalar"
    f = cpu_flags() if flags is None else flags
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"} <= f
    if avx512 and "avx512_bf16" in f:
        return "avx512bf16"
    if avx512:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= f:
        return "avx2"
    return "scalar"


def runnable_isas(flags: set[str] | None = None) -> list[str]:
    """Every ISA build this CPU can run, best first (the detected one and all below it)."""
    return list(ISAS[ISAS.index(detect_isa(flags)):])


class CpuKernel:
    """A loaded build of the kernel for one ISA."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self.isa = isa
        self._lib = lib
        self._fn = lib.ft_cpu_experts
        self._fn.restype = ctypes.c_int
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [p, i64, i64, p, i64, p, p, p, i64, i64, ctypes.c_int, p,
                             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float]
        lib.ft_cpu_isa.restype = ctypes.c_char_p
        self.built_isa = lib.ft_cpu_isa().decode()
        self._lin = lib.ft_cpu_linear
        self._lin.restype = ctypes.c_int
        self._lin.argtypes = [p, i64, i64, p, ctypes.c_int, i64, p, ctypes.c_int]
        self._attn = lib.ft_decode_attention
        self._attn.restype = ctypes.c_int
        self._attn.argtypes = [p, p, p, ctypes.c_int, p, i64, i64, i64, i64, ctypes.c_float, p,
                               ctypes.c_int]
        self._sum = lib.ft_stream_sum
        self._sum.restype = ctypes.c_float
        self._sum.argtypes = [p, i64, ctypes.c_int, i64]

    @property
    def decode_tile_tokens(self) -> int:
        """Most tokens per expert group that still take the decode path in this build."""
        return DECODE_TILE_TOKENS[self.built_isa]

    @property
    def lib(self) -> ctypes.CDLL:
        """The loaded library (for the other ctypes bindings: bridge_ops)."""
        return self._lib

    def set_prefetch(self, on: bool) -> None:
        """Benchmark knob: software prefetch of the next tile (on by default)."""
        self._lib.ft_cpu_set_prefetch(ctypes.c_int(int(on)))

    def set_prefetch_distance(self, nbytes: int) -> None:
        """Benchmark knob: how far ahead (bytes) the decode path prefetches."""
        self._lib.ft_cpu_set_prefetch_distance(ctypes.c_int64(int(nbytes)))

    def set_prefetch_hint(self, hint: str) -> None:
        """Benchmark knob: the decode path's prefetch target, one of PREFETCH_HINTS."""
        self._lib.ft_cpu_set_prefetch_hint(ctypes.c_int(PREFETCH_HINTS.index(hint)))

    def set_steal(self, on: bool) -> None:
        """Benchmark knob: decode-path threads that finish their share steal the others'
        remaining units (on by default)."""
        self._lib.ft_cpu_set_steal(ctypes.c_int(int(on)))

    def last_timing(self) -> list[tuple[float, float, float, int]]:
        """Per thread of the last decode-path call: ns from the call's entry to its region
        entry, to its own phase-1 units done, to its last unit done; units it stole ([] when
        the call took another path)."""
        buf = (ctypes.c_double * (4 * 256))()
        n = self._lib.ft_cpu_last_timing(buf, 256)
        return [(buf[4 * t], buf[4 * t + 1], buf[4 * t + 2], int(buf[4 * t + 3]))
                for t in range(n)]

    def set_contig(self, on: bool) -> None:
        """Benchmark knob: decode-size groups on per-thread contiguous row blocks (default) or
        on the interleaved-tile path."""
        self._lib.ft_cpu_set_contig(ctypes.c_int(int(on)))

    def linear(self, x: Tensor, weight: Tensor, out: Tensor, num_threads: int | None = None
               ) -> None:
        """out [T, N] fp32 = x [T, K] fp32 @ weight [N, K].T, weight contiguous fp32 or bf16.
        Shapes and dtypes are checked by the caller (freetoken.kernels.cpu.linear_ops)."""
        nth = num_threads if num_threads is not None else torch.get_num_threads()
        rc = self._lin(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(),
                       1 if weight.dtype == torch.bfloat16 else 0, weight.shape[0],
                       out.data_ptr(), nth)
        if rc != 0:
            raise RuntimeError(f"ft_cpu_linear failed rc={rc}")

    def decode_attention(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, slots: Tensor,
                         scale: float, out: Tensor, num_threads: int | None = None) -> bool:
        """out [Hq, D] fp32 = attention of q [Hq, D] fp32 over the pool rows `slots` [L] int64
        of k_pool, v_pool [S, Hk, D] (contiguous, fp32 or bf16). False when the kernel does not
        take this shape (D not a multiple of its vector width): the caller uses torch."""
        nth = num_threads if num_threads is not None else torch.get_num_threads()
        rc = self._attn(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                        1 if k_pool.dtype == torch.bfloat16 else 0, slots.data_ptr(),
                        slots.shape[0], q.shape[0], k_pool.shape[1], q.shape[1],
                        ctypes.c_float(scale), out.data_ptr(), nth)
        if rc == 3:
            return False
        if rc != 0:
            raise RuntimeError(f"ft_decode_attention failed rc={rc}")
        return True

    def stream_sum(self, buf: Tensor, num_threads: int | None = None,
                   prefetch_bytes: int = 0) -> float:
        """Sum of squares of a contiguous float32 buffer, read once with all threads (the
        host read-bandwidth probe); `prefetch_bytes` > 0 adds software prefetch that far
        ahead."""
        if buf.dtype != torch.float32 or not buf.is_contiguous():
            raise ValueError("stream_sum needs a contiguous float32 tensor")
        nth = num_threads if num_threads is not None else torch.get_num_threads()
        return float(self._sum(buf.data_ptr(), buf.numel(), nth, int(prefetch_bytes)))

    def run(
        self,
        x: Tensor,
        topk_ids: Tensor,
        gate_up: Tensor,
        down: Tensor,
        compute_mask: Tensor | None,
        out: Tensor,
        num_threads: int | None = None,
        allow_dpbf16: bool = True,
        act: ExpertAct | None = None,
    ) -> None:
        """Fill `out` [T, K, H] fp32 for masked-in entries. Shapes are checked by the caller;
        the weights must be contiguous bf16 or fp32 of one dtype. `act`: None (the plain
        SwiGLU) or a "clamp" ExpertAct (DeepSeek-V4's; the dense kernel takes no biases)."""
        code = act_code(act)
        if code not in (0, ACT_CODES["clamp"]):
            raise ValueError(f"the dense CPU kernel takes no {act.kind!r} act (biases)")
        t, h = x.shape
        k = topk_ids.shape[1]
        e, two_i, _ = gate_up.shape
        xs = x.detach().to(torch.float32).contiguous()  # [T, H]
        ids = topk_ids.to(torch.int64).contiguous()  # [T, K]
        mask = None if compute_mask is None else compute_mask.to(torch.uint8).contiguous()
        if not (gate_up.is_contiguous() and down.is_contiguous()):
            raise ValueError("gate_up and down must be contiguous")
        wcode = 1 if gate_up.dtype == torch.bfloat16 else 0
        nth = num_threads if num_threads is not None else torch.get_num_threads()
        rc = self._fn(
            xs.data_ptr(), t, h, ids.data_ptr(), k,
            None if mask is None else mask.data_ptr(),
            gate_up.data_ptr(), down.data_ptr(), e, two_i // 2, wcode,
            out.data_ptr(), nth, int(allow_dpbf16), code,
            0.0 if act is None else float(act.limit),
        )
        if rc == 1:
            raise IndexError(f"expert id out of range [0, {e})")
        if rc != 0:
            raise RuntimeError(f"ft_cpu_experts failed rc={rc}")


_lock = threading.Lock()
_loaded: dict[str, CpuKernel | None] = {}


def simde_include() -> str | None:
    """SIMDe's headers (the `simde-py` dev dependency), or None where it is not installed."""
    try:
        import simde_py
    except ImportError:
        return None
    return simde_py.get_include()


def build_emulated(verbose: bool = False) -> CpuKernel:
    """The avx512 code paths compiled against SIMDe's portable AVX-512 into an avx2 build
    (simd.h's FT_SIMDE_AVX512), so a CPU without AVX-512 runs them, slowly, against the same
    references; `built_isa` says "avx512". Tests only: the engine never loads it. Raises
    RuntimeError without simde-py, or on a build failure."""
    inc = simde_include()
    if inc is None:
        raise RuntimeError("simde-py is not installed (pip install simde-py)")
    return build("avx2", verbose, emulate=["-DFT_SIMDE_AVX512", f"-I{inc}"])


_BUILT = "built.json"  # in a build directory, written after its build loaded: {key, library}


def _build_key(sources_hash: str, cflags: list[str], ldflags: list[str]) -> str:
    """One build configuration: the sources and headers, every flag, torch and Python."""
    parts = [sources_hash, torch.__version__, platform.python_version(), *cflags, "|", *ldflags]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _built_library(build_dir: Path, key: str) -> Path | None:
    """The library a finished build of configuration `key` left in `build_dir`, or None.

    Loading it directly skips `cpp_extension.load`, which runs ninja under a file lock on the
    directory at every process start: 0.3 s alone, seconds behind another process holding
    the lock, and a full rebuild (~25 s) whenever a checkout at another path with the same
    sources had rewritten build.ninja (ninja sees new source paths; measured between two
    worktrees here)."""
    try:
        rec = json.loads((build_dir / _BUILT).read_text())
        name = rec["library"] if rec.get("key") == key else None
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None
    path = build_dir / name if isinstance(name, str) and "/" not in name else None
    return path if path is not None and path.is_file() else None


def _record_build(build_dir: Path, key: str, lib: Path) -> None:
    """Mark `build_dir` finished (atomically: a reader sees no record or the whole one)."""
    tmp = build_dir / f".{_BUILT}.{os.getpid()}.{threading.get_ident()}"
    try:
        tmp.write_text(json.dumps({"key": key, "library": lib.name}))
        os.replace(tmp, build_dir / _BUILT)
    except OSError as e:  # a read-only cache: the next process goes through ninja again
        log.warning(kv("cpu_kernel_build_record_failed", dir=str(build_dir), reason=repr(e)))


def build(isa: str, verbose: bool = False, emulate: list[str] | None = None) -> CpuKernel:
    """Compile (or reuse the cached build) for `isa` and load it. Raises on failure.
    `emulate`: build_emulated's extra flags (its own library name and directory)."""
    from torch.utils import cpp_extension

    # one build directory per configuration (sources and headers, flags, link flags, torch):
    # checkouts of different versions on one machine (worktrees, an installed copy) would
    # otherwise rebuild into the same directory in turn, and a process could load another
    # version's library (whose C ABI may differ from the ctypes signatures this checkout
    # declares); the system-OpenMP fallback link gets its own directory too
    srcs = hashlib.sha256(b"".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))).hexdigest()
    tag = isa + ("-simde512" if emulate else "")
    # (the headers are in `srcs`, so a header change is a new directory: a fresh build)
    cflags = ["-O3", "-fopenmp", "-std=c++17", *_ISA_FLAGS[isa], *(emulate or [])]

    def load(ldflags: list[str]) -> CpuKernel:
        key = _build_key(srcs, cflags, ldflags)
        build_dir = cache_root() / "ext" / tag / key
        built = _built_library(build_dir, key)
        if built is not None:  # finished before: no ninja, no lock
            return CpuKernel(ctypes.CDLL(str(built)), isa)
        build_dir.mkdir(parents=True, exist_ok=True)
        path = cpp_extension.load(
            name=f"ft_expert_kernel_{tag.replace('-', '_')}",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
        kern = CpuKernel(ctypes.CDLL(str(path)), isa)
        _record_build(build_dir, key, Path(path))
        return kern

    torch_omp = torch_openmp_ldflags()  # one OpenMP runtime in the process: torch's
    if torch_omp is not None:
        try:
            return load(torch_omp)
        except Exception as e:  # noqa: BLE001 - e.g. torch's libgomp older than the compiler
            log.warning(kv("cpu_kernel_torch_openmp_failed", fallback="system libgomp",
                           reason=repr(e)[:200]))
    return load(["-fopenmp"])


def load_kernel(isa: str | None = None) -> CpuKernel | None:
    """The kernel for `isa` (default: FT_CPU_ISA or this CPU's best), or None if unavailable.
    Builds at most once per ISA and process; a failure is logged once and remembered."""
    want = isa or FT_CPU_ISA.value()  # (a choice: ValueError naming the variable)
    if want == "torch":
        return None
    if want == "auto":
        want = detect_isa()
    if want not in ISAS:
        raise ValueError(f"unknown ISA {want!r}; expected one of {ISAS} or 'torch'")
    with _lock:
        if want in _loaded:
            return _loaded[want]
        try:
            kern: CpuKernel | None = build(want)
            log.info(kv("cpu_kernel_loaded", isa=want,
                        openmp=",".join(Path(p).name for p in openmp_runtimes())))
        except Exception as e:  # noqa: BLE001 - any build/load failure means "use torch"
            log.warning(kv("cpu_kernel_unavailable", isa=want, fallback="torch",
                           reason=repr(e)[:300]))
            kern = None
        _loaded[want] = kern
        return kern

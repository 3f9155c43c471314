"""Paged decode attention for the graph runner on CUDA: flashinfer where it is installed (the
`gpu` extra), our Triton split-K kernel otherwise. Both read the pool in place through a CSR of
slots (`kv_indptr [B+1]`, `kv_indices`) held in fixed device buffers, which the runner rewrites
before each replay; `prepare` (host side, outside the graph) plans the step.

Page size is 1 (the pool is `[S, Hk, D]` per layer; flashinfer sees it as `[S, 1, Hk, D]`).
flashinfer is pinned to its `fa2` tensor-core decode on Hopper (SGLang does the same: fa3
regressed there), planned once per step for every full-attention layer.

Shapes: B rows, Hq/Hk heads, D head dim, S pool slots, N = kv_indptr[B] keys in the step.
"""
from __future__ import annotations

import torch
from torch import Tensor

from freetoken.layers.step_context import PagedDecode
from freetoken.log import get_logger, kv

log = get_logger("engine")


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True


class FlashInferDecode(PagedDecode):
    name = "flashinfer"

    def __init__(self, batch: int, indptr: Tensor, indices: Tensor, hq: int, hk: int, d: int,
                 dtype: torch.dtype, scale: float, workspace: Tensor):
        import flashinfer

        self.batch, self.hq, self.hk, self.d = batch, hq, hk, d
        self.dtype, self.scale = dtype, scale
        self.indptr = indptr[: batch + 1]  # [B+1] int32 device (a view the wrapper keeps)
        self.indices = indices  # [cap] int32 device
        self.last_len = torch.ones(batch, dtype=torch.int32, device=indices.device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_len, backend="fa2")
        self._ones_host = torch.ones(batch, dtype=torch.int32)

    def prepare(self, indptr_host: Tensor, n: int) -> None:
        """Plan the step: indptr_host [B+1] int32 on the host; the indices are already in the
        device buffer's first n entries."""
        self.wrapper.plan(indptr_host, self.indices[:n], self._ones_host, self.hq, self.hk, self.d,
                          1, q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)

    def run(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, scale: float) -> Tensor:
        S = k_pool.shape[0]
        cache = (k_pool.view(S, 1, self.hk, self.d), v_pool.view(S, 1, self.hk, self.d))
        return self.wrapper.run(q, cache)


class TritonDecode(PagedDecode):
    name = "triton"

    def __init__(self, batch: int, indptr: Tensor, indices: Tensor):
        from freetoken.kernels.triton.paged_attention import paged_decode_attention

        self._kernel = paged_decode_attention
        self.batch = batch
        self.indptr = indptr[: batch + 1]
        self.indices = indices

    def prepare(self, indptr_host: Tensor, n: int) -> None:
        pass  # the kernel reads the device CSR as it is

    def run(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, scale: float) -> Tensor:
        return self._kernel(q, k_pool, v_pool, self.indptr, self.indices, scale)


class TritonMLADecode(PagedDecode):
    """Absorbed MLA decode over the latent pool (freetoken/kernels/triton/mla_decode.py) through the
    runner's CSR: `run_latent(q_lat [B, Hq, C+R], pool [S, 1, C+R], scale, c) -> [B, Hq, C]`.
    `run` (the GQA contract) is not offered: a latent pool is no K/V pair."""

    name = "triton_mla"

    def __init__(self, batch: int, indptr: Tensor, indices: Tensor):
        from freetoken.kernels.triton.mla_decode import mla_decode_attention

        self._kernel = mla_decode_attention
        self.indptr = indptr[: batch + 1]
        self.indices = indices

    def prepare(self, indptr_host: Tensor, n: int) -> None:
        pass  # the kernel reads the device CSR as it is

    def run_latent(self, q_lat: Tensor, pool: Tensor, scale: float, c: int,
                   csr: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """`csr` (indptr, indices): another CSR of the same rows (GLM-5's picked latents)."""
        indptr, indices = csr if csr is not None else (self.indptr, self.indices)
        return self._kernel(q_lat, pool, indptr, indices, scale, c)


class TritonSinkDecode(PagedDecode):
    """gpt-oss's decode over the paged pool with a sink logit per head and, on its sliding
    layers, a window (freetoken/kernels/triton/sink_attention.py), through the runner's CSR:
    `run_sinks(q [B, Hq, D], k_pool, v_pool [S, Hk, D], scale, sinks [Hq], window) -> [B, Hq,
    D]`. `run` (no sink) is not offered: every layer of the family has sinks."""

    name = "triton_sink"

    def __init__(self, batch: int, indptr: Tensor, indices: Tensor):
        from freetoken.kernels.triton.sink_attention import sink_decode_attention

        self._kernel = sink_decode_attention
        self.indptr = indptr[: batch + 1]
        self.indices = indices

    def prepare(self, indptr_host: Tensor, n: int) -> None:
        pass  # the kernel reads the device CSR as it is

    def run_sinks(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, scale: float, sinks: Tensor,
                  window: int) -> Tensor:
        return self._kernel(q, k_pool, v_pool, self.indptr, self.indices, scale, sinks, window)


def choose_sink_backend() -> str:
    """'triton_sink' for attention with sinks (gpt-oss) when the kernel imports, else
    'torch'."""
    try:
        import freetoken.kernels.triton.sink_attention  # noqa: F401
    except (ImportError, RuntimeError):
        return "torch"
    return "triton_sink"


def choose_mla_backend(cfg) -> str:
    """'triton_mla' for MLA (DeepSeek-V3, Kimi-Linear, GLM-5: its indexer then picks each row's
    latents on the device, `layers/dsa.py: pick_csr`) when the kernel imports, else 'torch'."""
    try:
        import freetoken.kernels.triton.mla_decode  # noqa: F401
    except (ImportError, RuntimeError):
        return "torch"
    return "triton_mla"


def choose_backend(requested: str = "auto", dtype: torch.dtype = torch.bfloat16,
                   head_dim: int = 128) -> str:
    """'flashinfer' | 'triton' | 'torch' for the graph runner's decode attention. flashinfer
    takes fp16/bf16 pools only; 'torch' (per-row gathers, not capturable) is the last resort."""
    # flashinfer's fa2 decode is instantiated for 16-bit pools and head dims 64/128/256 (a tiny
    # test model's 16 fails with "Invalid configuration")
    fits = dtype in (torch.float16, torch.bfloat16) and head_dim in (64, 128, 256)
    if requested in ("auto", "flashinfer") and fits and flashinfer_available():
        return "flashinfer"
    if requested == "flashinfer":
        log.warning(kv("flashinfer_unusable", dtype=str(dtype), head_dim=head_dim, using="triton",
                       hint="flashinfer needs the gpu extra and a 16-bit pool"))
    try:
        import freetoken.kernels.triton.paged_attention  # noqa: F401
    except (ImportError, RuntimeError):
        return "torch"
    return "triton"


def bucket_plan(kind: str, size: int, indptr: Tensor, indices: Tensor, cfg, dtype: torch.dtype,
                workspace: Tensor | None) -> tuple[PagedDecode, Tensor | None]:
    """The `kind` ("flashinfer" | "triton" | "triton_mla" | "triton_sink") plan of a decode
    runner's bucket of `size` rows over its device indptr/indices, and the FlashInfer
    workspace (made on first use)."""
    if kind == "triton_mla":
        return TritonMLADecode(size, indptr, indices), workspace
    if kind == "triton_sink":
        return TritonSinkDecode(size, indptr, indices), workspace
    if kind == "flashinfer":
        if workspace is None:
            workspace = torch.empty(128 << 20, dtype=torch.uint8, device=indptr.device)
        return FlashInferDecode(size, indptr, indices, cfg.num_heads, cfg.num_kv_heads,
                                cfg.head_dim, dtype, cfg.head_dim ** -0.5, workspace), workspace
    return TritonDecode(size, indptr, indices), workspace

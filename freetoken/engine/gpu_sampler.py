"""Batched sampling on the device, with per-row parameters in tensors so a decode step's sampling
can be captured in a CUDA graph: greedy, temperature, top-k, top-p, stop ids blocked while
`min_tokens` is not reached (or always with `ignore_eos`), and per-request seeds.

Randomness is a counter-based hash, not a generator with state: the Gumbel noise of row b at
vocabulary index v is a function of (seed_b, step_b, v) only, where step_b is the number of
tokens the request has generated. So a seeded request draws the same tokens whatever batch it
shares, whichever bucket or graph it runs in, and eager and replayed steps agree exactly.
Sampling is `argmax(logits / T + gumbel)` over the tokens top-k and top-p allow, which draws from
exactly the softmax of the allowed logits (the Gumbel-max trick).

A row whose largest logit (after the blocked stop ids) is not finite (a NaN anywhere, only
-inf, or an overflow to +inf: the model computed it wrong) draws no token: its id is
`FAILED_ROW` (-1), checked per row on the device without a host sync (so it can be captured),
and the engine fails that request alone
(`EngineCore._postprocess`; the CPU sampler raises `RowFailure` for the same rows). A decode step
chained on a failed row feeds it token 0 instead (graph_runner), never an id out of range.

Shapes: B rows, V vocabulary, NB blocked-id columns.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = (_signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9),
                         _signed(0x94D049BB133111EB))


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def uniform_noise(seed: Tensor, step: Tensor, vocab: int) -> Tensor:
    """u [B, V] float64 in (0, 1): splitmix64 of (seed, step, index)."""
    idx = torch.arange(vocab, device=seed.device, dtype=torch.int64)  # [V]
    x = (seed[:, None] * _GOLDEN + step[:, None] * _MIX1) + idx[None, :] * _MIX2  # [B, V]
    x = x ^ _shr(x, 30)
    x = x * _MIX1
    x = x ^ _shr(x, 27)
    x = x * _MIX2
    x = x ^ _shr(x, 31)
    return (_shr(x, 11).double() + 0.5) * (1.0 / (1 << 53))


@dataclass
class SamplingRows:
    """Per-row sampling parameters as device tensors (the graph runner's static buffers)."""

    temperature: Tensor  # [B] float32; <= 0 is greedy
    top_k: Tensor  # [B] int64; 0 = off
    top_p: Tensor  # [B] float32 in (0, 1]
    seed: Tensor  # [B] int64
    step: Tensor  # [B] int64: tokens generated so far
    block_ids: Tensor  # [B, NB] int64 stop ids
    block_on: Tensor  # [B, NB] bool: forbid that id this step


def block_stop_ids(logits: Tensor, rows: SamplingRows) -> Tensor:
    vals = torch.where(rows.block_on, float("-inf"), logits.gather(1, rows.block_ids))
    return logits.scatter(1, rows.block_ids, vals)  # [B, V]


FAILED_ROW = -1  # the id of a row that cannot be sampled (see the module docstring)


def checked_argmax(lg: Tensor) -> Tensor:
    """[B] int64: the argmax of each row of `lg [B, V]`, FAILED_ROW where the row's largest
    logit is not finite. argmax takes a NaN as the largest value, so that one test covers a
    NaN anywhere, a row of -inf only and an overflow to +inf, with one gather over [B] beside
    the argmax (three whole-row passes before: 79 kernels in the H200's eager decode step
    against a budget of 73, 2026-12-02)."""
    am = lg.argmax(-1)  # [B]
    best = lg.gather(1, am[:, None]).squeeze(1)  # [B]
    # x - x == 0 exactly when x is finite (inf - inf and NaN are NaN): 2 kernels, isfinite's
    # decomposition takes 4
    return torch.where(best - best == 0, am, FAILED_ROW)


def greedy(logits: Tensor, rows: SamplingRows) -> Tensor:
    """[B] int64: argmax of the logits with the blocked stop ids removed (FAILED_ROW where the
    row's logits are not finite)."""
    return checked_argmax(block_stop_ids(logits.float(), rows))


def sample(logits: Tensor, rows: SamplingRows) -> Tensor:
    """[B] int64 next tokens; rows with temperature <= 0 take the argmax; FAILED_ROW where the
    row's logits are not finite."""
    lg = block_stop_ids(logits.float(), rows)  # [B, V]
    V = lg.shape[1]
    z = lg / rows.temperature.clamp(min=1e-5)[:, None]  # [B, V]
    sz, _ = z.sort(-1, descending=True)  # [B, V]
    k = torch.where(rows.top_k > 0, rows.top_k, V).clamp(1, V)  # [B]
    rank = torch.arange(V, device=lg.device)[None, :]  # [1, V]
    sz_k = sz.masked_fill(rank >= k[:, None], float("-inf"))
    p = torch.softmax(sz_k, -1)  # [B, V] sorted probabilities after top-k
    keep = ((p.cumsum(-1) - p) < rows.top_p[:, None]) & (rank < k[:, None])  # sorted prefix
    n_keep = keep.sum(-1).clamp(min=1)  # [B]
    thresh = sz.gather(1, (n_keep - 1)[:, None])  # [B, 1] smallest kept scaled logit
    gumbel = -torch.log(-torch.log(uniform_noise(rows.seed, rows.step, V)))  # [B, V] f64
    score = torch.where(z >= thresh, z.double() + gumbel, float("-inf"))
    drawn = score.argmax(-1)  # [B]
    am = checked_argmax(lg)  # [B]
    return torch.where((rows.temperature > 0) & (am != FAILED_ROW), drawn, am)


@dataclass
class RowSampling:
    """One row's sampling parameters on the host (what `SamplingRows` holds per row)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    step: int = 0  # tokens the request has generated
    blocked: tuple[int, ...] = ()  # stop ids forbidden this step


def sampling_columns(rows: Sequence[RowSampling], nb: int) -> tuple[list, ...]:
    """The rows as columns (temperature, top_k, top_p, seed, step, block_ids [B][nb],
    block_on [B][nb]). A row's unused blocked-id columns repeat its first id with the same flag
    (a scatter of one id with two different values would be undefined)."""
    blk = [list(r.blocked[:nb]) or [0] for r in rows]
    return ([r.temperature for r in rows], [r.top_k for r in rows], [r.top_p for r in rows],
            [r.seed for r in rows], [r.step for r in rows],
            [b + [b[0]] * (nb - len(b)) for b in blk], [[bool(r.blocked)] * nb for r in rows])


def sample_rows(logits: Tensor, rows: Sequence[RowSampling], device: torch.device) -> list[int]:
    """The next token of each row of `logits [R, V]` outside the decode runner (prefill and
    mixed steps), the rows' parameters uploaded for this call; FAILED_ROW for a row that
    cannot be sampled."""
    if not rows:
        return []
    cols = sampling_columns(rows, max(1, max(len(r.blocked) for r in rows)))
    dtypes = (torch.float32, torch.int64, torch.float32, torch.int64, torch.int64, torch.int64,
              torch.bool)
    sr = SamplingRows(*(torch.tensor(c, dtype=dt).to(device, non_blocking=True)
                        for c, dt in zip(cols, dtypes)))
    ids = greedy(logits, sr) if all(r.temperature <= 0 for r in rows) else sample(logits, sr)
    return ids.tolist()

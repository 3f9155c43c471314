"""The pinned staging of a decode step's inputs (the decode runner's host side).

Per step the host writes the rows' inputs into a pinned staging buffer and issues one
asynchronous copy into its device twin (the same byte layout), which the step reads in place;
two host buffers alternate so that the next step's writes never race the copy of the one in
flight (freetoken/engine/graph_runner.py launches step n+1 before step n's ids are read).

Shapes: B rows of the step, Bk its bucket, NB blocked stop ids per row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from freetoken.engine import gpu_sampler

MAX_BLOCKED = 16  # stop ids a row may need blocked in one step (more: the step runs eagerly)


@dataclass
class DecodeRow(gpu_sampler.RowSampling):
    """One sequence's decode step: feed `token` at `position` (its KV goes to `out_slot`), attend
    over `kv_slots` (the whole context, `out_slot` last), sample with the request's parameters
    (the `RowSampling` fields)."""

    token: int = 0
    position: int = 0
    out_slot: int = 0
    state_slot: int = -1  # -1 for attention-only models
    kv_slots: Tensor = None  # type: ignore[assignment]  # [position + 1] int64 on the host


class _Layout:
    """Byte offsets of the runner's packed step inputs (see DecodeRunner.__init__); every
    section starts 8-byte aligned so the typed views are valid on both sides."""

    def __init__(self, bm: int, cap: int):
        specs = [("i64", torch.int64, (8, bm)), ("blk", torch.int64, (bm, MAX_BLOCKED)),
                 ("f32", torch.float32, (2, bm)), ("indptr", torch.int32, (bm + 1,)),
                 ("mask", torch.bool, (bm,)), ("blk_on", torch.bool, (bm, MAX_BLOCKED)),
                 ("indices", torch.int32, (cap,)), ("out", torch.int64, (bm,))]
        self.specs, at = [], 0  # (offset, dtype, shape, bytes)
        for name, dt, shape in specs:
            nbytes = dt.itemsize * math.prod(shape)
            self.specs.append((at, dt, shape, nbytes))
            if name == "indices":
                self.indices_at = at
            if name == "out":
                self.out_at = at
            at += (nbytes + 7) // 8 * 8
        self.nbytes = at

    def views(self, buf: Tensor) -> list[Tensor]:
        return [buf[at:at + n].view(dt).view(shape) for at, dt, shape, n in self.specs]


class DecodeStaging:
    """The runner's staging (a base of DecodeRunner): `_init_staging` builds the buffers;
    `_stage` writes a step's rows, `_upload` copies them, `_uploaded_now` marks the copy."""

    scratch_kv: int
    scratch_state: int | None
    device: torch.device

    def _init_staging(self, Bm: int, cap: int, pin: bool) -> None:
        d = self.device
        # The step's inputs live in one packed buffer on each side (pinned host staging and its
        # device twin, the same byte layout), carved into typed views, so a step uploads them
        # with one copy: rows of the int64 block are ids, positions, out_slots, state_slots,
        # seeds, steps, top_k, source (where the row's input id is read: its own id above,
        # or the id the previous step sampled); then blocked ids, temperature/top_p, the
        # attention indptr, the row mask, the blocked flags, the attention indices (every key
        # of every row, padding rows included), of which a step copies only the used prefix,
        # and last the sampled ids, which the graph writes and no upload reaches. Two host
        # buffers alternate between steps (see `launch`).
        self._layout = _Layout(Bm, cap)
        self.h_bufs = [torch.zeros(self._layout.nbytes, dtype=torch.uint8, pin_memory=pin)
                       for _ in range(2)]
        self._views = [self._layout.views(b) for b in self.h_bufs]
        # numpy views of the host staging: list -> buffer writes without a tensor per column
        self._nps = [[t.numpy() for t in v] for v in self._views]
        self._uploaded = [None, None]  # per host buffer: event after its last upload
        self._turn = 0
        self._use_buffer(0)
        self.d_buf = torch.zeros(self._layout.nbytes, dtype=torch.uint8, device=d)
        (self.d_i64, self.d_blk, self.d_f32, self.d_indptr, self.row_mask, self.d_blk_on,
         self.d_indices, self.out_ids) = self._layout.views(self.d_buf)
        # the whole buffer as int64: a row's input is one gather from it (source row of i64)
        self._flat = self.d_buf.view(torch.int64)
        self._out_at = self._layout.out_at // 8

    def _use_buffer(self, k: int) -> None:
        """Stage into host buffer k from now on (after its previous upload has run)."""
        ev = self._uploaded[k]
        if ev is not None:
            ev.synchronize()
        self.h_buf = self.h_bufs[k]
        (self.h_i64, self.h_blk, self.h_f32, self.h_indptr, self.h_mask, self.h_blk_on,
         self.h_indices, _) = self._views[k]
        self._np = self._nps[k]

    def _stage(self, rows: list[DecodeRow], Bk: int, chain: list[int] | None = None
               ) -> tuple[Tensor, int]:
        """Write the rows, padded to Bk with rows on the scratch slots, into the host staging
        (through numpy views: one write per column); returns indptr [Bk+1] and the key
        count. `chain[i] >= 0`: row i's input is the id the previous step sampled in its row
        chain[i] (its `token` is ignored)."""
        n = len(rows)
        temp, top_k, top_p, seed, step, blk, on = gpu_sampler.sampling_columns(rows, MAX_BLOCKED)
        state_pad = self.scratch_state if self.scratch_state is not None else 0
        i64, nblk, f32, ptr, mask, blk_on, idx, _ = self._np
        # the source of row i's input id in the device buffer as int64: its own staged id
        # (row 0 of the i64 block: index i) or the previous step's sampled id in row c
        src = (list(range(n)) if chain is None
               else [self._out_at + c if c >= 0 else i for i, c in enumerate(chain)])
        if n:  # (none at capture: every row a padding row)
            i64[:, :n] = [[r.token for r in rows], [r.position for r in rows],
                          [r.out_slot for r in rows], [max(r.state_slot, 0) for r in rows],
                          seed, step, top_k, src]
            f32[:, :n] = [temp, top_p]
            nblk[:n] = blk
            blk_on[:n] = on
        i64[:, n:Bk] = [[0], [0], [self.scratch_kv], [state_pad], [0], [0], [0], [0]]
        f32[:, n:Bk] = [[0.0], [1.0]]
        nblk[n:Bk] = 0
        blk_on[n:Bk] = False
        mask[:n] = True
        mask[n:Bk] = False
        lens = [r.kv_slots.numel() for r in rows] + [1] * (Bk - n)
        ptr[0] = 0
        ptr[1:Bk + 1] = lens
        ptr[1:Bk + 1] = ptr[1:Bk + 1].cumsum()
        total = int(ptr[Bk])
        at = 0
        for r in rows:
            k = r.kv_slots.numel()
            idx[at:at + k] = r.kv_slots.numpy()
            at += k
        idx[at:total] = self.scratch_kv
        return self.h_indptr[:Bk + 1], total

    def _upload(self, Bk: int, total: int) -> None:
        """One copy: the packed inputs up to the last used attention index."""
        end = self._layout.indices_at + 4 * total
        self.d_buf[:end].copy_(self.h_buf[:end], non_blocking=self.device.type == "cuda")

    def _uploaded_now(self) -> None:
        """Mark the current host buffer's upload (and the attention plan's own copies, issued
        after it) as enqueued; the buffer is staged into again only once they have run."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._uploaded[self._turn] = ev

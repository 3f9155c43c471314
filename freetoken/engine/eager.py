"""An eager step: the planned items' packed batch through the model, and a token per row that
samples.

Every step that does not go through the decode runner (a prefill chunk in the batch, the CPU,
a decode batch wider than the runner's buckets) runs here. Kept logits (`cache/logits.py`): a
prompt chunk the plan marks `keep_logits` writes its last row into the kept tensor `[n_kept,
V]` (made at the first such row); an item of 0 tokens (a whole prompt cached with its logits)
feeds nothing and samples from its kept row.
"""
from __future__ import annotations

import torch

from freetoken.cache.tensors import Caches
from freetoken.engine.gpu_sampler import sample_rows
from freetoken.engine.step_inputs import forward_batch, row_sampling
from freetoken.models.qwen import QwenMoE
from freetoken.scheduler.plan import BatchItem
from freetoken.types.forward_batch import ForwardBatch, MoEStep


class EagerStep:
    """Forward and sampling of an eager step over `model` and `caches`. `n_kept`: kept logits
    rows (0: none); `device_sampler`: one batched call of the device sampler (CUDA), else each
    request's own sampler."""

    def __init__(self, model: QwenMoE, caches: Caches, n_kept: int, device_sampler: bool):
        self.model, self.caches = model, caches
        w = model.model.embed_tokens.weight
        self.device = w.device
        self.kept: torch.Tensor | None = None  # [n_kept, V], made by the first row kept
        self.n_kept = n_kept
        self.device_sampler = device_sampler

    def run(self, items: list[BatchItem], moe: MoEStep) -> list:
        """The next token of every item that wants logits, in item order (an exception, or
        `gpu_sampler.FAILED_ROW`, for a row that cannot be sampled: it fails alone)."""
        fed = [it for it in items if it.n > 0]  # n == 0: sampled from kept logits, no forward
        logits = self.model(self.batch(fed, moe), self.caches) if fed else None  # [R, V]
        want, rows = self.logit_rows(items, logits)
        return self.sample(want, rows)

    def batch(self, items: list[BatchItem], moe: MoEStep) -> ForwardBatch:
        return forward_batch(items, moe, self.device, self.caches.state is not None)

    def logit_rows(self, items: list[BatchItem], logits: torch.Tensor | None
                   ) -> tuple[list[BatchItem], torch.Tensor]:
        """The items that sample this step and their logits `[R, V]`, in item order: a fed
        item's row of `logits` (which holds a row per item that wants or keeps logits,
        `forward_batch`), an unfed one's kept row. Rows to keep are written to their slot."""
        want, picked, j = [], [], 0
        for it in items:
            if it.n == 0:
                assert self.kept is not None and it.logits_from is not None
                want.append(it)
                picked.append(self.kept[it.logits_from])
                continue
            if not (it.wants_logits or it.keep_logits is not None):
                continue
            assert logits is not None
            row, j = logits[j], j + 1
            if it.keep_logits is not None:
                if self.kept is None:
                    self.kept = torch.empty((self.n_kept, row.shape[-1]), dtype=row.dtype,
                                            device=row.device)
                self.kept[it.keep_logits] = row
            if it.wants_logits:
                want.append(it)
                picked.append(row)
        out = torch.stack(picked) if picked else torch.empty(0, device=self.device)
        return want, out

    def sample(self, items: list[BatchItem], logits: torch.Tensor) -> list:
        """Next token of every row: with `device_sampler` one batched call of the device
        sampler (the function the decode runner replays, so seeds draw the same tokens either
        way); else each request's own sampler, whose exception stands for its row."""
        if not self.device_sampler:
            out: list = []
            for i, it in enumerate(items):
                try:
                    out.append(it.req.sampler.sample(logits[i], it.req.num_generated))
                except Exception as e:  # noqa: BLE001  (this row alone fails)
                    out.append(e)
            return out
        return sample_rows(logits, [row_sampling(it) for it in items], self.device)

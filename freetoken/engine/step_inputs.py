"""A planned step's rows as the model and the decode runner take them: the packed
`ForwardBatch` of an eager step, and each request's `DecodeRow` for the runner."""
from __future__ import annotations

import torch

from freetoken.engine.decode_staging import DecodeRow
from freetoken.engine.gpu_sampler import RowSampling
from freetoken.scheduler.plan import BatchItem
from freetoken.types.forward_batch import ForwardBatch, MoEStep


def row_sampling(it: BatchItem, n: int | None = None) -> RowSampling:
    """Sampling of `it`'s row; `n`: the generated-token index it samples (default: the
    request's count now)."""
    r = it.req
    p, s = r.req.sampling, r.sampler
    n = r.num_generated if n is None else n
    return RowSampling(p.temperature, p.top_k, p.top_p, s.seed, n, tuple(s.blocked_ids(n)))


def decode_row(it: BatchItem, ahead: bool = False) -> DecodeRow:
    """`it`'s runner row: it feeds position r.computed (the token there), or with `ahead`
    the position after it, whose token the runner takes on the device from the step in
    flight (`token` unused) and whose sample is the request's next but one."""
    r = it.req
    pos = r.computed + ahead
    return DecodeRow(**vars(row_sampling(it, r.num_generated + ahead)),
                     token=0 if ahead else r.ids[pos], position=pos,
                     out_slot=int(r.row[pos]),
                     state_slot=r.state_slot if r.state_slot is not None else -1,
                     kv_slots=r.row[: pos + 1])


def forward_batch(items: list[BatchItem], moe: MoEStep, device: torch.device,
                  has_state: bool) -> ForwardBatch:
    """The packed batch of an eager step (every item's new tokens, its KV slots, its state
    slot when the model has linear attention), its MoE layers run as `moe` says. Logits rows:
    the last row of every item that wants logits or keeps them (`BatchItem.keep_logits`)."""
    ids, pos, rows = [], [], []
    for it in items:
        r = it.req
        ids.extend(r.ids[r.computed:r.computed + it.n])
        pos.extend(range(r.computed, r.computed + it.n))
        if it.wants_logits or it.keep_logits is not None:
            rows.append(len(ids) - 1)
    d = device
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=d),
        positions=torch.tensor(pos, dtype=torch.long, device=d),
        new_lens=[it.n for it in items],
        prefix_lens=[it.req.computed for it in items],
        kv_slots=[it.req.row[: it.req.computed + it.n].to(d) for it in items],
        state_slots=[it.req.state_slot for it in items] if has_state else [],
        logits_rows=torch.tensor(rows, dtype=torch.long, device=d),
        moe=moe,
    )

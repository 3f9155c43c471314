"""Slot decision on the device: one Triton program decides one layer's step, all as data.

Same contract as `freetoken.experts.residency.decide_reference` (read its module docstring):
identical outputs and identical table updates, including tie-breaking. Outputs have fixed sizes
and `num_fetch` may be a device tensor, so no value travels to the host and a decode step that
calls this per layer can be captured in a CUDA graph.

Layout of the work (a single program, `grid=(1,)`; the decision is tiny next to the experts):
  phase 1  count routed entries per expert [E] over chunks of the T*K ids; pick the q smallest
           miss keys (a composite key is a total order, so sorted order == spec order)
             miss key   = (T*K - count) * BLOCK_E + expert   -> first q = experts to fetch
           and refresh the hit slots' last_use to the new clock value.
  phase 2  victim key = (age + 1) * BLOCK_S + slot over slots whose last_use != now (the hit
           slots are exactly those) -> first q = victim slots; store the clock.
           The q smallest keys come from q block-wide minimum reductions up to SMALL_Q picks
           (decode), from a bitonic sort of the block past it: the sort of ~2k slot keys took
           24.5 µs per layer on the H200, most of an offload decode layer's overhead, and q is
           0 on most layers of a routing with locality.
  phase 3  read the fetch lists back and rewrite the three tables.
  phase 4  slot_ids = expert_slot[layer*E + id] for every entry.
A block barrier separates the phases so one phase's global stores are visible to every thread
(and so no thread stores the clock before all have read it: the GPU test caught that race).
Limits: one program holds next_pow2(S) keys in registers; fine up to S of a few thousand.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_EXCLUDED = tl.constexpr(2**62)

# Up to this many picks, the q smallest keys come from q block reductions (a few hundred
# cycles each); past it, from one bitonic sort of the whole block (tens of µs for the ~2k
# slot keys of a real cache). Decode steps pick a handful (q <= top-k at batch 1), and on
# routing with locality most layers pick none.
SMALL_Q = 16


@triton.jit
def _store_by_min(keys, q, out_ptr, BLOCK: tl.constexpr):
    """out[j] = (j-th smallest of keys) % BLOCK for j < q, by q block-wide reductions."""
    rest = keys
    for j in range(q):
        low = tl.min(rest, axis=0)
        tl.store(out_ptr + j, low % BLOCK)
        rest = tl.where(rest == low, _EXCLUDED, rest)


@triton.jit
def _store_smallest(keys, q, out_ptr, F, BLOCK: tl.constexpr, SMALL: tl.constexpr,
                    SORT: tl.constexpr):
    """out[j] = (j-th smallest of keys) % BLOCK for j < q, -1 for q <= j < F. The keys below
    _EXCLUDED are distinct (each carries its index), so both ways give the sorted order.
    Without SORT (the launch knows q <= F <= SMALL) the sort is not compiled at all."""
    idx = tl.arange(0, BLOCK)
    tl.store(out_ptr + idx, tl.full([BLOCK], -1, tl.int64), mask=(idx >= q) & (idx < F))
    if SORT:
        if q <= SMALL:
            _store_by_min(keys, q, out_ptr, BLOCK)
        else:
            ordered = tl.sort(keys)
            tl.store(out_ptr + idx, ordered % BLOCK, mask=(idx < q) & (idx < F))
    else:
        _store_by_min(keys, q, out_ptr, BLOCK)


# every int that follows the step's token count, layer or cache size is left unspecialised:
# Triton would otherwise compile a variant per (== 1, % 16 == 0) class of each (issue 20 item 6:
# 42 compiles of ~6 s each on a first start of the 20-layer model)
@triton.jit(do_not_specialize=["layer", "TK", "S", "F"])
def _slot_decide_kernel(
    ids_ptr, num_fetch_ptr, owner_ptr, eslot_ptr, last_ptr, clock_ptr,
    slot_ids_ptr, cpu_ptr, fetch_e_ptr, fetch_s_ptr, counters_ptr, acc_ptr,
    layer, TK, E, S, F,
    BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr,
    TABLE: tl.constexpr, SMALL: tl.constexpr, SORT: tl.constexpr,
):
    base = layer * E
    e = tl.arange(0, BLOCK_E)  # [BE]
    e_ok = e < E
    s = tl.arange(0, BLOCK_S)  # [BS]
    s_ok = s < S

    counts = tl.zeros([BLOCK_E], dtype=tl.int32)  # [BE] routed entries per expert
    for start in range(0, TK, BLOCK_TK):
        o = start + tl.arange(0, BLOCK_TK)  # [BT]
        x = tl.load(ids_ptr + o, mask=o < TK, other=-1)  # [BT], -1 = padding
        counts += tl.sum((x[None, :] == e[:, None]).to(tl.int32), axis=1)

    slot_of = tl.load(eslot_ptr + base + e, mask=e_ok, other=-1)  # [BE]
    need = e_ok & (counts > 0)
    hit = need & (slot_of >= 0)  # [BE]
    miss = need & (slot_of < 0)  # [BE]
    n_hit = tl.sum(hit.to(tl.int64), axis=0)
    n_miss = tl.sum(miss.to(tl.int64), axis=0)
    if TABLE:  # a fetch rule per miss count: nf = num_fetch[n_miss]
        nf = tl.load(num_fetch_ptr + n_miss).to(tl.int64)
    else:
        nf = tl.load(num_fetch_ptr).to(tl.int64)
    q = tl.where(nf < 0, n_miss, tl.minimum(nf, n_miss))
    q = tl.minimum(q, S - n_hit)

    mkey = tl.where(miss, (TK - counts).to(tl.int64) * BLOCK_E + e, _EXCLUDED)  # [BE]
    _store_smallest(mkey, q, fetch_e_ptr, F, BLOCK_E, SMALL, SORT)
    # Refreshing the hit slots first marks them: after the barrier, last_use == now holds for
    # exactly the slots this step uses (the clock only grows), which keeps them from eviction.
    now = tl.load(clock_ptr) + 1
    tl.store(last_ptr + slot_of, tl.zeros([BLOCK_E], dtype=tl.int64) + now, mask=hit)
    tl.debug_barrier()

    owner = tl.load(owner_ptr + s, mask=s_ok, other=-1)  # [BS]
    last = tl.load(last_ptr + s, mask=s_ok, other=-1)  # [BS]
    age = tl.where(owner >= 0, last, -1)  # [BS]
    candidate = s_ok & (last != now)
    vkey = tl.where(candidate, (age + 1) * BLOCK_S + s, _EXCLUDED)  # [BS]
    _store_smallest(vkey, q, fetch_s_ptr, F, BLOCK_S, SMALL, SORT)
    # every thread has read the clock before the first barrier; only now may it move
    tl.store(clock_ptr, now)
    tl.store(counters_ptr + 0, n_hit)
    tl.store(counters_ptr + 1, n_miss)
    tl.store(counters_ptr + 2, q)
    # running totals (one program, stream-ordered launches: no atomics needed); always added,
    # into a scratch buffer when the caller keeps none (one compile less than a switch)
    tl.store(acc_ptr + 0, tl.load(acc_ptr + 0) + n_hit)
    tl.store(acc_ptr + 1, tl.load(acc_ptr + 1) + n_miss)
    tl.store(acc_ptr + 2, tl.load(acc_ptr + 2) + q)
    tl.debug_barrier()

    f = tl.arange(0, BLOCK_F)  # [BF]
    f_ok = f < q
    fe = tl.load(fetch_e_ptr + f, mask=f_ok, other=0)  # [BF]
    fs = tl.load(fetch_s_ptr + f, mask=f_ok, other=0)  # [BF]
    old = tl.load(owner_ptr + fs, mask=f_ok, other=-1)  # [BF]
    # old experts are resident and new ones are not, so these address sets never overlap
    tl.store(eslot_ptr + old, tl.full([BLOCK_F], -1, tl.int64), mask=f_ok & (old >= 0))
    tl.store(owner_ptr + fs, base + fe, mask=f_ok)
    tl.store(eslot_ptr + base + fe, fs, mask=f_ok)
    tl.store(last_ptr + fs, tl.zeros([BLOCK_F], dtype=tl.int64) + now, mask=f_ok)
    tl.debug_barrier()

    for start in range(0, TK, BLOCK_TK):
        o = start + tl.arange(0, BLOCK_TK)  # [BT]
        o_ok = o < TK
        x = tl.load(ids_ptr + o, mask=o_ok, other=-1)  # [BT]
        valid = o_ok & (x >= 0)
        sl = tl.load(eslot_ptr + base + x, mask=valid, other=-1)  # [BT]
        tl.store(slot_ids_ptr + o, sl, mask=o_ok)
        tl.store(cpu_ptr + o, valid & (sl < 0), mask=o_ok)


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(max(1, n)))


def slot_decide(
    slot_owner: Tensor, expert_slot: Tensor, slot_last_use: Tensor, clock: Tensor,
    num_experts: int, layer: int, topk_ids: Tensor, num_fetch: int | Tensor, fetch_cap: int,
    accumulate: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Launch the decision kernel for `topk_ids [T, K]` over one residency table's tensors
    (`slot_owner [S]`, `expert_slot [L*E]`, `slot_last_use [S]`, `clock [1]`, all on one device),
    updating them in place. Returns `(slot_ids [T, K], cpu_mask [T, K], fetch_experts [F],
    fetch_slots [F], counters [3])` with F = `fetch_cap`; `ResidencyTable.decide` wraps them.

    `num_fetch` may be a python int, a 0-d/1-element int tensor on the tables' device, or a
    table [E+1] of the number to fetch per miss count (see residency.py, rule 3). Up to
    SMALL_Q fetches the picks are block reductions, past it a sort (tests lower SMALL_Q to
    reach the sort at tiny shapes). `accumulate` [3] int64 on the device: the counters are
    added to it in the same launch.
    """
    dev = slot_owner.device
    E, S, F = num_experts, int(slot_owner.numel()), fetch_cap
    ids = topk_ids.to(device=dev, dtype=torch.int64).contiguous()  # [T, K]
    T, K = ids.shape
    table = isinstance(num_fetch, Tensor) and num_fetch.numel() > 1
    if table:
        assert num_fetch.numel() == E + 1, "a fetch table has one entry per miss count 0..E"
        nf = num_fetch.to(device=dev, dtype=torch.int64).contiguous()  # [E+1]
    elif isinstance(num_fetch, Tensor):
        nf = num_fetch.to(device=dev, dtype=torch.int64).reshape(1)  # [1]
    else:
        nf = torch.full((1,), int(num_fetch), dtype=torch.int64, device=dev)  # [1]
    slot_ids = torch.empty((T, K), dtype=torch.int64, device=dev)  # [T, K]
    cpu_mask = torch.empty((T, K), dtype=torch.bool, device=dev)  # [T, K]
    fetch_e = torch.empty((F,), dtype=torch.int64, device=dev)  # [F]
    fetch_s = torch.empty((F,), dtype=torch.int64, device=dev)  # [F]
    counters = torch.empty((3,), dtype=torch.int64, device=dev)  # [3]
    block_s = _pow2(S)
    # constexprs take few values (each is a compile): the decode buckets' small fetch lists
    # (F <= 32: no sort compiled), else one block of E; ids in chunks of 32 at every T
    block_f = _pow2(F) if F <= 32 else _pow2(E)
    _slot_decide_kernel[(1,)](
        ids, nf, slot_owner, expert_slot, slot_last_use, clock,
        slot_ids, cpu_mask, fetch_e, fetch_s, counters,
        torch.empty(3, dtype=torch.int64, device=dev) if accumulate is None else accumulate,
        layer, T * K, E, S, F,
        BLOCK_TK=32, BLOCK_E=_pow2(E), BLOCK_S=block_s, BLOCK_F=block_f,
        TABLE=table, SMALL=SMALL_Q, SORT=block_f > SMALL_Q,
        num_warps=8 if block_s >= 2048 else 4,
    )
    return slot_ids, cpu_mask, fetch_e, fetch_s, counters

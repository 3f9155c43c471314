"""The reuse rule of the hybrid-state radix cache: how much of a prompt needs no recompute.

Linear-attention layers can only resume from a snapshot (a state-pool slot at a radix node,
covering exactly `[0, node.depth)`), so for a model with linear attention the reusable prefix
of `ids` is

    usable = deepest snapshot position s with s <= min(KV match of ids, len(ids) - 1)

(0 with a zero state when there is none); for a model without linear layers (no state pool)
usable = min(KV match, len(ids) - 1). The `len(ids) - 1` cap exists because the caller must
feed at least the last prompt token to get logits, except where the logits are kept
(`logits.py`): when the whole of `ids` is cached and the node ending at `len(ids)` holds both a
snapshot and a kept logits row, usable = len(ids) and `HybridMatch.logits_slot` names the row,
so an exact repeat (and, with the rows the scheduler keeps at L - 1, a resend one token back)
computes nothing before its first token.

`find_reuse` applies the rule over the tree, the snapshot tiers and the kept logits that
`HybridRadixCache` owns (hybrid.py, whose `match` is the entry point); it marks what it uses
recently used and counts the resume on the snapshot, and locks nothing.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from freetoken.cache.logits import KeptLogits
from freetoken.cache.node import TreeNode
from freetoken.cache.radix import RadixCache
from freetoken.cache.tiers import SnapshotTiers


class HybridMatch(NamedTuple):
    """Reuse decision for one prompt.

    `length`: tokens `[0, length)` need no recompute; `kv_slots` (`[length]`, tree-owned) are
    their KV; `node` ends at `length` (lock it). `kv_len`: raw KV match of `ids[:len-1]`.
    `state_len`/`state_slot`/`state_class`: the snapshot resumed from (`state_len == length`,
    slot -1 and class None when none: start from a zero state; always so without a state pool).
    `reason`: why no longer reuse: `last_token` (capped at len-1), `no_snapshot_after=S` (KV
    matched further but no snapshot past S), `kv_miss_at=K` (the KV prefix diverges at K).
    `state_tier`: `device`/`host` (None without a snapshot). `lost`: when a snapshot deeper
    than `length` within the KV match existed and went away, `why:tier@pos` of the deepest
    (`device_full`: evicted with no host room, `host_full`: evicted from the host tier);
    empty otherwise. `logits_slot`: the kept logits row of the whole prompt (`length ==
    len(ids)`, reason `kept_logits`; sample the first token from it, feed nothing), else -1.
    """

    length: int
    kv_len: int
    state_len: int
    state_slot: int
    node: TreeNode
    kv_slots: torch.Tensor  # [length]
    reason: str
    state_class: str | None
    state_tier: str | None = None
    lost: str = ""
    logits_slot: int = -1


def find_reuse(radix: RadixCache, tiers: SnapshotTiers | None, logits: KeptLogits,
               key: list[int], user: str | None) -> HybridMatch:
    """The longest reusable prefix of `key` under the rule in the module docstring. `tiers`:
    the snapshot tiers, None for a model without linear attention (KV alone decides). Marks
    the used path and snapshot recently used; counts the resume (and `user`, the session) on
    the snapshot and in the session lineage."""
    cap = max(len(key) - 1, 0)
    tier, lost = None, ""
    if tiers is None:
        m = radix.lookup(key[:cap])
        kv_len = length = m.length
        state_len, node, slots, slot, cls = 0, m.node, m.slots, -1, None
    else:
        snaps = tiers.snaps
        path, n, _, k = radix.walk(key[:cap])
        kv_len = n + k
        whole = kept_whole(radix, snaps, logits, key)
        if whole is not None:
            path, kv_len = whole, len(key)
        i = len(path) - 1
        while i >= 0 and path[i] not in snaps:
            i -= 1
        gone = [x for x in path[i + 1:] if x in tiers.gone]
        if gone:
            lost = f"{tiers.gone[gone[-1]]}@{gone[-1].depth}"
        use = path[: i + 1]
        radix.touch(use)
        node = use[-1] if use else radix.root
        length = state_len = node.depth
        slots = torch.cat([x.value for x in use]) if use else torch.empty(0, dtype=torch.long)
        snap = snaps.get(node)
        slot, cls = (-1, None) if snap is None else (snap.slot, snap.cls)
        if snap is not None:
            tier = snap.tier
            snap.last_access = tiers.tick()
            snap.hits += 1
            if user is not None:
                snap.users.add(user)
                tiers.lineage.touch(user, node)
    logits_slot = -1
    if len(key) == 0:
        reason = "empty"
    elif length == len(key):
        reason, logits_slot = "kept_logits", logits.hit(node)
    elif length == cap:
        reason = "last_token"
    elif length < kv_len:
        reason = f"no_snapshot_after={length}"
    else:
        reason = f"kv_miss_at={kv_len}"
    return HybridMatch(length, kv_len, state_len, slot, node, slots, reason, cls, tier, lost,
                       logits_slot)


def kept_whole(radix: RadixCache, snaps: dict, logits: KeptLogits, key: list[int]
               ) -> list[TreeNode] | None:
    """The path to the node ending at `len(key)` when all of `key` is cached there and that
    node holds a snapshot and a kept logits row, else None."""
    if not logits.at or not key:
        return None
    path, n, partial, _ = radix.walk(key)
    if partial is not None or n != len(key) or not path:
        return None
    end = path[-1]
    return path if end in snaps and end in logits.at else None

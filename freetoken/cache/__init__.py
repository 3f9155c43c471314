"""Prefix caches: KV slot allocator, radix tree, recurrent-state pool, hybrid radix cache and
snapshot placement policies. Pure bookkeeping over integer slot ids; the engine owns tensors."""
from freetoken.cache.allocator import SlotAllocator
from freetoken.cache.hybrid import HybridMatch, HybridRadixCache, Released, Snapshot
from freetoken.cache.node import TreeNode
from freetoken.cache.policy import (
    ANCHOR,
    CLASS_RANK,
    CUT_POINT,
    END,
    INTERVAL,
    CheckpointPolicy,
    EndOnlyPolicy,
    IntervalPolicy,
    SemanticPolicy,
    available_policies,
    class_rank,
    create_policy,
    register_policy,
)
from freetoken.cache.radix import Committed, MatchResult, RadixCache
from freetoken.cache.state_pool import StatePool

__all__ = [
    "ANCHOR", "CLASS_RANK", "CUT_POINT", "END", "INTERVAL",
    "CheckpointPolicy", "Committed", "EndOnlyPolicy", "HybridMatch", "HybridRadixCache",
    "IntervalPolicy", "MatchResult", "RadixCache", "Released", "SemanticPolicy", "SlotAllocator",
    "Snapshot", "StatePool", "TreeNode", "available_policies", "class_rank", "create_policy",
    "register_policy",
]

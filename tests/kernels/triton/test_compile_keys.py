"""Every shape the server can meet compiles in the warm-up (issue 20 item 6), counted on the CPU.

For each Triton wrapper on the served path, the compile keys (tests/kernels/triton/
compile_keys.py: Triton's own specialisation function, the kernels' `do_not_specialize`
lists, constexprs and launch options) of launches at every prompt length 1..299 plus 40 long
ones, every decode bucket and every layer, must all be among the keys the warm-up plan's shapes
produce (`engine/warm_up.prefill_shapes`, the decode buckets): a key outside is a kernel that
compiles inside a request (on the H200 a `_slot_decide_kernel` compile took ~6 s, and a first
start compiled 42 of them). The sizes are Qwen3.6-35B-A3B's (E 256, K 8, 32 value heads, chunk
8,192, stream threshold 6,334) with small hidden sizes (the hidden sizes are fixed per model:
one key each). Kernels do not run (`execute=False`): only their launch arguments matter.
Bugs caught: an integer argument that follows the token count or layer left specialised
(== 1, % 16), a block size sized from the token count on a grid the plan does not cover."""
from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("records interpreter launches; the H200 run lists its real cache "
                "(scripts/compile_inventory.py)", allow_module_level=True)

from freetoken.engine.warm_up import prefill_shapes
from tests.kernels.triton.compile_keys import diff, record_keys

E, K, HV, L = 256, 8, 32, 40  # experts, top-k, value heads, layers
CHUNK, THRESHOLD = 8192, 6334
BUCKETS = (1, 2, 4)
WARM = sorted(set(BUCKETS) | set(prefill_shapes(CHUNK, 262_144, THRESHOLD)))
rng = random.Random(0)
SWEEP = sorted(set(range(1, 300)) | {rng.randrange(300, CHUNK + 1) for _ in range(40)}
               | {THRESHOLD - 1, THRESHOLD, CHUNK})
# per kernel, at most this many compiles on the whole served path (each costs seconds)
MOST = {"_slot_decide_kernel": 4, "_router_topk_kernel": 2, "_rmsnorm_kernel": 2,
        "_gated_rmsnorm_kernel": 1, "_rmsnorm_rope_kernel": 1, "_gdn_gates_kernel": 1,
        "_align_small_kernel": 5, "_grouped_gate_up_kernel": 4, "_grouped_down_kernel": 4,
        "_wait_kernel": 3, "_raise_kernel": 1, "_store_rows_kernel": 3}


def _ids(T: int) -> torch.Tensor:
    return torch.randint(0, E, (T, K), dtype=torch.int64)


# the served sweep's layers: each specialisation class of a layer index (0 and 16 divisible by
# 16, 1, others); the warm-up runs every layer
LAYERS = (0, 1, 2, 3, 16, 17, 32, L - 1)


def _slot_decide(T: int, layers=range(L)) -> None:
    from freetoken.kernels.triton.slot_decide import slot_decide

    S = 1894  # the 37 % cache of the 20-layer shape
    owner, last = torch.full((S,), -1, dtype=torch.int64), torch.zeros(S, dtype=torch.int64)
    eslot, clock = torch.full((L * E,), -1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    table = torch.zeros(E + 1, dtype=torch.int64)
    acc = torch.zeros(3, dtype=torch.int64)
    for layer in layers:
        cap = min(T * K, E, S)
        # with and without running totals (the captured decode keeps them, prefill not)
        for a in (acc, None):
            slot_decide(owner, eslot, last, clock, E, layer, _ids(T), table, cap, accumulate=a)


def _router(T: int) -> None:
    from freetoken.kernels.triton.router import router_topk

    router_topk(torch.randn(T, E), K, True, torch.bfloat16)


def _norms(T: int) -> None:
    from freetoken.kernels.triton import norm

    H, D = 64, 32
    x = torch.randn(T, H, dtype=torch.bfloat16)
    w = torch.randn(H, dtype=torch.bfloat16)
    norm.rmsnorm(x, w, 1e-6, True)
    norm.rmsnorm(x, w, 1e-6, True, residual=torch.randn_like(x))
    g = torch.randn(T, HV, D, dtype=torch.float32)
    norm.gated_rmsnorm(g, torch.randn_like(g), torch.randn(D), 1e-6, x_dtype=torch.bfloat16)
    q = torch.randn(T, 16, D, dtype=torch.bfloat16)
    cos = torch.randn(T, 16)
    norm.rmsnorm_rope(q, torch.randn(D, dtype=torch.bfloat16), 1e-6, True, cos, cos.clone())


def _gates(T: int) -> None:
    from freetoken.kernels.triton.gdn import gdn_gates

    a = torch.randn(T, HV, dtype=torch.bfloat16)
    gdn_gates(a, torch.randn_like(a), torch.randn(HV), torch.randn(HV))


def _moe(T: int) -> None:
    from freetoken.kernels.triton.fused_moe import fused_moe

    H, I = 32, 16
    x = torch.randn(T, H)
    up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    fused_moe(x, _ids(T), up, down, torch.empty(T, K, H))


WRAPPERS = {"slot_decide": _slot_decide, "router": _router, "norms": _norms, "gates": _gates,
            "moe": _moe}


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_every_prompt_length_compiles_in_warm_up(name):
    fn = WRAPPERS[name]
    torch.manual_seed(0)
    with record_keys(execute=False) as warm:
        for T in WARM:
            fn(T)
    with record_keys(execute=False) as served:
        for T in SWEEP:
            fn(T, LAYERS) if fn is _slot_decide else fn(T)
    for kernel, ks in served.items():
        new = ks - warm.get(kernel, set())
        assert not new, (f"{kernel}: {len(new)} keys outside the warm-up plan (a compile inside "
                         f"a request)\n{diff({kernel: ks})}")
        assert len(ks) <= MOST.get(kernel, 4), f"{kernel}: {len(ks)} compiles\n{diff(served)}"


def test_bridge_flags_compile_once_per_bucket():
    """The hybrid backend's host flags: one launch per layer per step, `i` = the layer."""
    from freetoken.kernels.triton import host_flags as hf

    flags, seq = torch.zeros(L, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    err = torch.zeros(1, dtype=torch.int32)
    with record_keys(execute=False) as keys:
        for B in BUCKETS:
            x, ids = torch.randn(B, 64, dtype=torch.bfloat16), _ids(B)
            mask = torch.zeros(B, K, dtype=torch.bool)
            hx, hids = torch.empty_like(x), torch.empty_like(ids)
            for i in range(L):
                hf.store_rows(x, ids, mask, hx, hids, torch.empty_like(mask))
                hf.raise_flag(flags, i, seq)
                hf.wait_flag(flags, i, seq, err, mask)
    for kernel in ("_store_rows_kernel", "_raise_kernel", "_wait_kernel"):
        assert len(keys[kernel]) <= MOST[kernel], diff(keys)


def test_sink_decode_compiles_once_per_bucket():
    """gpt-oss's decode attention (freetoken/kernels/triton/sink_attention.py), the runner's
    `triton_sink` plan: the warm-up's decode step of each bucket (every row one key, both layer
    kinds: window 0 and 128) compiles every key that rows of any context length, on any slots
    of the pool, meet in serving."""
    from freetoken.kernels.triton.sink_attention import sink_decode_attention

    hq, hk, d, S = 8, 2, 64, 1024
    k_pool = torch.randn(S, hk, d, dtype=torch.bfloat16)
    sinks = torch.randn(hq, dtype=torch.bfloat16)

    def step(lengths: list[int]) -> None:
        B = len(lengths)
        q = torch.randn(B, hq, d, dtype=torch.bfloat16)
        indptr = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
        indices = torch.randint(0, S, (S,), dtype=torch.int32)  # the runner's CSR buffer
        for window in (0, 128):
            sink_decode_attention(q, k_pool, k_pool, indptr, indices, d ** -0.5, sinks, window)

    with record_keys(execute=False) as warm:
        for B in BUCKETS:
            step([1] * B)
    with record_keys(execute=False) as served:
        for B in BUCKETS:
            for _ in range(6):
                step([rng.randrange(1, 300) for _ in range(B)])
    for kernel, ks in served.items():
        new = ks - warm.get(kernel, set())
        assert not new, f"{kernel}: {len(new)} keys outside the warm-up\n{diff(served)}"
        assert len(ks) <= len(BUCKETS), f"{kernel}: {len(ks)} compiles\n{diff(served)}"
    assert set(served) == {"_sink_split_kernel", "_sink_merge_kernel"}


def test_recorder_sees_specialisation():
    """The recorder is not blind: an int the kernel leaves specialised makes keys (1, a
    multiple of 16, other), one it lists in do_not_specialize makes one."""
    import triton
    import triton.language as tl

    @triton.jit
    def spec(x_ptr, n, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), n)

    @triton.jit(do_not_specialize=["n"])
    def nospec(x_ptr, n, BLOCK: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, BLOCK), n)

    x = torch.zeros(4, dtype=torch.int32)
    with record_keys(execute=False) as keys:
        for n in (1, 16, 17, 32, 33):
            spec[(1,)](x, n, BLOCK=4)
            nospec[(1,)](x, n, BLOCK=4)
        spec[(1,)](x[1:], 3, BLOCK=2)  # a misaligned pointer and another constexpr
    assert len(keys["spec"]) == 4 and len(keys["nospec"]) == 1

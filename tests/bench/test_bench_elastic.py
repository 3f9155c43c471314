"""`ft bench elastic` small on the CPU: the streams decode through a shrink of the expert cache
(the planner's *memory claimed* rule, from a reading `--shrink` bytes under the margin) and a
grow back, every phase gets its tokens, no request fails, and the table names the sizes.
Oracle for the sizes: the slot bytes of the store (the claim is exactly 8 slots' worth)."""
from __future__ import annotations

import argparse

import torch

from freetoken.bench.cli_elastic import bench, print_rows, register
from freetoken.cli.build import load_with_experts
from freetoken.types.config import MoEConfig
from tests.models.conftest import tiny_hf  # noqa: F401  (shared session fixture)


def test_decode_through_shrink_and_grow(tiny_hf, capsys) -> None:  # noqa: F811
    d = tiny_hf("qwen3_5_moe")
    _, rt = load_with_experts(d, MoEConfig(backend="offload", cache_size=16),
                              dtype=torch.float32, progress=False)
    slot = rt.store.expert_bytes
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    args = p.parse_args(["elastic", "--model", str(d), "--device", "cpu", "--dtype", "fp32",
                         "--moe-backend", "offload", "--moe-cache-size", "16", "--batch", "2",
                         "--prompt-tokens", "20", "--phase-tokens", "6",
                         "--shrink", str(8 * slot)])
    rows = bench(args)
    names = [r["phase"] for r in rows]
    assert names == ["before", "rebuild_shrink", "shrunk", "rebuild_grow", "regrown", "summary"]
    assert [rows[i]["expert_slots"] for i in range(5)] == [16, 8, 8, 16, 16]
    assert rows[1]["reason"] == "memory_claimed" and rows[3]["reason"] == "memory_returned"
    for i in (0, 2, 4):
        assert rows[i]["tokens"] >= 2 * 6 and rows[i]["tok_s"] > 0
    s = rows[-1]
    assert s["ok"] and not s["failed"] and s["recovery"] > 0
    print_rows(rows)
    out = capsys.readouterr().out
    assert "recovery regrown/before" in out and "16 -> 8 -> back" in out

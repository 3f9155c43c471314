"""`ft bench decode --shape <fp8 shape> --random-weights` (issue 25 item 6): the store holds the
shape's experts in FP8 (its real bytes, never a BF16 copy) and every backend decodes."""
from __future__ import annotations

from freetoken.cli import main


def test_bench_decode_fp8_shape_runs_every_backend(capsys) -> None:
    assert main(["bench", "decode", "--shape", "tiny-qwen3.5-moe-fp8", "--random-weights",
                 "--device", "cpu", "--backends", "fused,cpu,hybrid", "--decode-tokens", "4",
                 "--prompt-tokens", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "format=fp8" in out
    table = out[out.index("floor tok/s"):]
    for be in ("fused", "cpu", "hybrid"):
        row = next(line for line in table.splitlines() if line.startswith(be))
        assert float(row.split()[1]) > 0, row

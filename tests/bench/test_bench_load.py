"""`ft bench load`: the disk measured in the same run, safetensors and FTW loads cold and warm
beside their floors, and a real `ft serve` start timed to ready and first token."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from freetoken.bench.checkpoint_writer import write_checkpoint
from freetoken.bench.load_bench import disk_bandwidth, weight_files
from freetoken.checkpoint.ftw_write import convert
from freetoken.cli import main


def test_bench_load_tables(tmp_path: Path) -> None:
    st = tmp_path / "st"
    write_checkpoint("tiny-qwen3.5-moe", 1, st, shard_bytes=8 << 20, progress=False)
    ftw = tmp_path / "ftw"
    convert(st, ftw, progress=False)
    out = tmp_path / "out"
    assert main(["bench", "load", str(st), str(ftw), "--out", str(out), "--disk-gb", "0.05",
                 "--kernel-caches", "warm", "--serve-arg=--device=cpu",
                 "--serve-arg=--kv-tokens=20000"]) == 0
    rep = json.loads((out / "load.json").read_text())
    assert rep["disk"]["gbps"] > 0 and rep["disk"]["nbytes"] > 0
    loads = {(r["format"], r["page_cache"]): r for r in rep["loads"]}
    assert set(loads) == {(f, pc) for f in ("safetensors", "ftw") for pc in ("cold", "warm")}
    for r in loads.values():
        assert r["bytes"] > 0 and r["read_s"] > 0
    assert {r["model"] for r in rep["serves"]} == {"st", "ftw"}
    for r in rep["serves"]:
        assert r["ready"] >= r["load"] > 0 and r["first_token"] > 0
    table = (out / "load.md").read_text()
    assert "floor s" in table and "x disk" in table


def test_disk_bandwidth_reads_every_byte_asked(tmp_path: Path) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(torch.randint(0, 255, (5 << 20,), dtype=torch.uint8).numpy().tobytes())
    bw = disk_bandwidth(weight_files(tmp_path), 1 << 40, threads=2)
    assert bw.nbytes == 5 << 20 and bw.gbps > 0
    assert bw.method in ("O_DIRECT", "buffered after fadvise(DONTNEED)")

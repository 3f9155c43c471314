"""Profile persistence, fresh routing, and `ft bench bw` on a CPU-only machine."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from freetoken.bench import bandwidth as bw
from freetoken.bench.cli_bw import register
from freetoken.experts import profile as bwp
from freetoken.experts.cost_model import BandwidthProfile


def test_profile_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = bwp.profile_key("qwen3.6-35b-a3b", torch.bfloat16)
    prof = BandwidthProfile(key=key, b_h=71.5, b_p=48.2, b_p_overlap=40.0, b_h_overlap=39.5,
                            host_read=88.0, link=55.0, expert_bytes=6291456, measured_at="now")
    path = bwp.save_profile(prof)
    assert path.is_relative_to(tmp_path / "freetoken" / "profiles")
    assert bwp.load_profile(key) == prof
    other = dict(key, dtype="torch.float32")
    assert bwp.load_profile(other) is None
    path.write_text("{not json")
    assert bwp.load_profile(key) is None


def test_fresh_routes_move_through_the_pool() -> None:
    routes = bw.fresh_routes(pool=40, window=10, tokens=3, top_k=4, steps=5)
    for s, ids in enumerate(routes):
        assert ids.shape == (3, 4)
        base = (s % 4) * 10
        assert ((ids >= base) & (ids < base + 10)).all()
        for row in ids:
            assert len(set(row.tolist())) == 4  # top-k experts of a token are distinct


def test_bench_bw_cpu_only_saves_b_h(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("FT_CPU_ISA", "torch")  # no kernel build in a fresh cache dir
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    args = p.parse_args(["bw", "--pool-gb", "0.04", "--seconds", "0.01", "--threads", "1"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "B_P skipped" in out
    files = list((tmp_path / "freetoken" / "profiles").glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["b_p"] is None and data["b_h"] > 0 and data["key"]["gpu"] == "none"
    assert bwp.load_profile(data["key"]) is not None

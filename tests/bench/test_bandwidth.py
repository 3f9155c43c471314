"""Profile persistence, fresh routing, and `ft bench bw` on a CPU-only machine."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from freetoken.bench.cli_bw import register
from freetoken.experts import calibrate as bw
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


def test_first_start_measures_a_profile_for_the_models_own_shape(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A model whose expert shape is no preset (`ft bench bw --shape` cannot name it) gets its
    profile measured at start and saved under "HxI", where `find_profile` then finds it; each
    stage is logged. Bugs caught: a profile saved under a key the lookup never asks for (the
    next start measures again), a measurement for the preset's shape instead of the model's."""
    import logging

    from freetoken.experts.runtime import find_profile, measure_profile_now
    from freetoken.types.presets import preset_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("FT_CPU_ISA", "torch")  # no kernel build in a fresh cache dir
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("freetoken.experts.calibrate.AUTO_BW_SECONDS", 0.01)
    monkeypatch.setattr("freetoken.experts.calibrate.AUTO_BW_POOL_GB", 0.02)
    import dataclasses

    # no preset has these expert dimensions
    cfg = dataclasses.replace(preset_config("qwen3.6-35b-a3b", 2), hidden_size=256,
                              moe_intermediate_size=96)

    class Model:  # what find_profile / measure_profile_now read of a model
        pass

    model = Model()
    model.cfg = cfg
    name, shape = bwp.shape_for(cfg)
    assert name == "256x96" and (shape.hidden, shape.inter) == (256, 96)
    assert bwp.shape_for(preset_config("qwen3.6-35b-a3b", 2))[0] == "qwen3.6-35b-a3b"
    assert find_profile(model, torch.float32) is None
    with caplog.at_level(logging.INFO, logger="ft.experts"):
        prof = measure_profile_now(model, torch.float32, threads=1)
    assert prof is not None and prof.b_h > 0 and prof.b_p is None
    assert prof.expert_bytes == shape.expert_bytes(torch.float32)
    assert find_profile(model, torch.float32) == prof
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "bw_profile_measure " in msgs and "B_H windows" in msgs and "bw_profile_measured" in msgs


def test_a_failed_start_measurement_falls_back_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A measurement that cannot run at start (no pinned memory to spare, say) must not stop
    the server: no profile, a warning naming the error, nothing saved."""
    import logging

    from freetoken.experts import calibrate
    from freetoken.experts.runtime import find_profile, measure_profile_now
    from freetoken.types.presets import preset_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def no_memory(*a, **k):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(calibrate, "measure_profile", no_memory)

    class Model:
        cfg = preset_config("qwen3.6-35b-a3b", 2)

    with caplog.at_level(logging.WARNING, logger="ft.experts"):
        assert measure_profile_now(Model(), torch.bfloat16, threads=1) is None
    assert any("bw_profile_measure_failed" in r.getMessage() and "out of memory" in r.getMessage()
               for r in caplog.records)
    assert find_profile(Model(), torch.bfloat16) is None
    assert not (tmp_path / "freetoken" / "profiles").exists()

"""Bandwidth profiles of quantized bank formats (issue 25): `ft bench bw --format` measures and
saves B_H (and B_P with CUDA) over a quantized pool in its real bytes; a quantized store's
runtime takes its own format's profile for the q* split (the dense one only as a logged
fallback); the re-profiler's samples count the real bytes."""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import pytest
import torch

from freetoken.bench.cli_bw import bank_format, register
from freetoken.cli.build import load_with_experts
from freetoken.experts import profile as bwp
from freetoken.experts.bw_track import Reprofiler
from freetoken.experts.calibrate import make_pool
from freetoken.experts.cost_model import BandwidthProfile
from freetoken.types.config import MoEConfig
from freetoken.types.model_config import ExpertFormat, expert_nbytes, load_config
from tests.engine.test_engine_core import _prompt, _req, _run
from tests.models.test_fp8_vs_hf import _write_fp8


def _cli(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p.parse_args(["bw", *argv])


def test_bench_bw_format_picks_the_bank_format() -> None:
    assert bank_format(_cli()) == torch.bfloat16  # qwen3.6 ships BF16
    assert bank_format(_cli("--shape", "gpt-oss-120b")) == ExpertFormat("mxfp4", 32)
    assert bank_format(_cli("--format", "fp8")) == ExpertFormat("fp8", 128)
    assert bank_format(_cli("--format", "fp8", "--block", "64")) == ExpertFormat("fp8", 64)
    assert bank_format(_cli("--shape", "gpt-oss-120b", "--format", "dense",
                            "--dtype", "float32")) == torch.float32


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_bench_bw_measures_a_quantized_pool_in_its_real_bytes(
        fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """CPU only: B_H over a pool of quantized banks, saved under the format's key with the
    bytes of one quantized expert (codes + scales: what the pool's banks hold), which is the
    key a quantized store's runtime looks up."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("FT_CPU_ISA", "torch")  # no kernel build in a fresh cache dir
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = _cli("--format", fmt, "--pool-gb", "0.012", "--seconds", "0.01", "--threads", "1")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert f"dtype={fmt}-b" in out and "B_P skipped" in out
    data = json.loads(next((tmp_path / "freetoken" / "profiles").glob("*.json")).read_text())
    ef = ExpertFormat(fmt, 128 if fmt == "fp8" else 32)
    shape = bwp.SHAPES["qwen3.6-35b-a3b"]
    gu, dn = make_pool(shape, ef, 1)  # one expert's banks
    assert data["expert_bytes"] == gu[0].nbytes + dn[0].nbytes == shape.expert_bytes(ef)
    assert data["expert_bytes"] < shape.expert_bytes(torch.bfloat16) / (1.9 if fmt == "fp8"
                                                                         else 3.7)
    assert data["key"] == bwp.profile_key("qwen3.6-35b-a3b", ef) and data["b_h"] > 0


def _save(key_dtype, b_p: float, b_h: float, cfg) -> None:
    name, shape = bwp.shape_for(cfg)
    bwp.save_profile(BandwidthProfile(key=bwp.profile_key(name, key_dtype), b_h=b_h, b_p=b_p,
                                      host_read=50.0, expert_bytes=shape.expert_bytes(key_dtype),
                                      measured_at="now"))


def test_quantized_runtime_splits_on_its_own_profile_and_samples_real_bytes(
        tiny_hf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A hybrid runtime over an FP8 checkpoint takes the fp8 profile's B_P / B_H (not the dense
    one beside it); without an fp8 profile it falls back to the dense one with a warning. Its
    host samples for the re-profiler are whole numbers of quantized experts' bytes."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("FT_CPU_ISA", "torch")  # no kernel build in a fresh cache dir
    ckpt = tmp_path / "fp8"
    _write_fp8(tiny_hf("qwen3_5_moe"), ckpt, tmp_path / "deq", 32)
    cfg = load_config(ckpt)
    fmt = cfg.expert_format
    assert isinstance(fmt, ExpertFormat) and fmt.name == "fp8"
    _save(torch.float32, 7.0, 3.0, cfg)  # the dense profile (store.dtype: float32 here)
    _save(fmt, 40.0, 20.0, cfg)
    moe = MoEConfig(backend="hybrid", cache_size=6, hybrid_max_fetch=1)
    model, rt = load_with_experts(ckpt, moe, dtype=torch.float32, progress=False)
    assert (rt.q_rule.b_p, rt.q_rule.b_h) == (40.0, 20.0)
    real = rt.store.expert_bytes
    assert real == expert_nbytes(cfg.hidden_size, cfg.moe_intermediate_size, fmt)
    assert real == rt.store.gate_up(0)[0].nbytes + rt.store.down(0)[0].nbytes
    samples: list[float] = []
    keep = Reprofiler.host_sample
    monkeypatch.setattr(Reprofiler, "host_sample",
                        lambda self, n, s: (samples.append(n), keep(self, n, s))[1])
    from freetoken.engine.core import EngineCore

    core = EngineCore(model, [], kv_tokens=400, state_slots=8, max_running=1, chunk_tokens=32,
                      decode_runner=False, moe=rt)
    assert rt.enable_reprofile(every_steps=2, drift=0.0, min_bytes=0) is not None
    _run(core, [_req("a", _prompt(cfg.vocab_size, 12, 0), 6)])
    assert samples and all(n > 0 and n % real == 0 for n in samples)

    bwp.profile_path(bwp.profile_key(bwp.shape_for(cfg)[0], fmt)).unlink()  # no fp8 profile
    with caplog.at_level(logging.WARNING, logger="ft.experts"):
        _, rt2 = load_with_experts(ckpt, moe, dtype=torch.float32, progress=False)
    assert (rt2.q_rule.b_p, rt2.q_rule.b_h) == (7.0, 3.0)
    assert any("bw_profile_dense_for_quantized" in r.getMessage() for r in caplog.records)


def test_a_tiny_shapes_measurement_stays_bounded() -> None:
    """Bug this catches: a first hybrid start of the tiny FP8 test model on the H200 measured
    its profile over a 3 GB pool of 6 KB experts (487k of them): the untimed warm pass made
    one CPU-kernel call per two experts, each slowed by the bank's size, and the start ran
    past 100 s. The pool is capped in experts, and the warm pass stops at its time budget."""
    from freetoken.experts import calibrate as cal

    shape = bwp.ExpertShape(hidden=64, inter=32, experts=8, top_k=2, layers=4)
    ef = ExpertFormat("fp8", 128)
    gu, dn = make_pool(shape, ef, 3e9)
    assert gu.shape[0] == dn.shape[0] == cal.MAX_POOL_EXPERTS < 3e9 // shape.expert_bytes(ef)
    big = bwp.SHAPES["qwen3.6-35b-a3b"]  # a real shape is not capped
    assert int(3e9 // big.expert_bytes(torch.bfloat16)) < cal.MAX_POOL_EXPERTS
    calls: list[int] = []

    def slow(x, ids, g, d) -> None:
        calls.append(1)
        time.sleep(0.002)

    routes = [torch.tensor([[2 * s, 2 * s + 1]]) for s in range(500)]
    _, step_s = cal.time_experts(slow, gu, dn, routes, warmup=0, budget_s=0.02)
    assert 1 <= len(calls) < 50 and step_s >= 0.002
    calls.clear()
    cal.time_experts(slow, gu, dn, routes[:20], warmup=0)  # no budget: every route runs
    assert len(calls) == 20

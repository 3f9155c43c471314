"""`ft bench prefill`'s rows and table (the measuring itself needs CUDA): each row maps to the
streamer options it names, and the table divides by the right floor."""
from __future__ import annotations

import pytest
import torch

from freetoken.bench.cli_prefill import _row_opts, _table
from freetoken.types.config import MoEConfig
from tests.models.conftest import tiny_hf  # noqa: F401  (shared session fixture)


def test_rows_map_to_streamer_options() -> None:
    base = MoEConfig(backend="offload", cache_rate=0.37)
    s = _row_opts("stream", base)
    assert (s.prefill_stream, s.prefill_overlap, s.prefill_hit_d2d) == ("on", True, True)
    assert _row_opts("stream/serial", base).prefill_overlap is False
    assert _row_opts("stream/all-link", base).prefill_hit_d2d is False
    assert _row_opts("experts", base).prefill_stream == "off"
    assert base.prefill_stream == "auto"  # the base options are not modified
    with pytest.raises(SystemExit):
        _row_opts("nonsense", base)


def test_table_floors_and_overlap_gain(capsys) -> None:
    b_p, pool = 50e9, 32e9
    results = {(8192, "stream"): (0.5, 24e9), (8192, "stream/serial"): (0.65, 24e9),
               (8192, "fused"): (0.3, 0.0)}
    _table(results, [8192], ["stream", "stream/serial", "fused"], b_p, pool)
    out = capsys.readouterr().out
    assert "0.640 s per chunk" in out  # pool / B_P
    line = next(x for x in out.splitlines() if " stream " in x)
    assert "0.480" in line and "1.04" in line and "0.78" in line  # floor, x floor, x pool/B_P
    assert "serial is 30% slower" in out


def test_ttft_runs_two_long_prompts_and_closes_its_engine(tiny_hf, capsys,  # noqa: F811
                                                          monkeypatch) -> None:
    """`--ttft` through EngineCore on the CPU: two prompts of the length (the process's first,
    then steady state), each with its chunks' seconds, and the engine closed at the end (an
    unclosed one left its state-tier fill running at exit: an abort on the H200)."""
    import freetoken.bench.cli_prefill as cp
    from freetoken.cli.build import load_with_experts
    from freetoken.engine.core import EngineCore
    from freetoken.types.config import MoEConfig

    model, rt = load_with_experts(tiny_hf("qwen3_5_moe"), MoEConfig(backend="offload",
                                                                    cache_size=16),
                                  dtype=torch.float32, progress=False)
    monkeypatch.setattr("freetoken.engine.sizing.default_chunk_tokens", lambda rt: 32)
    closed = []
    real_close = EngineCore.close
    monkeypatch.setattr(EngineCore, "close", lambda self: (closed.append(1), real_close(self)))
    s = cp.ttft(model, rt, 80, model.cfg.vocab_size)
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("TTFT 80 tokens")]
    assert [("(first)" in lines[0]), ("(again)" in lines[1])] == [True, True], out
    for ln in lines:  # 80 tokens in chunks of 32: three steps at least to the first token
        assert "chunks of 32" in ln and len(ln.split("steps ")[1].split()) >= 3 + 1, ln
    assert s > 0 and closed == [1]

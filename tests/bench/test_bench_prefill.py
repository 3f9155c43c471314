"""`ft bench prefill`'s rows and table (the measuring itself needs CUDA): each row maps to the
streamer options it names, and the table divides by the right floor."""
from __future__ import annotations

import pytest

from freetoken.bench.cli_prefill import _row_opts, _table
from freetoken.types.config import MoEConfig


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

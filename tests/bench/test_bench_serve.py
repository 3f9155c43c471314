"""`ft bench serve` end to end on CPU: a tiny random checkpoint served by a real `ft serve`
subprocess, W1–W4 at tiny scale through the HTTP API, the report with start-up phases,
stability and per-workload expert stats; `--route-trace FILE` really reroutes the server."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from freetoken.bench.checkpoint_writer import write_checkpoint
from freetoken.bench.serve_process import parse_phases
from freetoken.cli import main


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bench-serve") / "ckpt"
    write_checkpoint("tiny-qwen3.5-moe", 2, d, progress=False)
    return d


def test_bench_serve_end_to_end_with_replayed_routing(tiny_ckpt: Path, tmp_path: Path) -> None:
    # every decode step of every layer routes to experts 0 and 1: with half the pool cached,
    # replayed routing must hit almost always, where the random router hits about half the time
    trace = np.zeros((16, 2, 4, 2), dtype=np.uint8)
    trace[..., 1] = 1
    np.save(tmp_path / "trace.npy", trace)
    out = tmp_path / "out"
    rc = main(["bench", "serve", "--model", str(tiny_ckpt), "--scale", "tiny", "--out", str(out),
               "--moe-backend", "offload", "--moe-cache-rate", "0.5",
               "--route-trace", str(tmp_path / "trace.npy"),
               "--serve-arg=--device=cpu", "--serve-arg=--dtype=fp32",
               "--serve-arg=--kv-tokens=200000"])
    log = (out / "serve.log").read_text()
    assert rc == 0, log[-3000:]
    assert "route_trace" in log
    rep = json.loads((out / "serve_report.json").read_text())
    assert rep["phases"]["ready"] > rep["phases"]["load"] > 0
    assert rep["phases"]["first_token"] > 0
    rows = {r["workload"]: r for r in rep["workloads"]}
    assert set(rows) == {"W1", "W2", "W3", "W4"}
    assert rows["W1"]["vs_w1"] == pytest.approx(1.0)
    for r in rows.values():
        assert r["ok"] and r["tps"] > 0 and r["tokens"] > 0
        assert r["experts"]["backend"] == "offload"
    # measured on this tiny model: 0.80 replayed, 0.41 with the model's own random router
    # (prefill keeps the random router, hence not 1.0): a server that ignored the flag fails
    w1 = rows["W1"]["experts"]
    assert w1["hits"] + w1["misses"] > 0 and w1["hit_rate"] > 0.7, w1
    text = (out / "serve_report.md").read_text()
    assert "start → ready" in text and "| W4 |" in text
    assert (out / "report.md").exists() or list(out.glob("*.md"))


def test_phases_parse_the_server_log_lines() -> None:
    text = ("12:00:01 ft.checkpoint: ftw_loaded dir=x read_s=3.50 gbps=9.1\n"
            "12:00:02 ft.experts: bw_profile_measured seconds=11.5 b_p=50\n"
            "12:00:03 ft.model: loaded model=x family=qwen3_5_moe seconds=20.0\n"
            "12:00:09 ft.engine: warm_up seconds=35.2 graphs=6\n")
    assert parse_phases(text) == {"load": 8.5, "profile": 11.5, "warm_up": 35.2,
                                  "weights_read": 3.5}
    # the default idle warm-up runs after ready: reported beside, not inside, start -> ready
    idle = text.replace("ft.engine: warm_up seconds=35.2 graphs=6",
                        "ft.warmup: done tasks=30 seconds=12.5 wall=14.0")
    assert parse_phases(idle) == {"load": 8.5, "profile": 11.5, "warm_up_idle": 12.5,
                                  "weights_read": 3.5}
    split = text + ("12:00:10 ft.server: startup_phases before_s=4.10 resolve_s=0.02 "
                    "load_s=20.00 tokenizer_s=1.30 engine_s=2.50 warm_up_s=0.00 "
                    "elastic_s=0.01\n")
    got = parse_phases(split)
    assert {k: got[k] for k in ("imports", "tokenizer", "engine_build", "elastic")} == {
        "imports": 4.1, "tokenizer": 1.3, "engine_build": 2.5, "elastic": 0.01}


def test_the_startup_line_splits_a_real_start(tiny_ckpt: Path, caplog) -> None:
    """build_engine logs one startup_phases line whose stages parse back and add up to less
    than the wall time of the build (each stage timed once, none counted twice)."""
    import logging
    import time

    from freetoken.cli.build import build_engine
    from freetoken.types.config import EngineConfig

    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO):
        engine = build_engine(EngineConfig(model=str(tiny_ckpt), device="cpu",
                                           dtype="fp32"))
    wall = time.perf_counter() - t0
    engine.shutdown()
    lines = [r.getMessage() for r in caplog.records if "startup_phases" in r.getMessage()]
    assert len(lines) == 1
    got = parse_phases("00:00:00 ft.server: " + lines[0])
    assert got["imports"] > 0 and got["tokenizer"] >= 0 and got["engine_build"] >= 0
    stages = [float(f.split("=")[1]) for f in lines[0].split()[1:] if not f.startswith("before")]
    assert 0 < sum(stages) <= wall + 1e-3


def test_expert_delta_names_what_auto_ran() -> None:
    """The report's backend column for `auto` says which candidate it ran at the workload's
    end (settled or still timing), from /v1/stats' `experts.auto`; counters are differences."""
    from freetoken.bench.cli_bench_serve import expert_delta

    def stats(hits: int, auto: dict | None) -> dict:
        e = {"hits": hits, "misses": 10, "fetched": 4, "cpu_experts": 6, "fetch_bytes": 40,
             "cpu_bytes": 60, "streamed": 0, "stream_bytes": 0, "backend": "auto", "slots": 9}
        return {"experts": e | ({"auto": auto} if auto else {})}

    d = expert_delta(stats(5, None), stats(35, {"phase": "settled", "running": "hybrid"}))
    assert d is not None and d["backend"] == "auto: hybrid (settled)"
    assert (d["hits"], d["misses"], d["hit_rate"]) == (30, 0, 1.0)
    plain = expert_delta({}, {"experts": stats(3, None)["experts"] | {"backend": "offload"}})
    assert plain is not None and plain["backend"] == "offload" and "auto" not in plain

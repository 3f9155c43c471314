"""The runner against the fake server: forced lengths, cache growth, W3 overlap, the report."""
from __future__ import annotations

import itertools
from pathlib import Path

from fake_server import FakeServer

from workloads import build_workload, run_workload, write_report
from workloads.runner import WorkloadResult


def _by_session(r: WorkloadResult) -> dict[str, list]:
    out: dict[str, list] = {}
    for t in r.turns:
        out.setdefault(t.session, []).append(t)
    return out


def test_all_workloads_replay_with_forced_lengths_and_report(fake_server: FakeServer,
                                                             tmp_path: Path) -> None:
    results = {}
    for name in ("W1", "W2", "W3", "W4"):
        w = build_workload(name, "tiny")
        results[name] = run_workload(w, fake_server.url)
        r = results[name]
        assert r.ok, [t.error for t in r.turns]
        assert [t.output_tokens for t in r.turns] == [t.output_tokens for t in w.turns]
        assert all(t.ttft_s is not None and t.ttft_s > 0 for t in r.turns)
        assert r.mean_decode_tps is not None and r.mean_decode_tps > 0
    # Every request carried all forcing fields with the recorded length.
    for entry in fake_server.log:
        b = entry["body"]
        assert b["ignore_eos"] is True
        assert b["max_tokens"] == b["min_tokens"] == b["n_predict"] == entry["n"]
    # Cached tokens: the server's prefix oracle reaches the client, and grows turn over turn.
    for name in ("W2", "W3", "W4"):
        for session, turns in _by_session(results[name]).items():
            cached = [t.cached_tokens for t in turns]
            assert all(b > a for a, b in itertools.pairwise(cached)), (name, session, cached)
            assert all(t.recomputed_tokens == t.prompt_tokens - t.cached_tokens for t in turns)
    served = {e["prompt"] for e in fake_server.log}
    assert {t.prompt_tokens for r in results.values() for t in r.turns} <= served
    # W3: the two sub-agents run at the same time, launched ~40 ms apart.
    w3 = {t.turn_id: t for t in results["W3"].turns}
    s1, s2 = w3["S1.1"], w3["S2.1"]
    assert s2.start < s1.end and s1.start < s2.end
    assert 0.02 < s2.start - s1.start < 0.2
    assert w3["M4"].start >= max(w3["S1.5"].end, w3["S2.5"].end)
    report = write_report(results, tmp_path)
    text = report.read_text()
    assert "| W3 |" in text and "S2.5" in text
    for png in ("decode_rate.png", "ttft.png", "cache.png", "w3_timeline.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "results.json").exists()


def test_cross_api_replay_and_delta_count_fallback(fake_server: FakeServer) -> None:
    w2 = build_workload("W2", "tiny")
    r = run_workload(w2, fake_server.url + "/v1", api="anthropic", model="m")
    assert r.ok and r.api == "anthropic"
    assert [e["path"] for e in fake_server.log] == ["anthropic"] * 3
    assert all(e["body"]["model"] == "m" for e in fake_server.log)
    assert [t.output_tokens for t in r.turns] == [t.output_tokens for t in w2.turns]
    fake_server.usage = False
    w1 = build_workload("W1", "tiny")
    r1 = run_workload(w1, fake_server.url, api="openai")
    assert r1.turns[0].output_tokens == r1.turns[0].deltas == w1.turns[0].output_tokens
    assert r1.turns[0].prompt_tokens is None and r1.turns[0].recomputed_tokens is None


def test_unreachable_endpoint_records_errors() -> None:
    r = run_workload(build_workload("W1", "tiny"), "http://127.0.0.1:9", timeout_s=2)
    assert not r.ok and r.turns[0].error


def test_decode_rates_compare_with_w1_only_at_the_same_sampling(tmp_path) -> None:
    """Bug caught (#23): W1 alone sent top_p 0.95 (~35% of CPU decode speed), so W2-W4 came
    out at 1.2-1.6x W1 for a reason unrelated to agent context."""
    from workloads.client import TurnResult
    from workloads.report import new_tokens
    from workloads.runner import WorkloadResult, summarize

    def res(name: str, rates: list[tuple[str, float]]) -> WorkloadResult:
        r = WorkloadResult(name, "v", "openai", "x")
        for i, (samp, tps) in enumerate(rates):
            t = TurnResult(f"T{i}", "s", "main", 11, sampling=samp, first_token=0.0,
                           last_token=10 / tps, output_tokens=11, prompt_tokens=100 + 50 * i,
                           cached_tokens=90 if i else 0)
            r.turns.append(t)
        return r

    a, b = "temperature=0.6 top_p=0.95 top_k=0", "temperature=1 top_p=1 top_k=0"
    s = summarize({"W1": res("W1", [(a, 10.0)]), "W2": res("W2", [(b, 15.0), (b, 15.0)])})
    assert s["W2"]["stability_vs_w1"] is None  # different sampling: no ratio...
    assert s["W2"]["stability_vs_w1_other_sampling"] == 1.5  # ...both stated instead
    assert s["W2"]["sampling"] == [b] and s["W2"]["w1_sampling"] == [a]
    s = summarize({"W1": res("W1", [(a, 10.0), (b, 12.0)]), "W2": res("W2", [(b, 15.0)])})
    assert s["W2"]["stability_vs_w1"] == 1.25 and s["W2"]["w1_same_sampling_tps"] == 12.0
    # new tokens: what the session had not sent before (prompt - previous prompt - output)
    r = res("W2", [(b, 15.0), (b, 15.0), (b, 15.0)])
    assert new_tokens(r) == [100, 39, 39]
    from workloads.report import write_report as wr
    assert (wr({"W1": res("W1", [(a, 10.0)]), "W2": r}, tmp_path)).exists()

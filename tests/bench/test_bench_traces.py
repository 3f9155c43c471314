"""`ft bench anchors` cannot mislead (#23 item 5): replies by session, errors naming the record,
Responses-API traces, one-request traces, budget sweeps, per-scope results."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from freetoken.bench.anchor_report import excess_ratio
from freetoken.bench.anchor_sim import SimRequest, replay
from freetoken.bench.traces import TraceError, attribute_replies, load_trace
from freetoken.chat import ChatTokenizer, qwen3_tokenizer_dir
from freetoken.cli import main

TRACES = Path(__file__).parents[1] / "data" / "harness_traces"
RESPONSES = Path(__file__).parents[1] / "data" / "responses_traces"  # Codex, Responses API


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_dir(qwen3_tokenizer_dir())


def test_replies_are_attributed_by_session_not_by_file_order() -> None:
    """Bug caught: the reply was taken from the next request of the file, so the sub-agent
    requests recorded between two main turns made the main turn's reply fresh tokens."""
    main1 = SimRequest("m", [1, 2, 3], [])
    sub = SimRequest("s", [1, 2, 9, 9], [])  # a sub-agent, recorded in between
    main2 = SimRequest("m", [1, 2, 3, 7, 8, 0, 5], [])  # reply 7 8, <|im_end|>=0, then more
    attribute_replies([main1, sub, main2], im_end=0)
    assert main1.gen == [7, 8]
    assert sub.gen != [] and not set(sub.gen) & {1, 2, 3, 7, 8, 9}  # fresh: nobody sent it


def test_cc_sub_agents_get_their_own_sessions_and_the_main_threads_parent(tok) -> None:
    reqs = load_trace(tok, TRACES / "claude_code" / "cc_try1.jsonl")
    subs = [r for r in reqs if r.parent is not None]
    mains = [r for r in reqs if r.parent is None]
    assert len(subs) == 4 and len({r.session for r in subs}) == 2  # two agents, two turns each
    assert {r.parent for r in subs} == {subs[0].parent}
    assert all(r.session.startswith(subs[0].parent) for r in mains)  # resolves to the main
    attribute_replies(reqs, tok.special_ids["<|im_end|>"])
    # every main turn but the last gets its reply from the next main turn, past the sub-agents
    for a, b in itertools.pairwise(mains):
        assert b.ids[: len(a.ids) + len(a.gen)] == a.ids + a.gen and a.gen[0] < 10**9


def test_opencode_sub_agents_name_their_parent_by_x_parent_session_id(tok) -> None:
    """#23 item 1 on the recorded OpenCode sub-agents (oc_try1: two `task` sub-agents, each
    with its own `x-session-id` / `x-session-affinity` and the main's `x-parent-session-id`):
    the adapter's keys, as the proxy sends them, resolve in the cache's lineage to the main
    session, which waits on them until it speaks again."""
    from freetoken.cache.lineage import Lineage

    reqs = load_trace(tok, TRACES / "opencode" / "oc_try1.jsonl")
    subs = [r for r in reqs if r.parent is not None]
    assert len(subs) == 4 and len({r.session for r in subs}) == 2
    lin = Lineage()
    for i, r in enumerate(reqs):
        lin.begin(r.session, r.parent)
        lin.end(r.session)
        if i == 7:  # the second sub-agent's last turn: the main waits on both
            mains = {lin.sessions[s.session].parent for s in subs}
            assert len(mains) == 1 and lin.waiting_on_children(mains.pop())
    assert all(lin.sessions[r.session].declared and lin.sessions[r.session].finished
               for r in subs)  # the main spoke again after both (seq 8 on)
    main = reqs[1].session  # the agent's main thread (seq 0: the title request, its own head)
    assert reqs[0].session != main and reqs[8].session == main
    assert {lin.sessions[r.session].parent for r in subs} == {main}  # the latest with the id
    # `x-session-affinity` alone keys the session as `x-session-id` does
    from harness_adapters import HarnessRequest, detect_adapter

    rec = json.loads((TRACES / "opencode" / "oc_try1.jsonl").read_text().splitlines()[0])
    h = {k.lower(): v for k, v in rec["headers"].items()}
    both = HarnessRequest("openai", rec["path"], h, rec["body"])
    aff = HarnessRequest("openai", rec["path"], {k: v for k, v in h.items()
                                                 if k != "x-session-id"}, rec["body"])
    ad = detect_adapter(both)
    assert detect_adapter(aff) is ad and ad.session_key(aff) == ad.session_key(both)


def test_responses_api_trace_loads_every_request(tok) -> None:
    """Bug caught: Codex's Responses bodies (`input`, no `messages`) loaded 0 requests and the
    bench printed a table of 0.0 ratios."""
    reqs = load_trace(tok, RESPONSES / "codex_responses.jsonl")
    assert len(reqs) == 7
    assert len({r.session for r in reqs}) == 1  # one thread (turn metadata / prompt cache key)
    for a, b in itertools.pairwise(reqs[:5]):  # turns append: each prompt extends the last
        assert len(b.ids) > len(a.ids) and b.ids[: len(a.ids) - 8] == a.ids[: len(a.ids) - 8]
    text = tok.decode(reqs[1].ids)
    assert "exec_command" in text and "ls -la" in text and "<tool_response>" in text


def _write(tmp: Path, lines: list[str]) -> Path:
    p = tmp / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_unreadable_records_and_empty_traces_are_errors_naming_the_record(tok, tmp_path) -> None:
    good = json.dumps({"path": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi"}]}})
    with pytest.raises(TraceError, match=r"t\.jsonl:2: not a JSON record"):
        load_trace(tok, _write(tmp_path, [good, "{oops"]))
    bad = json.dumps({"path": "/v1/chat/completions", "body": {"messages": [{"role": "x"}]}})
    with pytest.raises(TraceError, match=r"t\.jsonl:2: the request does not render"):
        load_trace(tok, _write(tmp_path, [good, bad]))
    with pytest.raises(TraceError, match=r"t\.jsonl:1: no request body"):
        load_trace(tok, _write(tmp_path, [json.dumps({"path": "/v1/x", "body": {"a": 1}})]))
    count = json.dumps({"path": "/v1/messages/count_tokens", "body": {"messages": []}})
    with pytest.raises(TraceError, match="no generation request"):
        load_trace(tok, _write(tmp_path, [count]))
    rc = main(["--log-level", "WARNING", "bench", "anchors", "--traces",
               str(_write(tmp_path, [count]))])
    assert rc == 2


def test_one_request_trace_reports_its_recompute_not_a_ratio(tmp_path, capsys) -> None:
    good = json.dumps({"path": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hello there"}]}})
    rc = main(["--log-level", "WARNING", "bench", "anchors", "--traces",
               str(_write(tmp_path, [good])), "--policies", "semantic,llamacpp", "--json"])
    assert rc == 0
    sc = json.loads(capsys.readouterr().out)["budgets"][0]["scopes"]["interleaved"]
    assert sc["turns"] == 0 and sc["minimum"] > 0
    sem = sc["policies"]["semantic"]
    assert "ratio" not in sem and sem["recomputed"] == sc["minimum"]


def test_one_request_trace_prints_no_ratio(tmp_path, capsys) -> None:
    """The printed table (not only --json): bug caught, a one-request trace printed
    "ratio 0.0" for every policy."""
    good = json.dumps({"path": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hello there"}]}})
    rc = main(["--log-level", "WARNING", "bench", "anchors", "--traces",
               str(_write(tmp_path, [good])), "--policies", "semantic,llamacpp"])
    out = capsys.readouterr().out
    assert rc == 0 and "no later turn" in out and "(no ratio)" in out
    head = next(ln for ln in out.splitlines() if ln.strip().startswith("policy"))
    assert "ratio" not in head.replace("recomputed", "")
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith("semantic")]
    assert rows and all("0.0" not in r for r in rows)


def test_budget_sweep_and_per_trace_scopes(capsys) -> None:
    rc = main(["--log-level", "WARNING", "bench", "anchors", "--traces",
               str(TRACES / "mini_swe_agent"), "--budget", "4+0", "--budget", "16+32",
               "--policies", "semantic,upstream,llamacpp", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [(b["device_slots"], b["host_slots"]) for b in out["budgets"]] == [(4, 0), (16, 32)]
    for b in out["budgets"]:
        assert set(b["scopes"]) == {"interleaved", "mini_text", "mini_tool"}
        for sc in b["scopes"].values():
            sem = sc["policies"]["semantic"]
            assert {"excess_ratio_upstream", "excess_ratio_llamacpp", "ratio"} <= set(sem)
    rc = main(["bench", "anchors", "--budget", "x+1"])
    assert rc == 2


def test_excess_ratio_names_the_cases_a_division_hides() -> None:
    assert excess_ratio(10, 50) == 5.0
    assert excess_ratio(0, 50) == "inf" and excess_ratio(0, 0) == "at min"
    assert excess_ratio(7, 0) == "at min"


def test_a_parent_keeps_its_latest_snapshot_while_its_sub_agents_run() -> None:
    """Bug caught (#23): Claude Code's main thread lost its only useful snapshot (`end`, the
    lowest class) while its sub-agents ran, and recomputed 9,551 tokens against a minimum of
    395. With lineage its latest snapshot is worth a hit cut point while they run."""
    head = list(range(1, 101))

    def run(parent: str | None) -> int:
        p1 = SimRequest("p", head + [200] * 20, [], gen=[300] * 5)
        kids = [SimRequest(f"k{i}", head + [400 + i] * 30, [], gen=[500 + i] * 5,
                           parent=parent) for i in range(3)]
        p2 = SimRequest("p", p1.ids + p1.gen + [600] * 10, [])
        return replay([p1, *kids, p2], "semantic", device_slots=3, host_slots=0).recomputed[-1]

    assert run("p") == 10  # resumed at the parent's end: only the new tokens
    assert run(None) == 135  # without lineage the sub-agents' snapshots push it out

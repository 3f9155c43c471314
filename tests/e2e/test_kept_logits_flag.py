"""`ft serve --kept-logits N` (#23 item 4's rows, cache/logits.py) reaches the engine through
`build_engine` and changes what a resend costs: with the default (one row per state slot) an
exact resend of a prompt computes nothing before its first token; with `--kept-logits 0` it
resumes one token short and feeds the last prompt token again. Oracle for the tokens: the
plain single-request path (`generate`); for the work, the engine's own prefill counter.

Bug it catches: a flag parsed but dropped on the way to `EngineCore` (kept logits always on,
whatever the user asked, the state before this flag existed), or a count not honoured."""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from freetoken.cli.build import build_engine
from freetoken.cli.options import engine_config_from_args
from freetoken.cli.serve import register as register_serve
from freetoken.engine.generate import generate
from freetoken.models.loader import load_model
from freetoken.types.api import GenerateRequest, SamplingParams

IDS = list(range(2000, 2037))
N = 5


def _engine(model_dir: Path, *argv: str):
    p = argparse.ArgumentParser()
    register_serve(p.add_subparsers(dest="command"))
    args = p.parse_args(["serve", "--model", str(model_dir), "--device", "cpu", "--dtype",
                         "fp32", "--kv-tokens", "400", "--state-slots", "6", *argv])
    return build_engine(engine_config_from_args(args))


def _send(engine, rid: str) -> tuple[list[int], int, int]:
    """(tokens, cached_tokens of the first event, prefill tokens computed for it)."""
    before = engine.core.stats.summary()["prefill_tokens_computed"]

    async def go():
        toks, cached = [], None
        req = GenerateRequest(list(IDS), SamplingParams(max_tokens=N, temperature=0.0,
                                                        ignore_eos=True), [], request_id=rid)
        async for ev in engine.generate(req):
            cached = ev.cached_tokens if cached is None else cached
            toks += ev.token_ids
        return toks, cached

    toks, cached = asyncio.run(asyncio.wait_for(go(), 60))
    return toks, cached, engine.core.stats.summary()["prefill_tokens_computed"] - before


@pytest.mark.parametrize("argv,rows,resend_cost", [((), 6, 0), (("--kept-logits", "3"), 3, 0),
                                                   (("--kept-logits", "0"), 0, 1)])
def test_kept_logits_flag_changes_what_a_resend_computes(tiny_chat_dir, argv, rows,
                                                         resend_cost) -> None:
    model = load_model(tiny_chat_dir, progress=False)
    want = generate(model, IDS, SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True),
                    []).token_ids
    engine = _engine(tiny_chat_dir, *argv)
    try:
        cache = engine.core.sched.cache
        assert cache.logits.pool.num_slots == rows
        assert _send(engine, "first") == (want, 0, len(IDS))
        toks, cached, computed = _send(engine, "again")
        assert toks == want
        assert (cached, computed) == (len(IDS) - resend_cost, resend_cost)
        assert cache.stats().get("logits_hits", 0) == (1 if rows else 0)
    finally:
        engine.shutdown()


def test_negative_kept_logits_exits_naming_the_flag() -> None:
    p = argparse.ArgumentParser()
    register_serve(p.add_subparsers(dest="command"))
    with pytest.raises(SystemExit, match="--kept-logits"):
        engine_config_from_args(p.parse_args(["serve", "--kept-logits", "-1"]))

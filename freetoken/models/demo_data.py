"""Synthetic agent transcripts for training the demo model (`freetoken.models.train_demo`).

Each conversation starts from a real first request of a recorded harness (its system prompt, its
tool list, its user-message wrapping; `tests/data/harness_traces/`), with the recorded task
replaced by a short synthetic one, then goes on in that harness's own API shape: a tool call
that names a tool of the request's own list with arguments valid against its schema, the tool
result formatted the way that harness formats it, and a final answer that quotes the result
and ends the turn. Chat tasks ("hi") get a short answer and no call. Requests are mapped by the
server's own walks (`openai_to_template` / `anthropic_to_template`) and rendered by the
checkpoint's chat template (`ChatTokenizer.apply`) after the demo's prompt compaction
(`freetoken.chat.compaction`, the version `COMPACTION_OF` names for the data version: the cut
the server applies to the model whose manifest declares it), so the prompts are token for token
what the engine renders the demo from those harnesses.

Tasks map onto each harness's real tools: list files, read a file, run a shell command, write a
file (Claude Code: Bash/Read/Write; OpenCode: bash/read/write; OpenClaw: ls/read/exec/write;
Codex: exec_command; mini-swe-agent: its `bash` tool, or its text protocol with
```mswea_bash_command blocks and `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` to finish).

Everything comes from `random.Random` seeded by (seed, harness, shard): the same (version, seed,
counts) gives the same samples, however many worker processes make them. Every function that
draws takes the data `version` (`DATA_VERSIONS`; default `DATA_VERSION`, what a training run
makes): an older version's samples stay what they were, so tests of weights trained on it build
their held-out requests with the version their manifest names. A change to the output for a
seed is a new version.
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken.chat import compaction
from freetoken.chat.anthropic_map import anthropic_to_template
from freetoken.chat.openai_map import openai_to_template
from freetoken.chat.tokenizer import ChatTokenizer
from freetoken.envs import harness_traces_dir
from freetoken.models.demo_harnesses import HARNESSES, MINI_DONE, Harness
from freetoken.models.demo_requests import (  # noqa: F401 (the generator's API)
    RECORDED_CWD,
    base_request,
    corpus_lines,
    recorded_body,
    responses_to_openai,
)
from freetoken.models.demo_tasks import Task, Turn, make_task, working_dir
from freetoken.models.tool_schema import schema_errors, tool_call_errors  # noqa: F401

# v2-v4: more tasks a conversation, Claude Code doubled twice, shards with their own rngs,
#     copyable working directories and file names, mini requests cut to the task line (git log)
# v5: every prompt rendered through the demo's prompt compaction (`freetoken.chat.compaction`,
#     the cut the server applies to the model that declares it): Claude Code's first request
#     18.8k -> 2.4k tokens; no `short` mini conversations (the compaction cuts mini's request to
#     its task line anyway); more conversations for the same tokens
# v6: random path parts (mkdtemp-like working directories, random project, user and file
#     names: `demo_tasks.working_dir`), so a path in a call can only be copied from the prompt
#     and its BPE pieces are trained; the `demo-v2` compaction (core tools only: Claude Code's
#     first request 2.4k -> 0.4k tokens); twice the Claude Code conversations
DATA_VERSION = 6
DATA_VERSIONS = (5, 6)  # what the generator still makes (5: the shipped weights' data)
COMPACTION_OF = {5: compaction.VERSION, 6: compaction.VERSION_V2}  # each version's cut
PROMPT_COMPACTION = COMPACTION_OF[DATA_VERSION]  # recorded in the data's meta, then the manifest


def _check(version: int) -> int:
    if version not in DATA_VERSIONS:
        raise ValueError(f"data version {version} is not one of {DATA_VERSIONS}")
    return version

def _mini_text_reply(thought: str, command: str) -> str:
    return f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```"


def append_turns(h: Harness, body: dict[str, Any], turns: list[Turn], task: Task, cwd: str,
                 n: int) -> None:
    """Append one task's assistant/tool messages to `body` in the harness's API shape."""
    msgs = body["messages"]
    for turn in turns:
        if turn.call:
            name, args = (h.calls(task, cwd) if turn.command is None
                          else ("bash", {"command": turn.command}))
            cid = f"call_{n}_{len(msgs)}"
            if h.name == "mini_text":
                msgs.append({"role": "assistant",
                             "content": _mini_text_reply(turn.text, args["command"])})
                if turn.command is None:
                    msgs.append({"role": "user", "content": h.result(task, cwd)})
                continue
            if h.api == "anthropic":
                blocks = ([{"type": "text", "text": turn.text}] if turn.text else [])
                blocks.append({"type": "tool_use", "id": cid, "name": name, "input": args})
                msgs.append({"role": "assistant", "content": blocks})
                if turn.command is None:
                    msgs.append({"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": cid,
                         "content": h.result(task, cwd)}]})
            else:
                msgs.append({"role": "assistant", "content": turn.text or None, "tool_calls": [
                    {"id": cid, "type": "function",
                     "function": {"name": name, "arguments": json.dumps(args)}}]})
                if turn.command is None:
                    msgs.append({"role": "tool", "tool_call_id": cid,
                                 "content": h.result(task, cwd)})
        elif h.api == "anthropic":
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": turn.text}]})
        else:
            msgs.append({"role": "assistant", "content": turn.text})


def _user_message(h: Harness, text: str) -> dict[str, Any]:
    if h.api == "anthropic":
        return {"role": "user", "content": [{"type": "text", "text": text}]}
    if h.name.startswith("mini"):
        return {"role": "user", "content": f"Please solve this issue: {text}"}
    return {"role": "user", "content": text}


@dataclass
class Sample:
    harness: str
    ids: list[int]
    mask: list[int]  # 1 where the token is an assistant output the loss trains on


SHORT = "_short"  # a mini harness's conversations with the request cut to its task line


def harness_of(name: str) -> tuple[Harness, bool]:
    """(the harness, short) a sample name stands for: "mini_tool_short" is mini_tool's
    conversation with its first user message cut to the task line (`conversation(short=True)`)."""
    if name.endswith(SHORT):
        h = HARNESSES[name[:-len(SHORT)]]
        assert h.name.startswith("mini"), name
        return h, True
    return HARNESSES[name], False


def conversation(h: Harness, rng: random.Random, traces: Path | None = None,
                 corpus: list[str] | None = None, short: bool = False,
                 version: int = DATA_VERSION) -> tuple[dict[str, Any], list[Task]]:
    """One synthetic conversation body (API shape): one task (mini) or three to seven.
    `short` (mini only): the user message is its first paragraph, "Please solve this issue:
    <task>", without mini's ~500 tokens of instructions after it (data v4 mixed these into the
    full prompts; v5 needs none: every prompt is compacted, and the compaction cuts mini's
    request to that same line)."""
    cwd = working_dir(rng, _check(version))
    mini = h.name.startswith("mini")
    tasks = [make_task(rng, mini=mini, corpus=corpus, version=version)
             for _ in range(1 if mini else rng.randint(3, 7))]
    body = base_request(h, tasks[0].request, cwd, traces)
    if short:
        user = next(m for m in body["messages"] if m["role"] == "user")
        user["content"] = user["content"].split("\n\n", 1)[0]
    for i, task in enumerate(tasks):
        if i:
            body["messages"].append(_user_message(h, task.request))
        append_turns(h, body, task.turns(mini=mini, done=MINI_DONE), task, cwd, i)
    return body, tasks


def template_input(h: Harness, body: dict[str, Any]):
    return (anthropic_to_template(body) if h.api == "anthropic" else openai_to_template(body))


def compacted_input(h: Harness, body: dict[str, Any], version: int = DATA_VERSION):
    """The template input the served demo model is rendered: `template_input` through the
    prompt compaction of data `version` (`COMPACTION_OF`; `freetoken.chat.compaction`, the one
    function the server applies)."""
    ti = template_input(h, body)
    ti.messages, ti.tools = compaction.COMPACTIONS[COMPACTION_OF[version]](ti.messages, ti.tools)
    return ti


def assistant_mask(ids: list[int], tok: ChatTokenizer) -> list[int]:
    """1 on every assistant turn's tokens after `<|im_start|>assistant\\n` up to and including
    its `<|im_end|>`."""
    start, end = tok.special_ids["<|im_start|>"], tok.special_ids["<|im_end|>"]
    head = tok.encode("assistant\n")
    mask = [0] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i] == start and ids[i + 1:i + 1 + len(head)] == head:
            j = i + 1 + len(head)
            while j < len(ids) and ids[j] != end:
                mask[j] = 1
                j += 1
            if j < len(ids):
                mask[j] = 1
            i = j
        i += 1
    return mask


_SPLIT = "<|im_start|>"
_FOLLOW = {"role": "user", "content": "."}  # a message after the last turn: no loop.last think


class _Encoder:
    """`tok.apply`'s ids, faster: the rendered text is encoded piece by piece, split before
    each `<|im_start|>` (a special token, so the pieces tokenize independently), and the long
    recorded pieces (system prompt + tools) are encoded once. Prompts that hold control-token
    strings in their text take `tok.apply` itself."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self.tok = tok
        self._cache: dict[str, list[int]] = {}

    def ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            think: bool | None) -> tuple[list[int], str]:
        _, _, escaped = self.tok._escaper.escape(messages, tools)
        if escaped:
            p = self.tok.apply(messages, tools, think, add_generation_prompt=True)
            return p.input_ids, p.text
        text = self.tok.render(messages, tools, think, True, keep_all_reasoning=True)
        out: list[int] = []
        for i, piece in enumerate(text.split(_SPLIT)):
            piece = (_SPLIT if i else "") + piece
            if len(piece) > 2000:
                if piece not in self._cache:
                    self._cache[piece] = self.tok.encode(piece)
                out += self._cache[piece]
            elif piece:
                out += self.tok.encode(piece)
        return out, text


def render_sample(h: Harness, body: dict[str, Any], enc: _Encoder,
                  think_off: bool, version: int = DATA_VERSION) -> Sample:
    """The conversation as one training sequence: the request before the last assistant turn,
    rendered with the generation prompt (and `enable_thinking=False` when `think_off`, as a
    harness that turns reasoning off sends it), then that turn as the template renders it in
    the history (no think block: what the next request will hold) and `<|im_end|>`. The
    conversation is compacted first (`compacted_input`): what the server renders the model."""
    tok = enc.tok
    ti = compacted_input(h, body, version)
    last = max(i for i, m in enumerate(ti.messages) if m["role"] == "assistant")
    think = False if think_off else ti.enable_thinking
    ids, _ = enc.ids(ti.messages[:last], ti.tools, think)
    head = tok.render(ti.messages[:last], ti.tools, None, True, keep_all_reasoning=True)
    whole = tok.render(ti.messages[:last + 1] + [_FOLLOW], ti.tools, None, False,
                       keep_all_reasoning=True)
    assert whole.startswith(head), "the template is not append-only at this turn"
    target = whole[len(head):]
    target = target[:target.rindex("<|im_end|>", 0, target.rindex(_SPLIT)) + len("<|im_end|>")]
    tail = tok.encode(target)
    mask = assistant_mask(ids, tok)
    gen = max(i for i, t in enumerate(ids) if t == tok.special_ids[_SPLIT])
    mask[gen:] = [0] * (len(ids) - gen)  # the generation prompt (and its think block) is given
    return Sample(h.name, ids + tail, mask + [1] * len(tail))


SHARD = 100  # samples of one harness per shard; each shard has its own seeded rng


def _shards(counts: dict[str, int]) -> list[tuple[str, int, int]]:
    """(harness, shard index, samples) covering `counts`, in a fixed order."""
    return [(name, k, min(SHARD, n - k * SHARD))
            for name, n in sorted(counts.items()) for k in range(-(-n // SHARD))]


def shard_conversations(name: str, k: int, n: int, seed: int, traces: Path | None = None,
                        version: int = DATA_VERSION
                        ) -> Iterator[tuple[dict[str, Any], list[Task], bool]]:
    """(body, tasks, think_off) of shard `k` of harness `name`: `n` conversations of data
    `version` from `random.Random(f"{seed}:{name}:{k}")` (a string seed is hashed the same way
    on every run and machine): what `generate_shard` renders."""
    rng = random.Random(f"{seed}:{name}:{k}")
    corpus = corpus_lines(traces)
    h, short = harness_of(name)
    for _ in range(n):
        body, tasks = conversation(h, rng, traces, corpus, short, version)
        yield body, tasks, rng.random() < 0.3


def generate_shard(name: str, k: int, n: int, seed: int, tok: ChatTokenizer,
                   traces: Path | None = None, version: int = DATA_VERSION) -> list[Sample]:
    """Shard `k` of harness `name` (`shard_conversations`) as samples."""
    enc = _Encoder(tok)
    h, _ = harness_of(name)
    out = []
    for body, _, think_off in shard_conversations(name, k, n, seed, traces, version):
        out.append(render_sample(h, body, enc, think_off=think_off, version=version))
        out[-1].harness = name
    return out


_WORKER: dict[str, ChatTokenizer] = {}  # a pool worker's tokenizer, loaded by _worker_init


def _worker_init(tok_dir: str) -> None:
    _WORKER["tok"] = ChatTokenizer.from_dir(Path(tok_dir))


def _worker(job: tuple[str, int, int, int, str, int]) -> list[Sample]:
    return generate_shard(*job[:4], _WORKER["tok"], Path(job[4]), job[5])


def generate(counts: dict[str, int], seed: int, tok: ChatTokenizer,
             traces: Path | None = None, jobs: int = 1, tok_dir: Path | None = None,
             version: int = DATA_VERSION) -> list[Sample]:
    """`counts[harness]` samples of data `version` of each harness from one seed, shard by
    shard (`_shards`): the same samples whatever `jobs` (worker processes, which load the
    tokenizer from `tok_dir`). `traces`: default `envs.harness_traces_dir()`."""
    traces = traces or harness_traces_dir()
    shards = _shards(counts)
    _check(version)
    if jobs <= 1 or tok_dir is None:
        parts = [generate_shard(name, k, n, seed, tok, traces, version)
                 for name, k, n in shards]
    else:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(jobs, _worker_init, (str(tok_dir),)) as pool:
            parts = pool.map(_worker, [(name, k, n, seed, str(traces), version)
                                       for name, k, n in shards], chunksize=1)
    return [x for part in parts for x in part]


# v5: ~51M tokens (--scale 0.25: 12.9M, 1.49M targets), four times the distinct tasks the
# compacted prompts used to cost: a 330 s GPU run makes ~10-20 passes rather than ~70
# v6: ~48M tokens, ~13M targets (--scale 0.1 measured: see docs/models.md), twice v5's Claude
# Code conversations and 2.5 times the others: demo-v2 cuts Claude Code's, OpenCode's,
# OpenClaw's and Codex's prompts to ~0.4-0.6k tokens, so each costs a third of a v5 one
COUNTS = {5: {"claude_code": 12000, "openclaw": 3200, "opencode": 3200, "codex": 3200,
              "mini_tool": 8000, "mini_text": 8000},
          6: {"claude_code": 24000, "openclaw": 8000, "opencode": 8000, "codex": 8000,
              "mini_tool": 10000, "mini_text": 10000}}
DEFAULT_COUNTS = COUNTS[DATA_VERSION]


def main(argv: list[str] | None = None) -> None:
    import argparse

    from freetoken.models.demo import tokenizer_size, tokenizer_source_dir
    from freetoken.models.train_demo import save_data

    p = argparse.ArgumentParser(description="write the demo model's pre-tokenized training data")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-version", type=int, default=DATA_VERSION, choices=DATA_VERSIONS,
                   help="the generator's version (its counts and prompt compaction too)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every harness's count")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (same samples)")
    p.add_argument("--harnesses", default=None,
                   help="these harnesses only (comma list; the same samples as in the whole set)")
    p.add_argument("--lzma-preset", type=int, default=6,
                   help="the file's compression (1: several times faster to write, larger)")
    args = p.parse_args(argv)
    tok_dir = tokenizer_source_dir()
    tok = ChatTokenizer.from_dir(tok_dir)
    version = args.data_version
    keep = args.harnesses.split(",") if args.harnesses else list(COUNTS[version])
    counts = {k: max(1, round(v * args.scale)) for k, v in COUNTS[version].items() if k in keep}
    samples = generate(counts, args.seed, tok, jobs=args.jobs, tok_dir=tok_dir, version=version)
    vocab = -(-tokenizer_size(tok_dir / "tokenizer.json") // 64) * 64
    meta = {"data_version": version, "prompt_compaction": COMPACTION_OF[version],
            "seed": args.seed, "counts": counts,
            "vocab_size": vocab, "tokens": sum(len(s.ids) for s in samples),
            "target_tokens": sum(sum(s.mask) for s in samples)}
    save_data(Path(args.out), [(s.harness, s.ids, s.mask) for s in samples], meta,
              args.lzma_preset)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()

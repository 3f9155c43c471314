"""Synthetic agent transcripts for training the demo model (`freetoken.models.train_demo`).

Each conversation starts from a real first request of a recorded harness (its system prompt, its
tool list, its user-message wrapping; `tests/data/harness_traces/`), with the recorded task
replaced by a short synthetic one, then goes on in that harness's own API shape: a tool call
that names a tool of the request's own list with arguments valid against its schema, the tool
result formatted the way that harness formats it, and a final answer that quotes the result
and ends the turn. Chat tasks ("hi") get a short answer and no call. Requests are mapped by the
server's own walks (`openai_to_template` / `anthropic_to_template`) and rendered by the
checkpoint's chat template (`ChatTokenizer.apply`) after the demo's prompt compaction
(`freetoken.chat.compaction`, data v5: the cut the server applies to the model whose manifest
declares it), so the prompts are token for token what the engine renders the demo from those
harnesses.

Tasks map onto each harness's real tools: list files, read a file, run a shell command, write a
file (Claude Code: Bash/Read/Write; OpenCode: bash/read/write; OpenClaw: ls/read/exec/write;
Codex: exec_command; mini-swe-agent: its `bash` tool, or its text protocol with
```mswea_bash_command blocks and `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` to finish).

Everything comes from `random.Random` seeded by (seed, harness, shard): the same (version, seed,
counts) gives the same samples, however many worker processes make them. Bump `DATA_VERSION`
whenever the output for a seed changes.
"""
from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken.chat import compaction
from freetoken.chat.anthropic_map import anthropic_to_template
from freetoken.chat.openai_map import openai_to_template
from freetoken.chat.tokenizer import ChatTokenizer
from freetoken.envs import harness_traces_dir
from freetoken.models.demo_harnesses import HARNESSES, MINI_DONE, Harness
from freetoken.models.demo_tasks import Task, Turn, make_task, working_dir
from freetoken.models.tool_schema import schema_errors, tool_call_errors  # noqa: F401

# v2-v4: more tasks a conversation, Claude Code doubled twice, shards with their own rngs,
#     copyable working directories and file names, mini requests cut to the task line (git log)
# v5: every prompt rendered through the demo's prompt compaction (`freetoken.chat.compaction`,
#     the cut the server applies to the model that declares it): Claude Code's first request
#     18.8k -> 2.4k tokens; no `short` mini conversations (the compaction cuts mini's request to
#     its task line anyway); more conversations for the same tokens
DATA_VERSION = 5
PROMPT_COMPACTION = compaction.VERSION  # recorded in the data's meta, then in the manifest
RECORDED_CWD = "/home/dev/project"
_RECORDED_TASK = re.compile(r"Explore this repo:[^\n\"]*?summarize\.")


def recorded_body(h: Harness, traces: Path | None = None) -> dict[str, Any]:
    """The request `h` names in the recorded traces (`traces`: default
    `envs.harness_traces_dir()`)."""
    with open((traces or harness_traces_dir()) / h.trace, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec["seq"] == h.seq:
                return dict(rec["body"])
    raise KeyError(f"{h.trace} has no request seq={h.seq}")


def responses_to_openai(body: dict[str, Any]) -> dict[str, Any]:
    """A Codex Responses body as the chat body it amounts to: developer items become system
    messages, `input_text` parts joined, function tools kept (hosted tools and namespaces
    dropped: the template cannot render them)."""
    msgs: list[dict[str, Any]] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": body["instructions"]})
    for it in body.get("input") or []:
        if it.get("type") != "message":
            continue
        text = "\n".join(p.get("text", "") for p in it.get("content") or [])
        role = "system" if it["role"] == "developer" else it["role"]
        if role == "system" and msgs and msgs[-1]["role"] == "system":
            msgs[-1]["content"] += "\n\n" + text
        else:
            msgs.append({"role": role, "content": text})
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description",
                                                                "parameters") if k in t}}
             for t in body.get("tools") or [] if t.get("type") == "function"]
    return {"messages": msgs, "tools": tools}


def _replace_task(obj: Any, task_text: str, cwd: str) -> Any:
    """The recorded body with its task sentence (the last one wins for Codex, whose task is a
    whole user message) and working directory replaced."""
    s = json.dumps(obj, ensure_ascii=False)
    s = s.replace(RECORDED_CWD, cwd).replace("<project>", cwd)
    s = _RECORDED_TASK.sub(lambda _m: json.dumps(task_text, ensure_ascii=False)[1:-1], s)
    return json.loads(s)


def base_request(h: Harness, task_text: str, cwd: str,
                 traces: Path | None = None) -> dict[str, Any]:
    body = recorded_body(h, traces)
    if h.api == "responses":
        body = responses_to_openai(body)
        body["messages"][-1]["content"] = task_text
    keep = {k: body[k] for k in ("system", "tools", "thinking", "messages") if k in body}
    return _replace_task(copy.deepcopy(keep), task_text, cwd)


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


def corpus_lines(traces: Path | None = None) -> list[str]:
    """Plain lines of the recorded system prompts (20-90 characters, no markup): file contents
    for the read tasks."""
    seen: set[str] = set()
    for h in HARNESSES.values():
        body = recorded_body(h, traces)
        system = body.get("system", "")
        texts = [system] if isinstance(system, str) else [b.get("text", "") for b in system]
        texts += [m["content"] for m in body.get("messages", [])
                  if isinstance(m.get("content"), str)]
        for t in texts:
            for line in t.split("\n"):
                line = line.strip()
                if 20 <= len(line) <= 90 and not re.search(r"[<>{}`|\\]", line):
                    seen.add(line)
    return sorted(seen)


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
                 corpus: list[str] | None = None, short: bool = False
                 ) -> tuple[dict[str, Any], list[Task]]:
    """One synthetic conversation body (API shape): one task (mini) or three to seven.
    `short` (mini only): the user message is its first paragraph, "Please solve this issue:
    <task>", without mini's ~500 tokens of instructions after it (data v4 mixed these into the
    full prompts; v5 needs none: every prompt is compacted, and the compaction cuts mini's
    request to that same line)."""
    cwd = working_dir(rng)
    mini = h.name.startswith("mini")
    tasks = [make_task(rng, mini=mini, corpus=corpus)
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


def compacted_input(h: Harness, body: dict[str, Any]):
    """The template input the served demo model is rendered: `template_input` through the
    prompt compaction (`freetoken.chat.compaction`, the one function the server applies)."""
    ti = template_input(h, body)
    ti.messages, ti.tools = compaction.COMPACTIONS[PROMPT_COMPACTION](ti.messages, ti.tools)
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
                  think_off: bool) -> Sample:
    """The conversation as one training sequence: the request before the last assistant turn,
    rendered with the generation prompt (and `enable_thinking=False` when `think_off`, as a
    harness that turns reasoning off sends it), then that turn as the template renders it in
    the history (no think block: what the next request will hold) and `<|im_end|>`. The
    conversation is compacted first (`compacted_input`): what the server renders the model."""
    tok = enc.tok
    ti = compacted_input(h, body)
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


def generate_shard(name: str, k: int, n: int, seed: int, tok: ChatTokenizer,
                   traces: Path | None = None) -> list[Sample]:
    """Shard `k` of harness `name`: `n` samples from `random.Random(f"{seed}:{name}:{k}")`
    (a string seed is hashed the same way on every run and machine)."""
    rng = random.Random(f"{seed}:{name}:{k}")
    enc = _Encoder(tok)
    corpus = corpus_lines(traces)
    h, short = harness_of(name)
    out = []
    for _ in range(n):
        body, _ = conversation(h, rng, traces, corpus, short)
        out.append(render_sample(h, body, enc, think_off=rng.random() < 0.3))
        out[-1].harness = name
    return out


_WORKER: dict[str, ChatTokenizer] = {}  # a pool worker's tokenizer, loaded by _worker_init


def _worker_init(tok_dir: str) -> None:
    _WORKER["tok"] = ChatTokenizer.from_dir(Path(tok_dir))


def _worker(job: tuple[str, int, int, int, str]) -> list[Sample]:
    return generate_shard(*job[:4], _WORKER["tok"], Path(job[4]))


def generate(counts: dict[str, int], seed: int, tok: ChatTokenizer,
             traces: Path | None = None, jobs: int = 1, tok_dir: Path | None = None
             ) -> list[Sample]:
    """`counts[harness]` samples of each harness from one seed, shard by shard (`_shards`):
    the same samples whatever `jobs` (worker processes, which load the tokenizer from
    `tok_dir`). `traces`: default `envs.harness_traces_dir()`."""
    traces = traces or harness_traces_dir()
    shards = _shards(counts)
    if jobs <= 1 or tok_dir is None:
        parts = [generate_shard(name, k, n, seed, tok, traces) for name, k, n in shards]
    else:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(jobs, _worker_init, (str(tok_dir),)) as pool:
            parts = pool.map(_worker, [(name, k, n, seed, str(traces))
                                       for name, k, n in shards], chunksize=1)
    return [x for part in parts for x in part]


# v5: ~51M tokens (--scale 0.25: 12.9M, 1.49M targets), four times the distinct tasks the
# compacted prompts used to cost: a 330 s GPU run makes ~10-20 passes rather than ~70
DEFAULT_COUNTS = {"claude_code": 12000, "openclaw": 3200, "opencode": 3200, "codex": 3200,
                  "mini_tool": 8000, "mini_text": 8000}


def main(argv: list[str] | None = None) -> None:
    import argparse

    from freetoken.models.demo import tokenizer_size, tokenizer_source_dir
    from freetoken.models.train_demo import save_data

    p = argparse.ArgumentParser(description="write the demo model's pre-tokenized training data")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every harness's count")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (same samples)")
    p.add_argument("--harnesses", default=None,
                   help="these harnesses only (comma list; the same samples as in the whole set)")
    p.add_argument("--lzma-preset", type=int, default=6,
                   help="the file's compression (1: several times faster to write, larger)")
    args = p.parse_args(argv)
    tok_dir = tokenizer_source_dir()
    tok = ChatTokenizer.from_dir(tok_dir)
    keep = args.harnesses.split(",") if args.harnesses else list(DEFAULT_COUNTS)
    counts = {k: max(1, round(v * args.scale)) for k, v in DEFAULT_COUNTS.items() if k in keep}
    samples = generate(counts, args.seed, tok, jobs=args.jobs, tok_dir=tok_dir)
    vocab = -(-tokenizer_size(tok_dir / "tokenizer.json") // 64) * 64
    meta = {"data_version": DATA_VERSION, "prompt_compaction": PROMPT_COMPACTION,
            "seed": args.seed, "counts": counts,
            "vocab_size": vocab, "tokens": sum(len(s.ids) for s in samples),
            "target_tokens": sum(sum(s.mask) for s in samples)}
    save_data(Path(args.out), [(s.harness, s.ids, s.mask) for s in samples], meta,
              args.lzma_preset)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()

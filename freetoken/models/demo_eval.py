"""Does the trained demo follow the request? Greedy decoding of held-out synthetic
conversations (seeds the training data never used), scored against the generator's gold turns.

    python -m freetoken.models.demo_eval --weights freetoken/models/demo_weights [--device cuda]
    python -m freetoken.models.demo_eval --weights RUN_OUT --harnesses mini_tool,opencode

For each harness, the first request of `--per-harness` held-out conversations whose first task
uses a tool, then that request with the gold call and its result: the first turn must end
(`<|im_end|>` within `--max-tokens`), make a call that validates against the request's own
tool list and equals the gold call in its key arguments (the path or command the task names:
`copied`); the answer after the result must end and hold the gold answer's lines (the quoted
tool output: `quoted`, the mean fraction of lines). A model that learned only the format makes
valid calls but copies nothing: `valid` high, `copied` and `quoted` near 0.

It runs transformers' own model on the compact vocabulary (`train_demo`'s rows, unknown ids
read as the shared row); its greedy tokens are the full model's: an unused id's logit is the
shared row's.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

HELD_OUT_SEED = 12345  # training data uses seed 0's shards (`demo_data.generate_shard`)
KEY_ARGS = ("command", "cmd", "file_path", "filePath", "path")  # what says what a call does


def load_compact(weights: Path, device: str):
    """(model, used full-vocabulary ids): a `ship`ped weights dir (used_ids inside) or a
    `train_demo` output (used.npy beside)."""
    import numpy as np
    from safetensors.torch import load_file

    from freetoken.models.train_demo import build_model

    state = load_file(str(weights / "compact.safetensors"))
    used = state.pop("used_ids", None)
    used = (used.long().numpy() if used is not None else np.load(weights / "used.npy"))
    model = build_model(len(used) + 1, 0)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.to(device).eval(), used


def held_out(name: str, n: int, version: int | None = None) -> list[tuple[Any, Any, int]]:
    """(template input, first task, index of the first assistant message) of `n` held-out
    conversations of harness `name` whose first task calls a tool, of data `version` (the
    weights' own: `trained_data`; None: the generator's default)."""
    from freetoken.models import demo_data as dd

    h, corpus, out = dd.HARNESSES[name], dd.corpus_lines(), []
    version = dd.DATA_VERSION if version is None else version
    seed = HELD_OUT_SEED
    while len(out) < n:
        body, tasks = dd.conversation(h, random.Random(seed), corpus=corpus, version=version)
        seed += 1
        if tasks[0].kind == "chat":
            continue
        ti = dd.template_input(h, body)
        first = next(i for i, m in enumerate(ti.messages) if m["role"] == "assistant")
        out.append((ti, tasks[0], first))
    return out


def trained_data(weights: Path) -> dict[str, Any]:
    """The data meta the weights were trained on (`data_version`, `prompt_compaction`, seed,
    counts): a shipped dir's manifest `train.data`, or a `train_demo` output's train_meta.json
    (empty when neither is there)."""
    man, meta = weights / "manifest.json", weights / "train_meta.json"
    if man.is_file():
        return json.loads(man.read_text()).get("train", {}).get("data", {})
    if meta.is_file():
        return json.loads(meta.read_text()).get("data", {})
    return {}


def declared_compaction(weights: Path) -> str | None:
    """The prompt compaction the weights were trained with: a shipped dir's manifest
    `prompt_compaction`, or a `train_demo` output's data meta (None: rendered as sent)."""
    man = weights / "manifest.json"
    if man.is_file():
        return json.loads(man.read_text()).get("prompt_compaction")
    return trained_data(weights).get("prompt_compaction")


class Greedy:
    """Greedy decoding of a request as the server renders it: through `compaction` (a
    `freetoken.chat.compaction` version) when the weights declare one."""

    def __init__(self, model, used, tok, device: str, max_tokens: int,
                 compaction: str | None = None) -> None:
        from freetoken.chat.compaction import COMPACTIONS

        self.model, self.tok, self.device, self.max_tokens = model, tok, device, max_tokens
        self.compact = COMPACTIONS[compaction] if compaction else None
        self.used = used
        self.index = {int(t): i for i, t in enumerate(used)}
        self.other = len(used)
        self.end = self.index[tok.special_ids["<|im_end|>"]]

    def __call__(self, messages, tools) -> tuple[str, bool]:
        """(decoded text, ended by <|im_end|>)."""
        import torch

        if self.compact is not None:
            messages, tools = self.compact(messages, tools)
        ids = self.tok.apply(messages, tools).input_ids
        x = torch.tensor([[self.index.get(t, self.other) for t in ids]], device=self.device)
        with torch.no_grad():
            y = self.model.generate(x, max_new_tokens=self.max_tokens, do_sample=False,
                                    eos_token_id=self.end, pad_token_id=self.end)
        new = [int(t) for t in y[0, x.shape[1]:]]
        ended = self.end in new
        new = new[:new.index(self.end)] if ended else new
        full = [int(self.used[t]) if t < self.other else 0 for t in new]
        return self.tok.decode(full), ended


def parse_call(text: str) -> tuple[str, dict[str, Any]] | None:
    from freetoken.chat.tool_parsers import parse_tool_call

    if "<tool_call>" not in text:
        return None
    parsed = parse_tool_call(text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0])
    if parsed is None:
        return None
    try:
        return parsed[0], json.loads(parsed[1])
    except ValueError:
        return None


def gold_call(ti, first: int) -> tuple[str, dict[str, Any]] | None:
    m = ti.messages[first]
    if m.get("tool_calls"):
        f = m["tool_calls"][0]["function"]
        args = f["arguments"]
        return f["name"], json.loads(args) if isinstance(args, str) else args
    return None


def mini_command(text: str) -> str | None:
    if "```mswea_bash_command\n" not in text:
        return None
    return text.split("```mswea_bash_command\n", 1)[1].split("\n```")[0]


def score_first(name: str, ti, first: int, text: str) -> tuple[bool, bool]:
    """(valid, copied) of a first turn."""
    from freetoken.models import demo_data as dd

    if name == "mini_text":
        got = mini_command(text)
        gold = mini_command(ti.messages[first]["content"])
        return got is not None, got == gold
    call, gold = parse_call(text), gold_call(ti, first)
    if call is None or gold is None:
        return False, False
    valid = dd.tool_call_errors(ti.tools, *call) == []
    keys = set(KEY_ARGS) & set(gold[1])
    return valid, call[0] == gold[0] and all(call[1].get(k) == gold[1][k] for k in keys)


def quoted(output: str, gold: str, text: str) -> float | None:
    """Of the tool output's lines that the gold answer quotes (file names, file lines, command
    output), the fraction `text` holds too; None when the answer quotes nothing (a write)."""
    items = [ln.strip() for ln in output.split("\n") if ln.strip() and ln.strip() in gold]
    return sum(ln in text for ln in items) / len(items) if items else None


def evaluate(greedy: Greedy, names: list[str], n: int, say=print,
             version: int | None = None) -> dict[str, dict[str, float]]:
    report = {}
    for name in names:
        rows = []
        for ti, task, first in held_out(name, n, version):
            text, ended = greedy(ti.messages[:first], ti.tools)
            valid, copied = score_first(name, ti, first, text)
            nxt = next(i for i in range(first + 1, len(ti.messages))
                       if ti.messages[i]["role"] == "assistant")
            gold = ti.messages[nxt]
            ans, ended2 = greedy(ti.messages[:nxt], ti.tools)
            q = quoted(task.output, gold.get("content") or "", ans)
            rows.append((ended, valid, copied, ended2, q))
            say(f"ft.demo_eval: turn harness={name} kind={task.kind} ask={task.request!r} "
                f"ended={ended} valid={valid} copied={copied} call={text[-160:]!r} "
                f"answer_ended={ended2} quoted={q} answer={ans[:160]!r}")
        cols = ("ended", "valid", "copied", "answer_ended", "quoted")
        report[name] = {}
        for i, c in enumerate(cols):
            vals = [float(r[i]) for r in rows if r[i] is not None]
            report[name][c] = round(sum(vals) / len(vals), 3) if vals else None
        say(f"ft.demo_eval: harness={name} n={len(rows)} "
            + " ".join(f"{k}={v}" for k, v in report[name].items()))
    return report


def main(argv: list[str] | None = None) -> None:
    from freetoken.chat.tokenizer import ChatTokenizer
    from freetoken.models import demo_data as dd
    from freetoken.models.demo import tokenizer_source_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", required=True, help="shipped weights dir or a train_demo --out")
    p.add_argument("--device", default="cpu")
    p.add_argument("--harnesses", default=",".join(sorted(dd.HARNESSES)))
    p.add_argument("--per-harness", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--compaction", default="auto",
                   help="prompt compaction version, 'none', or 'auto' (what the weights declare)")
    args = p.parse_args(argv)
    from freetoken.models.train_kernels import block_optional_kernels

    block_optional_kernels("torch")  # the reference path everywhere: no kernel compiles
    model, used = load_compact(Path(args.weights), args.device)
    tok = ChatTokenizer.from_dir(tokenizer_source_dir())
    comp = (declared_compaction(Path(args.weights)) if args.compaction == "auto"
            else None if args.compaction == "none" else args.compaction)
    version = trained_data(Path(args.weights)).get("data_version", dd.DATA_VERSION)
    print(f"ft.demo_eval: compaction={comp} data_version={version}", flush=True)
    greedy = Greedy(model, used, tok, args.device, args.max_tokens, comp)
    report = evaluate(greedy, args.harnesses.split(","), args.per_harness, version=version)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

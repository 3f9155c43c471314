"""What every route needs: the engine, the tokenizer, the served names, and prompt rendering
with its failure modes mapped to 400s."""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import jinja2
from anyio import to_thread

from freetoken.chat import (
    ChatInputError,
    ChatRequest,
    TemplateInput,
    anthropic_request,
    openai_request,
)
from freetoken.chat.output import output_parser
from freetoken.log import get_logger, kv
from freetoken.server.errors import APIError
from freetoken.server.validation import req_str
from freetoken.types.api import EngineClient

log = get_logger("demo")


@dataclass
class ServerState:
    engine: EngineClient
    tokenizer: Any  # freetoken.chat.ChatTokenizer
    api_key: str | None
    served_model_names: list[str]
    strict_model: bool = False
    parser_family: str = "qwen3"
    stall_timeout_s: float = 30.0  # see sse.EventStreamResponse
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, body: dict) -> str:
        """The requested model name (echoed in answers). Any name is served unless strict."""
        name = req_str(body, "model")
        if self.strict_model and name not in self.served_model_names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                           f"{self.served_model_names}", "model", "model_not_found")
        return name

    def vocab_limit(self) -> int:
        """Token ids must lie in [0, vocab_limit): the model's vocabulary when the engine
        reports it (it is often padded past the tokenizer's), else the tokenizer's."""
        model_vocab = getattr(self.engine, "vocab_size", None)
        tok_vocab = int(getattr(self.tokenizer, "vocab_size", 0) or 0)
        return max(int(model_vocab or 0), tok_vocab)

    async def render(self, ti: TemplateInput, tools: list | None) -> Any:
        """Render + tokenize in a worker thread (a 20k-token prompt takes tens of ms). A model
        whose checkpoint declares a prompt compaction (`tokenizer.compaction`: the trained demo,
        `freetoken.chat.compaction`) is rendered its compacted request, as it was trained; the
        output parser still checks calls against the request's own `tools`."""

        def work() -> Any:
            messages, shown = compacted(self.tokenizer, ti.messages, tools)
            try:
                return self.tokenizer.apply(messages, tools=shown,
                                            enable_thinking=ti.enable_thinking,
                                            reasoning_effort=ti.reasoning_effort)
            except ChatInputError as e:
                raise APIError.bad(e.message, e.param) from None
            except jinja2.TemplateError as e:  # the template's raise_exception(): input it rejects
                raise APIError.bad(f"the chat template rejected these messages: {e}",
                                   "messages") from None

        return await to_thread.run_sync(work)

    def parser(self, thinking: bool, prompt: Any, tools: list | None, id_prefix: str) -> Any:
        """The reasoning/tool-call parser of one response; tool-call ids get `id_prefix`
        (`call_` for OpenAI, `toolu_` for Anthropic)."""
        return output_parser(self.tokenizer, family=self.parser_family, thinking=thinking,
                             starts_in_reasoning=bool(getattr(prompt, "opens_reasoning", False)),
                             tools=tools, id_factory=lambda _i: id_prefix + secrets.token_hex(12))


def compacted(tokenizer: Any, messages: list, tools: list | None) -> tuple[list, list | None]:
    """(messages, tools) as the model is rendered them: compacted when its checkpoint declares a
    compaction (one `ft.demo:` line a request), else as they are."""
    declared = getattr(tokenizer, "compaction", None)
    if declared is None:
        return messages, tools
    version, fn = declared
    out, shown = fn(messages, tools)
    log.info(kv("prompt_compaction", version=version, messages=f"{len(messages)}->{len(out)}",
                chars=f"{_chars(messages, tools)}->{_chars(out, shown)}"))
    return out, shown


def _chars(messages: list, tools: list | None) -> int:
    text = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    return text + (len(json.dumps(tools)) if tools else 0)


def chat_request(api: str, body: dict) -> ChatRequest:
    """The one validation pass of a chat body's messages, tools, tool_choice and thinking
    (`api`: 'openai' or 'anthropic'), checked and mapped to the template input together; a
    refusal is an APIError(400) naming the field."""
    try:
        return (anthropic_request if api == "anthropic" else openai_request)(body)
    except ChatInputError as e:
        raise APIError.bad(e.message, e.param) from None

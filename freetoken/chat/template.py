"""Chat-template loading and rendering, the same way transformers does it.

The environment mirrors `transformers.utils.chat_template_utils._compile_jinja_template`: an
immutable sandbox, `trim_blocks`/`lstrip_blocks`, `loopcontrols`, a `tojson` filter that does not
escape HTML and accepts `indent`/`separators`/`sort_keys`, and the globals `raise_exception` and
`strftime_now`. `{% generation %}` blocks (assistant masks) are rendered as their body.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from freetoken.chat.errors import ChatInputError

# The Qwen templates (Qwen3, Qwen3-Next, Qwen3.5/3.6) show reasoning only for assistant turns after
# the last user query; this is the condition they test (GLM's: `ns.last_user_index`).
# `keep_all_reasoning` widens it.
_LAST_QUERY_TEST = re.compile(r"loop\.index0\s*>\s*ns\.last_(?:query|user)_index")
KEEP_REASONING_VAR = "ft_keep_all_reasoning"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (we never need the mask)."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """Namespace that refuses underscore attributes (as transformers' sandbox does)."""

    def __setitem__(self, name: str, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} not allowed")
        super().__setitem__(name, value)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def keep_reasoning_variant(source: str) -> str | None:
    """The template with every assistant turn rendered as if it followed the last user query.

    Returns None when the template has no such test (it then keeps or drops reasoning by rules
    we do not know how to widen, and is used as is).
    """
    if not _LAST_QUERY_TEST.search(source):
        return None
    return _LAST_QUERY_TEST.sub(
        lambda m: f"({m.group(0)} or {KEEP_REASONING_VAR})", source
    )


def load_chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The checkpoint's chat template: `tokenizer_config.json`'s `chat_template` (a string, or a
    list of named templates of which `default` is used), else `chat_template.jinja` (what
    transformers 5 writes), else `chat_template.json`."""
    tpl = tokenizer_config.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if isinstance(tpl, str):
        return tpl
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = path / "chat_template.json"
    if json_file.is_file():
        data = json.loads(json_file.read_text(encoding="utf-8"))
        if isinstance(data.get("chat_template"), str):
            return str(data["chat_template"])
    return None


def render_template(source: str, **variables: Any) -> str:
    """Render `source`; a template-raised error or a type error on malformed input (e.g. a
    content the template cannot concatenate) becomes ChatInputError."""
    try:
        return compile_template(source).render(**variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatInputError(f"chat template rejected the conversation: {e}", "messages") from e
    except (TypeError, AttributeError) as e:
        raise ChatInputError(f"chat template failed on the conversation: {e}", "messages") from e

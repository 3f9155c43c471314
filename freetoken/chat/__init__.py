"""Chat layer: tokenizer + chat template, request mapping, anchors, detokenization, and
streaming reasoning/tool-call parsing."""
from freetoken.chat.anchors import AnchorTokens, detect_anchors
from freetoken.chat.anthropic_map import anthropic_request, anthropic_to_template
from freetoken.chat.detok import IncrementalDetokenizer
from freetoken.chat.errors import ChatInputError
from freetoken.chat.mapping import ChatRequest, TemplateInput
from freetoken.chat.openai_map import openai_request, openai_to_template
from freetoken.chat.output import OutEvent, OutputParser, ReasoningDelta, TextDelta, ToolCall
from freetoken.chat.tokenizer import ChatTokenizer, Prompt, qwen3_tokenizer_dir

__all__ = [
    "AnchorTokens",
    "ChatInputError",
    "ChatRequest",
    "ChatTokenizer",
    "IncrementalDetokenizer",
    "OutEvent",
    "OutputParser",
    "Prompt",
    "ReasoningDelta",
    "TemplateInput",
    "TextDelta",
    "ToolCall",
    "anthropic_request",
    "anthropic_to_template",
    "detect_anchors",
    "openai_request",
    "openai_to_template",
    "qwen3_tokenizer_dir",
]

"""The events an output parser streams (chat/output.py for the `<think>` / `<tool_call>`
families, chat/harmony_output.py for gpt-oss's channels), in a module of their own so both
parsers import them without importing each other."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON object text


OutEvent = ReasoningDelta | TextDelta | ToolCall

"""Errors of the chat layer."""
from __future__ import annotations


class ChatInputError(ValueError):
    """A request body that cannot be turned into a prompt. Maps to HTTP 400.

    `param` names the offending field in the API's own terms, e.g. `messages[3].content[1].type`.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

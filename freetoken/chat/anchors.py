"""Semantic anchors: chat-template block boundaries found on token ids.

Detection only looks at the ids of the template's special tokens (`<|im_start|>`, `<think>`,
`<tool_call>`, `<tool_response>`, ...), so it holds for any family whose template marks these
blocks with single tokens; a family lacking one of them simply yields no anchors of that kind.

Every anchor's `position` is the index of the tag token that opens (or closes) the block, so a
state checkpoint taken "before position p" covers tokens [0, p) and excludes the tag itself:

- `turn_start(role)`: each `<|im_start|>`; role read from the tokens that follow it. Qwen renders
  tool results inside a `user` turn.
- `head_end`: the first `<|im_start|>` after a leading system turn (system prompt + tools); only
  when the prompt starts with a system turn.
- `think_start` / `think_end`: `<think>` / `</think>`.
  Tag tokens inside a system turn (Qwen's tools header quotes `<tool_call>` as format
  instructions) are boilerplate, not block boundaries, and give no anchor.
- `tool_call_start`: `<tool_call>`.
- `tool_result_start` / `tool_result_end`: `<tool_response>` / `</tool_response>`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from freetoken.types.api import Anchor

_TAG_KINDS = {
    "think_start": "<think>",
    "think_end": "</think>",
    "tool_call_start": "<tool_call>",
    "tool_result_start": "<tool_response>",
    "tool_result_end": "</tool_response>",
}
ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class AnchorTokens:
    """Token ids anchor detection looks for; None where the vocabulary lacks the token.

    `role_seqs` maps the id sequence a role name encodes to (as it follows `<|im_start|>`) to
    the role.
    """

    turn_start: int | None
    tag_kinds: dict[int, str] = field(default_factory=dict)  # tag token id -> anchor kind
    role_seqs: dict[tuple[int, ...], str] = field(default_factory=dict)

    @classmethod
    def from_vocab(
        cls, special_ids: dict[str, int], encode_role: dict[str, list[int]]
    ) -> AnchorTokens:
        """Build from `{token text: id}` of the added tokens and each role name's encoding."""
        tags = {special_ids[t]: k for k, t in _TAG_KINDS.items() if t in special_ids}
        seqs = {tuple(ids): role for role, ids in encode_role.items() if ids}
        return cls(special_ids.get("<|im_start|>"), tags, seqs)

    def role_at(self, ids: Sequence[int], pos: int) -> str | None:
        """The role whose encoding starts at `pos`, longest match first."""
        for seq in sorted(self.role_seqs, key=len, reverse=True):
            if tuple(ids[pos : pos + len(seq)]) == seq:
                return self.role_seqs[seq]
        return None


def detect_anchors(ids: Sequence[int], tok_ids: AnchorTokens) -> list[Anchor]:
    """Anchors of `ids` in position order (head_end sorts before the turn_start it shares a
    position with)."""
    anchors: list[Anchor] = []
    first_role: str | None = None
    head_done = False
    role: str | None = None
    for pos, tid in enumerate(ids):
        if tid == tok_ids.turn_start:
            role = tok_ids.role_at(ids, pos + 1)
            if first_role is None:
                first_role = role or "?"
            elif not head_done:
                head_done = True
                if first_role == "system":
                    anchors.append(Anchor(pos, "head_end"))
            anchors.append(Anchor(pos, "turn_start", role=role))
        else:
            kind = tok_ids.tag_kinds.get(tid)
            if kind is not None and role != "system":
                anchors.append(Anchor(pos, kind))
    return anchors

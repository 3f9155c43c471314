"""Semantic anchors: chat-template block boundaries found on token ids.

Detection only looks at the ids of the template's special tokens (`<|im_start|>`, `<think>`,
`<tool_call>`, `<tool_response>`, ...), so it holds for any family whose template marks these
blocks with single tokens; a family lacking one of them simply yields no anchors of that kind.
Turns open with a token followed by the role's name (Qwen's `<|im_start|>`; Kimi's
`<|im_system|>` / `<|im_user|>` / `<|im_assistant|>`, each also a default role when the name
that follows is not a role: a `tool_declare` block, a message `name`) or with a token that is
the role (GLM's `<|system|>` / `<|user|>` / `<|assistant|>` / `<|observation|>` (tool);
DeepSeek's `<｜User｜>` / `<｜Assistant｜>`, `<｜tool▁outputs▁begin｜>` (tool), and its BOS, which
the system prompt follows).

Every anchor's `position` is the index of the tag token that opens (or closes) the block, so a
state checkpoint taken "before position p" covers tokens [0, p) and excludes the tag itself:

- `turn_start(role)`: each `<|im_start|>`; role read from the tokens that follow it. Qwen renders
  tool results inside a `user` turn.
- `head_end`: the first turn start after the leading system turns (system prompt + tools); only
  when the prompt starts with a system turn.
- `think_start` / `think_end`: `<think>` / `</think>`.
  Tag tokens inside a system turn (Qwen's tools header quotes `<tool_call>` as format
  instructions) are boilerplate, not block boundaries, and give no anchor.
- `tool_call_start`: `<tool_call>` (DeepSeek `<｜tool▁calls▁begin｜>`, Kimi
  `<|tool_calls_section_begin|>`).
- `tool_result_start` / `tool_result_end`: `<tool_response>` / `</tool_response>` (DeepSeek
  `<｜tool▁output▁begin｜>` / `<｜tool▁output▁end｜>`; Kimi marks a result by its tool turn only).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from freetoken.types.api import Anchor

_TAG_KINDS = {
    "<think>": "think_start",
    "</think>": "think_end",
    "<tool_call>": "tool_call_start",
    "<tool_response>": "tool_result_start",
    "</tool_response>": "tool_result_end",
    "<｜tool▁calls▁begin｜>": "tool_call_start",
    "<｜tool▁output▁begin｜>": "tool_result_start",
    "<｜tool▁output▁end｜>": "tool_result_end",
    "<|tool_calls_section_begin|>": "tool_call_start",
}
ROLES = ("system", "user", "assistant", "tool", "developer")
# tokens followed by the role's name: the role they stand for when the name is none of ROLES
_NAMED_TURNS = {"<|im_start|>": None, "<|im_system|>": "system", "<|im_user|>": "user",
                "<|im_assistant|>": "assistant"}
# tokens that are the role
_ROLE_TURNS = {"<|system|>": "system", "<|user|>": "user", "<|assistant|>": "assistant",
               "<|observation|>": "tool", "<｜User｜>": "user", "<｜Assistant｜>": "assistant",
               "<｜tool▁outputs▁begin｜>": "tool", "<｜begin▁of▁sentence｜>": "system"}


@dataclass(frozen=True)
class AnchorTokens:
    """Token ids anchor detection looks for; None where the vocabulary lacks the token.

    `role_seqs` maps the id sequence a role name encodes to (as it follows `<|im_start|>`) to
    the role. `turns`: every turn-opening token id -> (its default role, whether the role's name
    follows it).
    """

    turn_start: int | None
    tag_kinds: dict[int, str] = field(default_factory=dict)  # tag token id -> anchor kind
    role_seqs: dict[tuple[int, ...], str] = field(default_factory=dict)
    turns: dict[int, tuple[str | None, bool]] = field(default_factory=dict)

    @classmethod
    def from_vocab(
        cls, special_ids: dict[str, int], encode_role: dict[str, list[int]]
    ) -> AnchorTokens:
        """Build from `{token text: id}` of the added tokens and each role name's encoding."""
        tags = {special_ids[t]: k for t, k in _TAG_KINDS.items() if t in special_ids}
        seqs = {tuple(ids): role for role, ids in encode_role.items() if ids}
        turns = {special_ids[t]: (r, True) for t, r in _NAMED_TURNS.items() if t in special_ids}
        turns.update({special_ids[t]: (r, False) for t, r in _ROLE_TURNS.items()
                      if t in special_ids})
        return cls(special_ids.get("<|im_start|>"), tags, seqs, turns)

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
    turns = tok_ids.turns or ({tok_ids.turn_start: (None, True)}
                              if tok_ids.turn_start is not None else {})
    for pos, tid in enumerate(ids):
        turn = turns.get(tid)
        if turn is not None:
            default, named = turn
            role = (tok_ids.role_at(ids, pos + 1) if named else None) or default
            if first_role is None:
                first_role = role or "?"
            elif not head_done and (role != "system" or first_role != "system"):
                head_done = True
                if first_role == "system":
                    anchors.append(Anchor(pos, "head_end"))
            anchors.append(Anchor(pos, "turn_start", role=role))
        else:
            kind = tok_ids.tag_kinds.get(tid)
            if kind is not None and role != "system":
                anchors.append(Anchor(pos, kind))
    return anchors

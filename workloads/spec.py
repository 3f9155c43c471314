"""Workload data model: a versioned, replayable sequence of API requests.

A `Workload` is a list of `Turn`s. Each turn is one HTTP request with its exact body (message
list, tools, parameters) in the harness's native API shape, the number of output tokens the replay
forces, and its place in the concurrency graph: a turn starts `delay_s` after every turn in
`after` has finished (siblings of a fan-out share the same `after` and differ in `delay_s`).
The history a later turn carries already contains the recorded assistant reply of the earlier
turn (`reply`), so a replay never depends on what the server actually generates.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Api = Literal["openai", "anthropic"]
Scale = Literal["tiny", "full"]
SCALES: tuple[Scale, ...] = ("tiny", "full")


@dataclass(frozen=True)
class Turn:
    """One request of a workload.

    `body` is the request as the harness sends it (without the replay's forcing fields);
    `output_tokens` is the recorded length of the reply, forced on replay; `reply` is the
    recorded assistant message (in `api` shape) that later turns of `session` carry.
    """

    id: str
    session: str
    api: Api
    body: dict[str, Any]
    output_tokens: int
    after: tuple[str, ...] = ()
    delay_s: float = 0.0
    group: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    reply: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["after"] = list(self.after)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Turn:
        return Turn(**{**d, "after": tuple(d.get("after", ()))})


@dataclass(frozen=True)
class Workload:
    """A named, versioned request sequence. Turn ids are unique; `after` only names earlier
    turns, so the list order is a valid launch order."""

    name: str
    generator_version: str
    scale: Scale
    seed: int
    description: str
    turns: tuple[Turn, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for t in self.turns:
            if t.id in seen:
                raise ValueError(f"{self.name}: duplicate turn id {t.id}")
            missing = [a for a in t.after if a not in seen]
            if missing:
                raise ValueError(f"{self.name}: turn {t.id} waits on later/unknown {missing}")
            if t.output_tokens < 1:
                raise ValueError(f"{self.name}: turn {t.id} has output_tokens < 1")
            seen.add(t.id)

    @property
    def version(self) -> str:
        """`W3/v1/full/seed0/<content hash>`: changes whenever any byte of any turn changes."""
        return (f"{self.name}/v{self.generator_version}/{self.scale}/seed{self.seed}/"
                f"{self.digest()[:12]}")

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in self.turns:
            h.update(json.dumps(t.to_json(), sort_keys=True, ensure_ascii=False).encode())
        return h.hexdigest()

    @property
    def api(self) -> Api:
        return self.turns[0].api

    def turn(self, turn_id: str) -> Turn:
        return next(t for t in self.turns if t.id == turn_id)

    def sessions(self) -> dict[str, list[Turn]]:
        out: dict[str, list[Turn]] = {}
        for t in self.turns:
            out.setdefault(t.session, []).append(t)
        return out

    def to_jsonl(self, path: str | Path) -> Path:
        """Line 1: the header (name, version, ...); then one turn per line."""
        path = Path(path)
        head = {"name": self.name, "version": self.version, "generator_version":
                self.generator_version, "scale": self.scale, "seed": self.seed,
                "description": self.description, "n_turns": len(self.turns)}
        with path.open("w") as f:
            f.write(json.dumps(head, ensure_ascii=False) + "\n")
            for t in self.turns:
                f.write(json.dumps(t.to_json(), ensure_ascii=False) + "\n")
        return path

    @staticmethod
    def from_jsonl(path: str | Path) -> Workload:
        lines = Path(path).read_text().splitlines()
        head = json.loads(lines[0])
        turns = tuple(Turn.from_json(json.loads(x)) for x in lines[1:] if x.strip())
        return Workload(head["name"], head["generator_version"], head["scale"], head["seed"],
                        head["description"], turns)

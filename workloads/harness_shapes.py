"""Real harness request shapes, extracted once from the recorded traces.

`data/shapes.json` holds, per harness, the parts of a request the harness sends verbatim on every
turn (system prompt, tool list, parameters, identifying headers) as recorded in
`shared/harness_traces/` (Claude Code 2.1.197, OpenCode 1.18.33, OpenClaw 2026.9.6). The workload
generators build every request from these shapes, so the package needs no access to the traces at
run time. Regenerate with `python -m workloads.harness_shapes <harness_traces dir>`.
"""
from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path
from typing import Any

SHAPES_PATH = Path(__file__).with_name("data") / "shapes.json"
_KEEP_HEADERS = {"anthropic-beta", "anthropic-version", "User-Agent", "x-app"}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _params(body: dict[str, Any], drop: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in drop}


def extract_shapes(trace_dir: Path) -> dict[str, Any]:
    """Pull the per-harness constant request parts out of the recorded traces."""
    cc = _lines(trace_dir / "claude_code" / "cc_try1.jsonl")
    main = cc[0]["body"]
    sub = next(r["body"] for r in cc if r["body"]["system"][0]["text"].endswith("subagent=true;"))
    oc = _lines(trace_dir / "opencode" / "oc_try1.jsonl")
    oc_main = next(r for r in oc if r["body"].get("tools") and "x-parent-session-id" not in
                   r["headers"])
    oc_sub = next(r for r in oc if "x-parent-session-id" in r["headers"])
    ocl = _lines(trace_dir / "openclaw" / "ocl_try1.jsonl")[0]["body"]
    drop = ("messages", "system", "tools")
    return {
        "source": "shared/harness_traces (cc_try1, oc_try1, ocl_try1)",
        "claude_code": {
            "system": main["system"],
            "tools": main["tools"],
            "reminder": main["messages"][0]["content"][0]["text"],
            "agent_types": main["messages"][1]["content"],
            "params": _params(main, drop),
            "headers": {k: v for k, v in cc[0]["headers"].items() if k in _KEEP_HEADERS},
            "sub_system": sub["system"],
            "sub_tools": sub["tools"],
            "sub_skills": sub["messages"][1]["content"],
            "sub_params": _params(sub, drop),
        },
        "opencode": {
            "system": oc_main["body"]["messages"][0]["content"],
            "tools": oc_main["body"]["tools"],
            "sub_tools": oc_sub["body"]["tools"],
            "params": _params(oc_main["body"], ("messages", "tools")),
        },
        "openclaw": {
            "system": ocl["messages"][0]["content"],
            "tools": ocl["tools"],
            "runtime": ocl["messages"][1]["content"].split("\n\n", 1)[1],
            "trailing": ocl["messages"][2]["content"][0]["text"],
            "params": _params(ocl, ("messages", "tools")),
        },
    }


@functools.lru_cache(maxsize=1)
def _load() -> dict[str, Any]:
    return json.loads(SHAPES_PATH.read_text())


def shapes(harness: str) -> dict[str, Any]:
    """A deep copy of one harness's recorded shapes (callers may mutate it)."""
    return copy.deepcopy(_load()[harness])


if __name__ == "__main__":
    out = extract_shapes(Path(sys.argv[1]))
    SHAPES_PATH.parent.mkdir(exist_ok=True)
    SHAPES_PATH.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {SHAPES_PATH} ({SHAPES_PATH.stat().st_size} bytes)")

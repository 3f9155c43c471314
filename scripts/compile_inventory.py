"""What compiled on a first start (issue 20 item 6): the kernel cache root as a timeline.

Usage: python scripts/compile_inventory.py ROOT   (ROOT: $XDG_CACHE_HOME of the server)
Prints the Triton kernels compiled (count per kernel, then each compile's time from the first
file written, warps, stages and how many arguments were specialised on divisibility), then the
other cache directories (flashinfer, torch extensions, FreeToken's CPU kernels) with the span
of their files' times.
"""
from __future__ import annotations

import collections
import json
import os
import re
import sys
from pathlib import Path


def _files(root: Path) -> list[tuple[float, Path]]:
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            p = Path(d) / n
            try:
                out.append((p.stat().st_mtime, p))
            except OSError:  # removed while walking (a compile's temporary file)
                continue
    return out


def _triton_entry(p: Path) -> tuple[str, object, object, str] | None:
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or "name" not in meta:
        return None
    ttir = p.with_suffix(".ttir")
    div = ""
    if ttir.exists():
        m = re.search(r"tt\.func public @\w+\((.*?)\)\s*(attributes|\{)",
                      ttir.read_text()[:20000], re.DOTALL)
        if m:
            div = f"{m.group(1).count('tt.divisibility')}div"
    return meta["name"], meta.get("num_warps"), meta.get("num_stages"), div


def main(root: Path) -> int:
    rows = _files(root)
    if not rows:
        print(f"empty: {root}")
        return 0
    t0 = min(t for t, _ in rows)
    kernels, spans = [], collections.defaultdict(list)
    for t, p in rows:
        rel = p.relative_to(root).parts
        if "triton" in rel:
            if p.suffix == ".json" and not p.name.startswith("__grp__"):
                e = _triton_entry(p)
                if e is not None:
                    kernels.append((t - t0, *e))
        else:
            spans["/".join(rel[:5])].append(t - t0)
    print(f"# triton kernels compiled: {len(kernels)}")
    for name, n in collections.Counter(k[1] for k in kernels).most_common():
        print(f"{n:4d} {name}")
    print("# timeline (s from the first file, name, warps, stages, divisibility-specialised args)")
    for k in sorted(kernels):
        print(f"{k[0]:8.1f} {k[1]} w{k[2]} s{k[3]} {k[4]}")
    print("# other cache directories: first..last file time, files")
    for d, ts in sorted(spans.items()):
        print(f"{d}: {min(ts):.1f}..{max(ts):.1f}s n={len(ts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

"""The demo model's loss curve as a PNG (matplotlib, imported only here): written by
`train_demo` at the end of a run and by `demo_trained` when it ships the weights."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_loss(log: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    by: dict[str, list[tuple[int, float]]] = {}
    for r in log:
        by.setdefault(r["harness"], []).append((r["step"], r["loss"]))
    for name, pts in sorted(by.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=2, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy of assistant tokens (nats)")
    ax.set_title("demo model training (batches are one harness each)")
    ax.legend(markerscale=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

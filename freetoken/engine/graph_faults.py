"""Replay faults of the decode runner's CUDA graphs (issue 22; engine/graph_runner.py).

A replay that raises, or that returns a row its step poisoned (`gpu_sampler.FAILED_ROW` where
the eager step need not have), is the graph's failure, not the request's: the runner drops
every graph, decodes eagerly from then on and says so in one `ft.engine: graph_fault` line;
the engine re-runs the rows concerned alone from their cached prefix (engine/isolation.py:
`GraphFault`, `GRAPH_POISONED`). `_replay` is the seam a CPU test injects such a fault
through.

`ReplayFaults` is a mixin of `DecodeRunner` (it uses `device`, `use_graphs`, `_want_graphs`
and `_drop_graphs`).
"""
from __future__ import annotations

import torch

from freetoken.engine import gpu_sampler
from freetoken.engine.graph_capture import Bucket
from freetoken.engine.isolation import GRAPH_POISONED, GraphFault
from freetoken.layers.step_context import PagedDecode
from freetoken.log import get_logger, kv

engine_log = get_logger("engine")


class ReplayFaults:
    graph_faults: int  # replays that raised or poisoned rows (graphs off after one)

    def _replay(self, graph: torch.cuda.CUDAGraph, bk: Bucket, attn: PagedDecode,
                greedy: bool) -> None:
        """Replay `graph`, the capture of `bk`'s step for `greedy` (`attn`: the step's plan,
        which the graph reads from the static buffers it was captured on). The seam a CPU
        test injects a replay fault through: its stand-in runs `_forward` with the same
        arguments, then fails."""
        graph.replay()

    def _replay_or_fault(self, graph: torch.cuda.CUDAGraph, bk: Bucket, attn: PagedDecode,
                         greedy: bool, rows: int) -> None:
        """`_replay`; a raise turns graphs off (`_graph_fault`) and becomes a `GraphFault`
        for the engine, which re-runs the step's rows alone."""
        try:
            self._replay(graph, bk, attn, greedy)
        except Exception as e:  # (the rows are re-run: engine/isolation.py)
            self._graph_fault("replay_raised", bk.size, rows, e)
            raise GraphFault(f"decode graph replay failed: {e!r}") from e

    def _poisoned(self, n: int, out: list[int]) -> list[int]:
        """The ids of a replayed step of `n` rows: a row the graph poisoned turns graphs off
        and comes back as GRAPH_POISONED (re-run alone by the engine)."""
        if gpu_sampler.FAILED_ROW not in out:
            return out
        bad = [i for i, t in enumerate(out) if t == gpu_sampler.FAILED_ROW]
        self._graph_fault("poisoned_rows", n, n, f"rows {bad} non-finite")
        return [GRAPH_POISONED if t == gpu_sampler.FAILED_ROW else t for t in out]

    def _graph_fault(self, kind: str, bucket: int, rows: int, error: object) -> None:
        """A replay failed (module docstring): every graph goes, eager from here on."""
        self.graph_faults += 1
        was_on = self.use_graphs
        if self.device.type == "cuda":
            try:  # (no graph is destroyed while a replay of it may still run)
                torch.cuda.synchronize()
            except RuntimeError:
                pass
        self._drop_graphs()
        self._want_graphs = self.use_graphs = False
        if was_on:
            engine_log.warning(kv("graph_fault", kind=kind, bucket=bucket, rows=rows,
                                  error=repr(error)[:200], graphs="off", recovery="rows re-run "
                                  "alone, eagerly"))

"""The two routing hooks the product installs on a model's MoE routers (`build_engine` in
freetoken/cli/build.py and `ft generate`; the benches reuse them from freetoken/bench):

- `attach_recorder` (`--record-routing FILE`): every MoE block's routed expert ids. Decode
  steps (one token in the batch) are recorded per step and layer; multi-token batches (prefill
  chunks) as prefill routing. With several concurrent requests the decode record interleaves
  them: record single-stream sessions for clean traces. The file format (`.npz`) and its
  loader are in freetoken/bench/routing_trace.py.
- `TraceRouter` / `install_trace` / `install_serve_trace` (the hidden `ft serve --route-trace
  shared|uniform|FILE` that `ft bench serve` passes, and `ft bench decode --route-trace`): a
  random-weight model routed by a replayed trained router, so the expert cache meets realistic
  locality, or uniformly (the bench's `random` case, served). The server batches decode
  rows, so each row r of a decode step replays its own trace sequence (`(layer // Lt + r) %
  N`), and the step advances once per step at the last MoE layer. A batch is a decode step
  when it is a CUDA-graph bucket (`row_mask` given) or has at most `max_rows` rows
  (`--max-running`); prefill chunks keep the model's own random router. The step counter and
  the trace live on the device, so graphs replay the trace like eager steps.
"""
from __future__ import annotations

import atexit
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from freetoken.envs import routing_traces_dir
from freetoken.log import get_logger, kv
from freetoken.models.qwen import QwenMoE

log = get_logger("experts")
replay_log = get_logger("engine")


def _id_dtype(num_experts: int) -> type[np.integer]:
    return np.uint8 if num_experts <= 256 else np.int16


class RoutingRecorder:
    """Collects one sequence's routing as the model runs; `save(path)` writes the .npz format.

    Call `record(layer, ids)` once per MoE layer per decode step (ids `[K]` or `[1, K]`), and
    `record_prefill(layer, ids [T, K])` for prompt chunks (chunks of a layer are concatenated).
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self._decode: list[list[np.ndarray]] = [[] for _ in range(num_layers)]
        self._prefill: list[list[np.ndarray]] = [[] for _ in range(num_layers)]

    def _as_ids(self, ids: Tensor | np.ndarray) -> np.ndarray:
        arr = ids.detach().cpu().numpy() if isinstance(ids, Tensor) else np.asarray(ids)
        if arr.shape[-1] != self.top_k:
            raise ValueError(f"expected top_k={self.top_k} ids per token, got {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.num_experts):
            raise ValueError("expert id out of range")
        return arr.astype(_id_dtype(self.num_experts))

    def record(self, layer: int, ids: Tensor | np.ndarray) -> None:
        self._decode[layer].append(self._as_ids(ids).reshape(self.top_k))

    def record_prefill(self, layer: int, ids: Tensor | np.ndarray) -> None:
        self._prefill[layer].append(self._as_ids(ids).reshape(-1, self.top_k))

    @property
    def steps(self) -> int:
        return min(len(x) for x in self._decode)

    def decode_array(self) -> np.ndarray:
        """`[steps, L, K]` over the steps that every layer completed."""
        n = self.steps
        dt = _id_dtype(self.num_experts)
        if n == 0:
            return np.zeros((0, self.num_layers, self.top_k), dt)
        return np.stack([np.stack(layer[:n]) for layer in self._decode], axis=1)

    def save(self, path: str | Path) -> None:
        arrays: dict[str, np.ndarray] = {
            "decode": self.decode_array(),
            "num_experts": np.int64(self.num_experts),
            "top_k": np.int64(self.top_k),
        }
        if all(self._prefill):
            arrays["prefill"] = np.stack([np.concatenate(x) for x in self._prefill])
        np.savez_compressed(path, **arrays)


def attach_recorder(model: QwenMoE, path: str | None = None) -> RoutingRecorder:
    """Install the hooks; with `path`, also save there at interpreter exit."""
    blocks = model.moe_blocks()
    cfg = model.cfg
    rec = RoutingRecorder(len(blocks), cfg.num_experts, cfg.top_k)
    for m, b in enumerate(blocks):
        def hook(_layer_id: int, ids: torch.Tensor, _m: int = m) -> None:
            if ids.shape[0] == 1:
                rec.record(_m, ids[0])
            else:
                rec.record_prefill(_m, ids)

        b.route_hook = hook
    if path:
        def save() -> None:
            rec.save(path)
            log.info(kv("routing_saved", path=path, steps=rec.steps))

        atexit.register(save)
    return rec


def trace_path(spec: str) -> Path:
    """The decode trace `spec` names: "shared", the shared traces' decode_routing.npy
    (`envs.routing_traces_dir`: FT_ROUTING_TRACES or the workloads package's copy), else the
    path itself."""
    if spec == "shared":
        return routing_traces_dir() / "decode_routing.npy"
    return Path(spec)


class TraceRouter:
    """Replaces the router's choice in decode steps with a recorded one: row r of model layer l
    at decode step s takes trace layer l % Lt of sequence (l // Lt + r) % N, step s % steps.
    The trace, the step counter and the step's routing live on the model's device and the
    step advances there, so a replayed CUDA graph walks the trace like eager steps do.

    The lookup is laid out once (`bind`: `[steps, L, R, K]` per model layer and row) so that
    a step costs a fixed handful of kernels, not a handful per layer: the first MoE layer of a
    step gathers the step's `[L, R, K]` frame (one index_select, the row mask applied once),
    every layer's ids are then a view of it, and the last layer advances the counter. (Five
    small kernels a layer, 100 in the 20-layer bench, were ~15% of fused decode on the H200,
    where a step is ~2 ms of launch-bound kernels.)"""

    def __init__(self, decode: np.ndarray, num_experts: int, top_k: int,
                 device: torch.device | str = "cpu", max_rows: int = 8):
        assert decode.shape[-1] >= top_k and int(decode.max()) < num_experts
        self.t = torch.from_numpy(decode[..., :top_k].astype(np.int64)).to(device)  # [s,Lt,N,K]
        self.k = top_k
        self.max_rows = max(max_rows, 8)  # R
        self.step = torch.zeros(1, dtype=torch.int64, device=device)  # in [0, steps)
        self._table: torch.Tensor | None = None  # [steps, L, R, K] (see `bind`)
        self._frame: torch.Tensor | None = None  # [L, B, K] of the step running

    def bind(self, layers: int) -> None:
        """Lay the trace out for a model of `layers` MoE layers: table[s, l, r] = trace[s,
        l % Lt, (l // Lt + r) % N] ([steps, L, R, K] int64 on the trace's device)."""
        _, lt, n, _ = self.t.shape
        t = self.t.cpu().numpy()
        li = np.arange(layers)
        seqs = (li[:, None] // lt + np.arange(self.max_rows)[None, :]) % n  # [L, R]
        table = t[:, (li % lt)[:, None], seqs]  # [steps, L, R, K]
        self._table = torch.from_numpy(np.ascontiguousarray(table)).to(self.t.device)
        self._frame = None

    def ids(self, layer: int, rows: int = 1, row_mask: torch.Tensor | None = None
            ) -> torch.Tensor:
        """[rows, K]: the step's routing of `rows` decode rows (row r = sequence r) at MoE
        layer `layer`; -1 on rows outside `row_mask` [rows] bool (they route nowhere). Layer
        0 starts a step: it gathers the step's frame, which later layers read."""
        assert rows <= self.max_rows, f"{rows} rows: the trace router holds {self.max_rows}"
        if self._table is None or layer >= self._table.shape[1]:
            self.bind(max(layer + 1, self.t.shape[1]))
        assert self._table is not None
        if layer == 0 or self._frame is None or self._frame.shape[1] != rows:
            frame = self._table.index_select(0, self.step)[0, :, :rows]  # [L, rows, K]
            if row_mask is not None:
                frame = frame.masked_fill(~row_mask[None, :, None], -1)
            self._frame = frame
        return self._frame[layer]  # [rows, K] (a view)

    def advance(self) -> None:
        self.step.add_(1).remainder_(self.t.shape[0])


def install_trace(model: QwenMoE, router: TraceRouter, max_rows: int = 1) -> None:
    """Route every decode step of `model` by `router`: a CUDA-graph bucket (which passes
    `row_mask`; its padding rows route nowhere) or an eager step of at most `max_rows` rows.
    Prefill chunks keep the model's own router."""
    blocks = model.moe_blocks()
    router.bind(len(blocks))
    for i, b in enumerate(blocks):
        orig = b.gate.forward

        def fwd(x: torch.Tensor, *extra, row_mask: torch.Tensor | None = None, _i: int = i,
                _orig=orig) -> tuple[torch.Tensor, torch.Tensor]:
            # `extra`: a router's other inputs (deepseek_v4's token ids for its hash layers)
            w, ids = _orig(x, *extra, row_mask=row_mask)
            if row_mask is not None or x.shape[0] <= max_rows:
                ids = router.ids(_i, x.shape[0], row_mask)  # [T, K]
                if _i == len(blocks) - 1:
                    router.advance()
            return w, ids

        b.gate.forward = fwd  # type: ignore[method-assign]


def uniform_trace(steps: int, layers: int, rows: int, num_experts: int, top_k: int,
                  seed: int = 0) -> np.ndarray:
    """[steps, layers, rows, K] routing drawn uniformly per token: each row of each step picks
    K distinct experts of E at random: no locality, so a cache holding a fraction c of the
    experts hits c of them. `ft bench decode`'s `random` case, and `ft serve --route-trace
    uniform` (the same routing served, so the two figures compare at the same hit rate: the
    random router on the server's own tokens hit 0.50 at a 37 % cache on the H200, the bench's
    uniform one 0.36)."""
    g = np.random.default_rng(seed)
    out = np.empty((steps, layers, rows, top_k), dtype=np.int16)
    for s in range(steps):  # a step at a time: argsort of [L, N, E] keys stays small
        out[s] = np.argsort(g.random((layers, rows, num_experts)), axis=-1)[..., :top_k]
    return out


UNIFORM_STEPS = 1024  # `--route-trace uniform`: steps before the trace repeats (no cache can
# hold a cycle: 1024 steps route every expert of every layer many times over)


def install_serve_trace(model: QwenMoE, spec: str, max_rows: int = 4) -> TraceRouter:
    device = model.model.embed_tokens.weight.device
    cfg = model.cfg
    if spec == "uniform":
        path: Path | str = "uniform"
        decode = uniform_trace(UNIFORM_STEPS, len(model.moe_blocks()), max(max_rows, 8),
                               cfg.num_experts, cfg.top_k)
    else:
        path = trace_path(spec)
        if not path.is_file():
            raise SystemExit(f"--route-trace: no trace at {path} (shared | uniform | a .npy "
                             "[steps, L, N, K])")
        decode = np.load(path)
    router = TraceRouter(decode, cfg.num_experts, cfg.top_k, device, max_rows)
    install_trace(model, router, max_rows)
    replay_log.info(kv("route_trace", trace=path, steps=router.t.shape[0],
                       trace_layers=router.t.shape[1], sequences=router.t.shape[2],
                       layers=len(model.moe_blocks()), max_rows=max_rows))
    return router

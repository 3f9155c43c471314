"""gpt-oss real shapes without checkpoints (issue 25 item 6): the presets' MXFP4 expert bytes,
`ft bench checkpoint` writing the released layout (MXFP4 `*_blocks` / `*_scales` beside BF16
biases, `quantization_config`, alternating `layer_types`) that the product's reader serves,
and `ft bench decode --shape … --random-weights` over an MXFP4 store with every backend."""
from __future__ import annotations

import json

import torch
from safetensors import safe_open

from freetoken.cli import main
from freetoken.types.presets import preset_config


def test_presets_count_mxfp4_bytes() -> None:
    big = preset_config("gpt-oss-120b")
    # 3 matrices of 2880 x 2880: half a byte per value plus one e8m0 scale per 32 values
    assert big.expert_bytes() == 3 * 2880 * 2880 * 17 // 32
    assert round(big.expert_bytes() * big.num_experts * big.num_layers / 1e9, 1) == 60.9
    assert big.sliding_layers == tuple(range(0, 36, 2)) and big.sliding_window == 128
    small = preset_config("gpt-oss-20b", layers=4)
    assert (small.num_layers, small.num_experts, small.top_k) == (4, 32, 4)


def test_bench_checkpoint_writes_the_released_layout(tmp_path, capsys) -> None:
    out = tmp_path / "ckpt"
    assert main(["bench", "checkpoint", "--shape", "tiny-gpt-oss", str(out),
                 "--no-progress"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]
    (shard,) = out.glob("model-*.safetensors")
    with safe_open(str(shard), framework="pt") as f:
        p = "model.layers.1.mlp.experts."
        blocks = f.get_tensor(p + "gate_up_proj_blocks")
        assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (8, 128, 2, 16)
        assert tuple(f.get_tensor(p + "down_proj_scales").shape) == (8, 64, 2)
        assert f.get_tensor(p + "gate_up_proj_bias").dtype == torch.bfloat16
    from freetoken.engine.generate import generate
    from freetoken.kernels.quant import QuantBank
    from freetoken.models.loader import load_model
    from freetoken.types.api import SamplingParams

    m = load_model(out, dtype=torch.float32, progress=False)
    gu = m.moe_blocks()[1].experts.gate_up_proj
    assert isinstance(gu, QuantBank) and gu.fmt == "mxfp4"
    w = gu.dequantize()
    assert 0.005 < w.std().item() < 0.05  # near the N(0, 0.02) of the other matrices
    got = generate(m, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0), eos_ids=[])
    assert len(got.token_ids) == 4


def test_bench_decode_gpt_oss_shape_runs_every_backend(capsys) -> None:
    assert main(["bench", "decode", "--shape", "tiny-gpt-oss", "--random-weights",
                 "--device", "cpu", "--backends", "fused,offload,cpu,hybrid",
                 "--decode-tokens", "4", "--prompt-tokens", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "format=mxfp4" in out
    table = out[out.index("floor tok/s"):]
    for be in ("fused", "offload", "cpu", "hybrid"):
        row = next(line for line in table.splitlines() if line.startswith(be))
        assert float(row.split()[1]) > 0, row

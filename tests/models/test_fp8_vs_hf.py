"""FP8 Qwen3.6 (`qwen3_5_moe` with an fp8 `quantization_config`, issue 25 item 4): a tiny random
checkpoint written in FP8 the way released checkpoints are (BF16 weights quantized per B x B
block, `weight_scale_inv` beside each weight) loads with its routed experts kept FP8, and
matches transformers running the dequantized weights: fp32 logits within rel 1e-4, identical
greedy tokens; every expert backend is bit-identical to `fused`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.checkpoint.fp8 import is_fp8_linear
from freetoken.checkpoint.safetensors_reader import CheckpointError
from freetoken.cli.build import load_with_experts
from freetoken.engine.generate import generate
from freetoken.kernels.quant import QuantBank, quantize_fp8
from freetoken.models.loader import load_model
from freetoken.types.api import SamplingParams
from freetoken.types.config import MoEConfig
from tests.experts.test_moe_backends import _logits
from tests.models.fixtures import hf_reference


def _write_fp8(src: Path, dst: Path, deq_dir: Path, block: int) -> None:
    """The FP8 checkpoint of `src` in `dst`, and its dequantized weights as a plain fp32
    checkpoint in `deq_dir` (the oracle's). Weights are rounded to BF16 first, as a release
    starts from BF16."""
    shutil.copytree(src, dst)
    shutil.copytree(src, deq_dir)
    state = load_file(str(src / "model.safetensors"))
    out, deq = {}, {}
    for name, w in state.items():
        if is_fp8_linear(name, tuple(w.shape)):
            qb = quantize_fp8(w.to(torch.bfloat16), block)
            out[name], out[name + "_scale_inv"] = qb.data, qb.scale
            deq[name] = qb.dequantize(torch.float32)
        else:
            out[name], deq[name] = w, w
    save_file(out, str(dst / "model.safetensors"))
    save_file(deq, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module", params=[32, 128])
def fp8_ckpt(request, tiny_hf, tmp_path_factory):
    """(FP8 dir, transformers on the dequantized weights) at block 32 (several blocks per
    matrix, the CPU kernel's path) and 128 (the released block, larger than these matrices)."""
    src = tiny_hf("qwen3_5_moe")
    base = tmp_path_factory.mktemp(f"fp8-{request.param}")
    _write_fp8(src, base / "ckpt", base / "dequantized", request.param)
    return base / "ckpt", hf_reference(base / "dequantized")


def test_experts_stay_fp8(fp8_ckpt) -> None:
    d, _ = fp8_ckpt
    m = load_model(d, dtype=torch.float32, progress=False)
    blocks = m.moe_blocks()
    gu = blocks[0].experts.gate_up_proj
    assert isinstance(gu, QuantBank) and gu.data.dtype == torch.float8_e4m3fn
    cfg = m.cfg
    assert cfg.expert_format.name == "fp8"
    assert cfg.expert_bytes() == gu[0].nbytes + blocks[0].experts.down_proj[0].nbytes
    assert cfg.expert_bytes() < cfg.expert_bytes(torch.bfloat16) * 0.6


def test_fp8_logits_and_greedy_match_transformers(fp8_ckpt) -> None:
    d, ref = fp8_ckpt
    ours = load_model(d, dtype=torch.float32, progress=False)
    ids = torch.randint(0, ours.cfg.vocab_size, (48,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]  # [T, V]
    got = _logits(ours, ids)  # 40-token prefill (grouped path) + 8 decode steps (the kernel)
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    with torch.no_grad():
        greedy = ref.generate(torch.tensor([ids[:20]]), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    out = generate(ours, ids[:20], SamplingParams(max_tokens=16, temperature=0.0), eos_ids=[])
    assert out.token_ids == greedy


@pytest.mark.parametrize("backend,slots", [("offload", 3), ("cpu", 5), ("hybrid", 4),
                                           ("auto", 10)])
def test_fp8_backends_bit_identical_to_fused(fp8_ckpt, backend: str, slots: int) -> None:
    d, _ = fp8_ckpt
    fused = load_model(d, dtype=torch.float32, progress=False)
    ids = torch.randint(0, fused.cfg.vocab_size, (56,),
                        generator=torch.Generator().manual_seed(7)).tolist()
    want = _logits(fused, ids)
    m, rt = load_with_experts(d, MoEConfig(backend=backend, cache_size=slots),
                              dtype=torch.float32, progress=False)
    assert rt.store.fmt is not None and rt.store.fmt.name == "fp8"
    assert isinstance(rt.cache.gate_up_slots, QuantBank)
    assert torch.equal(_logits(m, ids), want)
    assert rt.counters.as_dict()["misses"] > 0


def test_bad_scale_grid_is_a_checkpoint_error(fp8_ckpt, tmp_path) -> None:
    d, _ = fp8_ckpt
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    state = load_file(str(bad / "model.safetensors"))
    name = next(n for n in state if n.endswith("experts.0.down_proj.weight_scale_inv"))
    state[name] = torch.ones(7, 7)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="block-scale shape"):
        load_model(bad, dtype=torch.float32, progress=False)


def test_ft_convert_refuses_quantized_experts(fp8_ckpt, tmp_path, capsys) -> None:
    # FTW holds dense banks only: converting an FP8 checkpoint is a clear refusal, not a crash
    # on a QuantBank (or a silent dequantization)
    from freetoken.cli import main

    d, _ = fp8_ckpt
    assert main(["convert", str(d), str(tmp_path / "ftw"), "--no-progress"]) != 0
    assert "quantized (fp8)" in capsys.readouterr().out


def test_fp8_fused_banks_on_disk_are_refused(fp8_ckpt, tmp_path) -> None:
    # an FP8 checkpoint whose layer stores its experts as fused banks would otherwise be cast
    # to the model dtype without its scales (silently wrong weights)
    d, _ = fp8_ckpt
    bad = tmp_path / "fused"
    shutil.copytree(d, bad)
    state = load_file(str(bad / "model.safetensors"))
    p = "model.layers.0.mlp.experts."
    gate_up = torch.stack([torch.cat((state.pop(f"{p}{e}.gate_proj.weight"),
                                      state.pop(f"{p}{e}.up_proj.weight"))) for e in range(8)])
    state[p + "gate_up_proj"] = gate_up
    state[p + "down_proj"] = torch.stack([state.pop(f"{p}{e}.down_proj.weight")
                                          for e in range(8)])
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="fused banks"):
        load_model(bad, dtype=torch.float32, progress=False)

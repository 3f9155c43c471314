"""The peer suite's model: a tiny random Qwen3 checkpoint (transformers, fixed seed, the real Qwen3
tokenizer) and its GGUF for llama.cpp.

`build_checkpoint(dir)` runs in the project's venv (torch + transformers). `write_gguf(ckpt,
out)` runs in the peer venv (`python tiny_qwen3.py CKPT OUT.gguf`, needs only numpy and the
`gguf` package): it reads the safetensors file itself and writes llama.cpp's `qwen3`
architecture the way llama.cpp's own `convert_hf_to_gguf.py` names and orders it (tensor names
`blk.N.attn_q` ..., tokenizer `gpt2` / pre `qwen2`, added special tokens CONTROL, other added
tokens USER_DEFINED, padded vocab entries UNUSED), all tensors float32 so that llama.cpp's
greedy tokens can be checked against transformers' on the same weights.
"""
from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

# small enough that a 20k-token Claude Code prompt prefills in seconds on one core
CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
          "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
          "vocab_size": 151936, "tie_word_embeddings": True, "bos_token_id": 151643,
          "eos_token_id": 151645}
SEED = 1234


def build_checkpoint(out: Path, tokenizer_dir: Path) -> Path:
    """A random-weight Qwen3ForCausalLM saved as safetensors, with the Qwen3 tokenizer files."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG)).to(torch.float32).eval()
    with torch.no_grad():  # init std 0.02 gives near-flat logits: widen them so argmax is clear
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, out / f)
    return out


def read_safetensors(path: Path) -> dict:
    """name -> float32 numpy array (the format: u64 header length, JSON header, raw data)."""
    import numpy as np

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": None}
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        buf = raw[8 + n + a:8 + n + b]
        if meta["dtype"] == "BF16":
            arr = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(buf, dtypes[meta["dtype"]]).astype(np.float32)
        out[name] = arr.reshape(meta["shape"])
    return out


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str | None:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.N.<module...>.weight
    if parts[:2] == ["model", "layers"]:
        mod = ".".join(parts[3:-1])
        if mod in _NAMES:
            return f"blk.{parts[2]}.{_NAMES[mod]}.{parts[-1]}"
    return None


def write_gguf(ckpt: Path, out: Path) -> Path:
    import gguf
    import numpy as np

    cfg = json.loads((ckpt / "config.json").read_text())
    tcfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(out), "qwen3")
    w.add_name("ft-tiny-qwen3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # tokenizer, as convert_hf_to_gguf.py's get_vocab_base() for a BPE (gpt2) vocab
    vocab = dict(tj["model"]["vocab"])
    added = {t["content"]: t for t in tj["added_tokens"]}
    for t in added.values():
        vocab[t["content"]] = t["id"]
    rev = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(cfg["vocab_size"]):
        if i not in rev:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif rev[i] in added:
            tokens.append(rev[i])
            types.append(gguf.TokenType.CONTROL if added[rev[i]]["special"]
                         else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(rev[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_pad_token_id(vocab[tcfg["pad_token"]])
    w.add_bos_token_id(vocab[tcfg["pad_token"]])  # Qwen: bos = <|endoftext|>, never added
    w.add_add_bos_token(False)
    w.add_chat_template(tcfg["chat_template"])
    for name, arr in read_safetensors(ckpt / "model.safetensors").items():
        g = gguf_name(name)
        if g is None:
            raise ValueError(f"unexpected tensor {name}")
        w.add_tensor(g, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


if __name__ == "__main__":
    write_gguf(Path(sys.argv[1]), Path(sys.argv[2]))

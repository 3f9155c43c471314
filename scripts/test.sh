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
# one worker per core, each test file on one worker (module fixtures start once);
# FT_TEST_JOBS=0 runs in this process (for -x / --pdb)
exec python -m pytest -q -n "${FT_TEST_JOBS:-auto}" --dist loadfile "$@"

#!/usr/bin/env bash
# Install FreeToken into .venv and serve the embedded demo model (built on first use) on
# http://127.0.0.1:8000 (OpenAI and Anthropic APIs). Extra arguments go to `ft serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e .
exec ft serve --model demo "$@"

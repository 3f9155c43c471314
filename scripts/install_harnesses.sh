#!/usr/bin/env bash
# Installs the real harnesses that tests/proxy/test_proxy_real_clients.py drives through the proxy:
# Claude Code from the npm registry and mini-swe-agent from PyPI (in its own virtualenv, so its
# litellm stack stays out of FreeToken's). Versions are those of the recorded traces.
#   scripts/install_harnesses.sh            # into ~/.cache/freetoken/harnesses
#   FT_HARNESS_PREFIX=DIR scripts/install_harnesses.sh
set -euo pipefail
PREFIX="${FT_HARNESS_PREFIX:-$HOME/.cache/freetoken/harnesses}"
CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.197}"
MINI_VERSION="${MINI_VERSION:-2.4.6}"
mkdir -p "$PREFIX/npm"
command -v npm >/dev/null || { echo "npm is needed (apt-get install nodejs npm)" >&2; exit 1; }
npm install --no-audit --no-fund --prefix "$PREFIX/npm" \
  "@anthropic-ai/claude-code@${CLAUDE_CODE_VERSION}"
python3 -m venv "$PREFIX/mini-venv"
"$PREFIX/mini-venv/bin/pip" install -q "mini-swe-agent==${MINI_VERSION}"
echo "claude: $PREFIX/npm/node_modules/.bin/claude"
echo "mini:   $PREFIX/mini-venv/bin/mini"

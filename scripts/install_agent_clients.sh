#!/usr/bin/env bash
# Install the coding-agent CLIs `mlxlocal launch` drives, from npm, at pinned versions, into a
# cache directory of ours (never a global npm prefix): $MLXLOCAL_NPM_PREFIX, default
# ${MLXLOCAL_HOME:-~/.cache/mlxlocal}/npm. Idempotent: a package already at its pinned version
# is left alone. Prints each binary's path; `mlxlocal launch` finds them there by itself.
#
#   scripts/install_agent_clients.sh              # codex and claude
#   scripts/install_agent_clients.sh opencode     # only opencode (or any of: codex claude opencode)
#
# Pinned versions (npm registry, 2026-11-30): @openai/codex 0.171.0,
# @anthropic-ai/claude-code 2.1.332, opencode-ai 1.18.33. Override one with e.g.
# CODEX_VERSION=0.172.0.
set -euo pipefail

CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
CLAUDE_VERSION="${CLAUDE_VERSION:-2.1.332}"
OPENCODE_VERSION="${OPENCODE_VERSION:-1.18.33}"
PREFIX="${MLXLOCAL_NPM_PREFIX:-${MLXLOCAL_HOME:-$HOME/.cache/mlxlocal}/npm}"

for tool in node npm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "error: '$tool' not found on PATH. Install Node.js (>= 20; Claude Code asks for >= 22), e.g." >&2
    echo "  macOS: brew install node    Debian/Ubuntu: apt-get install nodejs npm    or https://nodejs.org" >&2
    exit 1
  fi
done

clients=("$@")
[ ${#clients[@]} -eq 0 ] && clients=(codex claude)

mkdir -p "$PREFIX"
for client in "${clients[@]}"; do
  case "$client" in
    codex) pkg="@openai/codex"; version="$CODEX_VERSION"; bin=codex ;;
    claude) pkg="@anthropic-ai/claude-code"; version="$CLAUDE_VERSION"; bin=claude ;;
    opencode) pkg="opencode-ai"; version="$OPENCODE_VERSION"; bin=opencode ;;
    *) echo "error: unknown client '$client' (known: codex claude opencode)" >&2; exit 2 ;;
  esac
  installed="$(node -e 'try{console.log(require(process.argv[1]).version)}catch(e){}' \
    "$PREFIX/lib/node_modules/$pkg/package.json" 2>/dev/null || true)"
  if [ "$installed" = "$version" ] && [ -x "$PREFIX/bin/$bin" ]; then
    echo "$pkg@$version already installed" >&2
  else
    echo "installing $pkg@$version into $PREFIX ..." >&2
    npm install --global --prefix "$PREFIX" --no-fund --no-audit --loglevel=error "$pkg@$version" >&2
  fi
  if [ ! -x "$PREFIX/bin/$bin" ]; then
    echo "error: $pkg@$version installed but $PREFIX/bin/$bin is missing" >&2
    exit 1
  fi
  echo "$bin $version $PREFIX/bin/$bin"
done

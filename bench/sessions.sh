#!/usr/bin/env bash
# Warm sessions: SESSIONS sessions, each a shared prefix plus its own text,
# idle between turns, then each one more turn in random order
# (bench/sessions.py says exactly what is measured). Three servers, one
# after another, on the same model and workload:
#   hot       a RAM budget of half this machine's memory, to hold every
#             session (turns whose state it could not hold show as
#             `recomputed` in the report)
#   disk      a RAM budget of RAM_MIB; what it cannot hold goes to the disk
#             tier (--kv-disk-mib), and comes back on the session's turn
#   host      the same, with a host tier of HOST_MIB (--kv-host-mib) in
#             front of the disk: evicted state kept in memory in its
#             compact file form (without the shared prefix)
#   dropped   the same RAM budget without a disk tier: what it cannot hold
#             is dropped, and a returning session reads its history again
#
# usage: bench/sessions.sh
# env:   MODEL=smollm2-135m  SESSIONS=32  SHARED_TOKENS=3000  OWN_TOKENS=1000
#        RAM_MIB=1024        RAM budget of the disk and dropped servers
#        DISK_MIB=65536      the disk tier's budget
#        HOST_MIB=4096       the host tier's budget (setting `host`)
#        KV_DIR=DIR          where its files go (default: kv under the cache
#                            directory); dropped from the page cache before
#                            the sessions come back, so disk turns read the disk
#        SETTINGS="hot host disk dropped"
#        KV_BITS=32          the KV layout of every server (8 or 4: codes past
#                            --kv-quantized-start, KV_START=256)
#        OUT=DIR             results.jsonl and server logs (default: a temp dir)
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "[sessions] $*" >&2; }
source bench/lib.sh
MODEL=${MODEL:-smollm2-135m}
SESSIONS=${SESSIONS:-32}
SHARED_TOKENS=${SHARED_TOKENS:-3000}
OWN_TOKENS=${OWN_TOKENS:-1000}
RAM_MIB=${RAM_MIB:-1024}
DISK_MIB=${DISK_MIB:-65536}
HOST_MIB=${HOST_MIB:-4096}
SETTINGS=${SETTINGS:-hot host disk dropped}
KV_BITS=${KV_BITS:-32}
KV_START=${KV_START:-256}
OUT=${OUT:-$(mktemp -d /tmp/tether-sessions.XXXXXX)}
KV_DIR=${KV_DIR:-${TETHER_CACHE:-$HOME/.cache/tether}/kv}
PEER="${TETHER_CACHE:-$HOME/.cache/tether}/peer"
bench/peer/setup.sh >/dev/null
PY="$PEER/venv/bin/python"
TETHER_BIN="${TETHER_BIN:-}"
if [ -z "$TETHER_BIN" ]; then
  cargo build --release --locked -p tether
  TETHER_BIN=target/release/tether
fi
mkdir -p "$OUT"
# Sessions wait for their next turn for the whole run.
common=(--model "$MODEL" --device cpu --session-ttl-secs 7200 --max-sessions $((SESSIONS + 16))
  --kv-bits "$KV_BITS" --kv-quantized-start "$KV_START")
mem_mib=$(( $(sed -n 's/MemTotal: *\([0-9]*\) kB/\1/p' /proc/meminfo) / 1024 ))
for setting in $SETTINGS; do
  case $setting in
    hot) flags=(--prefix-cache-mib $((mem_mib / 2))) ;;
    disk) flags=(--prefix-cache-mib "$RAM_MIB" --kv-disk-mib "$DISK_MIB" --kv-dir "$KV_DIR") ;;
    host) flags=(--prefix-cache-mib "$RAM_MIB" --kv-host-mib "$HOST_MIB" --kv-disk-mib "$DISK_MIB" --kv-dir "$KV_DIR") ;;
    dropped) flags=(--prefix-cache-mib "$RAM_MIB") ;;
    *) log "unknown setting $setting"; exit 2 ;;
  esac
  start_tether "$TETHER_BIN" "$OUT/tether-$setting.log" "${common[@]}" "${flags[@]}"
  # The machine's memory, swap and block I/O every 5 s, beside the turns'
  # times (a tier's reads compete with writeback and page reclaim).
  vmstat -t 5 > "$OUT/vmstat-$setting.log" &
  vmstat_pid=$!
  "$PY" bench/sessions.py --url "http://127.0.0.1:$port" --server-pid "$SERVER_PID" --label "$MODEL kv$KV_BITS" --setting "$setting" \
    --sessions "$SESSIONS" --shared-tokens "$SHARED_TOKENS" --own-tokens "$OWN_TOKENS" --cold-files "$KV_DIR" --out "$OUT/results.jsonl"
  stop_server
  kill "$vmstat_pid" 2>/dev/null || true
done
"$PY" bench/sessions.py --report "$OUT/results.jsonl"
log "results: $OUT/results.jsonl"

# Shared by the benchmark scripts (sourced): one server at a time, on
# 127.0.0.1, stopped by stop_server (the callers trap it on EXIT). The caller
# defines log().

SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
  fi
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# wait_http URL LOGFILE SECONDS: until URL answers 200 (the server still alive)
wait_http() {
  local url="$1" logf="$2" deadline=$((SECONDS + $3))
  while [ $SECONDS -lt $deadline ]; do
    kill -0 "$SERVER_PID" 2>/dev/null || { log "server exited; its log:"; tail -20 "$logf" >&2; return 1; }
    curl -sf -m 2 -o /dev/null "$url" && return 0
    sleep 0.5
  done
  log "no answer from $url after $3 s; log:"; tail -20 "$logf" >&2
  return 1
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_tether BIN LOGFILE SERVE-ARGS...: `BIN serve` on a free port; sets
# SERVER_PID and port once /healthz answers.
start_tether() {
  local bin="$1" tlog="$2"
  shift 2
  "$bin" serve --host 127.0.0.1 --port 0 "$@" >"$tlog" 2>&1 &
  SERVER_PID=$!
  port=""
  for _ in $(seq 240); do
    port=$(sed -n 's#.*listening on http://127\.0\.0\.1:\([0-9]*\).*#\1#p' "$tlog" | head -1)
    [ -n "$port" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.5
  done
  [ -n "$port" ] || { log "tether serve did not start; log:"; tail -20 "$tlog" >&2; return 1; }
  wait_http "http://127.0.0.1:$port/healthz" "$tlog" 60
}

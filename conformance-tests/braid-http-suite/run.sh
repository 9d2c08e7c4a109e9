#!/usr/bin/env bash
# Runs braid-http's own test suite (d052db1 = 1.4.7) with its five test
# servers behind a reverse proxy, and counts what passes.
#
#   run.sh MODE [extra proxy args...]      MODE: direct | braid-proxy | nginx
#
# By hand, not part of `cargo test`: the suite is not on the npm registry,
# so it needs a checkout of github.com/braid-org/braid-http (any clone that
# holds commit d052db1; run.sh checks it out in its own copy).
#
# env:
#   BRAID_HTTP_REPO  where to clone braid-http from (a URL or a local clone;
#                    needed the first time)
#   WORK_DIR         the suite's clone, npm packages and results
#                    (default target/braid-http-suite)
#   BRAID_PROXY_BIN  braid-proxy binary (default target/release/braid-proxy)
#   IN_PARALLEL      tests at once (default 4; the suite's own default is 16)
#   PORT             client-facing base port, PORT..PORT+4 (default 9300);
#                    the servers listen on PORT+10..PORT+14 behind a proxy
#   FILTER           only tests whose name contains this (the suite's --filter)
#   HARD_TIMEOUT     seconds for the whole suite run (default 600)
#   UPSTREAM_KIND    braid-proxy's --upstream-kind (default: none, the proxy's own default)
#
# Writes results/MODE-<timestamp>.txt (summary + failing tests) and
# results/MODE-<timestamp>.log (the suite's raw output), plus
# results/MODE-<timestamp>.proxy/ (proxy logs) in the proxy modes.
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SUITE=${WORK_DIR:-$ROOT/target/braid-http-suite}
mkdir -p "$SUITE"
SUITE=$(cd "$SUITE" && pwd)
BH=$SUITE/braid-http
BH_COMMIT=d052db1
RESULTS=$SUITE/results
MODE=${1:-}
shift || true
EXTRA_ARGS=("$@")

BRAID_PROXY_BIN=${BRAID_PROXY_BIN:-$ROOT/target/release/braid-proxy}
IN_PARALLEL=${IN_PARALLEL:-4}
PORT=${PORT:-9300}
SERVER_PORT=$PORT
FILTER=${FILTER:-}
HARD_TIMEOUT=${HARD_TIMEOUT:-600}
UPSTREAM_KIND=${UPSTREAM_KIND-}

die() { echo "run.sh: $*" >&2; exit 2; }

case "$MODE" in
    direct|braid-proxy|nginx) ;;
    *) die "usage: run.sh direct|braid-proxy|nginx [extra proxy args...]" ;;
esac
if [[ $MODE == direct && ${#EXTRA_ARGS[@]} -gt 0 ]]; then
    die "direct mode takes no proxy args"
fi
[[ $MODE != direct ]] && SERVER_PORT=$((PORT + 10))

# ---------------------------------------------------------------- setup

# The braid-http checkout and its npm dependencies
if [[ ! -d $BH/.git ]]; then
    [[ -n ${BRAID_HTTP_REPO:-} ]] || die "set BRAID_HTTP_REPO to a clone or URL of braid-org/braid-http"
    git clone -q "$BRAID_HTTP_REPO" "$BH" || die "clone failed"
fi
if [[ $(git -C "$BH" rev-parse --short=7 HEAD) != "$BH_COMMIT" ]]; then
    git -C "$BH" checkout -q "$BH_COMMIT" || die "checkout $BH_COMMIT failed"
fi
if [[ ! -d $BH/node_modules/express ]]; then
    (cd "$BH" && timeout 300 npm install --no-audit --no-fund >/dev/null) || die "npm install failed"
fi

# The patched copies: test/harness-test.js, test/harness-tests.js
node "$HERE/patch-suite.cjs" "$BH" >/dev/null || die "patching the suite failed"

if [[ $MODE == braid-proxy ]]; then
    [[ -x $BRAID_PROXY_BIN ]] || die "no braid-proxy at $BRAID_PROXY_BIN (set BRAID_PROXY_BIN, or cargo build --release)"
fi
if [[ $MODE == nginx ]]; then
    command -v nginx >/dev/null || die "nginx not installed (apt-get install -y nginx)"
fi

port_busy() { (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null; }
for p in $(seq "$PORT" $((PORT + 4))) $(seq "$SERVER_PORT" $((SERVER_PORT + 4))); do
    port_busy "$p" && die "port $p is already in use (set PORT=...)"
done

mkdir -p "$RESULTS"
TS=$(date -u +%Y%m%dT%H%M%SZ)
BASE=$RESULTS/$MODE-$TS
LOG=$BASE.log
OUT=$BASE.txt

# ---------------------------------------------------------------- proxies

PIDS=()        # processes this script started, ended on exit
NGINX_DIR=$SUITE/nginx

cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    for _ in $(seq 50); do
        local alive=0
        for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || break
        sleep 0.1
    done
    for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
    # nginx's worker exits with its master; make sure
    if [[ -f $NGINX_DIR/nginx.pid ]]; then
        pid=$(cat "$NGINX_DIR/nginx.pid" 2>/dev/null)
        [[ -n $pid ]] && kill -KILL "$pid" 2>/dev/null
        rm -f "$NGINX_DIR/nginx.pid"
    fi
    wait 2>/dev/null
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_listening() {   # port, seconds
    local i
    for i in $(seq $(( $2 * 10 ))); do
        port_busy "$1" && return 0
        sleep 0.1
    done
    return 1
}

PROXY_DESC="none"
if [[ $MODE == braid-proxy ]]; then
    mkdir -p "$BASE.proxy"
    kind_args=()
    [[ -n $UPSTREAM_KIND ]] && kind_args=(--upstream-kind "$UPSTREAM_KIND")
    PROXY_DESC="$BRAID_PROXY_BIN ${kind_args[*]} ${EXTRA_ARGS[*]}"
    for k in 0 1 2 3 4; do
        "$BRAID_PROXY_BIN" --listen "127.0.0.1:$((PORT + k))" \
            --upstream "http://127.0.0.1:$((SERVER_PORT + k))" \
            "${kind_args[@]}" "${EXTRA_ARGS[@]}" \
            >"$BASE.proxy/proxy-$k.log" 2>&1 &
        PIDS+=($!)
    done
    for k in 0 1 2 3 4; do
        wait_listening $((PORT + k)) 10 || { tail -5 "$BASE.proxy/proxy-$k.log" >&2; die "braid-proxy $k did not start"; }
    done
elif [[ $MODE == nginx ]]; then
    mkdir -p "$NGINX_DIR"/{logs,tmp} "$BASE.proxy"
    : >"$NGINX_DIR/logs/access.log"; : >"$NGINX_DIR/logs/error.log"
    "$HERE/nginx-conf.sh" "$NGINX_DIR" "$PORT" "$SERVER_PORT" >"$NGINX_DIR/nginx.conf"
    for a in "${EXTRA_ARGS[@]}"; do   # extra args: more nginx directives, one per arg
        sed -i "s|^    client_max_body_size 0;|&\n    $a|" "$NGINX_DIR/nginx.conf"
    done
    nginx -t -q -p "$NGINX_DIR" -c "$NGINX_DIR/nginx.conf" || die "bad nginx config"
    nginx -p "$NGINX_DIR" -c "$NGINX_DIR/nginx.conf" >"$BASE.proxy/nginx.stdout" 2>&1 &
    PIDS+=($!)
    PROXY_DESC="nginx $(nginx -v 2>&1 | sed 's/.*\///') ${EXTRA_ARGS[*]}"
    for k in 0 1 2 3 4; do
        wait_listening $((PORT + k)) 10 || die "nginx did not start"
    done
fi

# ---------------------------------------------------------------- the suite

suite_args=(--port="$PORT" --in-parallel="$IN_PARALLEL")
[[ -n $FILTER ]] && suite_args+=(--filter="$FILTER")

echo "run.sh: $MODE, clients -> 127.0.0.1:$PORT..$((PORT + 4)), servers on $SERVER_PORT..$((SERVER_PORT + 4)), --in-parallel=$IN_PARALLEL, proxy: $PROXY_DESC" >&2
start=$(date +%s)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
(cd "$BH" && HARNESS_SERVER_PORT=$SERVER_PORT NO_COLOR=1 \
    exec timeout -k 10 "$HARD_TIMEOUT" node test/harness-test.js "${suite_args[@]}") >"$LOG" 2>&1 </dev/null &
SUITE_PID=$!
PIDS+=($SUITE_PID)
wait $SUITE_PID
rc=$?
elapsed=$(( $(date +%s) - start ))
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

if [[ $MODE == nginx ]]; then
    cp "$NGINX_DIR/nginx.conf" "$NGINX_DIR/logs/error.log" "$NGINX_DIR/logs/access.log" "$BASE.proxy/" 2>/dev/null
fi
cleanup
PIDS=()

# ---------------------------------------------------------------- results

summary_line=$(grep -a '^Total: ' "$LOG" | tail -1)
complete=yes
if [[ -n $summary_line ]]; then
    total=$(sed -E 's/^Total: ([0-9]+).*/\1/' <<<"$summary_line")
    passed=$(sed -E 's/.*✓ : ([0-9]+).*/\1/' <<<"$summary_line")
    failed=$(sed -E 's/.*✗ : ([0-9]+).*/\1/' <<<"$summary_line")
    skipped=$(sed -E 's/.*Skipped: ([0-9]+).*/\1/' <<<"$summary_line")
    failing=$(awk '/^Failed tests:$/ {on=1; next} on && /^  ✗ / {sub(/^  ✗ /, ""); print; next} on && !/^  ✗ / {on=0}' "$LOG")
else
    # the suite did not finish (crash or hard timeout): count the verdicts printed so far
    complete="no (exit $rc after ${elapsed}s; counts are the verdicts printed before it stopped)"
    passed=$(grep -ac '^✓ ' "$LOG")
    failed=$(grep -ac '^✗ ' "$LOG")
    total=$((passed + failed)); skipped=0
    failing=$(grep -a '^✗ ' "$LOG" | sed -E 's/^✗ //; s/ \[[^]]*\]$//')
fi

{
    echo "mode:        $MODE"
    echo "timestamp:   $TS"
    echo "suite:       braid-http $(git -C "$BH" rev-parse --short=7 HEAD) test/harness-test.js ${suite_args[*]}"
    echo "proxy:       $PROXY_DESC"
    [[ $MODE == braid-proxy ]] && echo "proxy build: $("$BRAID_PROXY_BIN" --version 2>/dev/null || echo '?') $(sha256sum "$BRAID_PROXY_BIN" | cut -c1-12)"
    echo "complete:    $complete"
    echo "elapsed:     ${elapsed}s"
    echo "loadavg:     $load_before (start), $load_after (end); $(nproc) cores"
    echo "raw log:     $LOG"
    echo
    echo "total:   $total$([[ $complete != yes ]] && echo ' (reported before the stop; the suite has more)')"
    echo "passed:  $passed"
    echo "failed:  $failed"
    echo "skipped: $skipped"
    echo
    echo "failing tests:"
    [[ -n $failing ]] && sed 's/^/  /' <<<"$failing"
    echo
    echo "$MODE: $passed passed, $failed failed"
} >"$OUT"

echo "results: $OUT" >&2
note=""
[[ $complete != yes ]] && note=", INCOMPLETE: the suite stopped early, see $OUT"
echo "$MODE: $passed passed, $failed failed (total $total, --in-parallel=$IN_PARALLEL$note)"

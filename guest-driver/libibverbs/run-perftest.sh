#!/usr/bin/env bash
# Runs Debian's perftest programs, unmodified, between two process-mode
# tenants of one host through the drop-in libibverbs.so.1: for every
# program and size, a fresh hostd and vdevs alpha and beta, the server on
# alpha, the client on beta (QP exchange over TCP on localhost).
#
#   cargo build --release --workspace
#   guest-driver/libibverbs/run-perftest.sh [-n ITERS] [-s "64 65536"] [PROGRAM...]
#
# Needs: apt-get install perftest. Prints each client's result row.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${VRDMA_BIN_DIR:-$root/target/release}"
iters=5000
sizes="64 65536"
while getopts "n:s:" opt; do
    case "$opt" in
        n) iters="$OPTARG" ;;
        s) sizes="$OPTARG" ;;
        *) exit 2 ;;
    esac
done
shift $((OPTIND - 1))
programs=("$@")
[ ${#programs[@]} -gt 0 ] || programs=(ib_write_bw ib_read_bw ib_send_bw ib_write_lat ib_read_lat ib_send_lat)

for f in hostd vdev libibverbs.so; do
    [ -e "$bin/$f" ] || { echo "$bin/$f is missing: cargo build --release --workspace" >&2; exit 1; }
done
work="$(mktemp -d /tmp/vrdma-perftest.XXXXXX)"
pids=()
stop() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
}
trap 'stop; rm -rf "$work"' EXIT
ln -s "$bin/libibverbs.so" "$work/libibverbs.so.1"

wait_for() { for _ in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.05; done; echo "no $1" >&2; return 1; }

start_fabric() {
    rm -f "$work"/*.sock
    "$bin/hostd" --socket "$work/hostd.sock" >"$work/hostd.log" 2>&1 & pids+=($!)
    wait_for "$work/hostd.sock"
    for t in alpha beta; do
        "$bin/vdev" --socket "$work/$t.sock" --tenant "$t" --hostd "$work/hostd.sock" --once \
            >"$work/$t.log" 2>&1 & pids+=($!)
    done
    wait_for "$work/alpha.sock"
    wait_for "$work/beta.sock"
}

port=$((18000 + RANDOM % 10000))
for prog in "${programs[@]}"; do
    for size in $sizes; do
        start_fabric
        port=$((port + 1))
        LD_LIBRARY_PATH="$work" VRDMA_DEVICES="$work/alpha.sock" \
            "$prog" -p "$port" -s "$size" -n "$iters" -F -x 0 >"$work/server.out" 2>&1 &
        server=$!
        sleep 0.5
        status=0
        LD_LIBRARY_PATH="$work" VRDMA_DEVICES="$work/beta.sock" \
            "$prog" -p "$port" -s "$size" -n "$iters" -F -x 0 localhost >"$work/client.out" 2>&1 || status=$?
        wait "$server" || status=$?
        if [ "$status" -ne 0 ]; then
            echo "$prog -s $size FAILED ($status):" >&2
            cat "$work/server.out" "$work/client.out" >&2
        fi
        header="$(grep -m1 '#bytes' "$work/client.out" | sed 's/^ *//')"
        row="$(awk -v s="$size" '$1 == s' "$work/client.out" | tail -1 | sed 's/^ *//')"
        printf '%-12s %s\n%-12s %s\n' "$prog" "$header" "" "$row"
        stop
    done
done

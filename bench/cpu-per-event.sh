#!/usr/bin/env bash
# The daemon's own CPU time per event, two (or more) obsd binaries alternating in one run —
# for judging a change on a machine whose speed drifts: throughput ratios between runs move
# by 2x here, CPU per event much less.
#
#   bench/cpu-per-event.sh ROUNDS OLD_OBSD NEW_OBSD [...] -- BUSBENCH_ARGS
#   bench/cpu-per-event.sh 5 /tmp/obsd-before .build/release/obsd -- --scenario fanout --subs 1 --window 64
#   bench/cpu-per-event.sh 3 redis .build/release/obsd -- --scenario writes --window 64   (`redis`: the peer)
#
# Each round starts each binary in turn (`--in-memory`, pinned to CPU $SERVER_CPU, default 0)
# on a fresh socket and drives it with busbench (pinned to CPU $DRIVER_CPU, default 1) for
# $DUR seconds (default 3); µs per event = busbench's srv_cpu / its event (or write) rate.
# Prints every round, then the median per binary. BUSBENCH: the driver (default
# ../shared/busbench/busbench, built with make there); OBSD_ARGS adds daemon flags; STORE
# replaces `--in-memory` (`@DIR@` in it: a fresh data directory per run), e.g.
# STORE="--data-dir @DIR@ --sync relaxed" for durable writes.
set -eu
[ $# -ge 4 ] || { sed -n '2,14p' "$0"; exit 2; }
rounds=$1; shift
bins=(); while [ "$1" != "--" ]; do bins+=("$1"); shift; done; shift
here=$(cd "$(dirname "$0")/.." && pwd)
BUSBENCH=${BUSBENCH:-$here/../shared/busbench/busbench}
[ -x "$BUSBENCH" ] || { echo "no busbench at $BUSBENCH (set BUSBENCH)" >&2; exit 1; }
tmp=$(mktemp -d); pid=
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$tmp"' EXIT
declare -A results
for round in $(seq "$rounds"); do
  for bin in "${bins[@]}"; do
    # shellcheck disable=SC2086
    rm -rf "$tmp/data"
    store=${STORE:---in-memory}
    proto=obsd
    if [ "$bin" = redis ]; then
      # The peer, as compare.sh runs it: Redis 7 without persistence.
      proto=redis
      mkdir -p "$tmp/data"
      taskset -c "${SERVER_CPU:-0}" redis-server --port 0 --unixsocket "$tmp/s.sock" --dir "$tmp/data" --save '' --appendonly no \
        --maxclients 20000 --daemonize no >"$tmp/log" 2>&1 & pid=$!
    else
      taskset -c "${SERVER_CPU:-0}" "$bin" --socket "$tmp/s.sock" ${store//@DIR@/$tmp/data} ${OBSD_ARGS:-} >"$tmp/log" 2>&1 & pid=$!
    fi
    for _ in $(seq 200); do [ -S "$tmp/s.sock" ] && break; sleep 0.05; done
    out=$(taskset -c "${DRIVER_CPU:-1}" "$BUSBENCH" --proto "$proto" --socket "$tmp/s.sock" --server-pid "$pid" "$@" \
      --duration "${DUR:-3}" --timeout 60)
    kill "$pid"; wait "$pid" 2>/dev/null || true; pid=; rm -f "$tmp/s.sock"
    grep -q 'status=ok' <<<"$out" || { echo "busbench failed against $bin: $out" >&2; exit 1; }
    rate=$(grep -o '\(deliv\|ops\)_per_s=[0-9.]*' <<<"$out" | head -1 | cut -d= -f2)
    cpu=$(grep -o 'srv_cpu=[0-9.]*' <<<"$out" | cut -d= -f2)
    us=$(python3 -c "print(f'{$cpu * 1e6 / $rate:.3f}')")
    results[$bin]="${results[$bin]:-} $us"
    echo "round $round $bin rate=$rate srv_cpu=$cpu us_per_event=$us"
  done
done
for bin in "${bins[@]}"; do
  # shellcheck disable=SC2086
  echo "$bin median us_per_event $(printf '%s\n' ${results[$bin]} | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')"
done

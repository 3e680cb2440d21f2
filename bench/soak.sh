#!/usr/bin/env bash
# Soak obsd: bench/soak.sh [seconds] (default 300), or `make soak SOAK_SECONDS=N`.
# Starts a release obsd on a temporary socket and data directory, runs `obsbench soak`
# against it (connection churn, writers, gap-checked fast subscribers, slow readers that
# must be cut off), then stops the daemon with SIGTERM and requires a clean exit 0.
# Fails when the daemon's RSS grows past the bound after warm-up, when its descriptors do
# not return to the idle count, when an event is lost, or when the daemon dies.
# Extra arguments after the seconds go to `obsbench soak` (see `obsbench soak --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-300}"
shift || true
bin=.build/release
dir="$(mktemp -d /tmp/obsd-soak.XXXXXX)"
daemon=""
cleanup() {
  if [ -n "$daemon" ] && kill -0 "$daemon" 2>/dev/null; then kill -KILL "$daemon" 2>/dev/null || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT
ulimit -n "$(ulimit -Hn)"
# Queues small enough that the slow readers are cut off within seconds; the per-uid cap
# raised because every soak connection is this user's.
"$bin/obsd" --socket "$dir/obsd.sock" --data-dir "$dir/data" --log-level warning \
  --queue-bytes 262144 --overflow-grace 2 --max-connections-per-uid 4096 2>"$dir/obsd.log" &
daemon=$!
for _ in $(seq 100); do [ -S "$dir/obsd.sock" ] && break; sleep 0.1; done
[ -S "$dir/obsd.sock" ] || { cat "$dir/obsd.log"; echo "soak: obsd did not start"; exit 1; }
status=0
"$bin/obsbench" soak --socket "$dir/obsd.sock" --pid "$daemon" --seconds "$seconds" \
  --warmup "$(( seconds / 5 < 60 ? seconds / 5 : 60 ))" "$@" || status=$?
kill -TERM "$daemon"
code=0
wait "$daemon" || code=$?
daemon=""
if [ "$code" -ne 0 ]; then
  echo "soak: obsd exited $code after SIGTERM"; tail -20 "$dir/obsd.log"; exit 1
fi
echo "soak: obsd exited 0 after SIGTERM"
exit "$status"

#!/usr/bin/env bash
# Memory per key and start-up time, obsd beside Redis (issue 13's benchmark; not a test).
#
#   bench/memory.sh [KEYS] [obsd flags…]        after `swift build -c release`
#
# Fills KEYS keys (default 1,000,000; values like {"n":1,"name":"item 1"}, keys key/<i>)
# into a fresh durable obsd (`obsbench fill`, batches of 1,000) and into a fresh Redis
# (the same SETs through `redis-cli --pipe`, no persistence), each pinned to CPU 0; prints
# each server's RSS growth per key once filled. obsd is then killed with SIGKILL and
# restarted (it replays the log written since its last snapshot), then stopped cleanly
# (it writes a snapshot of everything) and restarted again: for each start, how long it
# took to serve and its RSS per key. Extra arguments go to obsd (e.g. `--history-limit 0`);
# OBSD_BIN runs another obsd binary (an older build, to compare).
set -euo pipefail
cd "$(dirname "$0")/.."
keys=${1:-1000000}; shift || true
bin=.build/release
obsd=${OBSD_BIN:-$bin/obsd}
[ -x $bin/obsd ] && [ -x $bin/obsbench ] || { echo "run swift build -c release first" >&2; exit 1; }
command -v redis-server >/dev/null || apt-get install -y -qq redis-server >/dev/null
tmp=$(mktemp -d /tmp/obsd-memory-XXXXXX); pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT

rss() { awk '/VmRSS/ {print $2}' /proc/$1/status; }            # KiB
wait_socket() { for _ in $(seq 3000); do [ -S "$1" ] && return 0; sleep 0.01; done; return 1; }
per_key() { echo $(( ($2 - $1) * 1024 / keys )); }

# obsd
taskset -c 0 $obsd --socket $tmp/obsd.sock --data-dir $tmp/data "$@" > $tmp/obsd.log 2>&1 & pid=$!
wait_socket $tmp/obsd.sock; sleep 0.2; base=$(rss $pid)
taskset -c 1 $bin/obsbench fill --socket $tmp/obsd.sock --keys "$keys" > $tmp/fill.txt
sleep 2; filled=$(rss $pid)
# restart LABEL: starts obsd on the data, times it until it serves, reads its RSS.
restart() {
  local start ready
  start=$(date +%s.%N)
  taskset -c 0 $obsd --socket $tmp/obsd.sock --data-dir $tmp/data "$@" > $tmp/obsd-$label.log 2>&1 & pid=$!
  until $bin/obsctl --socket $tmp/obsd.sock repos > /dev/null 2>&1; do sleep 0.005; done
  ready=$(date +%s.%N)
  sleep 1; restarted=$(rss $pid)
  seconds=$(echo "$ready - $start" | bc | sed 's/^\./0./')
}
kill -9 $pid; wait $pid 2>/dev/null || true; pid=
label=killed restart "$@"; killed_seconds=$seconds; killed_rss=$restarted
kill $pid; wait $pid || true; pid=
label=clean restart "$@"; clean_seconds=$seconds; clean_rss=$restarted
kill $pid; wait $pid || true; pid=
echo "obsd $(cat $tmp/fill.txt) flags=[$*]"
echo "obsd  rss/key filled: $(per_key $base $filled) B   after restart: $(per_key $base $clean_rss) B   (base ${base} KiB, filled ${filled} KiB, restarted ${clean_rss} KiB)"
echo "obsd  restart to serving after a clean stop: $clean_seconds s ($(grep -o 'loadSeconds=[0-9.]*' $tmp/obsd-clean.log)); data directory $(du -sh $tmp/data | cut -f1)"
echo "obsd  restart to serving after kill -9: $killed_seconds s ($(grep -o 'loadSeconds=[0-9.]*' $tmp/obsd-killed.log); $(grep -o 'replayed [0-9]* revisions' $tmp/obsd-killed.log || echo 'nothing replayed')); rss/key $(per_key $base $killed_rss) B"

# Redis
taskset -c 0 redis-server --unixsocket $tmp/redis.sock --port 0 --save '' --appendonly no > $tmp/redis.log 2>&1 & pid=$!
wait_socket $tmp/redis.sock; sleep 0.2; base=$(rss $pid)
python3 - "$keys" <<'EOF' | redis-cli -s $tmp/redis.sock --pipe > /dev/null
import sys
out = sys.stdout.buffer
for i in range(int(sys.argv[1])):
    k, v = b"key/%d" % i, b'{"n":%d,"name":"item %d"}' % (i, i)
    out.write(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(k), k, len(v), v))
EOF
sleep 2; filled=$(rss $pid)
echo "redis rss/key filled: $(per_key $base $filled) B   (base ${base} KiB, filled ${filled} KiB; $(redis-cli -s $tmp/redis.sock info memory | grep -o 'used_memory_human:[^[:space:]]*'))"

#!/usr/bin/env bash
# Two obsd daemons (A and B) sharing a fresh 3-member etcd cluster on loopback (README,
# "Several hosts"): write→event latency A→B, acknowledged writes/s with 1 and 16 writers
# across A and B, and etcd's own figures for the same work on the same cluster. Not a test.
#
#   bench/cluster-bench.sh [COUNT] [SECONDS]
#
# Needs etcd and etcdctl (make etcd, or Debian's etcd-server and etcd-client). Every process is stopped by PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
COUNT=${1:-1000}
SECONDS_OF_WRITES=${2:-10}

dir=$(mktemp -d /tmp/obsd-cluster-bench-XXXXXX)
source bench/etcd-cluster.sh   # start_etcd_cluster; every process in `pids` killed, $dir removed on exit

swift build -c release --product obsd >/dev/null
swift build -c release --product obsbench >/dev/null
swift build -c release --product obs-etcd-bench >/dev/null

start_etcd_cluster "$dir"
echo "== etcd $(etcd --version | head -1 | awk '{print $3}'), 3 members; leader $leader"

# A and B both list every member, in the same order (each talks to the first that answers).
for name in A B; do
  .build/release/obsd --socket "$dir/$name.sock" --etcd-endpoints "$urls" --log-level warning 2> "$dir/$name.log" &
  pids+=($!)
done
for name in A B; do
  for _ in $(seq 1 300); do [ -S "$dir/$name.sock" ] && break; sleep 0.1; done
  [ -S "$dir/$name.sock" ] || { echo "obsd $name did not start"; cat "$dir/$name.log"; exit 1; }
done

echo "== obsd A -> B"
.build/release/obsbench cluster --sockets "$dir/A.sock,$dir/B.sock" --mode latency --count "$COUNT"
for w in 1 16; do
  .build/release/obsbench cluster --sockets "$dir/A.sock,$dir/B.sock" --mode writes --writers "$w" --seconds "$SECONDS_OF_WRITES"
done

echo "== etcd alone (same cluster): ObsEtcd on the JSON gateway, sequential"
.build/release/obs-etcd-bench --endpoints "http://$leader,http://$follower" -n "$COUNT"

echo "== etcd alone: compare-and-set txns on the gateway from 1 and 16 threads (Python http.client, a connection each)"
python3 - "$leader" "$SECONDS_OF_WRITES" <<'PY'
import base64, http.client, json, sys, threading, time
host, port = sys.argv[1].split(":"); seconds = float(sys.argv[2])
b = lambda s: base64.b64encode(s.encode()).decode()
def run(writers):
    counts = [0] * writers
    until = time.monotonic() + seconds
    def writer(w):
        c = http.client.HTTPConnection(host, int(port))
        def call(path, body):
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            return json.loads(c.getresponse().read())
        key = b("/bench/py/%d/%d" % (writers, w))
        rev = int(call("/v3/kv/put", {"key": key, "value": b("0")})["header"]["revision"])
        while time.monotonic() < until:
            r = call("/v3/kv/txn", {"compare": [{"key": key, "target": "MOD", "result": "EQUAL", "mod_revision": rev}],
                                    "success": [{"request_put": {"key": key, "value": b(str(counts[w]))}}]})
            assert r.get("succeeded"), r
            rev = int(r["header"]["revision"]); counts[w] += 1
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    start = time.monotonic()
    for t in threads: t.start()
    for t in threads: t.join()
    print("etcd gateway txn(compare + put), %d writer(s), own keys: %d in %.1f s = %.0f/s" % (writers, sum(counts), time.monotonic() - start, sum(counts) / (time.monotonic() - start)))
for w in (1, 16): run(w)
PY

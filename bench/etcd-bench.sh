#!/usr/bin/env bash
# Latency of ObsEtcd (etcd's JSON gateway) beside etcd's own gRPC client, on a fresh 3-member
# etcd cluster on loopback. Figures for docs/etcd-notes.md; not a test.
#
#   bench/etcd-bench.sh [COUNT] [--check-perf]
#
# Needs etcd and etcdctl (make etcd, or Debian's etcd-server and etcd-client). The gRPC baseline (bench/etcd/grpc-baseline.go,
# etcd's clientv3) runs when `go` and Debian's golang-etcd-server-dev are installed:
#   apt-get install golang-go golang-etcd-server-dev
# --check-perf also runs `etcdctl check perf --load=s` (60 s of etcd's own write benchmark).
set -euo pipefail
cd "$(dirname "$0")/.."
COUNT=${1:-1000}
CHECK_PERF=false
[ "${2:-}" = "--check-perf" ] && CHECK_PERF=true

dir=$(mktemp -d /tmp/obsd-etcd-bench-XXXXXX)
source bench/etcd-cluster.sh   # start_etcd_cluster; every process in `pids` killed, $dir removed on exit

start_etcd_cluster "$dir"
echo "== etcd $(etcd --version | head -1 | awk '{print $3}'): 3 members healthy after ${healthy_after} s"
echo "== leader $leader; writes go to the leader, the watcher reads from $follower"

swift build -c release --product obs-etcd-bench >/dev/null
.build/release/obs-etcd-bench --endpoints "http://$leader,http://$follower" -n "$COUNT"

if command -v go >/dev/null && [ -d /usr/share/gocode/src/go.etcd.io/etcd/clientv3 ]; then
  mkdir -p "$dir/go/src/grpcbaseline"
  cp bench/etcd/grpc-baseline.go "$dir/go/src/grpcbaseline/main.go"
  (cd "$dir/go/src/grpcbaseline" && GO111MODULE=off GOPATH="$dir/go:/usr/share/gocode" GOCACHE="$dir/gocache" go build -o "$dir/grpc-baseline" .)
  "$dir/grpc-baseline" -endpoints "$leader,$follower" -n "$COUNT"
else
  echo "(gRPC baseline skipped: needs golang-go and golang-etcd-server-dev)"
fi

# The same compare-and-set loop through the gateway from Python's http.client (one keep-alive
# connection): tells the gateway's own cost from ObsEtcd's.
python3 - "$leader" "$COUNT" <<'PY'
import base64, http.client, json, sys, time
host, port = sys.argv[1].split(":"); n = int(sys.argv[2])
c = http.client.HTTPConnection(host, int(port))
b = lambda s: base64.b64encode(s.encode()).decode()
def call(path, body):
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return json.loads(c.getresponse().read())
rev = int(call("/v3/kv/put", {"key": b("/bench/py/txn"), "value": b("0")})["header"]["revision"])
lat = []
for i in range(n):
    t = time.perf_counter()
    r = call("/v3/kv/txn", {"compare": [{"key": b("/bench/py/txn"), "target": "MOD", "result": "EQUAL", "mod_revision": rev}],
                            "success": [{"request_put": {"key": b("/bench/py/txn"), "value": b(str(i))}}]})
    assert r.get("succeeded"), r
    rev = int(r["header"]["revision"]); lat.append(time.perf_counter() - t)
lat.sort()
print("python http.client gateway txn(compare mod_revision + put) sequential: n=%d p50=%.2fms p99=%.2fms" % (n, lat[n // 2] * 1e3, lat[int((n - 1) * 0.99)] * 1e3))
PY

# etcdctl, one process per operation (its start-up included): what a shell script pays.
t0=$(date +%s%N)
for i in $(seq 1 50); do etcdctl --endpoints "$leader" put /bench/etcdctl "$i" >/dev/null; done
echo "etcdctl put, a process each: n=50 mean=$(( ($(date +%s%N) - t0) / 50000 ))µs"

if $CHECK_PERF; then
  etcdctl --endpoints "$endpoints" check perf --load=s
fi

# Sourced by the etcd benchmarks (after setting `dir`): a fresh 3-member etcd cluster on
# free loopback ports, and a trap that kills every process in `pids` and removes `dir`.
#
#   start_etcd_cluster DIR     members' data and logs under DIR; appends their PIDs to the
#                              caller's `pids` array; sets `endpoints` (host:port,…), `urls`
#                              (http://host:port,…), `leader`, `follower` and
#                              `healthy_after` (seconds from start to a healthy cluster)

# etcd and etcdctl as `make etcd` unpacks them (not installed), else as installed.
PATH="$PWD/.build/etcd/usr/bin:$PATH"

start_etcd_cluster() {
  local dir=$1 i c p start
  # Six free loopback ports (bound together, then released).
  read -r -a ports < <(python3 -c '
import socket
s = [socket.socket() for _ in range(6)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))')
  local cluster="m0=http://127.0.0.1:${ports[1]},m1=http://127.0.0.1:${ports[3]},m2=http://127.0.0.1:${ports[5]}"
  start=$(date +%s.%N)
  for i in 0 1 2; do
    c=${ports[$((2*i))]}; p=${ports[$((2*i+1))]}
    env -i PATH=/usr/bin:/bin "$(command -v etcd)" --name m$i --data-dir "$dir/m$i" \
      --listen-client-urls http://127.0.0.1:$c --advertise-client-urls http://127.0.0.1:$c \
      --listen-peer-urls http://127.0.0.1:$p --initial-advertise-peer-urls http://127.0.0.1:$p \
      --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token bench-$$ \
      --logger zap --log-outputs stderr 2> "$dir/m$i.log" &
    pids+=($!)
  done
  endpoints="127.0.0.1:${ports[0]},127.0.0.1:${ports[2]},127.0.0.1:${ports[4]}"
  urls="http://127.0.0.1:${ports[0]},http://127.0.0.1:${ports[2]},http://127.0.0.1:${ports[4]}"
  for _ in $(seq 1 300); do
    etcdctl --endpoints "$endpoints" endpoint health >/dev/null 2>&1 && break
    sleep 0.1
  done
  etcdctl --endpoints "$endpoints" endpoint health >/dev/null 2>&1 || { echo "etcd did not become healthy"; tail "$dir"/m*.log; return 1; }
  healthy_after=$(python3 -c "print(round($(date +%s.%N) - $start, 2))")
  leader=$(etcdctl --endpoints "$endpoints" endpoint status | awk -F', ' '$5 == "true" {print $1}')
  follower=$(echo "$endpoints" | tr , '\n' | grep -v "^$leader$" | head -1)
}

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT

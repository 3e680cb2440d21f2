// gRPC baseline for docs/etcd-notes.md: sequential txn latency and watch delivery latency
// with etcd's own Go client (clientv3), to compare with the JSON gateway client.
package main

import (
	"context"
	"flag"
	"fmt"
	"sort"
	"strings"
	"time"

	"go.etcd.io/etcd/clientv3"
)

func pct(d []time.Duration, p float64) time.Duration {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	return d[int(float64(len(d)-1)*p)]
}

func main() {
	eps := flag.String("endpoints", "127.0.0.1:2379", "writer endpoint[,watcher endpoint]")
	n := flag.Int("n", 1000, "operations")
	flag.Parse()
	list := strings.Split(*eps, ",")
	w, err := clientv3.New(clientv3.Config{Endpoints: list[:1], DialTimeout: 5 * time.Second})
	if err != nil { panic(err) }
	r, err := clientv3.New(clientv3.Config{Endpoints: list[len(list)-1:], DialTimeout: 5 * time.Second})
	if err != nil { panic(err) }
	ctx := context.Background()
	key := "/bench/grpc/txn"
	resp, err := w.Put(ctx, key, "0")
	if err != nil { panic(err) }
	rev := resp.Header.Revision
	var lat []time.Duration
	start := time.Now()
	for i := 0; i < *n; i++ {
		t := time.Now()
		tr, err := w.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", rev)).Then(clientv3.OpPut(key, fmt.Sprint(i))).Commit()
		if err != nil || !tr.Succeeded { panic(fmt.Sprint("txn failed ", err)) }
		rev = tr.Header.Revision
		lat = append(lat, time.Since(t))
	}
	el := time.Since(start)
	fmt.Printf("grpc txn(compare mod_revision + put) sequential: n=%d %.0f/s p50=%.2fms p99=%.2fms\n", *n, float64(*n)/el.Seconds(),
		float64(pct(lat, 0.5).Microseconds())/1000, float64(pct(lat, 0.99).Microseconds())/1000)

	wkey := "/bench/grpc/watch"
	wc := r.Watch(clientv3.WithRequireLeader(ctx), wkey)
	time.Sleep(200 * time.Millisecond) // let the watch be created
	lat = lat[:0]
	for i := 0; i < *n; i++ {
		t := time.Now()
		if _, err := w.Put(ctx, wkey, fmt.Sprint(i)); err != nil { panic(err) }
		ev := <-wc
		if ev.Err() != nil { panic(ev.Err()) }
		lat = append(lat, time.Since(t))
	}
	fmt.Printf("grpc put -> watcher on %s: n=%d p50=%.2fms p99=%.2fms\n", list[len(list)-1], *n,
		float64(pct(lat, 0.5).Microseconds())/1000, float64(pct(lat, 0.99).Microseconds())/1000)
}

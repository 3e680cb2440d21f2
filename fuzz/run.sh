#!/usr/bin/env bash
# Fuzz the protocol's input side with libFuzzer: fuzz/run.sh [seconds] (default 60).
# Builds obsfuzz with -sanitize=fuzzer,address into .build-fuzz (linked with lld: gold
# crashes on libFuzzer's objects), starts from the committed seed corpus (fuzz/corpus,
# never modified), keeps what it learns in .build-fuzz/corpus, and writes any crashing
# input to fuzz-artifacts/. Exits non-zero on a finding; replay one with
# `swift run obsfuzz fuzz-artifacts/crash-...`, then add it to fuzz/corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
swift build --scratch-path .build-fuzz -c release --product obsfuzz \
  -Xswiftc -sanitize=fuzzer,address -Xswiftc -DFUZZING -Xswiftc -use-ld=lld
mkdir -p .build-fuzz/corpus fuzz-artifacts
exec .build-fuzz/release/obsfuzz -max_total_time="$seconds" -max_len=200000 -rss_limit_mb=4096 \
  -print_final_stats=1 -artifact_prefix=fuzz-artifacts/ .build-fuzz/corpus fuzz/corpus

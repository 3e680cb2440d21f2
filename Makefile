# obsd — developer entry points. The README's two commands are `make run` and `make test`.

SWIFT ?= swift
PYTHON ?= python3
RELEASE := .build/release
empty :=
space := $(empty) $(empty)

.PHONY: all build run test unit-test release-e2e python-test docs tsan asan fuzz fuzz-smoke bench bench-calibrate soak deps test-deps etcd install uninstall clean robustness robustness-short

# Install layout (make install PREFIX=/usr DESTDIR=/tmp/pkg).
PREFIX ?= /usr/local
DESTDIR ?=
BINDIR ?= $(PREFIX)/bin
SYSCONFDIR ?= /etc
UNITDIR ?= $(PREFIX)/lib/systemd/system
USERUNITDIR ?= $(PREFIX)/lib/systemd/user
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
DOCDIR ?= $(PREFIX)/share/doc/obsd
# Units name /usr/local/bin and /etc/obsd; install rewrites them for this layout.
UNIT_PATHS := sed -e 's|/usr/local/bin/|$(BINDIR)/|g' -e 's|/etc/obsd/|$(SYSCONFDIR)/obsd/|g'

all: build

# Debian packages building and running obsd need (`make run`, `make build`, `make install`).
DEB_PACKAGES := libsqlite3-dev libsystemd-dev pkg-config
# What the tests use on top (`make test`): systemd-analyze and systemd-socket-activate, strace,
# socat, nc, and Prometheus' reference parser. etcd is not among them: see `etcd` below.
TEST_DEB_PACKAGES := systemd strace socat netcat-openbsd python3-prometheus-client

SUDO = $$([ "$$(id -u)" -eq 0 ] || echo sudo)
APT = DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get

# Installs the Debian packages $(1) that are not installed (apt lists refreshed if needed).
define apt_install
@missing=""; for p in $(1); do \
  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q ' installed$$' || missing="$$missing $$p"; done; \
if [ -n "$$missing" ]; then \
  echo "installing$$missing"; \
  $(APT) install -y $$missing >/dev/null 2>&1 || { $(APT) update >/dev/null && $(APT) install -y $$missing; }; \
fi
endef

deps:
	@command -v $(SWIFT) >/dev/null || { echo "swift is not installed (expected Swift 6.x at /opt/swift)"; exit 1; }
	$(call apt_install,$(DEB_PACKAGES))

test-deps: deps etcd
	$(call apt_install,$(TEST_DEB_PACKAGES))
	@$(PYTHON) -c 'import pytest' 2>/dev/null || $(PYTHON) -m pip install pytest
	@$(PYTHON) -c 'import mypy' 2>/dev/null || $(PYTHON) -m pip install mypy

# etcd and etcdctl, for the suites that run an etcd cluster (Tests/TestSupport/EtcdCluster.swift
# starts its own members on free ports), the walk-through of docs/SEVERAL-HOSTS.md and
# bench/etcd-*.sh: Debian's etcd-server and etcd-client unpacked into $(ETCD_DIR), not installed.
# Installing etcd-server would enable and start a system etcd on 127.0.0.1:2379 (and create an
# etcd user); unpacked, nothing runs until a test or a person starts it. Nothing to do when
# both programs are installed already.
ETCD_DIR := .build/etcd
etcd:
	@if { [ -x /usr/bin/etcd ] && [ -x /usr/bin/etcdctl ]; } || { [ -x $(ETCD_DIR)/usr/bin/etcd ] && [ -x $(ETCD_DIR)/usr/bin/etcdctl ]; }; then exit 0; fi; \
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	{ (cd "$$tmp" && apt-get download etcd-server etcd-client >/dev/null 2>&1) || \
	  { $(APT) update >/dev/null && (cd "$$tmp" && apt-get download etcd-server etcd-client); }; } && \
	mkdir -p $(ETCD_DIR) && for deb in "$$tmp"/*.deb; do dpkg-deb -x "$$deb" $(ETCD_DIR) || exit 1; done && \
	echo "etcd and etcdctl unpacked into $(ETCD_DIR)/usr/bin (not installed: no etcd service)"

build: deps
	$(SWIFT) build -c release

# Start the daemon in the foreground on the embedded defaults; stop it with Ctrl-C.
run: build
	$(RELEASE)/obsd $(ARGS)

# Every test: unit, codec and end-to-end suites (with a short soak and the fuzz corpus
# replayed, the example apps and a package outside the repository built against the
# client library), the documentation without a warning, the observation core under
# ThreadSanitizer and AddressSanitizer, thirty seconds of fuzzing, then the robustness suite's
# self-test and short run.
test: unit-test release-e2e python-test docs tsan asan fuzz-smoke robustness-short

# Some suites run on their own after the others, one after another: the soak (its fast
# subscribers must never fall a queue behind, which is a statement about obsd, not about a
# machine busy with thirty other test daemons) and those that run a real etcd cluster
# (their bounds — a write within seconds, a failover — are etcd's, and etcd's fsyncs and
# elections starve on a 2-core machine busy with everything else), and the client's lease
# keep-alive (a task of the cooperative pool that the other tests' blocking waits can hold
# up for longer than a TTL).
ALONE_SUITES := SoakTests EtcdClientTests ClusterTests LeaseKeepAliveTests

# At most this many tests at once: each end-to-end test runs a daemon (or three etcd
# members), and on a 2-CPU machine more at once only make every one slower. (Unbounded,
# swift-testing starts every test together.) The tests' blocking reads no longer hold the
# cooperative pool the client library needs: suites that block are marked `.mayBlock` and run
# on threads of their own (Tests/TestSupport/BlockingThreads.swift) — before that, a CI run
# starved a lease test for a minute.
export SWT_EXPERIMENTAL_MAXIMUM_PARALLELIZATION_WIDTH ?= 4

unit-test: test-deps
	$(SWIFT) build --build-tests
	$(SWIFT) test --skip-build $(foreach s,$(ALONE_SUITES),--skip $(s))
	for suite in $(ALONE_SUITES); do $(SWIFT) test --skip-build --filter $$suite || exit 1; done

# The optimised daemon against the end-to-end suites about delivery and subscriptions: the
# optimiser changes when objects die — a subscription used after it was freed crashed the
# release daemon, never the debug one the other runs start — so these run against it too.
RELEASE_SUITES := OnceSubscriptionTests ConformanceTests OrderingConformanceTests SubscribeOptionsTests HalfCloseTests DeliveryTests EpochTests LeaseTests
release-e2e: test-deps
	$(SWIFT) build -c release --product obsd
	$(SWIFT) build -c release --product obsctl
	$(SWIFT) build --build-tests
	OBSD_BUILD_DIR=$(RELEASE) $(SWIFT) test --skip-build --filter '$(subst $(space),|,$(strip $(RELEASE_SUITES)))'

# The Python client (clients/python): its pytest suite against the debug obsd, each test
# starting its own daemon in a temporary directory; mypy --strict and `pip install` of the
# package are tests of the suite.
python-test: test-deps
	$(SWIFT) build --product obsd
	OBSD_BIN=$(CURDIR)/.build/debug/obsd $(PYTHON) -m pytest -q clients/python/tests

# The DocC catalogs of the library products (Sources/ObsClient/ObsClient.docc,
# Sources/ObservableKit/ObservableKit.docc) with their API reference, built with
# swift-docc-plugin into .build/plugins/Swift-DocC/outputs/*.doccarchive. A documentation
# warning — a link that resolves to nothing, a parameter left undocumented — fails it.
DOCC_TARGETS := ObsClient ObservableKit
docs: deps
	$(SWIFT) package generate-documentation $(foreach t,$(DOCC_TARGETS),--target $(t)) --warnings-as-errors

# The sanitizers, on the suites that exercise the daemon's unsafe references (`Unmanaged`,
# `unowned(unsafe)`, `_withUnsafeGuaranteedRef`: the loops, shards, outboxes and history in
# ObsServerTests, ObsCoreTests and ObsStoreTests) and its threads (loops, the committer, the
# checkpointer, posts between them). ThreadSanitizer also runs ObservableKitTests. The
# daemon's modules lock with ObservableKit's `Locked` (pthread), which ThreadSanitizer sees:
# with Synchronization's `Mutex`, a futex inside the uninstrumented runtime on Linux, it
# reported every access under one as a race. AddressSanitizer leaves ObservableKitTests out:
# its weak-observer tests need a freed object's address given out again, which
# AddressSanitizer's quarantine never does; its leak check is off: the in-process tests leave
# their servers' loops, connections and sessions referring to each other at exit (the daemon
# keeps its own for the life of the process), which it would report as leaks.
SANITIZED_SUITES := ObsServerTests|ObsCoreTests|ObsStoreTests
tsan: deps
	$(SWIFT) test --scratch-path .build-tsan --sanitize=thread --filter 'ObservableKitTests|$(SANITIZED_SUITES)'

asan: deps
	ASAN_OPTIONS=detect_leaks=0 $(SWIFT) test --scratch-path .build-asan --sanitize=address --filter '$(SANITIZED_SUITES)'

# libFuzzer on the framer and request decoder (fuzz/run.sh); a finding fails the target.
FUZZ_SECONDS ?= 600
fuzz: deps
	fuzz/run.sh $(FUZZ_SECONDS)

fuzz-smoke: deps
	fuzz/run.sh 30

# Binaries, systemd units (system and user), the sysusers entry, and the configuration
# file (kept if one is already installed). Then: systemd-sysusers; systemctl daemon-reload;
# systemctl enable --now obsd.socket
install: build
	install -Dm755 $(RELEASE)/obsd $(DESTDIR)$(BINDIR)/obsd
	install -Dm755 $(RELEASE)/obsctl $(DESTDIR)$(BINDIR)/obsctl
	install -d $(DESTDIR)$(UNITDIR) $(DESTDIR)$(USERUNITDIR)
	$(UNIT_PATHS) systemd/obsd.service > $(DESTDIR)$(UNITDIR)/obsd.service
	$(UNIT_PATHS) systemd/obsd.socket > $(DESTDIR)$(UNITDIR)/obsd.socket
	$(UNIT_PATHS) systemd/obsd-metrics.service > $(DESTDIR)$(UNITDIR)/obsd-metrics.service
	$(UNIT_PATHS) systemd/obsd-metrics.timer > $(DESTDIR)$(UNITDIR)/obsd-metrics.timer
	$(UNIT_PATHS) systemd/user/obsd.service > $(DESTDIR)$(USERUNITDIR)/obsd.service
	$(UNIT_PATHS) systemd/user/obsd.socket > $(DESTDIR)$(USERUNITDIR)/obsd.socket
	chmod 644 $(DESTDIR)$(UNITDIR)/obsd.* $(DESTDIR)$(UNITDIR)/obsd-metrics.* $(DESTDIR)$(USERUNITDIR)/obsd.*
	install -Dm644 systemd/obsd.sysusers.conf $(DESTDIR)$(SYSUSERSDIR)/obsd.conf
	[ -e $(DESTDIR)$(SYSCONFDIR)/obsd/obsd.toml ] || install -Dm644 config/obsd.toml $(DESTDIR)$(SYSCONFDIR)/obsd/obsd.toml
	install -Dm644 README.md $(DESTDIR)$(DOCDIR)/README.md
	install -Dm644 docs/PROTOCOL.md $(DESTDIR)$(DOCDIR)/PROTOCOL.md

uninstall:
	rm -f $(DESTDIR)$(BINDIR)/obsd $(DESTDIR)$(BINDIR)/obsctl
	rm -f $(DESTDIR)$(UNITDIR)/obsd.service $(DESTDIR)$(UNITDIR)/obsd.socket
	rm -f $(DESTDIR)$(UNITDIR)/obsd-metrics.service $(DESTDIR)$(UNITDIR)/obsd-metrics.timer
	rm -f $(DESTDIR)$(USERUNITDIR)/obsd.service $(DESTDIR)$(USERUNITDIR)/obsd.socket
	rm -f $(DESTDIR)$(SYSUSERSDIR)/obsd.conf
	rm -rf $(DESTDIR)$(DOCDIR)
	@echo "kept $(SYSCONFDIR)/obsd/obsd.toml and the data in /var/lib/obsd"

# Benchmarks, side by side with Redis in one run (installs redis-server when missing): a
# markdown table headed with the machine and this command, a text chart; the table, the
# rows as JSON and an SVG chart also go to $(BENCH_OUT).
BENCH_OUT ?= .build/bench
bench: build
	BENCH_COMMAND="make bench$(if $(BENCH_ARGS), BENCH_ARGS='$(BENCH_ARGS)')" python3 bench/bench.py --out $(BENCH_OUT) $(BENCH_ARGS)

# The load generator checked against the neutral driver (../shared/busbench, built here
# with make): both drive the same Redis in the same rounds; prints obsbench/busbench.
BUSBENCH ?= ../shared/busbench
bench-calibrate: deps
	$(SWIFT) build -c release --product obsbench
	$(MAKE) -C $(BUSBENCH)
	BENCH_COMMAND="make bench-calibrate$(if $(BENCH_ARGS), BENCH_ARGS='$(BENCH_ARGS)')" python3 bench/bench.py --calibrate --busbench $(BUSBENCH) --out $(BENCH_OUT) $(BENCH_ARGS)

# A long soak of a release obsd: churn, slow readers, gap-checked subscribers; RSS and
# descriptors must come back (bench/soak.sh).
SOAK_SECONDS ?= 300
soak: build
	bench/soak.sh $(SOAK_SECONDS)

# The robustness suite (robustness/README.md): seeded random traffic from several client
# processes against the release obsd under injected faults (kill -9, SIGSTOP, failing and
# full disks, torn writes, crashes in checkpoints and roll-overs; with etcd: members killed,
# the leader killed, a member stopped, compaction), every recorded history checked against
# the contract afterwards. ROBUSTNESS_SECONDS of traffic (default 600: two thirds local, one
# third etcd), ending with `robustness: N operations, F faults, V violations (seed S)`.
# SEED=... replays a run's traffic and fault schedule; KNOWN_OPEN=none (or a list) leaves out
# the faults that trigger defects known open (robustness/README.md, "Known open").
ROBUSTNESS_SECONDS ?= 600
robustness: deps etcd
	$(SWIFT) build -c release --product obsd
	python3 robustness/run.py --seconds $(ROBUSTNESS_SECONDS) $(if $(SEED),--seed $(SEED)) $(if $(KNOWN_OPEN),--known-open $(KNOWN_OPEN))

# In `make test`: each validator seen to catch a defect injected on purpose (a mutating proxy,
# the daemon's test-only failpoints), then a short run — a new seed each time, printed — with
# no fault that triggers a defect known open. The release obsd is built by release-e2e.
ROBUSTNESS_SHORT_SECONDS ?= 75
robustness-short: deps etcd
	$(SWIFT) build -c release --product obsd
	python3 robustness/selftest.py
	python3 robustness/run.py --short --seconds $(ROBUSTNESS_SHORT_SECONDS)

clean:
	rm -rf .build .build-tsan .build-fuzz

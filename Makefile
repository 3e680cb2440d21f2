# obsd — developer entry points. The README's two commands are `make run` and `make test`.

SWIFT ?= swift
RELEASE := .build/release

.PHONY: all build run test unit-test tsan bench deps clean

all: build

# Debian packages the build needs; installed when missing (apt lists refreshed if needed).
DEB_PACKAGES := libsqlite3-dev pkg-config

deps:
	@command -v $(SWIFT) >/dev/null || { echo "swift is not installed (expected Swift 6.x at /opt/swift)"; exit 1; }
	@missing=""; for p in $(DEB_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  sudo=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  echo "installing$$missing"; \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y $$missing >/dev/null 2>&1 || \
	  { DEBIAN_FRONTEND=noninteractive $$sudo apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y $$missing; }; \
	fi

build: deps
	$(SWIFT) build -c release

# Start the daemon in the foreground on the embedded defaults; stop it with Ctrl-C.
run: build
	$(RELEASE)/obsd $(ARGS)

# Every test: unit, codec and end-to-end suites, then the observation core under ThreadSanitizer.
test: unit-test tsan

unit-test: deps
	$(SWIFT) build --build-tests
	$(SWIFT) test --skip-build

tsan: deps
	$(SWIFT) test --scratch-path .build-tsan --sanitize=thread --filter ObservableKitTests

# Benchmarks, side by side with Redis in one run (installs redis-server when missing).
bench: build
	python3 bench/bench.py $(BENCH_ARGS)

clean:
	rm -rf .build .build-tsan

# obsd — developer entry points. The README's two commands are `make run` and `make test`.

SWIFT ?= swift
RELEASE := .build/release

.PHONY: all build run test unit-test tsan bench deps clean

all: build

# Debian packages the build needs (none beyond the Swift toolchain yet).
deps:
	@command -v $(SWIFT) >/dev/null || { echo "swift is not installed (expected Swift 6.x at /opt/swift)"; exit 1; }

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

clean:
	rm -rf .build .build-tsan

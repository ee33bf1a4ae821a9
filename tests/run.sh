#!/usr/bin/env bash
# Runs every firn test on this machine: installs what is missing (Debian), builds the
# release binaries (plus the test-only probe build of the sampler), then runs unit and
# end-to-end tests. Needs root: the end-to-end tests load BPF and create test users.
# With CI=true or FIRN_REQUIRE_BPF=1 a test that cannot load BPF fails instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
    echo "tests/run.sh needs root (the end-to-end tests load BPF programs); try: sudo $0" >&2
    exit 1
fi

packages=(clang llvm libelf-dev zlib1g-dev make gcc pkg-config capnproto libcapnp-dev golang-go python3-dev util-linux systemd passwd openssl strace podman buildah runc linux-perf)
. packaging/install-deps.sh
install_missing "${packages[@]}"
if ! command -v cargo >/dev/null; then
    [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
fi

# The tests' independent readers: OpenTelemetry's Python bindings, Parca's npm client
# types, Chromium with selenium for the web view.
tests/setup-tools.sh

export FIRN_REQUIRE_BPF="${FIRN_REQUIRE_BPF:-1}"
# Gates first, they are the quickest to fail: the structure (files within 600 lines,
# no unused dependency, the enricher's layers), formatting, then clippy with warnings as
# errors and the workspace's lints (every unsafe block documented). The BPF C builds
# with -Wall -Wextra -Werror (sampler-bpf/build.rs).
python3 tests/gates.py
cargo fmt --all --check
cargo clippy --release --locked --workspace --all-targets -- -D warnings
# The probe copy first: cargo keeps both feature sets' artefacts, so the plain build
# after it only re-links.
cargo build --release --locked -p firn-sampler --features forbidden-probe
cp target/release/firn-sampler target/release/firn-sampler-probe
cargo build --release --locked --workspace --bins
# The fuzz targets (their own sanitizer build, ~8 min on 2 CPUs) build meanwhile at idle
# priority: SCHED_IDLE gets only CPU time no test wants, and the tests judge sample
# counts against each workload's own CPU time, so a shared machine does not skew them.
fuzz_secs="${FIRN_FUZZ_SECONDS:-60}"
fuzz_build=""
if [ "$fuzz_secs" -gt 0 ]; then
    mkdir -p target
    # Its own process group (job control on for this one job), so a failing test stops
    # the whole build. Not its own session: a session is a scheduler autogroup, and
    # autogroups share the CPUs equally whatever their tasks' policy.
    set -m
    chrt --idle 0 nice -n 19 fuzz/run.sh --build-only >target/fuzz-build.log 2>&1 &
    fuzz_build=$!
    set +m
    trap '[ -n "$fuzz_build" ] && kill -- "-$fuzz_build" 2>/dev/null || true' EXIT
fi
# Unit tests of every crate, then the end-to-end tests one at a time (they measure
# sample counts and CPU, so they must not share the machine with each other).
cargo test --release --locked --workspace --exclude firn-tests
python3 -m unittest discover -s tests/bench -p 'test_*.py'
cargo test --release --locked -p firn-tests -- --test-threads=1
# The benchmark suite, 20 s of firn only: its harness must keep working (numbers are not
# judged here; `python3 tests/bench/firn_bench.py` measures).
python3 tests/bench/firn_bench.py --smoke --skip-build
# Every fuzz target for FIRN_FUZZ_SECONDS (60; 0 skips), after its regression inputs
# (`fuzz/run.sh 600` alone is the real fuzzing run).
if [ "$fuzz_secs" -gt 0 ]; then
    if ! wait "$fuzz_build"; then
        fuzz_build=""
        tail -40 target/fuzz-build.log
        echo "building the fuzz targets failed (target/fuzz-build.log)" >&2
        exit 1
    fi
    fuzz_build=""
    fuzz/run.sh "$fuzz_secs"
fi

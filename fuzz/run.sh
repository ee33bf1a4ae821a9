#!/usr/bin/env bash
# Runs every cargo-fuzz target for SECONDS each (default 60), all at once, starting
# from the committed seeds (fuzz/seeds/<target>) after the regression inputs
# (fuzz/regressions/<target>: every crash ever found, each of which must pass). Prints each target's libFuzzer statistics; exits non-zero on any crash, leak,
# timeout (-timeout, seconds per input) or memory blow-up (-rss_limit_mb).
#   fuzz/run.sh 600           # ten minutes per target
#   fuzz/run.sh --build-only  # install cargo-fuzz if missing, build the targets, stop
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-60}"
build_only=false
if [ "$secs" = "--build-only" ]; then build_only=true; secs=0; fi
case "$secs" in ''|*[!0-9]*) echo "usage: fuzz/run.sh [SECONDS | --build-only]" >&2; exit 2 ;; esac
if ! command -v cargo-fuzz >/dev/null; then
    # A debug build of the tool: it only drives cargo, and builds in a third of the time.
    cargo install cargo-fuzz --locked --debug --version 0.13.2
fi
# cargo fuzz passes nightly-only flags (-Zsanitizer); the machine has a stable toolchain,
# whose compiler accepts them with RUSTC_BOOTSTRAP.
export RUSTC_BOOTSTRAP=1
targets=$(cargo fuzz list)
# FUZZ_PROFILE=--dev builds unoptimised (slower to run; debug builds may hit -timeout).
profile="${FUZZ_PROFILE:---release}"
cargo fuzz build "$profile"
if $build_only; then exit 0; fi
mkdir -p logs
run_one() {
    local t=$1
    mkdir -p "corpus/$t" "regressions/$t"
    # Regressions: each input once.
    if [ -n "$(ls "regressions/$t")" ]; then
        cargo fuzz run "$profile" "$t" "regressions/$t" -- -runs=0 >"logs/$t.regressions" 2>&1 \
            || { echo "$t: a regression input fails again (logs/$t.regressions)"; return 1; }
    fi
    if cargo fuzz run "$profile" "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"logs/$t.log" 2>&1; then
        local execs cov
        execs=$(awk '/stat::number_of_executed_units/{print $2}' "logs/$t.log")
        cov=$(grep -o 'cov: [0-9]*' "logs/$t.log" | tail -1)
        echo "$t: clean for ${secs}s, ${execs:-?} inputs, ${cov:-cov: ?}, corpus $(ls "corpus/$t" | wc -l)"
    else
        echo "$t: FAILED — see fuzz/logs/$t.log and fuzz/artifacts/$t/"
        tail -30 "logs/$t.log"
        return 1
    fi
}
# All targets at once: on a 2-CPU machine each gets a share of the CPUs for the whole
# SECONDS, which keeps CI's fuzzing to about SECONDS of wall time.
status=0
pids=()
for t in $targets; do
    run_one "$t" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status

"""Off-CPU time's cost (issue 30): `python3 tests/bench/offcpu_bench.py [seconds]` (root;
build the workspace first). `perf bench sched pipe` (two tasks passing a byte back and
forth: a context switch per message; both pinned to CPU 1) for SECONDS, interleaved, twice each: with no
firn, firn on-CPU only, firn --off-cpu (every switch) and firn --off-cpu
--off-cpu-every 16. Reports the pipe's throughput against the no-firn run of the same
repeat, the BPF ns per context switch (all of the sampler's programs, from the kernel's
bpf_stats, over the switches /proc/stat counted), both halves' CPU, and the sampler's
peak RSS; then both halves at rest on this idle node with --off-cpu."""
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from profilers import Firn, bpf_stats, proc_cpu, status_kib  # noqa: E402


def ctxt():
    for line in open("/proc/stat"):
        if line.startswith("ctxt "):
            return int(line.split()[1])
    return 0


def pipe_bench(seconds):
    """Mean ops/s of `perf bench sched pipe` runs over about `seconds`."""
    rates, t0 = [], time.time()
    while not rates or time.time() - t0 < seconds:
        # Both ends on one CPU: otherwise where the scheduler puts them (and how deep the
        # other CPU sleeps) moves the throughput more than any profiler does.
        out = subprocess.run(["taskset", "-c", "1", "perf", "bench", "sched", "pipe", "-l", "200000"],
                             capture_output=True, text=True, check=True).stdout
        m = re.search(r"([\d.]+) ops/sec", out)
        if m:
            rates.append(float(m.group(1)))
        elif not rates:
            raise RuntimeError(f"no ops/sec in perf's output: {out!r}")
    return sum(rates) / len(rates)


def one(label, extra, seconds):
    f = None
    if extra is not None:
        f = Firn(2)
        f.sampler_extra = extra
        f.start(99)
    pids = f.pids() if f else []
    c0 = {p: proc_cpu(p) for p in pids}
    b0, x0, t0 = bpf_stats(pids), ctxt(), time.time()
    ops = pipe_bench(seconds)
    wall = time.time() - t0
    b1, x1 = bpf_stats(pids), ctxt()
    r = {"label": label, "ops": ops}
    if f:
        c1 = {p: proc_cpu(p) for p in pids}
        r["sampler_ms_s"] = 1000 * (c1[pids[0]] - c0[pids[0]]) / wall
        r["enricher_ms_s"] = 1000 * (c1[pids[1]] - c0[pids[1]]) / wall
        r["bpf_ns_per_switch"] = (b1[0] - b0[0]) / max(1, x1 - x0)
        r["switches_per_s"] = (x1 - x0) / wall
        r["sampler_hwm_mib"] = status_kib(pids[0], "VmHWM") / 1024
        m = f.metrics()
        r["lost"] = {k: v for k, v in m.items()
                     if ("counts_map_full" in k or "stack_lost" in k or "off_cpu_untimed" in k) and v}
        r["off_cpu_waits"] = m.get("firn_sampler_bpf_off_cpu_waits", 0)
        f.stop(settle=False)
    return r


def at_rest(seconds):
    f = Firn(10)
    f.sampler_extra = ["--off-cpu"]
    f.start(99)
    time.sleep(30)
    pids = f.pids()
    c0 = {p: proc_cpu(p) for p in pids}
    time.sleep(seconds)
    c1 = {p: proc_cpu(p) for p in pids}
    r = [1000 * (c1[p] - c0[p]) / seconds for p in pids]
    f.stop(settle=False)
    return r


def main():
    secs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    old = open("/proc/sys/kernel/bpf_stats_enabled").read().strip() or "0"
    open("/proc/sys/kernel/bpf_stats_enabled", "w").write("1")
    try:
        runs = []
        for rep in range(2):
            base = one("none", None, secs)
            runs.append((rep, base))
            for label, extra in (("firn", []), ("firn --off-cpu", ["--off-cpu"]),
                                 ("firn --off-cpu --off-cpu-every 16", ["--off-cpu", "--off-cpu-every", "16"])):
                r = one(label, extra, secs)
                r["ratio"] = r["ops"] / base["ops"]
                runs.append((rep, r))
        for rep, r in runs:
            print(rep, r, flush=True)
        rest = at_rest(60)
        print(f"at rest with --off-cpu (99 Hz, 10 s rounds, 60 s after 30 s): sampler {rest[0]:.2f} ms/s, "
              f"enricher {rest[1]:.2f} ms/s", flush=True)
    finally:
        open("/proc/sys/kernel/bpf_stats_enabled", "w").write(old)


if __name__ == "__main__":
    main()

"""The off-CPU part of the benchmark suite (`firn_bench.py --parts offcpu`, issue 30):
what `firn-sampler --off-cpu` costs a switch-heavy program and an idle node.

`perf bench sched pipe` (two tasks passing a byte back and forth, a context switch per
message) with both ends pinned to one CPU: unpinned, where the scheduler puts the two
ends moved its throughput by 1.7× between runs with nothing changed. Runs interleaved,
each configuration once per repetition: no firn, firn on-CPU only, firn --off-cpu with
its defaults, and firn --off-cpu --off-cpu-rate 0 (every voluntary switch taken).
Throughput is measured with the kernel's bpf_stats off (they time every program run,
which on a switch storm is a cost of its own); BPF ns per switch comes from a second,
shorter run of each configuration with them on: the sched_switch program's run time
over its runs, and the sampler's programs' run time over the switches /proc/stat
counted. Both halves' CPU over the pipe run, and at rest on this idle node with the flag
on (60 s after 30 s) beside the same without it."""
import os
import re
import subprocess
import time

import benchlib as bl
from profilers import Firn, proc_cpu, status_kib
from runs import log

CONFIGS = (("firn", []), ("firn --off-cpu", ["--off-cpu"]),
           ("firn --off-cpu --off-cpu-rate 0", ["--off-cpu", "--off-cpu-rate", "0"]))
TRACING = 26  # BPF_PROG_TYPE_TRACING: the tp_btf sched_switch program


def ctxt():
    for line in open("/proc/stat"):
        if line.startswith("ctxt "):
            return int(line.split()[1])
    return 0


def prog_stats(pid):
    """(run ns, runs) of the sched_switch program and of all the sampler's programs."""
    sw, alls = [0, 0], [0, 0]
    try:
        fds = os.listdir(f"/proc/{pid}/fdinfo")
    except OSError:
        return sw, alls
    for fd in fds:
        try:
            text = open(f"/proc/{pid}/fdinfo/{fd}").read()
        except OSError:
            continue
        r = bl.parse_fdinfo_bpf(text)
        if not r:
            continue
        alls[0], alls[1] = alls[0] + r[0], alls[1] + r[1]
        t = re.search(r"prog_type:\s+(\d+)", text)
        if t and int(t.group(1)) == TRACING:
            sw[0], sw[1] = sw[0] + r[0], sw[1] + r[1]
    return sw, alls


def pipe_bench(seconds):
    """Mean ops/s of `perf bench sched pipe` runs over about `seconds`."""
    rates, t0 = [], time.time()
    while not rates or time.time() - t0 < seconds:
        out = subprocess.run(["taskset", "-c", "1", "perf", "bench", "sched", "pipe", "-l", "200000"],
                             capture_output=True, text=True, check=True).stdout
        m = re.search(r"([\d.]+) ops/sec", out)
        if m:
            rates.append(float(m.group(1)))
        elif not rates:
            raise RuntimeError(f"no ops/sec in perf's output: {out!r}")
    return sum(rates) / len(rates)


def set_stats(on):
    open("/proc/sys/kernel/bpf_stats_enabled", "w").write("1" if on else "0")


def one(label, extra, seconds, stats_seconds):
    """One configuration (extra None: no firn): throughput with bpf_stats off, then BPF
    ns with them on."""
    log(f"offcpu: {label} …")
    f = None
    if extra is not None:
        f = Firn(2)
        f.sampler_extra = extra
        f.start(99)
    pids = f.pids() if f else []
    set_stats(False)
    c0, t0 = {p: proc_cpu(p) for p in pids}, time.time()
    ops = pipe_bench(seconds)
    wall = time.time() - t0
    r = {"label": label, "ops": ops}
    if f:
        c1 = {p: proc_cpu(p) for p in pids}
        r["sampler_ms_s"] = 1000 * (c1[pids[0]] - c0[pids[0]]) / wall
        r["enricher_ms_s"] = 1000 * (c1[pids[1]] - c0[pids[1]]) / wall
        set_stats(True)
        (s0, a0), x0, t0 = prog_stats(pids[0]), ctxt(), time.time()
        pipe_bench(stats_seconds)
        (s1, a1), x1, wall = prog_stats(pids[0]), ctxt(), time.time() - t0
        set_stats(False)
        r["switches_per_s"] = (x1 - x0) / wall
        r["bpf_ns_per_switch"] = (a1[0] - a0[0]) / max(1, x1 - x0)
        r["switch_prog_ns"] = (s1[0] - s0[0]) / max(1, s1[1] - s0[1])
        r["sampler_hwm_mib"] = status_kib(pids[0], "VmHWM") / 1024
        m = f.metrics()
        r["lost"] = {k: v for k, v in m.items()
                     if ("counts_map_full" in k or "stack_lost" in k or "off_cpu_untimed" in k) and v}
        r["waits"] = m.get("firn_sampler_bpf_off_cpu_waits", 0)
        r["unsampled"] = m.get("firn_sampler_bpf_off_cpu_unsampled", 0)
        f.stop(settle=False)
    return r


def at_rest(extra, warm=30, window=60):
    """Both halves' CPU (ms/s) on this idle node, `window` s after `warm` s, 10 s rounds."""
    log(f"offcpu: at rest with {extra or 'no flag'} …")
    f = Firn(10)
    f.sampler_extra = extra
    f.start(99)
    time.sleep(warm)
    pids = f.pids()
    c0, t0 = {p: proc_cpu(p) for p in pids}, time.time()
    time.sleep(window)
    c1, wall = {p: proc_cpu(p) for p in pids}, time.time() - t0
    f.stop(settle=False)
    return [1000 * (c1[p] - c0[p]) / wall for p in pids]


def run(pairs, seconds):
    old = open("/proc/sys/kernel/bpf_stats_enabled").read().strip() or "0"
    try:
        runs = []
        for rep in range(pairs):
            base = one("none", None, seconds, 0)
            base["rep"] = rep
            runs.append(base)
            on_cpu = None
            for label, extra in CONFIGS:
                r = one(label, extra, seconds, max(5, seconds // 2))
                r["rep"], r["ratio"] = rep, r["ops"] / base["ops"]
                # Against firn without the flag in the same repetition: the flag's own
                # cost (the "with and without --off-cpu").
                if on_cpu is None:
                    on_cpu = r["ops"]
                else:
                    r["ratio_flag"] = r["ops"] / on_cpu
                runs.append(r)
        rest = {"off": at_rest([]), "on": at_rest(["--off-cpu"])}
    finally:
        open("/proc/sys/kernel/bpf_stats_enabled", "w").write(old)
    return {"runs": runs, "rest": rest, "seconds": seconds, "pairs": pairs}


def report(res):
    """The BENCHMARKS.md section."""
    runs = res["runs"]
    lines = ["| run | pipe throughput / none | / firn without the flag | BPF ns per switch (all programs) "
             "| sched_switch program ns per run | switches/s | waits taken | sampler / enricher ms/s "
             "| sampler peak MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = bl.med([r["ops"] for r in runs if r["label"] == "none"])
    lines.append(f"| no firn | {bl.fmt(base, '{:,.0f}')} ops/s | – | – | – | – | – | – | – |")
    for label, _ in CONFIGS:
        rs = [r for r in runs if r["label"] == label]

        def m(key, spec="{:.1f}"):
            return bl.fmt(bl.med([r[key] for r in rs]), spec)
        flag = m("ratio_flag", "{:.3f}") if all("ratio_flag" in r for r in rs) else "–"
        lines.append(f"| {label} | {m('ratio', '{:.3f}')} | **{flag}** | {m('bpf_ns_per_switch', '{:.0f}')} | "
                     f"{m('switch_prog_ns', '{:.0f}') if 'off-cpu' in label else '–'} | "
                     f"{m('switches_per_s', '{:,.0f}')} | {m('waits', '{:,.0f}')} | "
                     f"{m('sampler_ms_s')} / {m('enricher_ms_s')} | {m('sampler_hwm_mib')} |")
    off, on = res["rest"]["off"], res["rest"]["on"]
    lines += ["", f"Idle node, 99 Hz, 10 s rounds, CPU over 60 s after 30 s: without the flag sampler "
              f"{off[0]:.2f} and enricher {off[1]:.2f} ms/s; with `--off-cpu` sampler {on[0]:.2f} and "
              f"enricher {on[1]:.2f} ms/s."]
    d = bl.med([r["ratio_flag"] for r in runs if r["label"] == "firn --off-cpu"])
    lines += ["", f"Against the target (≤ 5 % throughput loss with the default settings, firn with the flag "
              f"against firn without it, each repetition's pair): {(1 - d[0]) * 100:.1f} % lost by the median, "
              f"{(1 - d[2]) * 100:.1f}–{(1 - d[1]) * 100:.1f} % over the repetitions "
              f"({'met' if d[0] >= 0.95 else 'missed'} by the median)."]
    return "\n".join(lines)

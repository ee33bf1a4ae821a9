"""A/B of the sampler's BPF cost per sample: two builds of firn-sampler (e.g. one from an
older commit: `git worktree add /tmp/old <commit>` and `cargo build --release -p
firn-sampler --target-dir /tmp/old-target` there) beside the same enricher, run after
run in alternation, on busy.c built without frame pointers (the table walk) and with
them (frame pointers), or (--workloads) on tests/workloads/syscalls.c, whose samples
mostly fall in the kernel, or on tests/workloads/pydeep.py. BPF ns per run from bpf_stats of the sampler's program fds over
the sampling window; a run is one sample.

  sudo python3 tests/bench/sampler_ab.py --a OLD/firn-sampler --b target/release/firn-sampler \\
      [--hz 99,999] [--runs 3] [--seconds 15]

Prints, per workload and frequency, the median (min-max) of A and of B and B/A.
  sudo python3 tests/bench/sampler_ab.py --a A --b B --hz 99 --runs 16 --seconds 12 --together --beat 2

With --together both samplers run at once over the same workload (each with its own
enricher and HTTP port; the one started first alternates), so a run's two figures share
the machine's state of that moment: on a VM whose per-sample cost drifts by 2x between
runs, the ratio within a run is steadier than the ratio of two runs. Each sampler's
programs are told apart by its pid; the two only share the workload's lines and the
kernel's helper code, and which one's timer fires first in a period is random per run.

That order is a bias of its own: the sampler whose timer fires just after the other's
finds the task's and the stack's lines warm, and at one rate the two keep their phase
for the whole run, so a run's ratio leans by where the phases fell (an A/A run spread
0.76-1.27 on this VM). With --beat D one of the two samples at Hz - D, so their phases
slide through each other D times a second and every run averages over all of them; which
binary gets the lower rate alternates every other run, as does the start order (use a
multiple of 4 runs). The table then adds the geometric mean of the within-run ratios
with its standard error as a factor (×/÷)."""
import argparse
import os
import subprocess
import sys
import time

import benchlib as bl
import firn_bench as fb
import profilers as pr


WORKLOADS = {"nofp": "no frame pointers", "fp": "frame pointers",
             "syscalls": "system calls (`syscalls.c`)", "python": "Python (`pydeep.py`, Debian's python3)"}


def workload(name, out):
    """The command line of workload `name` (a key of WORKLOADS), built into `out` if needed."""
    w = pr.ROOT / "tests" / "workloads"
    if name == "nofp":
        return [str(fb.build_nofp(out))]
    if name == "syscalls":
        subprocess.run(["gcc", "-O2", "-g", "-o", str(out / "syscalls"), str(w / "syscalls.c")], check=True)
        return [str(out / "syscalls")]
    if name == "python":
        return ["/usr/bin/python3", str(w / "pydeep.py")]
    return [str(out / pr.COMM)]


def one(binary, hz, work, seconds):
    f = pr.Firn(2)
    f.start(hz, sampler_binary=binary)
    w = subprocess.Popen([*work, str(seconds + 4)], stdout=subprocess.DEVNULL)
    try:
        time.sleep(2)
        ns0, cnt0 = pr.bpf_stats([f.sampler.pid])
        time.sleep(seconds)
        ns1, cnt1 = pr.bpf_stats([f.sampler.pid])
    finally:
        w.kill()
        w.wait()
        f.stop(settle=False)
    return (ns1 - ns0) / max(1, cnt1 - cnt0)


def together(first, second, rates, work, seconds):
    """One run of both samplers at once, at `rates` (first's, second's): (ns/sample of
    first, of second)."""
    runs = []
    try:
        for i, (binary, hz) in enumerate(zip((first, second), rates)):
            pr.HTTP = f"127.0.0.1:{17999 - i}"
            f = pr.Firn(2)
            runs.append(f)
            f.start(hz, sampler_binary=binary)
    finally:
        pr.HTTP = "127.0.0.1:17999"
    w = subprocess.Popen([*work, str(seconds + 4)], stdout=subprocess.DEVNULL)
    try:
        time.sleep(2)
        before = [pr.bpf_stats([f.sampler.pid]) for f in runs]
        time.sleep(seconds)
        after = [pr.bpf_stats([f.sampler.pid]) for f in runs]
    finally:
        w.kill()
        w.wait()
        for f in runs:
            f.stop(settle=False)
    return [(n1 - n0) / max(1, c1 - c0) for (n0, c0), (n1, c1) in zip(before, after)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the baseline sampler binary")
    ap.add_argument("--b", required=True, help="the sampler binary measured against it")
    ap.add_argument("--hz", default="99,999")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--skip-build", action="store_true", help="take the workspace binaries as built")
    ap.add_argument("--together", action="store_true",
                    help="run A and B at once in each run (the ratio is then taken within each run)")
    ap.add_argument("--beat", type=int, default=0,
                    help="with --together: one sampler at Hz minus this (alternating which), so the two "
                         "timers' phases slide through each other within every run")
    ap.add_argument("--workloads", default="nofp,fp",
                    help="comma-separated, of: nofp (busy.c without frame pointers: the table walk), fp "
                         "(with them), syscalls (tests/workloads/syscalls.c: most of its samples in the "
                         "kernel, the user stack from the registers saved at entry), python (Debian's "
                         "python3 running tests/workloads/pydeep.py: the interpreter's frames read)")
    args = ap.parse_args()
    if args.beat and not args.together:
        sys.exit("sampler_ab.py: --beat needs --together")
    if os.geteuid() != 0:
        sys.exit("sampler_ab.py: run as root (the sampler loads BPF)")
    wanted = args.workloads.split(",")
    if not set(wanted) <= set(WORKLOADS):
        sys.exit(f"sampler_ab.py: --workloads takes {', '.join(WORKLOADS)}; got {args.workloads}")
    out = fb.build_all(args.skip_build)
    # Each: its command line, to which a run appends its seconds.
    workloads = {WORKLOADS[w]: workload(w, out) for w in wanted}
    old = pr._read("/proc/sys/kernel/bpf_stats_enabled").strip() or "0"
    open("/proc/sys/kernel/bpf_stats_enabled", "w").write("1")
    try:
        print("| workload | Hz | A ns/sample | B ns/sample | B/A |\n|---|---|---|---|---|")
        for name, work in workloads.items():
            for hz in [int(h) for h in args.hz.split(",")]:
                a, b, ratios = [], [], []
                for run in range(args.runs):
                    if args.together:
                        # The one started first alternates from run to run, the one at the
                        # lower rate (--beat) every other run.
                        b_low, a_first = bl.beat_turn(run)
                        ra, rb = (hz, hz - args.beat) if b_low else (hz - args.beat, hz)
                        if a_first:
                            x, y = together(args.a, args.b, (ra, rb), work, args.seconds)
                        else:
                            y, x = together(args.b, args.a, (rb, ra), work, args.seconds)
                        a.append(x)
                        b.append(y)
                        ratios.append(y / x)
                    else:
                        a.append(one(args.a, hz, work, args.seconds))
                        b.append(one(args.b, hz, work, args.seconds))
                (ma, la, ha), (mb, lb, hb) = bl.med(a), bl.med(b)
                ratio = f"{mb / ma:.2f}"
                if ratios:
                    mr, lr, hr = bl.med(ratios)
                    ratio = f"{mr:.2f} ({lr:.2f}–{hr:.2f}, within runs)"
                    gm = bl.ratio_mean(ratios)
                    if gm:
                        ratio += f"; geometric mean {gm[0]:.3f} ×/÷ {gm[1]:.3f} (1 SE, {gm[2]} runs)"
                print(f"| {name} | {hz} | {ma:,.0f} ({la:,.0f}–{ha:,.0f}) | {mb:,.0f} ({lb:,.0f}–{hb:,.0f}) "
                      f"| {ratio} |", flush=True)
    finally:
        open("/proc/sys/kernel/bpf_stats_enabled", "w").write(old)


if __name__ == "__main__":
    main()

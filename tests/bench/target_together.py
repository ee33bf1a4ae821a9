"""#31's BPF target with both profilers at once: firn's BPF ns per sample walking the
no-frame-pointer workload from tables, against bpftrace's walking the frame-pointer one
(`ustack`), measured in the same seconds so that the host's drift cancels.

  sudo python3 tests/bench/target_together.py [--hz 19,99] [--runs 4] [--phases 10] \\
      [--phase 2] [--beat 2] [--skip-build]

Why: the suite's target pairs (runs.target_pairs) run the two profilers back to back,
20 s each; on a VM whose per-sample cost drifts by up to 2x between runs, the pairs'
ratio moved from 0.66 to 0.97 between two runs of the same code. Here both profilers
sample for the whole run, and both workloads (busy.c without and with frame pointers,
one thread per CPU each) are alive for it, but only one runs at a time: the other is
held with SIGSTOP, and they take turns every `--phase` seconds. bpf_stats of each
profiler's programs is read at every turn, so each phase gives firn's and bpftrace's
ns per sample on one workload, and a run's ratio (firn on no-FP phases / bpftrace on
FP phases) is taken over phases a few seconds apart.

Both profilers' timers firing in the same periods, the one that fires second finds the
task's and the stack's cache lines warm; at one rate the two would keep their phase for
the whole run (see sampler_ab.py). So one of them samples at Hz - `--beat`, which one
alternating every two runs, the start order every run (use a multiple of 4 runs). Both being
attached at once, each pays for the other's cache traffic: the ratio is the figure,
not the absolute ns (reported beside it for what they are).

Before measuring, the no-frame-pointer workload runs for three of firn's rounds alone,
so its tables are built and loaded (the target is about the walk, not a first sample).

Prints per Hz: runs, firn ns on no-FP, bpftrace ns on FP (medians of the runs), the
within-run ratio (median, min-max; geometric mean ×/÷ its standard error), and firn
against bpftrace on the same FP phases."""
import argparse
import os
import signal
import subprocess
import sys
import time

import benchlib as bl
import profilers as pr
from runs import log, start_workload

ROUND = 2


def stats(profs):
    """bpf_stats (ns, runs) of each profiler's processes."""
    return [pr.bpf_stats(p.pids()) for p in profs]


def one_run(hz, run, nofp, fp, phases, phase, beat):
    """One run: {'firn': {'nofp': (ns, cnt), 'fp': …}, 'bpftrace': {…}}."""
    low, first = bl.beat_turn(run)  # firn at the lower rate, firn started first
    rates = {"firn": hz - beat if low else hz, "bpftrace": hz if low else hz - beat}
    order = ["firn", "bpftrace"] if first else ["bpftrace", "firn"]
    profs = {}
    works = {}
    try:
        for name in order:
            profs[name] = pr.Firn(ROUND) if name == "firn" else pr.Bpftrace()
            profs[name].start(rates[name])
        life = str(int(3 * ROUND + 2 * phases * (phase + 1) + 30))
        for kind, exe in (("fp", fp), ("nofp", nofp)):
            works[kind], _ = start_workload(exe, life)
            if kind == "fp":
                os.kill(works[kind].pid, signal.SIGSTOP)
        time.sleep(3 * ROUND + 1)  # no-FP alone: its tables built and loaded
        got = {name: {"nofp": [0, 0], "fp": [0, 0]} for name in profs}
        names = list(profs)
        for i in range(2 * phases):
            kind = "fp" if i % 2 == 0 else "nofp"
            other = "nofp" if kind == "fp" else "fp"
            os.kill(works[other].pid, signal.SIGSTOP)
            os.kill(works[kind].pid, signal.SIGCONT)
            time.sleep(0.2)  # the stopped one's last samples are past
            before = stats([profs[n] for n in names])
            time.sleep(phase)
            after = stats([profs[n] for n in names])
            for n, (n0, c0), (n1, c1) in zip(names, before, after):
                got[n][kind][0] += n1 - n0
                got[n][kind][1] += c1 - c0
        return rates, got
    finally:
        for w in works.values():
            try:
                os.kill(w.pid, signal.SIGCONT)
            except OSError:
                pass
            w.kill()
            w.wait()
        for name, p in profs.items():
            try:
                if name == "firn":
                    p.stop(settle=False)
                else:
                    p.stop()
            except Exception as e:  # reported, the next run goes on
                print(f"  stopping {name}: {e}", file=sys.stderr)


def per(got, name, kind):
    ns, cnt = got[name][kind]
    return ns / cnt if cnt else None


def measure(hzs, runs, nofp, fp, phases=10, phase=2.0, beat=2):
    """Every run at every Hz (bpf_stats must be on): a row per Hz, {'hz', 'firn',
    'bpftrace', 'ratios', 'same'} (per run: firn ns on no-FP, bpftrace ns on FP, their
    ratio, firn on FP over bpftrace on FP)."""
    rows = []
    for hz in hzs:
        row = {"hz": hz, "phases": phases, "phase": phase, "beat": beat,
               "firn": [], "bpftrace": [], "ratios": [], "same": []}
        for run in range(runs):
            try:
                rates, got = one_run(hz, run, nofp, fp, phases, phase, beat)
            except Exception as e:  # reported, not fatal: the suite's other parts stand
                log(f"together {hz} Hz {run + 1}/{runs} failed: {e}")
                continue
            f, b, ffp = per(got, "firn", "nofp"), per(got, "bpftrace", "fp"), per(got, "firn", "fp")
            log(f"together {hz} Hz {run + 1}/{runs} (firn {rates['firn']} Hz, bpftrace {rates['bpftrace']} Hz): "
                f"firn no-FP {f or 0:,.0f} ns, bpftrace FP {b or 0:,.0f} ns, firn FP {ffp or 0:,.0f} ns, "
                f"samples {got['firn']['nofp'][1]} / {got['bpftrace']['fp'][1]}")
            row["firn"].append(f)
            row["bpftrace"].append(b)
            row["ratios"] += bl.paired_ratios([(f, b)])
            row["same"] += bl.paired_ratios([(ffp, b)])
        rows.append(row)
    return rows


def table(rows):
    def show(rs):
        s = bl.fmt(bl.med(rs), "{:.2f}")
        gm = bl.ratio_mean(rs)
        return s + (f"; geometric mean {gm[0]:.3f} ×/÷ {gm[1]:.3f}" if gm else "")
    lines = ["| Hz | runs | firn ns, no frame pointers | bpftrace ns, frame pointers | firn / bpftrace within runs "
             "| firn / bpftrace, both on frame pointers |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['hz']} | {len(r['ratios'])} | {bl.fmt(bl.med(r['firn']), '{:.0f}')} "
                     f"| {bl.fmt(bl.med(r['bpftrace']), '{:.0f}')} | {show(r['ratios'])} | {show(r['same'])} |")
    return "\n".join(lines)


def section(rows):
    """The unwind section's paragraph and table (firn_bench.py)."""
    r0 = rows[0]
    return (f"The same target with both profilers at once (`target_together.py`: both workloads alive, "
            f"taking turns under SIGSTOP every {r0['phase']:g} s, {r0['phases']} turns each a run, one "
            f"profiler at Hz − {r0['beat']}), so the host's drift cancels within a run; the ratio is the "
            "figure, each profiler's ns include the other's cache traffic.\n\n" + table(rows))


def main():
    import firn_bench as fb  # it imports this module for its unwind part

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hz", default="19,99", help="frequencies, comma-separated (each run: one at Hz, one at Hz - beat)")
    ap.add_argument("--runs", type=int, default=4, help="runs per frequency (a multiple of 4 balances rates and order)")
    ap.add_argument("--phases", type=int, default=10, help="turns of each workload per run")
    ap.add_argument("--phase", type=float, default=2.0, help="seconds each turn is measured")
    ap.add_argument("--beat", type=int, default=2, help="one profiler samples at Hz minus this")
    ap.add_argument("--skip-build", action="store_true", help="take the workspace binaries as built")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("target_together.py: run as root (both profilers load BPF)")
    if args.runs < 1 or args.phases < 1 or args.phase <= 0 or args.beat < 0:
        sys.exit("target_together.py: --runs, --phases and --phase must be positive, --beat not negative")
    try:
        hzs = [int(h) for h in args.hz.split(",")]
    except ValueError:
        sys.exit(f"target_together.py: --hz wants whole numbers separated by commas, got {args.hz!r}")
    if min(hzs) - args.beat < 1:
        sys.exit("target_together.py: every --hz must exceed --beat")
    out = fb.build_all(args.skip_build)
    nofp, fp = fb.build_nofp(out), out / pr.COMM
    old = pr._read("/proc/sys/kernel/bpf_stats_enabled").strip() or "0"
    open("/proc/sys/kernel/bpf_stats_enabled", "w").write("1")
    try:
        rows = measure(hzs, args.runs, nofp, fp, args.phases, args.phase, args.beat)
    finally:
        open("/proc/sys/kernel/bpf_stats_enabled", "w").write(old)
    print(f"Both at once, {args.phases} turns of {args.phase:g} s per workload a run, beat {args.beat} Hz.")
    print(table(rows))


if __name__ == "__main__":
    main()

"""The sampler's memory through an exec storm: 1,000 processes a second of ~1 ms each
(tests/workloads/churn.c with CHURN_MS=1), firn at 99 Hz with 10 s rounds, as the scale
part's exec storm. Every 5 s through the storm and every 10 s for 40 s after it: the
sampler's VmRSS, RssAnon and RssFile (/proc/<pid>/status) and its own gauges
(heap_used_bytes and heap_free_bytes from glibc's mallinfo2, processes_known), so a
peak can be told apart into code pages, the heap and the records held. The enricher's
peak (VmHWM) is reported beside.

  sudo python3 tests/bench/sampler_storm.py [--b target/release/firn-sampler] \\
      [--a OLD/firn-sampler] [--pairs 2] [--seconds 60]

With --a, the two builds run in alternation (A first), and the medians of each and B/A
are printed: the machine's drift between runs is shared. Builds to compare should be
built alike (`cargo build --release -p firn-sampler`: the workspace build unifies
features and gives another binary). Needs the workloads (firn_bench.py builds them)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import firn_bench as fb
import runs

STATUS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
GAUGES = ("firn_sampler_heap_used_bytes", "firn_sampler_heap_free_bytes",
          "firn_sampler_processes_known")


def status(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS:
                out[key] = int(value.split()[0]) / 1024
    return out


def point(f, t):
    m = f.metrics()
    p = {"t": round(t, 1), **{k: round(v, 2) for k, v in status(f.sampler.pid).items()}}
    for k in GAUGES:
        if k in m:
            name = k.removeprefix("firn_sampler_")
            p[name] = round(m[k] / (1 << 20), 2) if name.endswith("bytes") else m[k]
    return p


def storm(out, binary, seconds, rate):
    f = runs.ChurnFirn(10, out / "unwind-cache")
    f.start(99, sampler_binary=binary)
    try:
        time.sleep(12)
        before = point(f, 0)
        churn = subprocess.Popen([str(out / "churn"), str(seconds), str(rate), str(out / "churn-child")],
                                 stdout=subprocess.PIPE, text=True, env=dict(os.environ, CHURN_MS="1"))
        churn.stdout.readline()
        t0, during = time.time(), []
        while churn.poll() is None:
            time.sleep(5)
            during.append(point(f, time.time() - t0))
            print("  ", json.dumps(during[-1]), flush=True)
        churn.stdout.read()
        after = []
        for _ in range(4):
            time.sleep(10)
            after.append(point(f, time.time() - t0))
        print("   after:", json.dumps(after[-1]), flush=True)
        m = f.metrics()
    finally:
        stopped = f.stop()
    return {
        "enricher_peak_mib": round(stopped.get("rss_peak_enricher_kib", 0) / 1024, 2),
        "peak_mib": max(p["VmHWM"] for p in during + after),
        "rss_max_mib": max(p["VmRSS"] for p in during),
        "anon_max_mib": max(p["RssAnon"] for p in during),
        "file_mib": during[-1]["RssFile"],
        "heap_used_max_mib": max((p.get("heap_used_bytes", 0) for p in during), default=0),
        "heap_used_before_mib": before.get("heap_used_bytes", 0),
        "heap_used_after_mib": after[-1].get("heap_used_bytes", 0),
        "processes_max": max((p.get("processes_known", 0) for p in during), default=0),
        "events_lost": m.get("firn_sampler_bpf_events_lost", 0),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", default=str(fb.ROOT / "target" / "release" / "firn-sampler"),
                    help="the sampler build measured (default: target/release/firn-sampler)")
    ap.add_argument("--a", help="a baseline sampler build, run in alternation with --b")
    ap.add_argument("--pairs", type=int, default=2, help="runs of each build (default 2)")
    ap.add_argument("--seconds", type=int, default=60, help="length of each storm (default 60)")
    ap.add_argument("--rate", type=int, default=1000, help="processes a second (default 1000)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("sampler_storm.py needs root (it starts the sampler)")
    out = fb.build_all(True)
    builds = [("A", args.a), ("B", args.b)] if args.a else [("B", args.b)]
    results = {name: [] for name, _ in builds}
    for i in range(args.pairs):
        for name, binary in builds:
            print(f"run {i + 1} {name}: {binary}", flush=True)
            r = storm(out, binary, args.seconds, args.rate)
            print(f"run {i + 1} {name}:", json.dumps(r), flush=True)
            results[name].append(r)
    for key in ("peak_mib", "rss_max_mib", "anon_max_mib", "heap_used_max_mib", "heap_used_after_mib",
                "enricher_peak_mib"):
        med = {n: statistics.median(r[key] for r in rs) for n, rs in results.items()}
        line = "  ".join(f"{n} {v:.2f} ({min(r[key] for r in results[n]):.2f}-"
                         f"{max(r[key] for r in results[n]):.2f})" for n, v in med.items())
        ratio = f"  B/A {med['B'] / med['A']:.2f}" if "A" in med and med["A"] else ""
        print(f"{key:22s} {line}{ratio}")


if __name__ == "__main__":
    main()

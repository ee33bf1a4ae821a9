"""The sampler's memory under process churn: A/B of two builds of firn-sampler, run
after run in alternation beside the same enricher, each through the scale part's churn
(50 short processes a second, 20 ms each) and its exec storm (1,000 a second, 1 ms
each). The scale part takes 10 minutes of churn and runs one build; this tells two
builds apart in a few minutes.

  sudo python3 tests/bench/churn_rss.py --a OLD/firn-sampler --b target/release/firn-sampler \\
      [--runs 2] [--churn-seconds 120] [--storm-seconds 60]

Prints, per load, the median (min-max) of each build's peak RSS (VmHWM), of its
largest VmRSS seen every 5 s, and B/A. An old build: `git worktree add /tmp/old
<commit>` and `cargo build --release -p firn-sampler --target-dir /tmp/old-target`
there (never the workspace's own target directory)."""
import argparse
import os
import sys

import benchlib as bl
import firn_bench as fb
from runs import scale_churn


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the baseline sampler binary")
    ap.add_argument("--b", required=True, help="the sampler binary measured against it")
    ap.add_argument("--runs", type=int, default=2, help="runs of each build per load (2)")
    ap.add_argument("--churn-seconds", type=int, default=120, help="length of each churn run (120)")
    ap.add_argument("--storm-seconds", type=int, default=60, help="length of each exec storm (60; 0: none)")
    ap.add_argument("--skip-build", action="store_true", help="take the workspace binaries as built")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: sudo python3 tests/bench/churn_rss.py")
    for b in (args.a, args.b):
        if not os.access(b, os.X_OK):
            sys.exit(f"not an executable: {b}")
    out = fb.build_all(args.skip_build)
    loads = [("churn", args.churn_seconds, 50, 20)]
    if args.storm_seconds > 0:
        loads.append(("exec storm", args.storm_seconds, 1000, 1))
    res = {}
    for label, seconds, rate, ms in loads:
        for _ in range(args.runs):
            for name, binary in (("A", args.a), ("B", args.b)):
                r = scale_churn(out, [out / "churn-child"], seconds, rate, 99, 10, label, ms=ms,
                                sampler_binary=binary)
                res.setdefault((label, name), []).append(
                    (r["sampler_rss_peak_mib"], max((p[1] for p in r["sampler_rss_points"]), default=0.0)))
    print("| load | measure | A MiB | B MiB | B/A |\n|---|---|---|---|---|")
    for label, *_ in loads:
        for i, measure in enumerate(("peak (VmHWM)", "largest VmRSS")):
            a = [x[i] for x in res[(label, "A")]]
            b = [x[i] for x in res[(label, "B")]]
            (am, alo, ahi), (bm, blo, bhi) = bl.med(a), bl.med(b)
            print(f"| {label} | {measure} | {am:.1f} ({alo:.1f}–{ahi:.1f}) | {bm:.1f} ({blo:.1f}–{bhi:.1f}) "
                  f"| {bm / am:.2f} |")


if __name__ == "__main__":
    main()

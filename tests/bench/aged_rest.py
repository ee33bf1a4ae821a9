"""The enricher at rest after a day: A/B of two builds of firn-enricher on an idle node
whose output directory already holds a day of rounds (8,640 round folders of 10 s
rounds by default, five small profiles and an index each, as a node at rest leaves
them), run after run in alternation, beside the same sampler. The firn_bench.py rest
part starts from an empty directory, so what grows with the rounds kept never shows
there.

  sudo python3 tests/bench/aged_rest.py --a OLD/firn-enricher --b target/release/firn-enricher \\
      [--rounds 8640] [--runs 2] [--hz 99] [--warm 30] [--window 60]

Prints the median (min-max) of each build's CPU over the window (ms/s) and B/A. An old
build: `git worktree add /tmp/old <commit>` and `cargo build --release -p firn-enricher
--target-dir /tmp/old-target` there (never the workspace's own target directory)."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import benchlib as bl
import firn_bench as fb
import profilers as pr


class Aged(pr.Firn):
    """firn with an output directory that holds `rounds` rounds written before it
    started, all younger than the retention age."""

    def __init__(self, rnd, rounds):
        super().__init__(rnd)
        self.rounds = rounds

    def prepare(self, plan):
        out = plan["out"]
        st = os.stat(out)
        t = time.gmtime(time.time() - self.rounds * self.rnd)
        base = time.mktime(t)
        for i in range(self.rounds):
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(base + i * self.rnd))
            d = os.path.join(out, f"{stamp}Z-r{i + 1:06d}")
            os.mkdir(d)
            for p in range(5):
                with open(os.path.join(d, f"pid-{100 + p}.pb.gz"), "wb") as f:
                    f.write(b"\0" * 2048)
            with open(os.path.join(d, "index.jsonl"), "w") as f:
                for p in range(5):
                    f.write(json.dumps({"file": f"pid-{100 + p}.pb.gz", "labels": {"pid": str(100 + p)},
                                        "samples": 0, "round": i + 1}) + "\n")
            for name in os.listdir(d):
                os.chown(os.path.join(d, name), st.st_uid, st.st_gid)
            os.chown(d, st.st_uid, st.st_gid)


def one(binary, hz, rnd, rounds, warm, window):
    f = Aged(rnd, rounds)
    f.start(hz, enricher_binary=binary)
    try:
        time.sleep(max(0.0, warm - (time.time() - f.t0)))
        e = f.enricher.pid
        c0, t0 = pr.proc_cpu(e), time.time()
        time.sleep(window)
        c1, t1 = pr.proc_cpu(e), time.time()
    finally:
        f.stop(settle=False)
        shutil.rmtree(f.tmp, ignore_errors=True)
    return 1000 * (c1 - c0) / (t1 - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="the baseline enricher binary")
    ap.add_argument("--b", required=True, help="the enricher binary measured against it")
    ap.add_argument("--rounds", type=int, default=8640, help="round folders already kept (8640: a day of 10 s rounds)")
    ap.add_argument("--round", type=int, default=10, help="round length, s (10)")
    ap.add_argument("--hz", type=int, default=99)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--warm", type=int, default=30)
    ap.add_argument("--window", type=int, default=60)
    ap.add_argument("--skip-build", action="store_true", help="take the workspace binaries as built")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("aged_rest.py: run as root (the sampler loads BPF)")
    fb.build_all(args.skip_build)
    a, b = [], []
    for i in range(args.runs):
        for binary, got in ((args.a, a), (args.b, b)):
            got.append(one(binary, args.hz, args.round, args.rounds, args.warm, args.window))
            print(f"aged rest: run {i + 1}, {binary}: {got[-1]:.2f} ms/s", file=sys.stderr, flush=True)
    (ma, la, ha), (mb, lb, hb) = bl.med(a), bl.med(b)
    print(f"| rounds kept | Hz | A enricher ms/s | B enricher ms/s | B/A |\n|---|---|---|---|---|\n"
          f"| {args.rounds:,} | {args.hz} | {ma:.2f} ({la:.2f}–{ha:.2f}) | {mb:.2f} ({lb:.2f}–{hb:.2f}) "
          f"| {mb / ma:.2f} |", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""firn overhead benchmark (run as root): `sudo python3 tests/bench/firn_bench.py`.

Runs the clang-built busy workload on every CPU, interleaving runs without firn (A)
and with it (B: the sampler and the real enricher in its default configuration,
writing profiles of every process to a temporary directory, running as an
unprivileged user), and reports per B run: CPU time of each as a share of one core,
their RSS, the BPF program's cost per sample (kernel.bpf_stats_enabled run_time_ns /
run_cnt, read from the sampler's prog fdinfo), samples captured vs expected (from the
sampler's counter and the workload's profiles), and workload throughput as a ratio to
the A runs of the same session. Medians with min-max. Writes target/bench/sampler.json
and rewrites the firn section of BENCHMARKS.md.
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release"


def build():
    subprocess.run(["cargo", "build", "--release", "--locked", "--workspace", "--bins"], cwd=ROOT, check=True)
    out = ROOT / "target" / "workloads"
    out.mkdir(parents=True, exist_ok=True)
    exe = out / "busy-bench"
    subprocess.run(["clang", "-O2", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer",
                    "-pthread", "-o", str(exe), str(ROOT / "tests/workloads/busy.c")], check=True)
    return exe


def cpu_seconds(pid):
    """CPU time of every thread of pid, in ns resolution (schedstat), as seconds."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def bpf_stats(pid):
    run_ns = cnt = 0
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            text = open(f"/proc/{pid}/fdinfo/{fd}").read()
        except OSError:
            continue
        if "prog_type" in text and "run_cnt" in text:
            run_ns += int(re.search(r"run_time_ns:\s+(\d+)", text).group(1))
            cnt += int(re.search(r"run_cnt:\s+(\d+)", text).group(1))
    return run_ns, cnt


def run_workload(exe, seconds):
    p = subprocess.Popen([str(exe), str(seconds)], stdout=subprocess.PIPE, text=True)
    pid = None
    for line in p.stdout:
        if line.startswith("ready"):
            pid = int(line.split()[1])
            break
    return p, pid


def finish_workload(p):
    out = p.stdout.read()
    p.wait()
    m = re.search(r"iterations_per_second ([\d.]+)", out)
    return float(m.group(1)) if m else float("nan")


def run_a(exe, seconds):
    p, _ = run_workload(exe, seconds)
    return {"throughput": finish_workload(p)}


def bench_user():
    """The unprivileged user the enricher runs as (created if missing)."""
    name = "firn-bench"
    if subprocess.run(["id", name], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        "--user-group", name], check=True)
    uid = int(subprocess.run(["id", "-u", name], capture_output=True, text=True).stdout)
    gid = int(subprocess.run(["id", "-g", name], capture_output=True, text=True).stdout)
    return uid, gid


def run_b(exe, seconds, freq, rnd):
    tmp = tempfile.mkdtemp(prefix="firn-bench-")
    os.chmod(tmp, 0o755)
    uid, gid = bench_user()
    sock = os.path.join(tmp, "s.sock")
    out = os.path.join(tmp, "profiles")
    os.mkdir(out)
    os.chown(out, uid, gid)
    log = open(os.path.join(tmp, "sampler.log"), "w")
    sampler = subprocess.Popen([str(BIN / "firn-sampler"), "--socket", sock, "--frequency", str(freq),
                                "--round", str(rnd), "--allow-uid", str(uid), "--socket-group", str(gid)],
                               stderr=log)
    for _ in range(200):
        if os.path.exists(sock):
            break
        time.sleep(0.05)
    enricher = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                                 str(BIN / "firn-enricher"), "--socket", sock, "--output-dir", out,
                                 "--http-address", "127.0.0.1:17999"],
                                stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "enricher.log"), "w"))
    time.sleep(2 * rnd + 0.5)  # first rounds handled (binaries loaded): steady state
    pids = [sampler.pid, enricher.pid]
    c0, (ns0, n0) = [cpu_seconds(p) for p in pids], bpf_stats(sampler.pid)
    t0 = time.time()
    w, wpid = run_workload(exe, seconds)
    throughput = finish_workload(w)
    wall = time.time() - t0
    c1, (ns1, n1) = [cpu_seconds(p) for p in pids], bpf_stats(sampler.pid)
    rss = [status_kib(p, "VmRSS") for p in pids]
    hwm = [status_kib(p, "VmHWM") for p in pids]
    time.sleep(rnd + 2)  # the round holding the workload's end
    for p in (enricher, sampler):
        p.terminate()
        p.wait()
    captured = 0
    for d in sorted(os.listdir(out)):
        try:
            index = open(os.path.join(out, d, "index.jsonl")).read().splitlines()
        except OSError:
            continue
        for line in index:
            e = json.loads(line)
            if e["labels"].get("pid") == str(wpid):
                captured += e["samples"]
    subprocess.run(["rm", "-rf", tmp])
    expected = freq * seconds * os.cpu_count()
    return {
        "throughput": throughput,
        "sampler_cpu_share_of_core": (c1[0] - c0[0]) / wall,
        "enricher_cpu_share_of_core": (c1[1] - c0[1]) / wall,
        "sampler_rss_peak_kib": hwm[0],
        "sampler_rss_kib": rss[0],
        "enricher_rss_peak_kib": hwm[1],
        "enricher_rss_kib": rss[1],
        "bpf_ns_per_sample": (ns1 - ns0) / max(1, n1 - n0),
        "bpf_runs": n1 - n0,
        "captured": captured,
        "expected": expected,
    }


def med(xs):
    xs = [x for x in xs if x == x]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (float("nan"),) * 3


def fmt(t, spec="{:.3g}"):
    return f"{spec.format(t[0])} ({spec.format(t[1])}–{spec.format(t[2])})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--frequency", type=int, default=19)
    ap.add_argument("--round", type=int, default=10)
    ap.add_argument("--no-update", action="store_true", help="do not rewrite BENCHMARKS.md")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: sudo python3 tests/bench/firn_bench.py")
    exe = build()
    old = open("/proc/sys/kernel/bpf_stats_enabled").read().strip()
    open("/proc/sys/kernel/bpf_stats_enabled", "w").write("1")
    a, b = [], []
    try:
        for i in range(args.pairs):
            print(f"pair {i + 1}/{args.pairs}: A (no profiler) …", flush=True)
            a.append(run_a(exe, args.seconds))
            print(f"pair {i + 1}/{args.pairs}: B (firn-sampler) …", flush=True)
            b.append(run_b(exe, args.seconds, args.frequency, args.round))
    finally:
        open("/proc/sys/kernel/bpf_stats_enabled", "w").write(old)
    base = statistics.median(r["throughput"] for r in a)
    res = {
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")},
        "params": vars(args),
        "a": a,
        "b": b,
        "summary": {
            "throughput_ratio": med([r["throughput"] / base for r in b]),
            "sampler_cpu_percent_of_core": med([100 * r["sampler_cpu_share_of_core"] for r in b]),
            "sampler_rss_peak_mib": med([r["sampler_rss_peak_kib"] / 1024 for r in b]),
            "sampler_rss_mib": med([r["sampler_rss_kib"] / 1024 for r in b]),
            "enricher_cpu_percent_of_core": med([100 * r["enricher_cpu_share_of_core"] for r in b]),
            "enricher_rss_mib": med([r["enricher_rss_kib"] / 1024 for r in b]),
            "enricher_rss_peak_mib": med([r["enricher_rss_peak_kib"] / 1024 for r in b]),
            "bpf_ns_per_sample": med([r["bpf_ns_per_sample"] for r in b]),
            "captured_vs_expected": med([r["captured"] / r["expected"] for r in b]),
        },
    }
    out = ROOT / "target" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler.json").write_text(json.dumps(res, indent=1))
    s = res["summary"]
    table = "\n".join([
        f"Run {res['machine']['date']}, kernel {res['machine']['kernel']}, {res['machine']['cpus']} CPUs, "
        f"{args.frequency} Hz, {args.round} s rounds, {args.pairs} interleaved pairs of {args.seconds} s "
        "(median, min–max):",
        "",
        "| measure | result | target |",
        "|---|---|---|",
        f"| workload throughput with firn / without | {fmt(s['throughput_ratio'], '{:.4f}')} | – |",
        f"| sampler CPU, % of one core | {fmt(s['sampler_cpu_percent_of_core'], '{:.3f}')} | ≤ 0.05 |",
        f"| sampler steady RSS (VmRSS), MiB | {fmt(s['sampler_rss_mib'], '{:.1f}')} | ≤ 8 |",
        f"| sampler peak RSS incl. setup (VmHWM), MiB | {fmt(s['sampler_rss_peak_mib'], '{:.1f}')} | – |",
        f"| enricher CPU, % of one core | {fmt(s['enricher_cpu_percent_of_core'], '{:.3f}')} | ≤ 0.5 |",
        f"| enricher steady RSS (VmRSS), MiB | {fmt(s['enricher_rss_mib'], '{:.1f}')} | ≤ 64 |",
        f"| enricher peak RSS (VmHWM), MiB | {fmt(s['enricher_rss_peak_mib'], '{:.1f}')} | – |",
        f"| BPF cost per sample, ns | {fmt(s['bpf_ns_per_sample'], '{:.0f}')} | reported |",
        f"| workload samples in its profiles / (Hz × s × CPUs) | {fmt(s['captured_vs_expected'], '{:.3f}')} | ≈ 1 |",
    ])
    print(table)
    if not args.no_update:
        bm = ROOT / "BENCHMARKS.md"
        text = bm.read_text()
        start, end = "<!-- firn-bench:start -->", "<!-- firn-bench:end -->"
        i, j = text.index(start) + len(start), text.index(end)
        bm.write_text(text[:i] + "\n" + table + "\n" + text[j:])
        print(f"updated {bm}")


if __name__ == "__main__":
    main()

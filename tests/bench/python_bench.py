"""The Python part of the benchmark suite (firn_bench.py --parts python): what a
Python sample costs in BPF beside a native one of similar depth (both without frame
pointers, one process per CPU, runs interleaved), the kernel memory of the Python
walk's maps, and the enricher with 50 Python processes."""
import os
import re
import subprocess
import time

import benchlib as bl
from profilers import ROOT, Firn, bpf_stats, proc_cpu, status_kib
from runs import log

# The Python walk's maps (python.bpf.h) by (map type, key size, value size).
PY_MAPS = {(1, 4, 136): "pyprocs", (1, 8, 3992): "pycode", (9, 4, 8): "pythreads", (9, 8, 1): "pyseen"}


def build_deep(out):
    exe = out / "deep-nofp"
    subprocess.run(["gcc", "-O2", "-g", "-o", str(exe), str(ROOT / "tests/workloads/deep.c")], check=True)
    return exe


def python_maps(pid):
    """name → (max_entries, memlock bytes) of the Python walk's maps."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            text = open(f"/proc/{pid}/fdinfo/{fd}").read()
        except OSError:
            continue
        if "map_type" not in text:
            continue
        t = re.search(r"map_type:\s+(\d+)", text)
        k = re.search(r"key_size:\s+(\d+)", text)
        v = re.search(r"value_size:\s+(\d+)", text)
        n = re.search(r"max_entries:\s+(\d+)", text)
        m = re.search(r"memlock:\s+(\d+)", text)
        name = PY_MAPS.get((int(t.group(1)), int(k.group(1)), int(v.group(1)))) if t and k and v else None
        if name and m:
            out[name] = (int(n.group(1)), int(m.group(1)))
    return out


def frames(m):
    keys = ("firn_sampler_bpf_unwind_table_frames", "firn_sampler_bpf_unwind_fp_frames",
            "firn_sampler_bpf_python_frames")
    return sum(m.get(k, 0) for k in keys), m.get("firn_sampler_bpf_samples", 0)


def cost_run(kind, hz, rnd, seconds, deep):
    """BPF ns per sample and frames per sample, `kind` "python" or "native"."""
    log(f"python: {kind} at {hz} Hz …")
    f = Firn(rnd)
    f.start(hz)
    n = os.cpu_count()
    if kind == "python":
        cmd = ["python3", str(ROOT / "tests/workloads/pydeep.py"), str(seconds + 3 * rnd + 20)]
    else:
        cmd = [str(deep), str(seconds + 3 * rnd + 20)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL) for _ in range(n)]
    # Tables and interpreter records in, names copied: two rounds and a margin.
    time.sleep(2 * rnd + 5)
    s, _ = f.pids()
    b0, m0 = bpf_stats([s]), f.metrics()
    time.sleep(seconds)
    b1, m1 = bpf_stats([s]), f.metrics()
    maps = python_maps(s)
    for p in procs:
        p.kill()
        p.wait()
    f.stop(settle=False)
    (fr0, n0), (fr1, n1) = frames(m0), frames(m1)
    runs = b1[1] - b0[1]
    return {"kind": kind, "hz": hz,
            "bpf_ns_per_sample": (b1[0] - b0[0]) / runs if runs else float("nan"),
            "frames_per_sample": (fr1 - fr0) / (n1 - n0) if n1 > n0 else float("nan"),
            "python_frames": m1.get("firn_sampler_bpf_python_frames", 0) - m0.get("firn_sampler_bpf_python_frames", 0),
            "maps": maps}


def many_run(hz, rnd, count=50, warm=30, window=60):
    """The enricher with `count` Python processes, each a small loop that sleeps."""
    log(f"python: {count} Python processes at {hz} Hz …")
    code = ("import time\ndef work():\n    x = 0\n    for i in range(20000):\n        x = (x * 31 + i) % 1000003\n"
            "    return x\nwhile True:\n    work()\n    time.sleep(0.05)\n")
    procs = [subprocess.Popen(["python3", "-c", code]) for _ in range(count)]
    f = Firn(rnd)
    f.start(hz)
    time.sleep(warm)
    s, e = f.pids()
    c0, t0 = {p: proc_cpu(p) for p in (s, e)}, time.time()
    time.sleep(window)
    c1, t1 = {p: proc_cpu(p) for p in (s, e)}, time.time()
    m = f.metrics()
    r = {"processes": count, "hz": hz,
         "sampler_ms_per_s": (c1[s] - c0[s]) / (t1 - t0) * 1e3,
         "enricher_ms_per_s": (c1[e] - c0[e]) / (t1 - t0) * 1e3,
         "enricher_rss_mib": status_kib(e, "VmRSS") / 1024,
         "sampler_rss_mib": status_kib(s, "VmRSS") / 1024,
         "interpreters_sent": m.get("firn_enricher_python_interpreters_sent_total", 0),
         "code_received": m.get("firn_enricher_python_code_received_total", 0),
         "maps": python_maps(s)}
    for p in procs:
        p.kill()
        p.wait()
    f.stop(settle=False)
    return r


def run(out, hz, rnd, seconds, pairs):
    deep = build_deep(out)
    runs = []
    for _ in range(pairs):
        for kind in ("native", "python"):
            runs.append(cost_run(kind, hz, rnd, seconds, deep))
    return {"cost": runs, "many": many_run(hz, rnd)}


def report(res):
    """The BENCHMARKS.md section."""
    def med(kind, key):
        return bl.med([r[key] for r in res["cost"] if r["kind"] == kind])

    nat, py = med("native", "bpf_ns_per_sample"), med("python", "bpf_ns_per_sample")
    lines = ["| workload (one process per CPU, no frame pointers) | BPF ns per sample | frames per sample |",
             "|---|---|---|"]
    for kind, label in (("native", "native: gcc -O2, 20 nested calls (`tests/workloads/deep.c`)"),
                        ("python", "Python: Debian's python3, 12 nested calls (`tests/workloads/pydeep.py`)")):
        ns, fr = med(kind, "bpf_ns_per_sample"), med(kind, "frames_per_sample")
        lines.append(f"| {label} | {bl.fmt(ns, '{:.0f}')} | {bl.fmt(fr, '{:.1f}')} |")
    lines.append("")
    lines.append(f"A Python sample costs **{py[0] / nat[0]:.2f}×** a native one by the medians, "
                 f"{py[1] / nat[1]:.2f}× by the fastest runs ({len(res['cost']) // 2} interleaved pairs; "
                 "target ≤ 1.5×).")
    many = res["many"]
    lines += ["", f"With {many['processes']} Python processes (each a short loop, then 50 ms asleep), 99 Hz, "
              f"CPU over 60 s after 30 s: sampler {many['sampler_ms_per_s']:.2f} ms/s, "
              f"enricher {many['enricher_ms_per_s']:.2f} ms/s; RSS sampler {many['sampler_rss_mib']:.1f} MiB, "
              f"enricher {many['enricher_rss_mib']:.1f} MiB; {int(many['interpreters_sent'])} interpreter records, "
              f"{int(many['code_received'])} code objects named.", "",
              "| map (kernel memory, memlock) | entries | with 50 Python processes |", "|---|---|---|"]
    for name, (entries, mem) in sorted(many["maps"].items()):
        lines.append(f"| `{name}` | {entries:,} | {mem / 1024:.0f} KiB |")
    return "\n".join(lines)

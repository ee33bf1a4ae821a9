#!/usr/bin/env python3
"""firn benchmark suite (root): `sudo python3 tests/bench/firn_bench.py`.

Measures firn (the sampler, and the real enricher in its default configuration with the
local sink, as an unprivileged user) side by side with `perf record -F HZ -a -g`,
bpftrace (`profile:hz:HZ { @[kstack, ustack, comm] = count(); }`) and BCC's
`profile -F HZ -f`, on the same machine in the same run:

  overhead  a CPU-bound workload on every CPU (tests/workloads/busy.c, reports its own
            iterations per second), with no profiler and with each profiler, at each
            frequency; runs interleaved (none, firn, perf, bpftrace, bcc, none, …);
  idle      the same profilers with no workload;
  unwind    firn and bpftrace on busy.c built with plain gcc -O2 (no frame pointers:
            firn walks it from tables); then #31's target, firn on that build against
            bpftrace on the frame-pointer one, in pairs of runs back to back and with
            both profilers at once, the workloads taking turns (target_together.py);
  rest      firn only, its cost of being installed: idle, idle with a program firn has
            never seen started at the window's start (another Python interpreter than
            the harness's, with some extension modules: its first wave of table loads
            and symbol parses), and busy (one busy thread per CPU), at each frequency;
            each half's CPU over 60 s after 30 s of warm-up, its RSS every 2 s and its
            peak (VmHWM over its whole life);
  upload    firn only, busy at 99 Hz: the enricher with the local sink alone, and with
            OTLP, Parca and OpenSearch uploads on (to the test receivers in tests/receivers/, set
            up by tests/setup-tools.sh), interleaved; CPU over 60 s after 30 s, RSS,
            peak, and bytes sent per round and per 1,000 samples;
  python    firn only: BPF ns per sample of a Python workload beside a native one of
            similar depth (no frame pointers, interleaved), the Python walk's map memory,
            and both halves with 50 Python processes;
  offcpu    firn only: `perf bench sched pipe` (pinned) with no firn, firn, firn
            --off-cpu and firn --off-cpu --off-cpu-rate 0, interleaved: throughput
            (bpf_stats off), BPF ns per switch (bpf_stats on), both halves' CPU; both
            halves at rest with and without the flag;
  scale     firn only: 1,000 mostly idle processes plus the workload; a storm of
            short-lived processes (attribution to the right executable, enricher RSS
            trend); 200 distinct executables (symbol cache size and hit rate).

Every figure is a median with min–max over the repetitions, workload throughput as a
ratio to the no-profiler runs of the same session. Installs linux-perf, bpftrace and
bpfcc-tools (plus kernel headers for BCC) when missing. Writes target/bench/suite.json
and rewrites the generated sections of BENCHMARKS.md (unless --no-update).
`--smoke` runs a short firn-only overhead pass (CI: the harness cannot rot; numbers are
not judged).
"""
import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
import offcpu_bench  # noqa: E402
import python_bench  # noqa: E402
from profilers import BCC_PROFILE, COMM, ROOT, Bcc, Bpftrace, Firn, Perf, _read  # noqa: E402
import target_together  # noqa: E402
from runs import (  # noqa: E402
    LIVE, REST_LIVE, log, one_run, rest_run, scale_churn, scale_many_processes, series, target_pairs,
    target_table, upload_run)

WORK = ROOT / "target" / "bench"


# ---------------------------------------------------------------- set-up

def install_peers():
    need = [pkg for pkg, have in (("linux-perf", shutil.which("perf")),
                                  ("bpftrace", shutil.which("bpftrace")),
                                  ("bpfcc-tools", os.path.exists(BCC_PROFILE))) if not have]
    if need:
        log("installing", " ".join(need))
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *need], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def bcc_headers():
    """BCC compiles its program against /lib/modules/$(uname -r)/build. Kernels without
    a headers package (this VM's) get Debian's linux-headers-amd64 linked there; the
    program BCC's profile compiles reads no kernel structure, so their version does not
    matter. Returns the links made, to be removed afterwards."""
    build = Path("/lib/modules") / platform.release() / "build"
    if build.exists() or os.path.exists("/sys/kernel/kheaders.tar.xz"):
        return []
    heads = sorted(Path("/usr/src").glob("linux-headers-*-amd64"))
    if not heads:
        subprocess.run(["apt-get", "install", "-y", "linux-headers-amd64"], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        heads = sorted(Path("/usr/src").glob("linux-headers-*-amd64"))
    common = Path(str(heads[-1]).replace("-amd64", "-common"))
    build.parent.mkdir(parents=True, exist_ok=True)
    made = [build]
    build.symlink_to(heads[-1])
    if common.exists() and not (build.parent / "source").exists():
        (build.parent / "source").symlink_to(common)
        made.append(build.parent / "source")
    return made


def build_all(skip_cargo):
    if not skip_cargo:
        subprocess.run(["cargo", "build", "--release", "--locked", "--workspace", "--bins"],
                       cwd=ROOT, check=True)
    out = ROOT / "target" / "workloads"
    out.mkdir(parents=True, exist_ok=True)
    cc = ["clang", "-O2", "-g", "-fno-omit-frame-pointer", "-mno-omit-leaf-frame-pointer"]
    w = ROOT / "tests" / "workloads"
    subprocess.run([*cc, "-pthread", "-o", str(out / COMM), str(w / "busy.c")], check=True)
    subprocess.run([*cc, "-o", str(out / "churn"), str(w / "churn.c")], check=True)
    subprocess.run([*cc, "-o", str(out / "idlers"), str(w / "idlers.c")], check=True)
    subprocess.run([*cc, "-o", str(out / "churn-child"), str(w / "churn_child.c")], check=True)
    return out


def build_nofp(out):
    """busy.c as a distribution builds it: gcc -O2, no frame pointers (same comm)."""
    d = out / "nofp"
    d.mkdir(exist_ok=True)
    exe = d / COMM
    subprocess.run(["gcc", "-O2", "-g", "-pthread", "-o", str(exe), str(ROOT / "tests/workloads/busy.c")],
                   check=True)
    return exe


def kernel_memory_table(kmem):
    """The sampler's BPF map memory by map type, and the unwind tables per binary."""
    names = {1: "hash", 2: "array", 6: "percpu array", 7: "stack trace", 9: "LRU hash",
             27: "ring buffer"}
    lines = ["| BPF maps (type: count) | kernel memory (memlock) |", "|---|---|"]
    total = 0
    for t, maps in sorted(kmem["maps_by_type"].items(), key=lambda kv: int(kv[0])):
        b = sum(m[1] for m in maps)
        total += b
        lines.append(f"| {names.get(int(t), t)}: {len(maps)} | {b / 2**20:.1f} MiB |")
    lines.append(f"| **all maps** | **{total / 2**20:.1f} MiB** |")
    tables = sorted(kmem["tables"].items(), key=lambda kv: -kv[1])
    rows = sum(r for _, r in tables)
    lines += ["", f"Unwind tables loaded: {len(tables)} binaries, {rows:,} rows, "
              f"{rows * 8 / 2**20:.1f} MiB of the row pool (8 bytes a row).", "",
              "| binary | rows | KiB |", "|---|---|---|"]
    for path, r in tables[:15]:
        lines.append(f"| `{path}` | {r:,} | {r * 8 / 1024:.0f} |")
    if len(tables) > 15:
        rest = sum(r for _, r in tables[15:])
        lines.append(f"| {len(tables) - 15} others | {rest:,} | {rest * 8 / 1024:.0f} |")
    return "\n".join(lines)


def many_binaries(out, n):
    """n distinct executables (distinct build ids) of the churn child."""
    d = out / "many"
    d.mkdir(exist_ok=True)
    obj = d / "child.o"
    subprocess.run(["clang", "-O2", "-g", "-fno-omit-frame-pointer", "-c", "-o", str(obj),
                    str(ROOT / "tests/workloads/churn_child.c")], check=True)
    exes = []
    for i in range(n):
        exe = d / f"churn-bin-{i:03d}"
        if not exe.exists():
            subprocess.run(["clang", f"-Wl,--build-id=0x{0xf12a0000 + i:08x}", "-o", str(exe), str(obj)],
                           check=True)
        exes.append(exe)
    return exes


# ---------------------------------------------------------------- workloads

def matrix(freqs, profilers, kind, pairs, exe, seconds, rnd):
    make = {"firn": lambda: Firn(rnd), "perf": Perf, "bpftrace": Bpftrace, "bcc": Bcc}
    runs = []
    for rep in range(pairs):
        for hz in freqs:
            order = ["none"] + [p for p in profilers if hz < 999 or p in ("firn", "perf")]
            if kind == "idle":
                order = order[1:]
            for name in order:
                log(f"{kind} {rep + 1}/{pairs} {hz} Hz: {name} …")
                prof = None if name == "none" else make[name]()
                try:
                    runs.append(one_run(kind, prof, hz, exe, seconds))
                except Exception as e:  # a peer that fails is reported, not fatal
                    log(f"  {name} failed: {e}")
                    runs.append({"profiler": name, "hz": hz, "kind": kind, "error": str(e)})
    return runs


def summarize(runs, kind):
    rows = []
    keys = sorted({(r["hz"], r["profiler"]) for r in runs if "error" not in r},
                  key=lambda k: (k[0], ["none", "firn", "perf", "bpftrace", "bcc"].index(k[1])))
    for hz, name in keys:
        rs = [r for r in runs if r["hz"] == hz and r["profiler"] == name and "error" not in r]
        base = [r["throughput"] for r in runs
                if r["hz"] == hz and r["profiler"] == "none" and "throughput" in r]
        row = {"hz": hz, "profiler": name, "n": len(rs)}
        if kind == "overhead":
            row["throughput_ratio"] = bl.med(bl.ratios([r["throughput"] for r in rs], base))
        if name != "none":
            for k in ("cpu_window_per_s", "cpu_total_per_s", "bpf_ns_per_run"):
                row[k] = bl.med([r.get(k, float("nan")) for r in rs])
            row["rss_peak_mib"] = bl.med([r["rss_peak_kib"] / 1024 for r in rs])
            if kind == "overhead":
                row["captured_ratio"] = bl.med([r["captured"] / r["expected"] for r in rs])
            lost = {}
            for r in rs:
                for k, v in r["lost"].items():
                    lost.setdefault(k, []).append(v)
            row["lost"] = {k: bl.med(v) for k, v in lost.items()}
            if name == "firn":
                for part in ("sampler", "enricher"):
                    row[f"cpu_window_per_s_{part}"] = bl.med([r[f"cpu_window_per_s_{part}"] for r in rs])
                    row[f"rss_peak_{part}_mib"] = bl.med([r[f"rss_peak_{part}_kib"] / 1024 for r in rs])
                    row[f"rss_{part}_mib"] = bl.med([r[f"rss_kib_{part}"] / 1024 for r in rs])
                if all(LIVE in r for r in rs):
                    row[LIVE] = bl.med([r[LIVE] for r in rs])
        rows.append(row)
    return rows


def table(rows, kind):
    ms = lambda t: bl.fmt(tuple(x * 1000 for x in t), "{:.1f}")  # noqa: E731
    head = "| Hz | profiler | runs | "
    if kind == "overhead":
        head += "throughput / none | samples / expected | "
    head += "CPU ms per s (sampling window) | CPU ms per s (whole life) | peak RSS MiB | BPF ns per run | lost |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [str(r["hz"]), r["profiler"], str(r["n"])]
        if kind == "overhead":
            cells.append(bl.fmt(r["throughput_ratio"], "{:.4f}"))
            cells.append(bl.fmt(r.get("captured_ratio", (float("nan"),) * 3), "{:.3f}"))
        if r["profiler"] == "none":
            cells += ["–"] * 5
        else:
            cpu = ms(r["cpu_window_per_s"])
            if r["profiler"] == "firn":
                cpu += f"<br>sampler {ms(r['cpu_window_per_s_sampler'])}<br>enricher {ms(r['cpu_window_per_s_enricher'])}"
                cpu += f" (live threads only: {ms(r[LIVE])})" if LIVE in r else ""
            rss = bl.fmt(r["rss_peak_mib"], "{:.1f}")
            if r["profiler"] == "firn":
                rss += (f"<br>sampler {bl.fmt(r['rss_peak_sampler_mib'], '{:.1f}')}"
                        f"<br>enricher {bl.fmt(r['rss_peak_enricher_mib'], '{:.1f}')}")
            lost = "<br>".join(f"{k} {bl.fmt(v, '{:.0f}')}" for k, v in r["lost"].items()) or "–"
            cells += [cpu, ms(r["cpu_total_per_s"]), rss, bl.fmt(r["bpf_ns_per_run"], "{:.0f}"), lost]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


# ---------------------------------------------------------------- rest (firn only)

def upload_table(rows):
    """Medians per mode and the upload's added cost, against #9's targets."""
    def col(mode, key):
        return [r[key] for r in rows if r["mode"] == mode]

    out = ["Target (#9): uploads add ≤ 0.5 ms/s of enricher CPU and ≤ 8 MiB of RSS at 99 Hz. The difference "
           "of whole-enricher CPU between runs is noisy (symbolization and unwind-table waves differ run to "
           "run); the encode time is the sinks' own work in the round loop, timed in the enricher.", "",
           "| enricher | local sink only | + OTLP + Parca + OpenSearch | added | verdict |", "|---|---|---|---|---|"]
    for key, label, limit in (("enricher_ms_per_s", "CPU ms/s", 0.5), ("enricher_rss_mib", "RSS MiB (end)", 8.0),
                              ("enricher_peak_mib", "peak MiB (VmHWM)", 8.0)):
        a, b = bl.med(col("local", key)), bl.med(col("upload", key))
        added = b[0] - a[0]
        out.append(f"| {label} | {bl.fmt(a)} | {bl.fmt(b)} | {added:+.2f} | "
                   f"{'met' if added <= limit else '**missed**'} (≤ {limit}) |")
    up = [r for r in rows if r["mode"] == "upload"]
    out += ["", "| sink | requests in the window | encode ms/s | bytes per round | bytes per 1,000 samples | "
            "documents per round | retries |",
            "|---|---|---|---|---|---|---|"]
    for sink in ("otlp", "parca", "opensearch"):
        out.append(f"| {sink} | {bl.fmt(bl.med([r[sink + '_requests'] for r in up]))} | "
                   f"{bl.fmt(bl.med([r[sink + '_encode_ms_per_s'] for r in up]))} | "
                   f"{bl.fmt(bl.med([r[sink + '_bytes_per_round'] for r in up]))} | "
                   f"{bl.fmt(bl.med([r[sink + '_bytes_per_1000_samples'] for r in up]))} | "
                   f"{bl.fmt(bl.med([r[sink + '_documents_per_round'] for r in up])) if sink == 'opensearch' else '–'} | "
                   f"{max((r[sink + '_retries'] for r in up), default=0):.0f} |")
    return "\n".join(out)


def window_events(rs):
    """What happened during each run's window, a run per line (older suite.json rows lack it)."""
    keys = ("window_new_processes", "window_tables_built", "window_symbol_parses")
    ms = ("window_build_ms", "window_symbolize_ms", "window_load_ms")
    return "<br>".join("/".join(f"{r[k]:.0f}" if k in r else "–" for k in keys) + "; "
                       + "/".join(f"{r[k]:.1f}" if k in r else "–" for k in ms) for r in rs)


def rest_table(rows):
    """Medians over repetitions per (state, Hz), against issue #31's targets (#14's for busy)."""
    targets = {("idle", 99): (0.15, 0.3, None), ("idle", 19): (0.075, 0.15, None),
               ("new", 99): (0.15, 0.3, None), ("new", 19): (0.075, 0.15, None),
               ("busy", 99): (None, None, 2.0)}
    out = ["Targets (#31, after #14's): idle at 99 Hz sampler ≤ 0.15 and enricher ≤ 0.3 ms/s, at 19 Hz "
           "half, first wave of table loads included; busy at 99 Hz both together ≤ 2 ms/s; everywhere "
           "enricher peak ≤ 64 MiB, sampler ≤ 8 MiB (end) and ≤ 10 MiB (peak). \"idle\": the harness "
           "runs for a second once the enricher is connected, so that its own tables are in firn's start-up "
           "wave like those of every program already running (before, its first sample fell at the window's start "
           "and each idle window held the harness's own wave of ~31 tables). \"new\": idle, and a "
           "program firn has never seen (another Python interpreter than the harness's, with some "
           "extension modules, busy for 0.5 s) starts at the window's start: a first wave of table loads "
           "and symbol parses inside the window, held to the idle targets. \"in the window\": new "
           "processes the sampler saw, tables the enricher built, and symbol parses (first loads, "
           "reparses, one-round parses) during the 60 s; then the enricher's ms in them building tables and "
           "symbolizing (parses included), and the sampler's ms loading tables. CPU is each process's "
           "CPU clock, ended threads included (before, a sum over its live threads: \"live threads only\").", "",
           "| machine | Hz | runs | sampler CPU ms/s | enricher CPU ms/s | together | target | "
           "sampler RSS MiB (end / peak) | enricher RSS MiB (end / peak) | symbols held MiB | "
           "BPF maps MiB | table loads: rows, sampler ns/row | in the window: processes/tables/parses; enricher ms building/symbolizing, sampler ms loading tables |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = ["idle", "new", "busy", "four"]
    keys = sorted({(r["state"], r["hz"]) for r in rows}, key=lambda k: (order.index(k[0]), k[1]))
    for state, hz in keys:
        rs = [r for r in rows if r["state"] == state and r["hz"] == hz]
        med = lambda k: bl.med([r[k] for r in rs])  # noqa: E731
        tog = bl.med([r["sampler_ms_per_s"] + r["enricher_ms_per_s"] for r in rs])
        t = targets.get((state, hz))
        verdict = []
        if t is None:
            pass
        elif t[2] is not None:
            verdict.append(f"CPU together ≤ {t[2]}: {'met' if tog[0] <= t[2] else 'missed'}")
        else:
            ok = med("sampler_ms_per_s")[0] <= t[0] and med("enricher_ms_per_s")[0] <= t[1]
            verdict.append(f"CPU sampler ≤ {t[0]}, enricher ≤ {t[1]}: {'met' if ok else 'missed'}")
        mem = (med("enricher_peak_mib")[0] <= 64 and med("sampler_rss_mib")[0] <= 8
               and med("sampler_peak_mib")[0] <= 10)
        verdict.append(f"RSS: {'met' if mem else 'missed'}")
        verdict = "; ".join(verdict)
        live = (f"<br>live threads only: {bl.fmt(med(REST_LIVE), '{:.2f}')}"
                if all(REST_LIVE in r for r in rs) else "")
        out.append(f"| {state} | {hz} | {len(rs)} | {bl.fmt(med('sampler_ms_per_s'), '{:.2f}')} | "
                   f"{bl.fmt(med('enricher_ms_per_s'), '{:.2f}')}{live} | {bl.fmt(tog, '{:.2f}')} | {verdict} | "
                   f"{bl.fmt(med('sampler_rss_mib'), '{:.1f}')} / {bl.fmt(med('sampler_peak_mib'), '{:.1f}')} | "
                   f"{bl.fmt(med('enricher_rss_mib'), '{:.1f}')} / {bl.fmt(med('enricher_peak_mib'), '{:.1f}')} | "
                   f"{bl.fmt(med('symbols_held_mib'), '{:.1f}')} | "
                   f"{bl.fmt(med('kernel_memory_mib'), '{:.1f}')} | "
                   f"{bl.fmt(med('rows_loaded'), '{:,.0f}')}, {bl.fmt(med('table_ns_per_row'), '{:.1f}')} | "
                   f"{window_events(rs)} |")
    return "\n".join(out)


# ---------------------------------------------------------------- report

def write_report(res, update):
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "suite.json").write_text(json.dumps(res, indent=1, default=str))
    m, p = res["machine"], res["params"]
    def head_of(pairs):
        return (f"Run {m['date']}, kernel {m['kernel']}, {m['cpus']} CPUs, {m['cpu_model']}; "
                f"{pairs} interleaved repetitions of {p['seconds']} s, firn rounds of {p['round']} s; "
                f"peers: {m['peers']}. Median (min–max).")
    head = head_of(p["pairs"])
    sections = {}
    if "overhead" in res:
        sections["bench-overhead"] = head + "\n\n" + table(res["overhead"], "overhead")
    if "idle" in res:
        sections["bench-idle"] = head_of(p.get("idle_pairs") or p["pairs"]) + "\n\n" + table(res["idle"], "idle")
    if "rest" in res:
        sections["bench-rest"] = (
            f"Run {m['date']}, kernel {m['kernel']}, {m['cpus']} CPUs, {m['cpu_model']}; firn rounds of "
            f"{p['round']} s, {p['rest_pairs']} run(s) per cell. CPU from each half's process CPU clock over 60 s "
            "after 30 s from its start; RSS at the end of the window; peak = VmHWM over the whole life "
            "(start-up included). busy = `busy.c` on every CPU; four = four busy programs "
            "(`busy.c` with and without frame pointers, a python3 loop, a bash loop).\n\n" + rest_table(res["rest"]))
    if "upload" in res:
        sections["bench-upload"] = (
            f"Run {m['date']}, kernel {m['kernel']}, {m['cpus']} CPUs, {m['cpu_model']}; firn rounds of "
            f"{p['round']} s at 99 Hz with `busy.c` on every CPU; {p['upload_pairs']} interleaved pair(s) "
            "of runs, local sink alone vs local + OTLP + Parca (debuginfo on) + OpenSearch to the test "
            "receivers on loopback (the OpenSearch one a stand-in); the receivers run in both modes, so the "
            "enricher profiles the same processes in each and only the sending differs. Enricher CPU from its process CPU clock over 60 s after 60 s; RSS at the end of the window; "
            "peak = VmHWM over its life. Median (min–max).\n\n" + upload_table(res["upload"]))
    if "unwind" in res:
        body = (head + "\n\nWorkload: `busy.c` built with plain `gcc -O2` (no frame pointers); firn "
                "unwinds it from tables, bpftrace walks frame pointers (and gets the leaf only).\n\n"
                + table(res["unwind"], "overhead"))
        if res.get("unwind_target"):
            body += ("\n\n#31's target, ≤ 0.7: firn unwinding the no-frame-pointer workload against "
                     "bpftrace walking the frame-pointer one, in pairs of runs back to back (which one "
                     "first alternating), the ratio taken within each pair; BPF ns per run as above.\n\n"
                     + target_table(res["unwind_target"]))
        if res.get("unwind_together"):
            body += "\n\n" + target_together.section(res["unwind_together"])
        if res.get("unwind_memory"):
            body += ("\n\nKernel memory of firn's maps at the end of its last 99 Hz run (every "
                     "process on the machine profiled):\n\n" + kernel_memory_table(res["unwind_memory"]))
        sections["bench-unwind"] = body
    if "python" in res:
        sections["bench-python"] = (
            f"Run {m['date']}, kernel {m['kernel']}, {m['cpus']} CPUs, {m['cpu_model']}; firn at 99 Hz, "
            f"rounds of {p['round']} s; BPF ns per sample from the kernel's bpf_stats over {p['seconds']} s "
            "after two rounds (tables and interpreter records in); frames per sample from the sampler's "
            "counters. Median (min–max).\n\n" + python_bench.report(res["python"]))
    if "offcpu" in res:
        o = res["offcpu"]
        sections["bench-offcpu"] = (
            f"Run {m['date']}, kernel {m['kernel']}, {m['cpus']} CPUs, {m['cpu_model']}; {o['pairs']} interleaved "
            f"repetitions of {o['seconds']} s per configuration, firn at 99 Hz with 2 s rounds. "
            "Median (min–max).\n\n" + offcpu_bench.report(o))
    if "scale" in res:
        s = res["scale"]
        lines = [head, "", "| scenario | result |", "|---|---|"]
        if "many_processes" in s:
            r = s["many_processes"]
            lines.append(f"| 1,000 idle processes + workload, {r['hz']} Hz | enricher CPU "
                         f"{r['cpu_window_per_s_enricher'] * 1000:.1f} ms/s, RSS {r['rss_kib_enricher'] / 1024:.1f} MiB "
                         f"(peak {r['rss_peak_enricher_kib'] / 1024:.1f}); sampler CPU "
                         f"{r['cpu_window_per_s_sampler'] * 1000:.2f} ms/s, RSS {r['rss_kib_sampler'] / 1024:.1f} MiB "
                         f"(peak {r['rss_peak_sampler_kib'] / 1024:.1f}); throughput/none "
                         f"{r['throughput'] / s['baseline_throughput']:.4f} |")
        for key in ("churn", "many_binaries", "execs"):
            if key in s:
                r = s[key]
                share = r["attributed"] / r["by_comm"] if r["by_comm"] else float("nan")
                mt = r["metrics"]
                hits = mt.get("firn_enricher_symbol_cache_hits_total", 0)
                misses = mt.get("firn_enricher_symbol_cache_misses_total", 0)
                lines.append(
                    f"| {r['label']}: {r['rate']}/s × ~{r.get('ms', 20)} ms over {r['executables']} executable(s), {r['seconds']} s | "
                    f"{r['attributed']}/{r['by_comm']} samples attributed to the right executable ({share:.1%}); "
                    f"enricher CPU {r['enricher_cpu_per_s'] * 1000:.1f} ms/s, RSS max {r['rss_max_mib']:.1f} MiB, "
                    f"trend {r['rss_trend_mib_per_min']:+.2f} MiB/min; binaries loaded "
                    f"{mt.get('firn_enricher_binaries_loaded_total', 0):.0f}, evicted "
                    f"{mt.get('firn_enricher_binaries_evicted_total', 0):.0f}, cached at the end "
                    f"{mt.get('firn_enricher_binaries_cached', 0):.0f}; "
                    f"frame cache hit rate {hits / max(1, hits + misses):.1%}; sampler CPU "
                    f"{r.get('sampler_cpu_per_s', float('nan')) * 1000:.1f} ms/s (at rest "
                    f"{r.get('sampler_cpu_at_rest_per_s', float('nan')) * 1000:.1f}), "
                    f"{r.get('sampler_us_per_new_process', float('nan')):.0f} µs per new process "
                    f"({r.get('new_processes', 0):.0f} announced), RSS max "
                    f"{max((p[1] for p in r.get('sampler_rss_points', [])), default=float('nan')):.1f} MiB "
                    f"(peak {r.get('sampler_rss_peak_mib', float('nan')):.1f}); ring buffer events lost "
                    f"{r.get('events_lost', 0):.0f}; processes gone before /proc read "
                    f"{mt.get('firn_sampler_processes_gone', 0):.0f}; enricher peak (VmHWM) "
                    f"{r.get('enricher_peak_mib', float('nan')):.1f} MiB; first sample to unwind table: median "
                    f"≤ {r.get('table_ready_median_ms', float('nan')):.0f} ms, 90 % ≤ "
                    f"{r.get('table_ready_p90_ms', float('nan')):.0f} ms "
                    f"({mt.get('firn_enricher_unwind_table_ready_seconds_count', 0):.0f} tables; "
                    f"{mt.get('firn_enricher_unwind_tables_early_total', 0):.0f} sent between rounds); "
                    f"table cache {mt.get('firn_enricher_unwind_table_cache_hits_total', 0):.0f} hits, "
                    f"{mt.get('firn_enricher_unwind_table_cache_misses_total', 0):.0f} misses, "
                    f"{mt.get('firn_enricher_unwind_cache_entries', 0):.0f} entries, "
                    f"{mt.get('firn_enricher_unwind_cache_bytes', 0) / 2**20:.1f} MiB |")
        for key in ("churn", "many_binaries"):
            if key in s:
                lines.append(f"\nEnricher RSS (MiB) during {s[key]['label']}, each minute: "
                             + series(s[key]["rss_points"]) + ".")
        sections["bench-scale"] = "\n".join(lines)
    for name, body in sections.items():
        log(f"\n== {name}\n{body}")
    if update:
        bm = ROOT / "BENCHMARKS.md"
        text = bm.read_text()
        for name, body in sections.items():
            text = bl.replace_section(text, name, body)
        bm.write_text(text)
        log(f"updated {bm}")


def cpu_model():
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=30, help="workload / idle seconds per run (30)")
    ap.add_argument("--pairs", type=int, default=3, help="interleaved repetitions (3)")
    ap.add_argument("--frequencies", default="19,99,999",
                    help="Hz list (19,99,999); at 999 Hz only firn and perf run, as planned")
    ap.add_argument("--profilers", default="firn,perf,bpftrace,bcc")
    ap.add_argument("--idle-pairs", type=int, help="repetitions of the idle part (default: --pairs)")
    ap.add_argument("--round", type=int, default=10, help="firn round seconds (10, the default)")
    ap.add_argument("--parts", default="overhead,idle,rest,unwind,python,offcpu,scale",
                    help="overhead,idle,rest,unwind,python,offcpu,scale,upload (upload: not in the default set)")
    ap.add_argument("--upload-pairs", type=int, default=2, help="interleaved repetitions of the upload part (2)")
    ap.add_argument("--rest-pairs", type=int, default=1, help="repetitions of the rest part (1)")
    ap.add_argument("--churn-seconds", type=int, default=600,
                    help="length of the churn storm (600: the RSS trend over 10 minutes)")
    ap.add_argument("--churn-rate", type=int, default=50,
                    help="processes per second in the churn storm (50: ~1 CPU of 20 ms processes on 2 CPUs)")
    ap.add_argument("--binaries", type=int, default=200)
    ap.add_argument("--smoke", action="store_true",
                    help="CI: one firn-only overhead run of 20 s at 99 Hz, 2 s rounds; nothing written to BENCHMARKS.md")
    ap.add_argument("--skip-build", action="store_true", help="use the existing release binaries")
    ap.add_argument("--no-update", action="store_true", help="do not rewrite BENCHMARKS.md")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: sudo python3 tests/bench/firn_bench.py")
    # Started in the background (nohup, &), SIGINT is ignored and children inherit that;
    # the profilers are stopped with SIGINT, so give them the default back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.smoke:
        args.seconds, args.pairs, args.frequencies, args.profilers = 20, 1, "99", "firn"
        args.round, args.parts, args.no_update = 2, "overhead", True
    profilers = [p for p in args.profilers.split(",") if p]
    parts = set(args.parts.split(","))
    freqs = [int(f) for f in args.frequencies.split(",")]
    links = []
    if set(profilers) - {"firn"}:
        install_peers()
        if "bcc" in profilers:
            links = bcc_headers()
    out = build_all(args.skip_build)
    exe = out / COMM
    old = _read("/proc/sys/kernel/bpf_stats_enabled").strip() or "0"
    open("/proc/sys/kernel/bpf_stats_enabled", "w").write("1")
    res = {"machine": {"kernel": platform.release(), "cpus": os.cpu_count(), "cpu_model": cpu_model(),
                       "date": time.strftime("%Y-%m-%d"),
                       "peers": ", ".join(_version(p) for p in profilers if p != "firn") or "none"},
           "params": vars(args)}
    try:
        if "overhead" in parts:
            runs = matrix(freqs, profilers, "overhead", args.pairs, exe, args.seconds, args.round)
            res["overhead_runs"] = runs
            res["overhead"] = summarize(runs, "overhead")
            if args.smoke:
                bad = [r for r in runs if "error" in r]
                firn = [r for r in runs if r["profiler"] == "firn" and "error" not in r]
                if bad or not firn or firn[0]["captured"] <= 0:
                    sys.exit(f"smoke run failed: {bad or firn}")
        if "idle" in parts:
            runs = matrix(freqs, profilers, "idle", args.idle_pairs or args.pairs, exe, args.seconds,
                          args.round)
            res["idle_runs"] = runs
            res["idle"] = summarize(runs, "idle")
        if "rest" in parts:
            runs = []
            nofp = build_nofp(out)
            for _ in range(args.rest_pairs):
                for hz in freqs:
                    for state in ("idle", "new", "busy"):
                        r = rest_run(hz, state, exe, args.round)
                        if r is not None:
                            runs.append(r)
                runs.append(rest_run(max(freqs), "four", exe, args.round, nofp=nofp))
            res["rest"] = runs
        if "upload" in parts:
            subprocess.run([str(ROOT / "tests/setup-tools.sh")], check=True)
            runs = []
            for _ in range(args.upload_pairs):
                for mode in ("local", "upload"):
                    runs.append(upload_run(99, mode, exe, args.round))
            res["upload"] = runs
        if "unwind" in parts:
            nofp = build_nofp(out)
            peers = [p for p in profilers if p in ("firn", "bpftrace")]
            runs = matrix(freqs, peers, "unwind", args.pairs, nofp, args.seconds, args.round)
            res["unwind_runs"] = runs
            res["unwind"] = summarize(runs, "overhead")
            kmem = [r["kernel_memory"] for r in runs
                    if r["profiler"] == "firn" and r["hz"] == 99 and "kernel_memory" in r]
            res["unwind_memory"] = kmem[-1] if kmem else None
            if "firn" in peers and "bpftrace" in peers:
                res["unwind_target"] = target_pairs(freqs, args.pairs, nofp, out / COMM,
                                                    args.seconds, args.round)
                res["unwind_together"] = target_together.measure(
                    [f for f in freqs if f < 999], 4, nofp, out / COMM)
        if "python" in parts:
            res["python"] = python_bench.run(out, 99, args.round, args.seconds, args.pairs)
        if "offcpu" in parts:
            res["offcpu"] = offcpu_bench.run(args.pairs, args.seconds)
        if "scale" in parts:
            hz = 99
            s = res["scale"] = {}
            base = [one_run("overhead", None, hz, exe, args.seconds)["throughput"]]
            s["many_processes"] = scale_many_processes(exe, out, args.seconds, hz, args.round)
            base.append(one_run("overhead", None, hz, exe, args.seconds)["throughput"])
            s["baseline_throughput"] = bl.med(base)[0]
            s["churn"] = scale_churn(out, [out / "churn-child"], args.churn_seconds, args.churn_rate, hz,
                                   args.round, "churn")
            s["many_binaries"] = scale_churn(out, many_binaries(out, args.binaries), max(60, args.binaries // 2),
                                           args.churn_rate, hz, args.round, "many binaries")
            # Exec storm: 1,000 short execs a second (1 ms of CPU each, one CPU's worth).
            s["execs"] = scale_churn(out, [out / "churn-child"], 60, 1000, hz, args.round, "execs", ms=1)
    finally:
        open("/proc/sys/kernel/bpf_stats_enabled", "w").write(old)
        for link in links:
            link.unlink()
    write_report(res, not args.no_update)


def _version(p):
    cmd = {"perf": ["perf", "--version"], "bpftrace": ["bpftrace", "--version"],
           "bcc": ["dpkg-query", "-W", "-f", "bpfcc-tools ${Version}", "bpfcc-tools"]}[p]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return f"{p} (not found)"


if __name__ == "__main__":
    main()

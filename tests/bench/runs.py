"""The runs of the benchmark suite (firn_bench.py): one profiler over one workload,
firn at rest, firn with its uploads, firn under scale. Each returns the numbers the
report's tables are made of."""

import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl
from profilers import ROOT, Bpftrace, Firn, bpf_stats, live_threads_cpu, proc_cpu, status_kib

# The enricher's CPU by the meter before proc_cpu (live threads only), kept beside it in
# the same runs to show what it missed: in one_run's and in rest_run's results.
LIVE, REST_LIVE = "cpu_window_per_s_enricher_live_threads", "enricher_ms_per_s_live_threads"


def log(*a):
    print(*a, flush=True)


def start_workload(exe, seconds):
    p = subprocess.Popen([str(exe), str(seconds)], stdout=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("ready"):
            return p, int(line.split()[1])
    return p, None


def finish_workload(p):
    out = p.stdout.read()
    p.wait()
    return bl.parse_busy(out)[0]


# ---------------------------------------------------------------- runs
# Profilers (tests/bench/profilers.py): start(hz) → after it is sampling; pids() →
# processes to measure; stop() → {'cpu_total', 'rss_peak_kib', 'captured', …}.

def one_run(kind, prof, hz, exe, seconds):
    """One run: the profiler (or none) started, then the workload (or an idle wait)."""
    r = {"profiler": prof.name if prof else "none", "hz": hz, "kind": kind}
    if prof:
        prof.start(hz)
        pids = prof.pids()
        c0 = {p: proc_cpu(p) for p in pids}
        l0 = live_threads_cpu(pids[1]) if prof.name == "firn" else 0.0
        b0 = bpf_stats(pids)
    t0 = time.time()
    wpid = None
    if kind in ("overhead", "unwind"):
        w, wpid = start_workload(exe, seconds)
        r["throughput"] = finish_workload(w)
    else:
        time.sleep(seconds)
    wall = time.time() - t0
    if prof:
        c1 = {p: proc_cpu(p) for p in pids}
        l1 = live_threads_cpu(pids[1]) if prof.name == "firn" else 0.0
        b1 = bpf_stats(pids)
        r["cpu_window_per_s"] = sum(c1[p] - c0[p] for p in pids) / wall
        if prof.name == "firn":
            r["cpu_window_per_s_sampler"] = (c1[pids[0]] - c0[pids[0]]) / wall
            r["cpu_window_per_s_enricher"] = (c1[pids[1]] - c0[pids[1]]) / wall
            r[LIVE] = (l1 - l0) / wall
            r["rss_kib_sampler"] = status_kib(pids[0], "VmRSS")
            r["rss_kib_enricher"] = status_kib(pids[1], "VmRSS")
        r["bpf_ns_per_run"] = (b1[0] - b0[0]) / (b1[1] - b0[1]) if b1[1] > b0[1] else float("nan")
        r["bpf_runs"] = b1[1] - b0[1]
        r.update(prof.stop(wpid))
        r["cpu_total_per_s"] = r["cpu_total"] / r["life_seconds"]
        r["expected"] = (bl.expected_samples(hz, seconds, os.cpu_count())
                         if kind in ("overhead", "unwind") else 0)
    r["wall"] = wall
    return r


class RestFirn(Firn):
    """firn for the rest part. The harness (this Python) is itself a program on the
    node: left alone, its first samples fall when it reads firn's counters at the
    window's start, and the idle window measures its own wave (~31 tables of this
    Python, the modules that reading loads, their symbols) instead of the node. So for
    a second, as soon as the enricher is connected, it reads the counters over and over:
    its samples reach the enricher in the first round and its tables and symbols are
    part of firn's start-up wave, as those of every program already running are. (Run
    before the enricher started, the samples reached no one and the wave still fell in
    the window.)"""

    def ready(self):
        end = time.time() + 1.0
        while time.time() < end:
            self.metrics()


# What a program firn has never seen costs ('new'): an interpreter other than the
# harness's (so its binaries are new to firn), loading some extension modules and their
# libraries, busy for half a second in those libraries (hashing, compression, SQLite),
# then asleep. Busy in them rather than in a Python loop, its frames reach the libraries
# as a real program's would, so their symbols are parsed in the window too (the tables
# are the same either way: 12 files, 106,651 rows on the test machine).
NEW_PROGRAM = ("import sys, time, json, decimal, hashlib, sqlite3, ssl, lzma, bz2, zlib, ctypes, csv\n"
               "data = bytes(range(256)) * 256\n"
               "db = sqlite3.connect(':memory:')\n"
               "end = time.time() + 0.5\n"
               "while time.time() < end:\n"
               "    hashlib.sha256(data).digest(); zlib.compress(data); bz2.compress(data)\n"
               "    lzma.compress(data[:4096])\n"
               "    db.execute('with recursive c(x) as (select 1 union all select x + 1 from c where x < 2000)'\n"
               "               ' select sum(x) from c').fetchall()\n"
               "time.sleep(float(sys.argv[1]))\n")


def target_pairs(freqs, pairs, nofp, fp, seconds, rnd):
    """#31's BPF target measured as it is stated: firn on the no-frame-pointer workload
    against bpftrace on the frame-pointer one, back to back, the one first alternating
    by repetition, so each pair's ratio shares the machine's state of those minutes."""
    out = []
    for rep in range(pairs):
        for hz in [f for f in freqs if f < 999]:
            order = [("firn", nofp), ("bpftrace", fp)]
            if rep % 2:
                order.reverse()
            got = {}
            for name, exe in order:
                log(f"target {rep + 1}/{pairs} {hz} Hz: {name} …")
                prof = Firn(rnd) if name == "firn" else Bpftrace()
                try:
                    got[name] = one_run("unwind", prof, hz, exe, seconds).get("bpf_ns_per_run")
                except Exception as e:  # reported, not fatal
                    log(f"  {name} failed: {e}")
            out.append({"hz": hz, "firn": got.get("firn"), "bpftrace": got.get("bpftrace")})
    return out


def target_table(pairs):
    lines = ["| Hz | pairs | firn ns, no frame pointers | bpftrace ns, frame pointers | firn / bpftrace within each pair |",
             "|---|---|---|---|---|"]
    for hz in sorted({p["hz"] for p in pairs}):
        ps = [p for p in pairs if p["hz"] == hz]
        firn = [p["firn"] for p in ps if p["firn"] is not None]
        bpft = [p["bpftrace"] for p in ps if p["bpftrace"] is not None]
        ratio = bl.paired_ratios([(p["firn"], p["bpftrace"]) for p in ps])
        lines.append(f"| {hz} | {len(ratio)} | {bl.fmt(bl.med(firn), '{:.0f}')} | "
                     f"{bl.fmt(bl.med(bpft), '{:.0f}')} | {bl.fmt(bl.med(ratio), '{:.2f}')} |")
    return "\n".join(lines)


def other_python():
    """A Python interpreter that is not the one running the harness (Debian's or one of
    pyenv's), or None."""
    me = os.path.realpath(sys.executable)
    pyenv = os.path.expanduser("~/.pyenv/versions")
    for c in ["/usr/bin/python3"] + sorted(glob.glob(os.path.join(pyenv, "*/bin/python3"))):
        if os.path.exists(c) and os.path.realpath(c) != me:
            return c
    return None


def rest_run(hz, state, exe, rnd, warm=30, window=60, nofp=None):
    """firn's cost at rest ('idle'), with a program it has never seen started at the
    window's start ('new'; None where the machine has no second Python), beside a busy machine ('busy': busy.c on every CPU) or
    beside four busy programs ('four': busy.c with and without frame pointers, python3
    and bash loops): CPU per half over `window` seconds after `warm` seconds from its
    start, RSS every 2 s, peaks."""
    log(f"rest: {state} at {hz} Hz …")
    w, others, newp = None, [], None
    py = other_python() if state == "new" else None
    if state == "new" and py is None:
        # A machine with one Python: the harness's own binaries are not new to firn.
        log("rest: new skipped: no Python interpreter other than the harness's (Debian's python3 or pyenv's)")
        return None
    life = warm + window + 3 * rnd + 30
    if state in ("busy", "four"):
        w, _ = start_workload(exe, life)
    if state == "four":
        others = [start_workload(nofp, life)[0],
                  subprocess.Popen(["python3", "-c", "while True: pass"]),
                  subprocess.Popen(["bash", "-c", "while :; do :; done"])]
    f = RestFirn(rnd)
    f.start(hz)
    time.sleep(max(0.0, warm - (time.time() - f.t0)))
    s, e = f.pids()
    # Counters before the window (fetched outside it): what happened in it, such as new
    # processes whose tables are built, explains a window's cost. The sampler's counters
    # come with its batches, so they lag the enricher's by up to a round.
    m0 = f.metrics()
    l0 = live_threads_cpu(e)
    c0, t0 = {p: proc_cpu(p) for p in (s, e)}, time.time()
    if py is not None:
        newp = subprocess.Popen([py, "-c", NEW_PROGRAM, str(window + 5)])
    points = []
    while time.time() - t0 < window:
        time.sleep(2)
        points.append((round(time.time() - f.t0, 1), status_kib(s, "VmRSS") / 1024,
                       status_kib(e, "VmRSS") / 1024))
    c1, t1 = {p: proc_cpu(p) for p in (s, e)}, time.time()
    l1 = live_threads_cpu(e)
    m = f.metrics()
    res = f.stop(settle=False)
    for p in ([w] if w else []) + others + ([newp] if newp else []):
        p.terminate()
        p.wait()
    last = points[-1] if points else (0, float("nan"), float("nan"))
    return {"hz": hz, "state": state, "window_s": t1 - t0, "warm_s": warm,
            "sampler_ms_per_s": 1000 * (c1[s] - c0[s]) / (t1 - t0),
            "enricher_ms_per_s": 1000 * (c1[e] - c0[e]) / (t1 - t0),
            REST_LIVE: 1000 * (l1 - l0) / (t1 - t0),
            "sampler_rss_mib": last[1], "enricher_rss_mib": last[2],
            "sampler_rss_max_mib": max((p[1] for p in points), default=float("nan")),
            "enricher_rss_max_mib": max((p[2] for p in points), default=float("nan")),
            "sampler_peak_mib": res["rss_peak_sampler_kib"] / 1024,
            "enricher_peak_mib": res["rss_peak_enricher_kib"] / 1024,
            "symbols_held_mib": m.get("firn_enricher_symbol_bytes_held", 0) / 2**20,
            "kernel_memory_mib": sum(b for maps in res.get("kernel_memory", {}).get("maps_by_type", {}).values()
                                     for _, b in maps) / 2**20,
            "rows_loaded": m.get("firn_sampler_unwind_rows_loaded", 0),
            "table_ns_per_row": m.get("firn_sampler_unwind_table_load_ns", 0)
            / max(1, m.get("firn_sampler_unwind_rows_loaded", 0)),
            "frames_cached": m.get("firn_enricher_symbol_frames_cached", 0),
            "window_new_processes": m.get("firn_sampler_events_new", 0) - m0.get("firn_sampler_events_new", 0),
            "window_tables_built": m.get("firn_enricher_unwind_tables_built_total", 0)
            - m0.get("firn_enricher_unwind_tables_built_total", 0),
            "window_symbol_parses": sum(m.get(k, 0) - m0.get(k, 0) for k in (
                "firn_enricher_symbol_reparses_total", "firn_enricher_symbol_parses_transient_total",
                "firn_enricher_symbol_parses_not_kept_total",
                "firn_enricher_binaries_loaded_total")),
            "window_build_ms": (m.get("firn_enricher_unwind_table_build_ns_total", 0)
                                - m0.get("firn_enricher_unwind_table_build_ns_total", 0)) / 1e6,
            "window_symbolize_ms": (m.get("firn_enricher_symbolize_ns_total", 0)
                                    - m0.get("firn_enricher_symbolize_ns_total", 0)) / 1e6,
            # The sampler's share of the window's wave: its table loads (rows checked, copied,
            # indexed), apart from the start-up wave that "table_ns_per_row" includes.
            "window_load_ms": (m.get("firn_sampler_unwind_table_load_ns", 0)
                               - m0.get("firn_sampler_unwind_table_load_ns", 0)) / 1e6,
            "rss_points": points}


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def upload_run(hz, mode, exe, rnd, warm=60, window=60):
    """The enricher's cost with the local sink alone ('local') or with OTLP, Parca and
    OpenSearch uploads on ('upload'), busy.c on every CPU."""
    log(f"upload: {mode} at {hz} Hz …")
    life = warm + window + 3 * rnd + 30
    w, _ = start_workload(exe, life)
    receivers, extra = [], []
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"firn-bench-upload-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    # The receivers run in both modes: the enricher profiles them too (python3, node:
    # big binaries whose unwind tables and symbols cost it CPU and memory), so only the
    # sending differs between the modes.
    op, pp, osp = free_port(), free_port(), free_port()
    rx = ROOT / "tests" / "receivers"
    receivers = [
        subprocess.Popen([str(ROOT / "target/test-venv/bin/python"), str(rx / "otlp_receiver.py"),
                          "--port", str(op), "--out", str(tmp / "otlp.jsonl")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen(["node", "--import", "./resolve-js.mjs", "parca_receiver.mjs",
                          "--port", str(pp), "--out", str(tmp / "parca.jsonl")], cwd=rx,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        # The OpenSearch stand-in (no OpenSearch server runs here).
        subprocess.Popen(["python3", str(rx / "opensearch_standin.py"), "--port", str(osp),
                          "--out", str(tmp / "opensearch")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    if mode == "upload":
        extra = ["--otlp-endpoint", f"http://127.0.0.1:{op}", "--parca-address", f"127.0.0.1:{pp}",
                 "--parca-insecure", "--opensearch-url", f"http://127.0.0.1:{osp}"]
    f = Firn(rnd)
    f.start(hz, extra)
    time.sleep(max(0.0, warm - (time.time() - f.t0)))
    e = f.pids()[1]
    m0, c0, t0 = f.metrics(), proc_cpu(e), time.time()
    rss = []
    while time.time() - t0 < window:
        time.sleep(2)
        rss.append(status_kib(e, "VmRSS") / 1024)
    m1, c1, t1 = f.metrics(), proc_cpu(e), time.time()
    res = f.stop(settle=False)
    w.terminate()
    w.wait()
    for r in receivers:
        r.terminate()
        r.wait()
    shutil.rmtree(tmp, ignore_errors=True)
    d = lambda k: m1.get(k, 0) - m0.get(k, 0)  # noqa: E731
    samples = d("firn_enricher_samples_received_total")
    out = {"hz": hz, "mode": mode, "window_s": t1 - t0,
           "enricher_ms_per_s": 1000 * (c1 - c0) / (t1 - t0),
           "enricher_rss_mib": rss[-1] if rss else float("nan"),
           "enricher_rss_max_mib": max(rss, default=float("nan")),
           "enricher_peak_mib": res["rss_peak_enricher_kib"] / 1024, "samples": samples}
    for sink in ("otlp", "parca", "opensearch"):
        sent = d(f'firn_enricher_upload_requests_sent_total{{sink="{sink}"}}')
        docs = d(f'firn_enricher_upload_documents_sent_total{{sink="{sink}"}}')
        out[f"{sink}_documents_per_round"] = docs / sent if sent else float("nan")
        nbytes = d(f'firn_enricher_upload_bytes_sent_total{{sink="{sink}"}}')
        out[f"{sink}_requests"] = sent
        out[f"{sink}_bytes_per_round"] = nbytes / sent if sent else float("nan")
        out[f"{sink}_bytes_per_1000_samples"] = 1000 * nbytes / samples if samples else float("nan")
        out[f"{sink}_retries"] = m1.get(f'firn_enricher_upload_retries_total{{sink="{sink}"}}', 0)
        out[f"{sink}_encode_ms_per_s"] = d(f'firn_enricher_upload_encode_ns_total{{sink="{sink}"}}') / 1e6 / (t1 - t0)
    return out


def series(points, every=60.0):
    """'t: v' every `every` seconds of (t, v) points: an RSS trend in one line."""
    out, next_t = [], 0.0
    for t, v in points:
        if t >= next_t:
            out.append(f"{t / 60:.0f} min {v:.1f}")
            next_t = t + every
    return ", ".join(out)


# ---------------------------------------------------------------- scale (firn only)

def scale_many_processes(exe, out, seconds, hz, rnd, count=1000):
    log(f"scale: {count} idle processes + workload, firn at {hz} Hz …")
    idlers = subprocess.Popen([str(out / "idlers"), str(count), str(seconds + 4 * rnd + 10)],
                              stdout=subprocess.PIPE, text=True)
    idlers.stdout.readline()
    try:
        r = one_run("overhead", Firn(rnd), hz, exe, seconds)
    finally:
        idlers.terminate()
        subprocess.run(["pkill", "-f", str(out / "idlers")])
        idlers.wait()
    return r


class ChurnFirn(Firn):
    """Firn that, before its profiles are removed, counts the churn children's samples
    by comm (from the BPF program, always there) and those whose executable label is
    the executable that comm names: attributed to the right executable."""

    def __init__(self, rnd, cache_dir=None):
        super().__init__(rnd)
        self.cache_dir = cache_dir

    def prepare(self, plan):
        # One unwind table cache for the scale runs, as a node's state folder outlives
        # restarts: later runs find the tables of the binaries earlier ones met.
        if self.cache_dir:
            os.makedirs(self.cache_dir, exist_ok=True)
            os.chown(self.cache_dir, plan["user"][0], plan["user"][1])

    def start(self, hz, enricher_extra=(), sampler_binary=None, enricher_binary=None):
        extra = list(enricher_extra)
        if self.cache_dir:
            extra += ["--unwind-cache-dir", str(self.cache_dir), "--unwind-cache-size", "128MiB"]
        super().start(hz, extra, sampler_binary, enricher_binary)

    def stop(self, workload_pid=None, settle=True):
        time.sleep(self.rnd + 2)
        self.by_comm = self.attributed = 0
        for e in self.entries():
            comm = e["labels"].get("comm", "")
            if comm.startswith("churn-"):
                self.by_comm += e["samples"]
                exe = e["labels"].get("executable", "")
                if exe and exe[:15] == comm:
                    self.attributed += e["samples"]
        return super().stop(workload_pid, settle=False)


def scale_churn(out, exes, seconds, rate, hz, rnd, label, ms=20, sampler_binary=None, enricher_binary=None):
    log(f"scale: {label}: {rate}/s × {ms} ms over {len(exes)} executable(s) for {seconds} s, firn at {hz} Hz …")
    f = ChurnFirn(rnd, out / "unwind-cache")
    f.start(hz, sampler_binary=sampler_binary, enricher_binary=enricher_binary)
    # The sampler's cost at rest, to take out of its cost under churn.
    s0, t_rest = proc_cpu(f.sampler.pid), time.time()
    time.sleep(5)
    rest = (proc_cpu(f.sampler.pid) - s0) / (time.time() - t_rest)
    m0 = f.metrics()
    c0, s0 = proc_cpu(f.enricher.pid), proc_cpu(f.sampler.pid)
    churn = subprocess.Popen([str(out / "churn"), str(seconds), str(rate), *map(str, exes)],
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, CHURN_MS=str(ms)))
    churn.stdout.readline()
    t0, rss, srss = time.time(), [], []
    while churn.poll() is None:
        rss.append((time.time() - t0, status_kib(f.enricher.pid, "VmRSS") / 1024))
        srss.append((time.time() - t0, status_kib(f.sampler.pid, "VmRSS") / 1024))
        time.sleep(5)
    report = churn.stdout.read()
    elapsed = time.time() - t0
    cpu = (proc_cpu(f.enricher.pid) - c0) / elapsed
    scpu = (proc_cpu(f.sampler.pid) - s0) / elapsed
    m1 = f.metrics()
    speak = status_kib(f.sampler.pid, "VmHWM") / 1024
    res = f.stop()
    epeak = res["rss_peak_enricher_kib"] / 1024
    new = m1.get("firn_sampler_events_new", 0) - m0.get("firn_sampler_events_new", 0)
    per_process = (scpu - rest) * elapsed / new if new else float("nan")
    return {"label": label, "rate": rate, "ms": ms, "executables": len(exes), "seconds": seconds,
            "churn_report": report.strip(), "enricher_cpu_per_s": cpu, "rss_points": rss,
            "sampler_cpu_per_s": scpu, "sampler_cpu_at_rest_per_s": rest,
            "sampler_us_per_new_process": per_process * 1e6, "new_processes": new,
            "sampler_rss_points": srss, "sampler_rss_peak_mib": speak,
            "events_lost": m1.get("firn_sampler_bpf_events_lost", 0),
            "gone_before_read": m1.get("firn_sampler_processes_gone", 0),
            # The first fifth is warm-up (binaries loading); the trend is of the rest.
            "rss_trend_mib_per_min": bl.trend_per_minute(rss[len(rss) // 5:]),
            "rss_max_mib": max((p[1] for p in rss), default=float("nan")), "enricher_peak_mib": epeak,
            "attributed": f.attributed, "by_comm": f.by_comm, "metrics": res["metrics"],
            "table_ready_median_ms": bl.histogram_quantile(
                res["metrics"], "firn_enricher_unwind_table_ready_seconds", 0.5) * 1000,
            "table_ready_p90_ms": bl.histogram_quantile(
                res["metrics"], "firn_enricher_unwind_table_ready_seconds", 0.9) * 1000}

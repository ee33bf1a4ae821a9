"""Running and measuring profilers for the benchmark suite: firn (started the way the
end-to-end tests start it, through `firn-plan`), `perf record`, bpftrace and BCC's
profile. Each profiler: start(hz) returns once it samples; pids() are the processes to
measure; stop() returns {'cpu_total', 'rss_peak_kib', 'captured', 'total_samples',
'lost', …}."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import benchlib as bl

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release"
COMM = "busy-bench"
HTTP = "127.0.0.1:17999"
BCC_PROFILE = "/usr/sbin/profile-bpfcc"
BPFTRACE_PROG = "profile:hz:{hz} {{ @[kstack, ustack, comm] = count(); }}"


def proc_cpu(pid):
    """CPU seconds of pid's whole thread group, ended threads included (its process CPU
    clock, ns resolution); 0 once gone. A sum over /proc/<pid>/task would drop a thread's
    time when it ends: tokio's blocking threads, where the enricher builds unwind tables,
    end 10 s after their last job, often inside a measured window, whose delta then lost
    that thread's whole time. A zombie keeps its total until it is reaped."""
    if pid <= 0:  # the kernel would read 0 as the caller
        return 0.0
    try:
        # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED) of the kernel's posix-cpu-timers.
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        return 0.0


def live_threads_cpu(pid):
    """CPU seconds of pid's live threads only (schedstat): the meter before proc_cpu,
    kept so a run can show what it missed."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except OSError:
        pass
    return total / 1e9


def tree(pid):
    """pid and its descendants (BCC's and bpftrace's helpers included)."""
    kids = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def status_kib(pid, field):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def bpf_stats(pids):
    ns = cnt = 0
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fdinfo")
        except OSError:
            continue
        for fd in fds:
            try:
                r = bl.parse_fdinfo_bpf(open(f"/proc/{pid}/fdinfo/{fd}").read())
            except OSError:
                continue
            if r:
                ns, cnt = ns + r[0], cnt + r[1]
    return ns, cnt


def stop_measured(p, sig):
    """Signals p and waits for it; (cpu seconds from its rusage, peak RSS KiB). The peak
    is the largest VmHWM sum over p and its children seen from just before the signal
    until it exits (ru_maxrss would include the pre-exec RSS of the forked Python that
    started it)."""
    hwm = sum(status_kib(q, "VmHWM") for q in tree(p.pid))
    p.send_signal(sig)
    deadline = time.time() + 120
    while True:
        if time.time() > deadline:
            p.kill()
            raise RuntimeError(f"{p.args[0]} did not exit within 120 s of signal {sig}")
        hwm = max(hwm, sum(status_kib(q, "VmHWM") for q in tree(p.pid)))
        pid, _, ru = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            p.returncode = 0
            return ru.ru_utime + ru.ru_stime, hwm
        time.sleep(0.05)


def wait_for_line(path, needle, p, timeout=30):
    """Waits until the log at path has a line containing needle; fails if p exits."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if needle in _read(path):
            return
        if p.poll() is not None:
            raise RuntimeError(f"{p.args[0]} exited before '{needle}': {_read(path)[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"{p.args[0]} did not log '{needle}' within {timeout} s")


class Firn:
    name = "firn"

    def __init__(self, rnd):
        self.rnd = rnd

    def start(self, hz, enricher_extra=(), sampler_binary=None, enricher_binary=None):
        self.tmp = tempfile.mkdtemp(prefix="firn-bench-")
        os.chmod(self.tmp, 0o755)
        # How to start firn comes from the tests' own definition (firn-plan), which also
        # prepares the user and the output directory.
        got = json.loads(subprocess.run(
            [str(BIN / "firn-plan"), self.tmp, "firn-bench", HTTP,
             "--frequency", str(hz), "--round", str(self.rnd), *getattr(self, "sampler_extra", ())],
            capture_output=True, text=True, check=True).stdout)
        plan = got["plan"]
        if sampler_binary:  # another build of the sampler (sampler_ab.py)
            plan["sampler"][0] = str(sampler_binary)
        self.out = plan["out"]
        self.prepare(plan)
        self.t0 = time.time()
        env = dict(os.environ, FIRN_LOG=os.environ.get("FIRN_BENCH_LOG", "info"))
        slog = os.path.join(self.tmp, "sampler.log")
        self.sampler = subprocess.Popen(plan["sampler"], stderr=open(slog, "w"), env=env)
        wait_for_line(slog, plan["sampler_ready"], self.sampler)
        elog = os.path.join(self.tmp, "enricher.log")
        enricher = list(got["enricher"])
        if enricher_binary:  # another build of the enricher (aged_rest.py)
            enricher[enricher.index(str(BIN / "firn-enricher"))] = str(enricher_binary)
        self.enricher = subprocess.Popen(enricher + list(enricher_extra), stdout=subprocess.DEVNULL,
                                         stderr=open(elog, "w"), env=env)
        wait_for_line(elog, plan["enricher_ready"], self.enricher)
        self.ready()
        # Two rounds: connected, the first binaries loaded — the steady state.
        time.sleep(2 * self.rnd + 0.5)

    def prepare(self, plan):
        """Before the enricher starts, with the plan's user made (for subclasses)."""

    def ready(self):
        """Once the enricher is connected, before the two rounds of settling (for subclasses)."""

    def pids(self):
        return [self.sampler.pid, self.enricher.pid]

    def metrics(self):
        try:
            token = open(os.path.join(self.out, ".http-token")).read().strip()
            req = urllib.request.Request(f"http://{HTTP}/metrics", headers={"Authorization": "Bearer " + token})
            with urllib.request.urlopen(req, timeout=5) as r:
                return bl.parse_prometheus(r.read().decode())
        except OSError:
            return {}

    def entries(self):
        for d in sorted(os.listdir(self.out)):
            try:
                lines = open(os.path.join(self.out, d, "index.jsonl")).read().splitlines()
            except OSError:
                continue
            for line in lines:
                yield json.loads(line)

    def kernel_memory(self):
        """Kernel memory of the sampler's BPF maps (memlock, by map type) and the unwind
        tables it loaded, per binary (from its log)."""
        by_type, seen = {}, set()
        try:
            fds = os.listdir(f"/proc/{self.sampler.pid}/fdinfo")
        except OSError:
            fds = []
        for fd in fds:
            try:
                r = bl.parse_fdinfo_map(open(f"/proc/{self.sampler.pid}/fdinfo/{fd}").read())
            except OSError:
                continue
            if r and r[3] not in seen:
                seen.add(r[3])
                by_type.setdefault(r[0], []).append((r[1], r[2]))
        return {"maps_by_type": by_type,
                "tables": bl.parse_table_log(_read(os.path.join(self.tmp, "sampler.log")))}

    def stop(self, workload_pid=None, settle=True):
        if settle:
            time.sleep(self.rnd + 2)  # the round holding the workload's end
        m = self.metrics()
        kmem = self.kernel_memory()
        ecpu, erss = stop_measured(self.enricher, signal.SIGTERM)
        scpu, srss = stop_measured(self.sampler, signal.SIGTERM)
        life = time.time() - self.t0
        captured = sum(e["samples"] for e in self.entries()
                       if workload_pid is not None and e["labels"].get("pid") == str(workload_pid))
        total = sum(e["samples"] for e in self.entries())
        lost = {
            "bpf_maps": sum(m.get(f"firn_sampler_{k}", 0) for k in (
                "bpf_user_stack_lost", "bpf_kernel_stack_lost", "bpf_counts_map_full")),
            "sampler_queue": m.get("firn_sampler_batches_dropped", 0),
            "enricher": sum(m.get(f"firn_enricher_{k}_total", 0) for k in (
                "batches_rejected", "sink_errors", "sink_disk_full")),
        }
        shutil.rmtree(self.tmp, ignore_errors=True)
        return {"cpu_total": scpu + ecpu, "cpu_total_sampler": scpu, "cpu_total_enricher": ecpu,
                "life_seconds": life, "rss_peak_kib": srss + erss, "rss_peak_sampler_kib": srss,
                "rss_peak_enricher_kib": erss, "captured": captured, "total_samples": total, "lost": lost,
                "kernel_memory": kmem,
                "metrics": {k: v for k, v in m.items()
                            if any(w in k for w in ("symbol", "binar", "process", "unwind"))}}


class Perf:
    name = "perf"

    def start(self, hz):
        self.tmp = tempfile.mkdtemp(prefix="perf-bench-")
        self.data = os.path.join(self.tmp, "perf.data")
        self.err = os.path.join(self.tmp, "stderr")
        self.t0 = time.time()
        self.p = subprocess.Popen(["perf", "record", "-F", str(hz), "-a", "-g", "-o", self.data],
                                  stdout=subprocess.DEVNULL, stderr=open(self.err, "w"))
        time.sleep(1.5)

    def pids(self):
        return [self.p.pid]

    def stop(self, workload_pid=None):
        cpu, rss = stop_measured(self.p, signal.SIGINT)
        life = time.time() - self.t0
        written, lost = bl.parse_perf_record_stderr(open(self.err).read())
        captured = 0
        if workload_pid is not None:
            out = subprocess.run(["perf", "script", "-i", self.data, "-F", "comm,pid", "--pid", str(workload_pid)],
                                 capture_output=True, text=True).stdout
            captured = bl.count_comm_lines("\n".join(line.split()[0] for line in out.splitlines() if line.split()),
                                           COMM)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return {"cpu_total": cpu, "life_seconds": life, "rss_peak_kib": rss, "captured": captured,
                "total_samples": written, "lost": {"perf_chunks": lost}}


class _Tool:
    """A peer profiler run as one process tree, its stdout and stderr kept in files."""
    name = "?"

    def spawn(self, argv):
        self.tmp = tempfile.mkdtemp(prefix=f"{self.name}-bench-")
        self.out = os.path.join(self.tmp, "out")
        self.err = os.path.join(self.tmp, "err")
        self.t0 = time.time()
        self.p = subprocess.Popen(argv, stdout=open(self.out, "w"), stderr=open(self.err, "w"))

    def pids(self):
        return tree(self.p.pid)

    def stop(self, workload_pid=None):
        cpu, rss = stop_measured(self.p, signal.SIGINT)
        life = time.time() - self.t0
        captured, total, lost = self.results(open(self.out).read(), open(self.err).read())
        shutil.rmtree(self.tmp, ignore_errors=True)
        return {"cpu_total": cpu, "life_seconds": life, "rss_peak_kib": rss,
                "captured": captured if workload_pid is not None else 0, "total_samples": total,
                "lost": lost}


class Bpftrace(_Tool):
    name = "bpftrace"

    def start(self, hz):
        self.spawn(["bpftrace", "-e", BPFTRACE_PROG.format(hz=hz)])
        for _ in range(600):
            if "Attaching" in open(self.out).read():
                break
            time.sleep(0.05)
        time.sleep(0.5)

    def results(self, out, err):
        mine, total = bl.parse_bpftrace_counts(out, COMM)
        return mine, total, {"stack_lookups_failed": err.count("failed to look up stack id")}


class Bcc(_Tool):
    name = "bcc"

    def start(self, hz):
        self.spawn([BCC_PROFILE, "-F", str(hz), "-f"])
        # Ready once its compiled program is loaded (it prints nothing until the end).
        for _ in range(1200):
            if bpf_stats([self.p.pid])[0] or any(
                    bl.parse_fdinfo_bpf(_read(f"/proc/{self.p.pid}/fdinfo/{fd}"))
                    for fd in _listdir(f"/proc/{self.p.pid}/fdinfo")):
                break
            if self.p.poll() is not None:
                raise RuntimeError(f"BCC profile exited: {open(self.err).read()[-500:]}")
            time.sleep(0.05)
        time.sleep(0.5)

    def results(self, out, err):
        mine, total, missed = bl.parse_folded(out, COMM)
        lost = bl.parse_bcc_warnings(err + out)
        return mine, total, {"stacks_not_shown": lost, "missed_stacks": missed}


def _read(path):
    try:
        return open(path).read()
    except OSError:
        return ""


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []

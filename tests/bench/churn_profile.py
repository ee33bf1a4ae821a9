"""One churn storm against the current build, for the sampler's and the enricher's cost per
new process and where it goes: `python3 tests/bench/churn_profile.py [seconds]` (root;
`firn_bench.py` builds the workloads first; SAMPLER=path runs another build of the
sampler). With PERF=1, perf records both halves with
DWARF call graphs into target/churn-{sampler,enricher}.perf (it adds its own cost).
Also counts the sampler's system calls (`perf stat -e raw_syscalls:sys_enter`) and its
voluntary context switches (its wakeups) per new process, and reports the enricher's
memory: its peak (VmHWM) and the most RSS, RssAnon and RssFile sampled every 0.5 s
during the storm, and its RSS at the end."""
import re
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from profilers import proc_cpu, status_kib  # noqa: E402
from runs import ChurnFirn  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
W = ROOT / "target" / "workloads"


class MemoryWatch:
    """The most of each /proc status field seen, sampled every 0.5 s until stopped."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile")

    def __init__(self, pid):
        self.pid, self.most, self.done = pid, dict.fromkeys(self.FIELDS, 0), threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.done.wait(0.5):
            for k in self.FIELDS:
                self.most[k] = max(self.most[k], status_kib(self.pid, k))

    def stop(self):
        self.done.set()
        self.thread.join()
        return self.most


def main():
    secs = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    f = ChurnFirn(10, W / "unwind-cache-profile")
    # SAMPLER=path: another build of the sampler (an A/B against this one).
    f.start(99, sampler_binary=os.environ.get("SAMPLER") or None)
    # perf runs once during the warm-up, so that its own binaries' tables are loaded
    # before the window (they are not the churn's cost).
    subprocess.run(["perf", "stat", "-e", "raw_syscalls:sys_enter", "-a", "sleep", "2"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(13)  # past the start-up wave of tables
    s0, e0 = proc_cpu(f.sampler.pid), proc_cpu(f.enricher.pid)
    time.sleep(10)
    rest_s, rest_e = (proc_cpu(f.sampler.pid) - s0) / 10, (proc_cpu(f.enricher.pid) - e0) / 10
    m0 = f.metrics()
    perfs = []
    if os.environ.get("PERF") == "1":
        for name, pid in (("sampler", f.sampler.pid), ("enricher", f.enricher.pid)):
            perfs.append(subprocess.Popen(
                ["perf", "record", "-F", "2999", "--call-graph", "dwarf,16384",
                 "-o", str(ROOT / "target" / f"churn-{name}.perf"), "-p", str(pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    stat = subprocess.Popen(["perf", "stat", "-x", ",", "-e", "raw_syscalls:sys_enter", "-p", str(f.sampler.pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    w0 = status_kib(f.sampler.pid, "voluntary_ctxt_switches")
    s0, e0, t0 = proc_cpu(f.sampler.pid), proc_cpu(f.enricher.pid), time.time()
    mem = MemoryWatch(f.enricher.pid)
    subprocess.run([str(W / "churn"), str(secs), "50", str(W / "churn-child")], stdout=subprocess.DEVNULL,
                   env=dict(os.environ, CHURN_MS="20"), check=True)
    el = time.time() - t0
    s, e = (proc_cpu(f.sampler.pid) - s0) / el, (proc_cpu(f.enricher.pid) - e0) / el
    w1 = status_kib(f.sampler.pid, "voluntary_ctxt_switches")
    stat.send_signal(2)
    m = re.match(r"\s*(\d+),", stat.communicate()[1])
    syscalls = int(m.group(1)) if m else float("nan")
    for p in perfs:
        p.send_signal(2)
        p.wait()
    m1 = f.metrics()
    most = mem.stop()
    hwm, rss_end = status_kib(f.enricher.pid, "VmHWM"), status_kib(f.enricher.pid, "VmRSS")
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
    new = d.get("firn_sampler_events_new", 0) or float("nan")
    print(f"at rest: sampler {rest_s * 1000:.2f}, enricher {rest_e * 1000:.2f} ms/s; churn 50/s for {el:.0f} s: "
          f"sampler {s * 1000:.2f}, enricher {e * 1000:.2f} ms/s; {new:.0f} new processes; per new process: "
          f"sampler {(s - rest_s) * el / new * 1e6:.0f} µs, enricher {(e - rest_e) * el / new * 1e6:.0f} µs; "
          f"/proc read {d.get('firn_sampler_process_read_ns', 0) / max(1, d.get('firn_sampler_processes_read', 0)) / 1000:.0f} "
          f"µs wall each; {d.get('firn_sampler_announcements_sent', 0):.0f} announcements for "
          f"{d.get('firn_sampler_processes_announced', 0):.0f} records; sampler syscalls {syscalls / new:.1f} and "
          f"wakeups {(w1 - w0) / new:.2f} per new process")
    print(f"enricher memory: peak (VmHWM) {hwm / 1024:.1f} MiB; during the storm RSS at most "
          f"{most['VmRSS'] / 1024:.1f} MiB (RssAnon {most['RssAnon'] / 1024:.1f}, RssFile "
          f"{most['RssFile'] / 1024:.1f}); at the end {rss_end / 1024:.1f} MiB; "
          f"{m1.get('firn_enricher_processes_known', 0):.0f} processes known, "
          f"{m1.get('firn_enricher_symbol_bytes_held', 0) / 2**20:.1f} MiB of symbols held")
    f.stop()


if __name__ == "__main__":
    main()

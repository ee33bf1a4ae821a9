"""Pure pieces of the benchmark suite: statistics, ratio math and the parsers of what
each profiler prints. Unit-tested by tests/bench/test_benchlib.py (no root needed)."""
import math
import re
import statistics


def med(xs):
    """(median, min, max) of the finite values of xs; NaNs when there are none."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return (math.nan, math.nan, math.nan)
    return (statistics.median(xs), min(xs), max(xs))


def ratios(values, baseline):
    """Each value divided by the median of the baseline runs of the same session."""
    base = med(baseline)[0]
    if not base or math.isnan(base):
        return [math.nan for _ in values]
    return [v / base for v in values]


def paired_ratios(pairs):
    """Per pair (a, b) measured back to back, a / b; pairs with a missing or zero b are
    left out. On a VM whose per-sample cost drifts by 2x over minutes, the ratio within
    a pair holds where the ratio of two medians taken minutes apart does not."""
    out = []
    for a, b in pairs:
        if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
            continue
        out.append(a / b)
    return out


def ratio_mean(ratios):
    """(geometric mean, its standard error as a factor, n) of ratios: the mean of their
    logarithms, so 0.5 and 2 cancel; the factor f says the mean is within ×/÷ f at one
    standard error. None when fewer than two usable ratios."""
    logs = [math.log(r) for r in ratios if r and r > 0 and not math.isnan(r) and not math.isinf(r)]
    n = len(logs)
    if n < 2:
        return None
    m = sum(logs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / (n - 1))
    return math.exp(m), math.exp(sd / math.sqrt(n)), n


def beat_turn(run):
    """For run `run` of two samplers at once, one at a beat below the other's rate: (the
    rate's turn, the start order's turn), two booleans each caller maps to its pair (which
    one samples lower, which one starts first). The rate's turn alternates every two runs
    and the order's every run, so every 4 runs balance both."""
    return run // 2 % 2 == 0, run % 2 == 0


def expected_samples(hz, seconds, cpus):
    return hz * seconds * cpus


def fmt(t, spec="{:.3g}"):
    """'median (min–max)'; '–' when nothing was measured."""
    if any(math.isnan(x) for x in t):
        return "–"
    return f"{spec.format(t[0])} ({spec.format(t[1])}–{spec.format(t[2])})"


def parse_busy(text):
    """The busy workload's report: iterations per second and its CPU seconds."""
    ips = re.search(r"iterations_per_second ([\d.]+)", text)
    cpu = re.search(r"cpu_seconds ([\d.]+)", text)
    return (float(ips.group(1)) if ips else math.nan, float(cpu.group(1)) if cpu else math.nan)


def parse_fdinfo_bpf(text):
    """(run_time_ns, run_cnt) of a BPF program fd's fdinfo; None for other fds."""
    if "prog_type" not in text:
        return None
    ns = re.search(r"run_time_ns:\s+(\d+)", text)
    cnt = re.search(r"run_cnt:\s+(\d+)", text)
    if not ns or not cnt:
        return None
    return int(ns.group(1)), int(cnt.group(1))


def parse_fdinfo_map(text):
    """(map_type, max_entries, memlock bytes, map_id) of a BPF map fd's fdinfo; None
    otherwise. A process may hold several fds of one map: count each map_id once."""
    if "map_type" not in text or "prog_type" in text:
        return None
    t = re.search(r"map_type:\s+(\d+)", text)
    n = re.search(r"max_entries:\s+(\d+)", text)
    m = re.search(r"memlock:\s+(\d+)", text)
    i = re.search(r"map_id:\s+(\d+)", text)
    if not t or not m:
        return None
    return int(t.group(1)), int(n.group(1)) if n else 0, int(m.group(1)), int(i.group(1)) if i else -1


def parse_table_log(text):
    """path → rows of each unwind table the sampler logged as loaded (last one wins)."""
    out = {}
    for line in text.splitlines():
        if "unwind table loaded" not in line:
            continue
        path = re.search(r"path=(\S+)", line)
        rows = re.search(r"rows=(\d+)", line)
        if path and rows:
            out[path.group(1)] = int(rows.group(1))
    return out


def histogram_quantile(metrics, name, q):
    """The upper bound of the bucket holding quantile q of a Prometheus histogram in
    parsed metrics (nan without observations; inf past the last bound)."""
    buckets, prefix = [], name + '_bucket{le="'
    for k, v in metrics.items():
        if k.startswith(prefix):
            le = k[len(prefix):-2]
            buckets.append((float("inf") if le == "+Inf" else float(le), v))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if total == 0:
        return float("nan")
    for le, cum in buckets:
        if cum >= q * total:
            return le
    return float("inf")


def parse_prometheus(text):
    """name → value of a Prometheus text exposition (firn's /metrics); a labelled series
    is keyed by its whole name, e.g. `x_total{sink="otlp"}`."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                pass
    return out


def parse_bpftrace_counts(text, comm):
    """Sum of the counts of bpftrace's `@[kstack, ustack, comm] = count()` entries whose
    comm is `comm`, and the sum over all entries."""
    mine = total = 0
    for m in re.finditer(r"^(?:, )?([^\n]*)\]: (\d+)$", text, re.M):
        key, n = m.group(1), int(m.group(2))
        total += n
        # The last key element follows the final ", " on the closing line.
        if key.rsplit(", ", 1)[-1].strip() == comm:
            mine += n
    return mine, total


def parse_folded(text, comm):
    """BCC profile -f (folded) output: (samples of comm, all samples, missed stacks)."""
    mine = total = missed = 0
    for line in text.splitlines():
        stack, sep, n = line.rpartition(" ")
        if not sep or not n.isdigit():
            continue
        n = int(n)
        total += n
        if stack.split(";", 1)[0] == comm:
            mine += n
        if "[Missed User Stack]" in stack or "[Missed Kernel Stack]" in stack:
            missed += n
    return mine, total, missed


def parse_bcc_warnings(text):
    """Stack traces BCC's profile says it lost or could not show."""
    lost = 0
    for m in re.finditer(r"WARNING: (\d+) stack traces (?:lost|could not be displayed)", text):
        lost += int(m.group(1))
    return lost


def parse_perf_record_stderr(text):
    """perf record's closing lines: (samples written, chunks lost)."""
    samples = re.search(r"\((\d+) samples\)", text)
    lost = re.search(r"lost (\d+) chunks", text)
    return (int(samples.group(1)) if samples else 0, int(lost.group(1)) if lost else 0)


def count_comm_lines(text, comm):
    """Lines of `perf script -F comm` output naming comm."""
    return sum(1 for line in text.splitlines() if line.strip() == comm)


def trend_per_minute(points):
    """Least-squares slope of (seconds, value) points, per minute: a growth trend."""
    if len(points) < 2:
        return math.nan
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    if den == 0:
        return math.nan
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def replace_section(text, name, body):
    """Replaces what lies between <!-- name:start --> and <!-- name:end -->, adding the
    pair at the end when it is missing."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        return text.rstrip("\n") + f"\n\n{start}\n{body}\n{end}\n"
    i, j = text.index(start) + len(start), text.index(end)
    return text[:i] + "\n" + body + "\n" + text[j:]

"""Unit tests of the benchmark suite's parsing and ratio math:
`python3 -m unittest discover -s tests/bench` (tests/run.sh runs them)."""
import math
import subprocess
import sys
import unittest

import benchlib as b
import profilers

# Shapes copied from real output on this machine (bpftrace v0.17.0, BCC profile -f,
# perf record's closing lines).
BPFTRACE = """Attaching 1 probe...


@[,
    0x7f9df5c0002a
, rustc]: 1
@[, , busy-bench]: 2
@[
    exc_page_fault+215
    asm_exc_page_fault+34
,
    hot_leaf+20
    middle+9
, busy-bench]: 40
@[
    pv_native_safe_halt+11
    default_idle+5
, , swapper/0]: 3
"""

FOLDED = """busy-bench;outer;middle;hot_leaf 120
busy-bench;[Missed User Stack] 2
opt cgu.0;[unknown];llvm::MDTuple::getImpl(llvm::LLVMContext&, llvm::ArrayRef<llvm::Metadata*>) 1
rustc;[unknown] 7
"""


class Stats(unittest.TestCase):
    def test_med_ignores_nan(self):
        self.assertEqual(b.med([3.0, math.nan, 1.0, 2.0]), (2.0, 1.0, 3.0))

    def test_histogram_quantile(self):
        m = b.parse_prometheus('h_bucket{le="0.1"} 3\nh_bucket{le="0.25"} 6\n'
                                'h_bucket{le="+Inf"} 8\nh_count 8\n')
        self.assertEqual(b.histogram_quantile(m, "h", 0.5), 0.25)
        self.assertEqual(b.histogram_quantile(m, "h", 0.3), 0.1)
        self.assertEqual(b.histogram_quantile(m, "h", 0.9), float("inf"))
        self.assertTrue(math.isnan(b.histogram_quantile({}, "h", 0.5)))

    def test_med_of_nothing_is_nan(self):
        self.assertTrue(all(math.isnan(x) for x in b.med([math.nan])))

    def test_ratios_use_the_baseline_median(self):
        self.assertEqual(b.ratios([90.0, 110.0], [100.0, 50.0, 200.0]), [0.9, 1.1])

    def test_ratios_without_baseline_are_nan(self):
        self.assertTrue(math.isnan(b.ratios([1.0], [])[0]))

    def test_expected_samples(self):
        self.assertEqual(b.expected_samples(99, 30, 2), 5940)

    def test_fmt(self):
        self.assertEqual(b.fmt((1.0, 0.5, 2.0), "{:.1f}"), "1.0 (0.5–2.0)")
        self.assertEqual(b.fmt((math.nan,) * 3), "–")

    def test_trend(self):
        self.assertAlmostEqual(b.trend_per_minute([(0, 10), (60, 12), (120, 14)]), 2.0)
        self.assertTrue(math.isnan(b.trend_per_minute([(0, 1)])))


class Parsers(unittest.TestCase):
    def test_fdinfo_map_and_table_log(self):
        text = ("pos:\t0\nflags:\t02000002\nmap_type:\t2\nkey_size:\t4\nvalue_size:\t8\n"
                "max_entries:\t4194304\nmap_flags:\t0x0\nmemlock:\t33558528\nmap_id:\t72\n")
        self.assertEqual(b.parse_fdinfo_map(text), (2, 4194304, 33558528, 72))
        self.assertIsNone(b.parse_fdinfo_map("prog_type:\t7\nrun_time_ns:\t1\n"))
        log = ("x INFO firn_sampler::server: unwind table loaded subscriber=1 path=/usr/lib/libc.so.6 rows=28274\n"
               "y INFO other line\n"
               "z INFO firn_sampler::server: unwind table loaded subscriber=1 path=/tmp/a rows=31\n")
        self.assertEqual(b.parse_table_log(log), {"/usr/lib/libc.so.6": 28274, "/tmp/a": 31})

    def test_busy(self):
        self.assertEqual(b.parse_busy("ready 12\niterations_per_second 812.5\ncpu_seconds 59.9\n"),
                         (812.5, 59.9))
        self.assertTrue(math.isnan(b.parse_busy("killed")[0]))

    def test_fdinfo(self):
        prog = "pos:\t0\nflags:\t02000002\nprog_type:\t7\nrun_time_ns:\t1234\nrun_cnt:\t10\n"
        self.assertEqual(b.parse_fdinfo_bpf(prog), (1234, 10))
        self.assertIsNone(b.parse_fdinfo_bpf("pos:\t0\nflags:\t02\n"))

    def test_prometheus(self):
        m = b.parse_prometheus("# TYPE x counter\nfirn_samples_received 42\nbad line here\nx{a=\"b\"} 1\n")
        self.assertEqual(m, {"firn_samples_received": 42.0, "x{a=\"b\"}": 1.0})

    def test_bpftrace(self):
        self.assertEqual(b.parse_bpftrace_counts(BPFTRACE, "busy-bench"), (42, 46))

    def test_folded(self):
        self.assertEqual(b.parse_folded(FOLDED, "busy-bench"), (122, 130, 2))

    def test_bcc_warnings(self):
        text = "WARNING: 8 stack traces could not be displayed. Consider increasing --stack-storage-size.\n"
        self.assertEqual(b.parse_bcc_warnings(text), 8)

    def test_perf_record(self):
        text = ("[ perf record: Woken up 3 times to write data ]\n"
                "Processed 5000 events and lost 2 chunks!\n"
                "[ perf record: Captured and wrote 1.2 MB perf.data (5940 samples) ]\n")
        self.assertEqual(b.parse_perf_record_stderr(text), (5940, 2))
        self.assertEqual(b.count_comm_lines("  busy-bench\nbash\nbusy-bench\n", "busy-bench"), 2)

    def test_replace_section(self):
        t = "a\n<!-- s:start -->\nold\n<!-- s:end -->\nb\n"
        self.assertEqual(b.replace_section(t, "s", "new"), "a\n<!-- s:start -->\nnew\n<!-- s:end -->\nb\n")
        self.assertIn("<!-- t:start -->\nx\n<!-- t:end -->", b.replace_section(t, "t", "x"))


class PairedRatios(unittest.TestCase):
    def test_each_pair_is_its_own_ratio(self):
        self.assertEqual(b.paired_ratios([(2.0, 4.0), (3.0, 3.0)]), [0.5, 1.0])

    def test_missing_or_zero_baselines_are_left_out(self):
        self.assertEqual(b.paired_ratios([(1.0, 0), (1.0, None), (math.nan, 2.0), (1.0, 2.0)]), [0.5])


class RatioMean(unittest.TestCase):
    def test_inverse_ratios_cancel(self):
        gm, f, n = b.ratio_mean([0.5, 2.0])
        self.assertAlmostEqual(gm, 1.0)
        self.assertEqual(n, 2)
        # sd of the logs is ln 2 * sqrt(2); over sqrt(2): ln 2, so a factor of 2.
        self.assertAlmostEqual(f, 2.0)

    def test_equal_ratios_have_no_spread(self):
        gm, f, _ = b.ratio_mean([0.9, 0.9, 0.9])
        self.assertAlmostEqual(gm, 0.9)
        self.assertAlmostEqual(f, 1.0)

    def test_unusable_ratios_are_left_out(self):
        self.assertIsNone(b.ratio_mean([1.0, math.nan, 0, -1, math.inf]))
        self.assertIsNone(b.ratio_mean([]))


class BeatTurn(unittest.TestCase):
    def test_four_runs_balance_rate_and_order(self):
        turns = [b.beat_turn(r) for r in range(4)]
        self.assertEqual(turns, [(True, True), (True, False), (False, True), (False, False)])


class TargetTogether(unittest.TestCase):
    """target_together.py's per-phase sums and its table."""

    def test_ns_per_sample_of_a_workload_and_none_without_samples(self):
        import target_together as t
        got = {"firn": {"nofp": [9000, 3], "fp": [0, 0]}}
        self.assertEqual(t.per(got, "firn", "nofp"), 3000)
        self.assertIsNone(t.per(got, "firn", "fp"))

    def test_a_row_without_usable_runs_shows_dashes(self):
        import target_together as t
        row = {"hz": 99, "phases": 10, "phase": 2.0, "beat": 2, "firn": [None], "bpftrace": [None],
               "ratios": [], "same": []}
        line = t.table([row]).splitlines()[-1]
        self.assertEqual(line, "| 99 | 0 | – | – | – | – |")

    def test_ratios_are_summarized(self):
        import target_together as t
        row = {"hz": 19, "phases": 10, "phase": 2.0, "beat": 2, "firn": [600, 700], "bpftrace": [1000, 1000],
               "ratios": [0.6, 0.7], "same": [0.8, 0.8]}
        line = t.table([row]).splitlines()[-1]
        self.assertIn("| 19 | 2 | 650 (600–700) | 1000 (1000–1000) | 0.65 (0.60–0.70); geometric mean 0.648", line)


class ProcCpu(unittest.TestCase):
    # A thread that burned CPU and ended: the process clock keeps its time, a sum over
    # the live threads (the meter before) does not.
    CHILD = """import sys, threading, time
def burn():
    t = time.thread_time()
    while time.thread_time() - t < 0.3:
        pass
th = threading.Thread(target=burn)
th.start()
th.join()
print("done", flush=True)
sys.stdin.read()
"""

    def test_ended_thread_counts(self):
        with subprocess.Popen([sys.executable, "-c", self.CHILD], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) as p:
            self.assertEqual(p.stdout.readline().strip(), "done")
            whole, live = profilers.proc_cpu(p.pid), profilers.live_threads_cpu(p.pid)
        self.assertGreaterEqual(whole, 0.3)
        self.assertGreaterEqual(whole - live, 0.25)
        self.assertEqual(profilers.proc_cpu(p.pid), 0.0)


if __name__ == "__main__":
    unittest.main()

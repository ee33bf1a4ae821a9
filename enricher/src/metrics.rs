//! The enricher's counters, shared with the HTTP server (`/metrics`). Every failure mode
//! and every drop has one.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

macro_rules! metrics {
    ($($name:ident: $help:literal,)*) => {
        #[derive(Default)]
        pub struct Metrics {
            $(#[doc = $help] pub $name: AtomicU64,)*
            /// Latest counters reported by the sampler (cumulative since its start).
            pub(crate) sampler: Mutex<Vec<(String, u64)>>,
            /// Seconds between a round's end and the end of its processing here.
            pub(crate) round_lag_ms: AtomicU64,
            /// Processes in the table (gauge).
            pub(crate) processes_known: AtomicU64,
            /// Binaries in the symbol cache (gauge).
            pub(crate) binaries_cached: AtomicU64,
            /// Pods of this node known from the Kubernetes API (gauge).
            pub(crate) kubernetes_pods: AtomicU64,
            /// Bytes of symbol tables and DWARF whose parse the symbolizer holds (gauge).
            pub(crate) symbol_bytes_held: AtomicU64,
            /// Named frames in the symbolizer's frame cache (gauge).
            pub(crate) symbol_frames_cached: AtomicU64,
            /// The Landlock ABI of the enricher's confinement (gauge; 0: none).
            pub(crate) landlock_abi: AtomicU64,
            /// Bytes the `/pprof/cpu` window holds, as counted for its bound (gauge).
            pub(crate) window_bytes: AtomicU64,
            /// Bytes and entries of the on-disk unwind table cache (gauges).
            pub(crate) unwind_cache_bytes: AtomicU64,
            pub(crate) unwind_cache_entries: AtomicU64,
            /// Delivery counters of the upload sinks (OTLP, Parca).
            pub(crate) sinks: Mutex<Vec<std::sync::Arc<SinkMetrics>>>,
            /// From a binary's first sample to its unwind table in the sampler.
            pub(crate) unwind_table_ready: Histogram,
        }

        impl Metrics {
            pub(crate) fn render(&self) -> String {
                let mut out = String::new();
                $(
                    let _ = writeln!(out, "# HELP firn_enricher_{}_total {}", stringify!($name), $help);
                    let _ = writeln!(out, "# TYPE firn_enricher_{}_total counter", stringify!($name));
                    let _ = writeln!(out, "firn_enricher_{}_total {}", stringify!($name), self.$name.load(Ordering::Relaxed));
                )*
                let _ = writeln!(out, "# HELP firn_enricher_log_lines_suppressed_total log lines held back by the per-call-site rate limit");
                let _ = writeln!(out, "# TYPE firn_enricher_log_lines_suppressed_total counter");
                let _ = writeln!(out, "firn_enricher_log_lines_suppressed_total {}", firn_logs::suppressed());
                let _ = writeln!(out, "# HELP firn_enricher_round_lag_seconds Time from a round's end at the sampler to its profiles being written.");
                let _ = writeln!(out, "# TYPE firn_enricher_round_lag_seconds gauge");
                let _ = writeln!(out, "firn_enricher_round_lag_seconds {:.3}", self.round_lag_ms.load(Ordering::Relaxed) as f64 / 1000.0);
                for (name, help, v) in [
                    ("processes_known", "Processes in the enricher's table.", &self.processes_known),
                    ("binaries_cached", "Binaries in the symbol cache.", &self.binaries_cached),
                    ("kubernetes_pods", "Pods of this node known from the Kubernetes API.", &self.kubernetes_pods),
                    ("symbol_bytes_held", "Bytes of symbol tables and DWARF whose parse the symbolizer holds (bounded by --symbol-budget).", &self.symbol_bytes_held),
                    ("symbol_frames_cached", "Named frames in the frame cache (bounded by --symbol-frames).", &self.symbol_frames_cached),
                    ("window_bytes", "Bytes of stacks, labels and mappings the /pprof/cpu window holds (bounded at 8 MiB).", &self.window_bytes),
                    ("landlock_abi", "The Landlock ABI the enricher confined itself with (0: none, or --unconfined).", &self.landlock_abi),
                    ("unwind_cache_bytes", "Bytes of the on-disk unwind table cache (bounded by --unwind-cache-size).", &self.unwind_cache_bytes),
                    ("unwind_cache_entries", "Unwind tables in the on-disk cache.", &self.unwind_cache_entries),
                ] {
                    let _ = writeln!(out, "# HELP firn_enricher_{name} {help}");
                    let _ = writeln!(out, "# TYPE firn_enricher_{name} gauge");
                    let _ = writeln!(out, "firn_enricher_{name} {}", v.load(Ordering::Relaxed));
                }
                if let Ok(s) = self.sinks.lock() {
                    SinkMetrics::render(&s, &mut out);
                }
                self.unwind_table_ready.render(
                    "firn_enricher_unwind_table_ready_seconds",
                    "Time from the first sample of a process mapping a binary without a table to that table loaded in the sampler (only binaries that needed one).",
                    &mut out,
                );
                if let Ok(s) = self.sampler.lock() {
                    for (name, value) in s.iter() {
                        let name: String = name
                            .chars()
                            .map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' })
                            .collect();
                        let kind = if firn_schema::SAMPLER_GAUGES.contains(&name.as_str()) {
                            "gauge"
                        } else {
                            "counter"
                        };
                        let _ = writeln!(out, "# TYPE firn_sampler_{name} {kind}");
                        let _ = writeln!(out, "firn_sampler_{name} {value}");
                    }
                }
                out
            }
        }
    };
}

metrics! {
    connects: "connections made to the sampler",
    connect_failures: "failed attempts to reach the sampler",
    disconnects: "sampler connections lost",
    batches_received: "batches received from the sampler",
    batches_rejected: "batches rejected as malformed or over a limit",
    batches_dropped_upstream: "batches the sampler dropped for this enricher (its queue was full)",
    samples_received: "sample counts received (sum of sample weights)",
    off_cpu_ns_received: "off-CPU nanoseconds received (the sampler's --off-cpu)",
    samples_without_process: "samples whose process record is unknown (encoded with comm only)",
    processes_dropped_by_relabel: "process label sets dropped by a keep or drop rule",
    samples_dropped_by_relabel: "samples of processes dropped by a keep or drop rule",
    frames_symbolized: "user frames given a function name",
    frames_unsymbolized_no_mapping: "user frames outside every known mapping (kept as address)",
    frames_unsymbolized_no_binary: "user frames whose binary could not be obtained (kept as address)",
    frames_unsymbolized_no_symbol: "user frames the binary has no symbol for (kept as address)",
    symbol_cache_hits: "frame lookups answered from the frame cache",
    symbol_cache_misses: "frame lookups that ran the symbolizer",
    binaries_loaded: "binaries opened for symbolization",
    binaries_evicted: "binaries evicted from the symbol cache",
    symbol_frames_evicted: "named frames evicted from the frame cache (--symbol-frames)",
    symbol_parses_dropped: "binaries whose parsed symbols and DWARF were dropped to stay within --symbol-budget",
    symbol_reparses: "binaries parsed again after being dropped for room",
    symbolize_ns: "nanoseconds spent in the symbolizer on frames not in the frame cache (parses included)",
    symbol_parses_transient: "parses of binaries whose symbol tables alone exceed --symbol-budget (dropped after the round)",
    symbol_parses_not_kept: "parses dropped after the round: keeping them would have dropped parses that cost more to make again and were needed more lately",
    symbol_table_scans: "parses not kept made by reading the symbol tables through a small buffer (blazesym would map and index them for the round)",
    symbol_table_scan_errors: "symbol table reads that failed (those frames kept as addresses for the round)",
    symbol_parses_lean: "parses not kept that were made from the symbol tables alone (no DWARF on a full budget): frames named without file:line for the round, not cached",
    binaries_over_symbol_budget: "binaries whose DWARF does not fit --symbol-budget (named from symbol tables only)",
    binaries_over_symbol_ceiling: "binaries whose symbol tables are larger than 4 x --symbol-budget (at least 96 MiB): not parsed, frames kept as addresses",
    debug_links_not_followed: "binaries (or their debug files) whose DWARF is reached through links by path (.gnu_debuglink, .gnu_debugaltlink, .debug_sup) with no debug file by build id in the debug directories to stand for it: named from symbol tables only (a binary's links are not followed)",
    dwarf_not_read_writable: "binaries with DWARF of their own that someone other than root may write: named from symbol tables (a link written into one after firn read it would be followed)",
    binaries_changed_after_load: "binaries written to after firn read their headers: not parsed, frames kept as addresses",
    debug_files_refused: "debug files by build id that are not regular ELF files (not read)",
    binary_load_errors: "binaries whose ELF could not be read",
    binaries_replaced_by_unstripped: "cached stripped binaries replaced by a copy with the same build id and a symbol table",
    symbolizer_panics: "binaries on which the symbolizer panicked (malformed; contained, frames kept as addresses)",
    broker_requests: "file descriptors requested from the sampler",
    broker_refusals: "broker requests the sampler refused (see log for reasons)",
    broker_errors: "broker requests that failed in transport",
    profiles_written: "pprof files written by the local sink",
    rounds_written: "rounds written by the local sink",
    rounds_empty: "rounds with no samples (no folder written)",
    sink_errors: "rounds the local sink could not write (unwritable, I/O error)",
    sink_disk_full: "rounds skipped because the output disk was nearly full",
    sink_retention_removed: "round folders removed by retention",
    http_requests: "HTTP requests served",
    http_refused_host: "HTTP requests refused for naming another Host (421: DNS rebinding)",
    http_refused_origin: "HTTP requests refused for coming from another site (403)",
    http_refused_token: "HTTP requests refused without the token (401)",
    http_connections_refused: "HTTP connections closed at accept: --http-max-connections reached",
    http_busy: "costly HTTP queries refused after waiting for their turn (503)",
    confinement_missing: "protections of the enricher's own confinement not in force (kernel lacks them, or --unconfined; logged at start)",
    window_rounds_evicted: "rounds dropped from the /pprof/cpu window early to bound memory",
    heap_trims: "times freed heap memory was given back to the system (after each round, and after table work between rounds)",
    config_reloads: "config files reloaded on SIGHUP",
    kubernetes_watch_errors: "Kubernetes pod watch errors (the watch resumes with backoff)",
    kubernetes_pending: "label sets computed while a container's pod was not yet known (retried next round)",
    config_reload_errors: "SIGHUP reloads refused (invalid file; previous config kept)",
    unwind_tables_built: "unwind tables built from a binary's CFI",
    unwind_table_build_errors: "binaries no unwind table could be built from (no CFI, malformed, not x86_64)",
    unwind_table_build_ns: "nanoseconds spent building unwind tables",
    unwind_tables_sent: "unwind tables the sampler took",
    unwind_table_cache_hits: "unwind tables read from the on-disk cache (no CFI parse)",
    unwind_table_cache_misses: "unwind tables not in the on-disk cache (built from CFI)",
    unwind_table_cache_corrupt: "cached unwind tables that failed their check (removed, built again, never sent)",
    unwind_table_cache_evicted: "cached unwind tables removed to keep the cache within --unwind-cache-size",
    unwind_table_cache_no_room: "unwind tables not kept on disk: over --unwind-cache-size or a quarter of the disk the profiles leave free",
    unwind_table_cache_write_errors: "unwind tables that could not be written to the on-disk cache",
    unwind_table_cache_skipped: "binaries whose table is not looked up in the on-disk cache: not a 64-bit ELF, CFI named by no section, or unreadable",
    unwind_tables_early: "unwind tables built and loaded between rounds, from a process's announcement",
    unwind_tables_built_aside: "tables of large files built on a blocking thread, one at a time, so small new programs' tables are not held up behind them",
    unwind_tables_aside_unsent: "tables built aside that were not sent when done: no link, another sampler session, or no process maps the file any more (kept on disk; a round tries the file again)",
    unwind_tables_early_overflow: "files dropped from the queue of tables built between rounds (over 4,096 waiting; their round sends them)",
    unwind_tables_deferred: "large files a round left to the queue between rounds, to be built off the event loop rather than inside the round",
    samples_in_moved_cgroups: "label sets of processes sampled in another cgroup than the one their record was read in (they moved; once per process, cgroup and round)",
    process_comm_changes: "changes of a process's main thread's comm from its record's or its last one (it renamed itself; labelled by the new one)",
    announcements_received: "announcements of new processes received between rounds",
    announcements_rejected: "announcements rejected as malformed or over a limit",
    unwind_table_rows_sent: "unwind rows the sampler took",
    unwind_tables_refused: "unwind tables the sampler refused (see log: budget, owner, rate)",
    unwind_table_send_errors: "unwind tables whose sending failed in transport",
    python_interpreters_found: "CPython interpreter files whose version and layout were read from the file (once per file and subscription)",
    python_interpreters_unknown: "CPython files of a version or build whose layout firn does not know (once per file and subscription; logged)",
    python_interpreters_sent: "interpreter records the sampler took (once per process and mappings version on a subscription)",
    python_interpreters_refused: "interpreter records the sampler refused (logged with the reason; the process keeps native frames)",
    python_interpreters_send_errors: "interpreter records whose call failed",
    python_code_received: "Python code objects' names received and kept",
    python_code_malformed: "Python code blobs that failed their decode (dropped)",
    python_code_evicted: "Python code objects' names dropped for room, least recently used first (their frames show [python: unknown code] later: the sampler sends names once a subscription)",
    python_frames_named: "Python frames named from their code object",
    python_frames_unnamed: "Python frames whose code object's names never arrived (shown as [python: unknown code])",
    user_stacks_incomplete: "user stacks the unwinder ended early (a marker frame names why)",
    debuginfo_uploaded: "binaries uploaded to Parca as debuginfo",
    debuginfo_upload_bytes: "bytes of debuginfo uploaded to Parca",
    debuginfo_already_present: "binaries Parca already had debuginfo for (not uploaded)",
    debuginfo_upload_errors: "debuginfo uploads that failed (retried later)",
    debuginfo_skipped: "binaries not uploaded: too large, or the server asked for a signed-URL upload",
    upload_token_reload_errors: "bearer token files that could not be read again on SIGHUP (the previous token stays)",
    opensearch_auth_failures: "answers of OpenSearch refusing firn's credentials (401/403; nothing more is sent until SIGHUP)",
    opensearch_template_installs: "index templates installed in OpenSearch (at start, when absent)",
    opensearch_template_upgrades: "firn index templates of an older mapping replaced, and their indices' mappings given the new fields",
    opensearch_template_kept: "index templates of firn's name left as found (not made by firn, or unreadable): documents with fields it lacks may be refused",
    opensearch_stacks_left_out: "distinct stacks past --opensearch-max-stacks or --opensearch-max-bytes in a round (counted in their profile documents only)",
}

impl Metrics {
    pub(crate) fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// Upper bounds of the histogram's buckets, in ms.
const BUCKETS_MS: [u64; 12] = [
    10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000,
];

/// A Prometheus histogram of durations, in fixed buckets.
#[derive(Default)]
pub(crate) struct Histogram {
    /// Observations at or under each bound (not cumulative), and over the last.
    counts: [AtomicU64; BUCKETS_MS.len() + 1],
    sum_ms: AtomicU64,
}

impl Histogram {
    pub(crate) fn observe_ms(&self, ms: u64) {
        let i = BUCKETS_MS.partition_point(|&b| b < ms);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ms.fetch_add(ms, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut total = 0;
        for (i, c) in self.counts.iter().enumerate() {
            total += c.load(Ordering::Relaxed);
            match BUCKETS_MS.get(i) {
                Some(b) => {
                    let _ = writeln!(
                        out,
                        "{name}_bucket{{le=\"{}\"}} {total}",
                        *b as f64 / 1000.0
                    );
                }
                None => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {total}");
                }
            }
        }
        let sum = self.sum_ms.load(Ordering::Relaxed) as f64 / 1000.0;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {total}");
    }
}

macro_rules! sink_metrics {
    ($($name:ident: $kind:literal, $help:literal,)*) => {
        /// Delivery counters of one sink, rendered with a `sink` label on `/metrics`.
        #[derive(Default)]
        pub(crate) struct SinkMetrics {
            pub(crate) sink: &'static str,
            $(#[doc = $help] pub $name: AtomicU64,)*
        }

        impl SinkMetrics {
            pub(crate) fn new(sink: &'static str) -> Self {
                Self { sink, ..Default::default() }
            }

            /// Prometheus text for every sink; HELP and TYPE once per metric.
            pub(crate) fn render(all: &[std::sync::Arc<SinkMetrics>], out: &mut String) {
                if all.is_empty() {
                    return;
                }
                $(
                    let name = if $kind == "counter" {
                        format!("firn_enricher_upload_{}_total", stringify!($name))
                    } else {
                        format!("firn_enricher_upload_{}", stringify!($name))
                    };
                    let _ = writeln!(out, "# HELP {name} {}", $help);
                    let _ = writeln!(out, "# TYPE {name} {}", $kind);
                    for m in all {
                        let _ = writeln!(out, "{name}{{sink=\"{}\"}} {}", m.sink, m.$name.load(Ordering::Relaxed));
                    }
                )*
            }
        }
    };
}

sink_metrics! {
    requests_sent: "counter", "requests the backend accepted (one per round)",
    bytes_sent: "counter", "bytes of accepted requests",
    retries: "counter", "send attempts that failed and will be retried (backend down, slow, overloaded)",
    rejected: "counter", "requests the backend refused as invalid (dropped, not retried)",
    profiles_rejected: "counter", "profiles an OTLP backend reported as rejected in a partial success",
    dropped: "counter", "requests dropped unsent: the oldest past the spool bound, or unwritable to the spool",
    spooled: "counter", "requests written to the on-disk spool",
    spool_errors: "counter", "spool writes or reads that failed (disk full, I/O error)",
    encode_ns: "counter", "nanoseconds spent encoding rounds for this sink (in the round loop)",
    documents_sent: "counter", "documents OpenSearch accepted (its _bulk answer, item by item)",
    documents_rejected: "counter", "documents OpenSearch refused for what they hold (mapping errors; dropped, not retried)",
    documents_retried: "counter", "documents OpenSearch asked to send again (429, 5xx items)",
    answers_too_large: "counter", "backend answers over the byte bound (gRPC 1 MiB; OpenSearch 16 MiB or twice --opensearch-max-bytes), refused unread and retried",
    queue_requests: "gauge", "requests waiting in memory",
    queue_bytes: "gauge", "bytes waiting in memory",
    spool_requests: "gauge", "requests waiting in the on-disk spool",
    spool_bytes: "gauge", "bytes waiting in the on-disk spool",
    last_success_seconds: "gauge", "Unix time of the last accepted request (0: none yet)",
    failing: "gauge", "1 while the backend is failing (requests wait and are retried)",
}

impl SinkMetrics {
    pub(crate) fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn set(c: &AtomicU64, n: u64) {
        c.store(n, Ordering::Relaxed);
    }
}

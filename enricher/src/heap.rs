//! The heap gives its freed memory back. By default glibc keeps it: its mmap threshold
//! rises to the largest block freed (up to 32 MiB), so after one big unwind table every
//! later table, cache read and encoded round comes from the heap and stays resident;
//! and each thread that allocates (the view's queries run on blocking threads) may get
//! an arena of its own. The enricher's big buffers are short-lived, so they are mapped
//! and unmapped on their own, few arenas are kept, and the heap is trimmed after each
//! round and after table work between rounds (where most tables are built now).

use std::time::{Duration, Instant};

use crate::metrics::Metrics;

/// Blocks from this size get a mapping of their own, unmapped when freed. Fixed: a
/// threshold set by hand no longer rises.
const MMAP_THRESHOLD: libc::c_int = 256 << 10;
/// Arenas at most: the event loop and the view's two costly queries at a time.
const ARENAS: libc::c_int = 2;
/// Table bytes between rounds worth a trim, and the shortest time between two.
const TRIM_AFTER_BYTES: u64 = 1 << 20;
const TRIM_EVERY: Duration = Duration::from_secs(1);

/// Sets the allocator's thresholds: at start, while the process is one thread. Both
/// are glibc's own settings (no system call, nothing the confinement sees).
pub(crate) fn configure() {
    // SAFETY: mallopt has no preconditions; it only changes glibc's malloc parameters.
    let ok = unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            && libc::mallopt(libc::M_ARENA_MAX, ARENAS) == 1
    };
    if !ok {
        tracing::warn!("the allocator refused its thresholds; freed memory may stay resident");
    }
}

/// When to give freed memory back.
pub(crate) struct Trimmer {
    last: Instant,
    /// Table bytes handled since the last trim.
    pending: u64,
}

impl Default for Trimmer {
    fn default() -> Self {
        Self {
            last: Instant::now(),
            pending: 0,
        }
    }
}

impl Trimmer {
    /// Gives freed heap memory back now (after a round: its batch, tables and encoded
    /// profiles are free).
    pub(crate) fn trim(&mut self, metrics: &Metrics) {
        // SAFETY: malloc_trim has no preconditions.
        unsafe { libc::malloc_trim(0) };
        self.last = Instant::now();
        self.pending = 0;
        Metrics::inc(&metrics.heap_trims);
    }

    /// After table work between rounds that handled `bytes` of tables: a trim once
    /// enough has been handled to matter, at most once a second (else the round's).
    pub(crate) fn after_tables(&mut self, bytes: u64, metrics: &Metrics) {
        self.pending = self.pending.saturating_add(bytes);
        if self.pending >= TRIM_AFTER_BYTES && self.last.elapsed() >= TRIM_EVERY {
            self.trim(metrics);
        }
    }
}

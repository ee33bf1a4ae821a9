//! Cgroup paths by cgroup id. BPF gives each sample the cgroup v2 id it was taken in;
//! the path of an id is read from `/proc/<pid>/cgroup` of a process sampled in it, once:
//! when the process is first read, or when BPF sees it sampled in another cgroup than
//! before (it moved). Samples then carry the id, and subscribers get each id's path
//! once, so the labels follow a process that moves, sample by sample. A process that
//! hops between cgroups costs one read per new cgroup, within a rate bound.

use std::collections::HashMap;
use std::rc::Rc;

use firn_logs::TokenBucket;

use crate::counters::{bump, Counters};
use crate::procfs;

/// Path bytes held at most; past it the table starts again empty (its paths are read
/// again as samples need them).
const MAX_BYTES: usize = 1 << 20;
/// Cgroup reads after a move, per second and at once.
const READS_PER_SEC: f64 = 50.0;
const READS_BURST: f64 = 100.0;

pub(crate) struct Cgroups {
    by_id: HashMap<u64, Rc<[u8]>>,
    bytes: usize,
    reads: TokenBucket,
}

impl Default for Cgroups {
    fn default() -> Self {
        Self {
            by_id: HashMap::new(),
            bytes: 0,
            reads: TokenBucket::new(READS_PER_SEC, READS_BURST),
        }
    }
}

/// Whether a cgroup file's text is cgroup v2 alone (one `0::` line): then it is the
/// same for every process of that cgroup id, and may stand for a read.
pub(crate) fn unified_only(text: &[u8]) -> bool {
    text.starts_with(b"0::") && text.iter().filter(|&&b| b == b'\n').count() <= 1
}

impl Cgroups {
    pub(crate) fn get(&self, id: u64) -> Option<Rc<[u8]>> {
        self.by_id.get(&id).cloned()
    }

    /// The text of a process's cgroup file, for cgroup `id` (0: unknown, not kept).
    pub(crate) fn learn(&mut self, id: u64, text: &[u8], counters: &Counters) {
        if id == 0 || text.is_empty() || self.by_id.contains_key(&id) {
            return;
        }
        if self.bytes + text.len() > MAX_BYTES {
            bump(&counters.cgroup_paths_flushed);
            self.by_id.clear();
            self.bytes = 0;
        }
        self.bytes += text.len();
        self.by_id.insert(id, Rc::from(text));
    }

    /// A discovered process sampled in cgroup `id`: the text known for it, if it can
    /// stand for reading the process's own file (cgroup v2 alone).
    pub(crate) fn for_discovery(&self, id: u64) -> Option<Rc<[u8]>> {
        self.get(id).filter(|t| unified_only(t))
    }

    /// Process `pid` (started at `start_ns`) was sampled in cgroup `id`, another than
    /// before: its path is read unless known, within the rate bound (counted).
    pub(crate) fn moved(&mut self, (pid, start_ns): (u32, u64), id: u64, counters: &Counters) {
        bump(&counters.cgroup_moves);
        if id == 0 || self.by_id.contains_key(&id) {
            return;
        }
        if !self.reads.allow() {
            bump(&counters.cgroup_reads_limited);
            return;
        }
        bump(&counters.cgroup_reads);
        match procfs::read_cgroup(pid, start_ns) {
            Ok(text) => self.learn(id, &text, counters),
            Err(e) => {
                bump(&counters.cgroup_read_errors);
                tracing::debug!(pid, error = %e, "the cgroup of a process that moved is unreadable");
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_read_once_per_cgroup_and_the_reads_are_bounded() {
        let c = Counters::default();
        let mut g = Cgroups::default();
        let me = std::process::id();
        let start = procfs::start_ns_of(me).expect("own start time");
        let own = std::fs::read(format!("/proc/{me}/cgroup")).unwrap();
        // Hopping between two cgroups: two reads, however many moves.
        for i in 0..1000 {
            g.moved((me, start), 100 + (i % 2), &c);
        }
        assert_eq!(c.cgroup_reads.get(), 2);
        assert_eq!(c.cgroup_moves.get(), 1000);
        assert_eq!(g.get(100).as_deref(), Some(&own[..]));
        // A thousand new cgroups at once: the rate bound holds the reads.
        for id in 0..1000 {
            g.moved((me, start), 10_000 + id, &c);
        }
        assert!(c.cgroup_reads.get() <= 2 + READS_BURST as u64 + 5);
        assert!(c.cgroup_reads_limited.get() >= 800);
        // The bytes bound: past it the table starts again.
        for id in 0..20_000u64 {
            g.learn(1_000_000 + id, &[b'x'; 100], &c);
        }
        assert!(g.bytes <= MAX_BYTES && g.len() <= MAX_BYTES / 100);
        assert!(c.cgroup_paths_flushed.get() >= 1);
        assert!(unified_only(b"0::/system.slice/x.service\n"));
        assert!(!unified_only(b"12:cpu:/a\n0::/a\n"));
    }
}

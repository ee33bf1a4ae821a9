//! Cgroup paths by cgroup id. BPF gives each sample the cgroup v2 id it was taken in;
//! the path of an id is read from `/proc/<pid>/cgroup` of a process sampled in it, once:
//! when the process is first read, or when BPF sees it sampled in another cgroup than
//! before (it moved). Samples then carry the id, and subscribers get each id's path
//! once, so the labels follow a process that moves, sample by sample. A process that
//! hops between cgroups costs one read per new cgroup, within a rate bound.
//!
//! Only the cgroup v2 line (`0::/path`) is kept: on a hybrid host the v1 lines differ
//! between processes of one v2 cgroup. A path is kept under an id only when the cgroup
//! filesystem confirms it (the directory's inode is the id): a process that moved again
//! between its sample and the read is not taken at its word (`cgroup_paths_stale`).
//! Where that filesystem is not mounted (a container's own view), the path is kept
//! unconfirmed (`cgroup_paths_unconfirmed`).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::OnceLock;

use firn_logs::TokenBucket;

use crate::counters::{bump, Counters};
use crate::procfs;

/// Path bytes held at most; past it the table starts again empty (its paths are read
/// again as samples need them).
const MAX_BYTES: usize = 1 << 20;
/// Cgroup reads after a move, per second and at once.
const READS_PER_SEC: f64 = 50.0;
const READS_BURST: f64 = 100.0;
/// Moves whose read the rate bound held back, retried later; past it the oldest go.
const MAX_PENDING: usize = 1024;

struct Path {
    /// The `0::` line, newline included.
    line: Rc<[u8]>,
    /// The whole file was that line (cgroup v2 alone): it may stand for another
    /// process's read.
    whole: bool,
}

pub(crate) struct Cgroups {
    by_id: HashMap<u64, Path>,
    bytes: usize,
    reads: TokenBucket,
    pending: VecDeque<((u32, u64), u64)>,
}

impl Default for Cgroups {
    fn default() -> Self {
        Self {
            by_id: HashMap::new(),
            bytes: 0,
            reads: TokenBucket::new(READS_PER_SEC, READS_BURST),
            pending: VecDeque::new(),
        }
    }
}

/// Whether a cgroup file's text is cgroup v2 alone (one `0::` line): then it is the
/// same for every process of that cgroup id, and may stand for a read.
pub(crate) fn unified_only(text: &[u8]) -> bool {
    text.starts_with(b"0::") && text.iter().filter(|&&b| b == b'\n').count() <= 1
}

/// The `0::` line of a cgroup file's text, newline included.
fn unified_line(text: &[u8]) -> Option<&[u8]> {
    let at = if text.starts_with(b"0::") {
        0
    } else {
        text.windows(4).position(|w| w == b"\n0::")? + 1
    };
    let rest = &text[at..];
    let end = rest
        .iter()
        .position(|&b| b == b'\n')
        .map_or(rest.len(), |n| n + 1);
    Some(&rest[..end])
}

/// The cgroup v2 filesystem as the sampler sees it, if mounted.
fn v2_root() -> Option<&'static std::path::Path> {
    static ROOT: OnceLock<Option<PathBuf>> = OnceLock::new();
    ROOT.get_or_init(|| {
        ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.join("cgroup.controllers").exists())
    })
    .as_deref()
}

/// Whether the cgroup filesystem says `line` names cgroup `id`: `Some(false)` when it
/// names another, `None` when it cannot tell.
fn confirms(line: &[u8], id: u64) -> Option<bool> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let path = line
        .strip_prefix(b"0::")?
        .strip_suffix(b"\n")
        .unwrap_or(&line[3..]);
    // Relative to the sampler's cgroup namespace; one outside it is not looked for.
    if !path.starts_with(b"/") || path.windows(2).any(|w| w == b"..") {
        return None;
    }
    let full = v2_root()?.join(std::ffi::OsStr::from_bytes(&path[1..]));
    std::fs::metadata(full).ok().map(|m| m.ino() == id)
}

impl Cgroups {
    /// The `0::` line of cgroup `id`, if known.
    pub(crate) fn get(&self, id: u64) -> Option<Rc<[u8]>> {
        self.by_id.get(&id).map(|p| p.line.clone())
    }

    /// The text of a process's cgroup file, read while it was in cgroup `id` (0:
    /// unknown, not kept): its v2 line is kept once the filesystem does not deny it.
    pub(crate) fn learn(&mut self, id: u64, text: &[u8], counters: &Counters) {
        if id == 0 || self.by_id.contains_key(&id) {
            return;
        }
        let Some(line) = unified_line(text) else {
            return;
        };
        match confirms(line, id) {
            Some(true) => {}
            Some(false) => {
                bump(&counters.cgroup_paths_stale);
                return;
            }
            None => bump(&counters.cgroup_paths_unconfirmed),
        }
        if self.bytes + line.len() > MAX_BYTES {
            bump(&counters.cgroup_paths_flushed);
            self.by_id.clear();
            self.bytes = 0;
        }
        self.bytes += line.len();
        let whole = unified_only(text);
        self.by_id.insert(
            id,
            Path {
                line: Rc::from(line),
                whole,
            },
        );
    }

    /// A discovered process sampled in cgroup `id`: the text known for it, if it can
    /// stand for reading the process's own file (cgroup v2 alone).
    pub(crate) fn for_discovery(&self, id: u64) -> Option<Rc<[u8]>> {
        self.by_id
            .get(&id)
            .filter(|p| p.whole)
            .map(|p| p.line.clone())
    }

    /// Process `pid` (started at `start_ns`) was sampled in cgroup `id`, another than
    /// before: its path is read unless known, within the rate bound (a read held back is
    /// tried again later, counted).
    pub(crate) fn moved(&mut self, who: (u32, u64), id: u64, counters: &Counters) {
        bump(&counters.cgroup_moves);
        self.retry(counters);
        if id == 0 || self.by_id.contains_key(&id) {
            return;
        }
        if !self.reads.allow() {
            bump(&counters.cgroup_reads_limited);
            if self.pending.len() >= MAX_PENDING {
                self.pending.pop_front();
            }
            self.pending.push_back((who, id));
            return;
        }
        self.read(who, id, counters);
    }

    /// Reads held back by the rate bound, as far as it allows now.
    pub(crate) fn retry(&mut self, counters: &Counters) {
        while let Some(&(who, id)) = self.pending.front() {
            if self.by_id.contains_key(&id) {
                self.pending.pop_front();
                continue;
            }
            if !self.reads.allow() {
                return;
            }
            self.pending.pop_front();
            self.read(who, id, counters);
        }
    }

    fn read(&mut self, (pid, start_ns): (u32, u64), id: u64, counters: &Counters) {
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
        let line = unified_line(&own).expect("a cgroup v2 line").to_vec();
        // Hopping between two cgroups the filesystem cannot confirm (made-up ids):
        // refused where it can tell, kept where it cannot; read at most once each.
        for i in 0..1000 {
            g.moved((me, start), 100 + (i % 2), &c);
        }
        assert!(c.cgroup_reads.get() <= READS_BURST as u64 + 10);
        assert_eq!(c.cgroup_moves.get(), 1000);
        if confirms(&line, 100) == Some(false) {
            assert!(g.get(100).is_none() && c.cgroup_paths_stale.get() >= 1);
        } else {
            assert_eq!(g.get(100).as_deref(), Some(&line[..]));
            assert_eq!(c.cgroup_reads.get(), 2);
        }
        // Our own cgroup's real id is confirmed.
        if let Some(root) = v2_root() {
            use std::os::unix::fs::MetadataExt;
            let p = root.join(std::str::from_utf8(&line[4..line.len() - 1]).unwrap());
            let id = std::fs::metadata(p).unwrap().ino();
            assert_eq!(confirms(&line, id), Some(true));
            g.learn(id, &own, &c);
            assert_eq!(g.get(id).as_deref(), Some(&line[..]));
        }
        // A thousand new cgroups at once: the rate bound holds the reads back.
        let before = c.cgroup_reads.get();
        for id in 0..1000 {
            g.moved((me, start), 10_000 + id, &c);
        }
        assert!(c.cgroup_reads.get() - before <= READS_BURST as u64 + 5);
        assert!(c.cgroup_reads_limited.get() >= 800);
        assert!(g.pending.len() <= MAX_PENDING);
        // The bytes bound: past it the table starts again.
        let mut text = b"0::/".to_vec();
        text.extend([b'x'; 96]);
        text.push(b'\n');
        for id in 0..20_000u64 {
            g.learn(1_000_000 + id, &text, &c);
        }
        assert!(g.bytes <= MAX_BYTES && g.len() <= MAX_BYTES / 100);
        assert!(c.cgroup_paths_flushed.get() >= 1);
    }

    #[test]
    fn only_the_v2_line_is_kept_and_stands_for_a_read_when_alone() {
        let c = Counters::default();
        let mut g = Cgroups::default();
        assert!(unified_only(b"0::/system.slice/x.service\n"));
        assert!(!unified_only(b"12:cpu:/a\n0::/a\n"));
        assert_eq!(
            unified_line(b"12:cpu:/a\n0::/b/c\n"),
            Some(&b"0::/b/c\n"[..])
        );
        assert_eq!(unified_line(b"0::/b\n"), Some(&b"0::/b\n"[..]));
        assert_eq!(unified_line(b"1:name=systemd:/\n"), None);
        // Paths outside the sampler's namespace are not looked for.
        assert_eq!(confirms(b"0::/../../x\n", 5), None);
        g.learn(7, b"12:cpu:/a\n0::/../hybrid\n", &c);
        g.learn(8, b"0::/../alone\n", &c);
        assert_eq!(g.get(7).as_deref(), Some(&b"0::/../hybrid\n"[..]));
        assert!(
            g.for_discovery(7).is_none(),
            "v1 lines differ between processes"
        );
        assert_eq!(g.for_discovery(8).as_deref(), Some(&b"0::/../alone\n"[..]));
        assert_eq!(c.cgroup_paths_unconfirmed.get(), 2);
    }
}

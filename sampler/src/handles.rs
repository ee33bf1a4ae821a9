//! `O_PATH` handles of the files recently seen mapped, so that the broker can still open
//! a binary after its process exited (a short-lived process is gone long before the
//! enricher asks). A handle is taken through the same checked walk the broker uses
//! (inside the process's root, regular file, the mapping's device and inode), one per
//! distinct file. It opens nothing and reads nothing; the broker reopens it read-only
//! only when a subscriber asks for a mapping with exactly that device and inode.
//!
//! Off the discovery path: reading a new process's record only queues its files
//! ([`Handles::queue`]); the walks run once the burst of new processes has been read
//! ([`Handles::take_queued`]), so the time to read a process never depends on the files
//! other processes map.
//!
//! Bounded: at most `max` handles (the oldest goes first, counted), each closed once no
//! record has referred to it for [`IDLE_ROUNDS`] rounds; at most [`STEPS_PER_ROUND`]
//! path components walked per round, [`MAX_QUEUED`] records waiting; a cut or absurdly
//! deep path is never walked, and a file whose walk failed is not walked again for
//! [`FAILED_ROUNDS`] rounds. A handle pins its inode (a deleted binary's blocks stay
//! allocated) and its mount (an unmount without MNT_DETACH gets EBUSY) until then.

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;

use firn_schema::firn_capnp::Refusal;

use crate::counters::{bump, Counters};
use crate::procfs::Mapping;

/// Rounds a handle stays without use: the enricher asks for a round's binaries as soon
/// as it has the round, so two rounds of slack cover a slow subscriber.
pub(crate) const IDLE_ROUNDS: u64 = 3;
/// Handles held at most by default (each is one fd); lowered to fit RLIMIT_NOFILE.
pub(crate) const MAX_HANDLES: usize = 4096;
/// Path components walked per round at most, over all walks (each is one `openat` and
/// one `fstat`, a few microseconds): a few tens of milliseconds of the sampler a round.
pub(crate) const STEPS_PER_ROUND: u32 = 16_384;
/// Records whose files wait to be walked at most; past it the oldest wait is dropped.
pub(crate) const MAX_QUEUED: usize = 1024;
/// Rounds a file whose walk failed is left alone (the same path fails the same way).
pub(crate) const FAILED_ROUNDS: u64 = 6;
/// Failed files remembered at most.
const MAX_FAILED: usize = 8192;
/// File descriptors left for everything else (clients, /proc reads, BPF).
pub(crate) const RESERVED_FDS: usize = 512;

/// (device, inode) of a mapped file, as `stat` reports the device.
pub(crate) type FileId = (u64, u64);

pub(crate) fn file_id(m: &Mapping) -> FileId {
    (libc::makedev(m.dev_major, m.dev_minor), m.inode)
}

struct Held {
    fd: OwnedFd,
    used: u64,
}

pub struct Handles {
    by_file: HashMap<FileId, Held>,
    max: usize,
    round: u64,
    /// Path components still to be walked this round.
    steps_left: u32,
    /// `/proc/<pid>` directories and the files they map, waiting for their walks.
    queue: VecDeque<(OwnedFd, Vec<Mapping>)>,
    /// Files whose walk failed, and the round it did.
    failed: HashMap<FileId, u64>,
}

impl Handles {
    /// Holds at most `max` handles (0: none are taken; the broker then reaches binaries
    /// of live processes only).
    pub fn new(max: usize) -> Self {
        Self {
            by_file: HashMap::new(),
            max,
            round: 0,
            steps_left: STEPS_PER_ROUND,
            queue: VecDeque::new(),
            failed: HashMap::new(),
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_file.len()
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.by_file.is_empty()
    }

    /// Notes the files of a record just read: those held are marked used, the others
    /// wait for [`take_queued`](Self::take_queued). `proc_dir` is the process's
    /// `/proc/<pid>` directory, kept open until then.
    pub(crate) fn queue(&mut self, proc_dir: OwnedFd, mappings: &[Mapping], c: &Counters) {
        if self.max == 0 {
            return;
        }
        let mut wanted = Vec::new();
        for m in mappings {
            match self.by_file.get_mut(&file_id(m)) {
                Some(h) => h.used = self.round,
                None if !wanted.iter().any(|w: &Mapping| file_id(w) == file_id(m)) => {
                    wanted.push(m.clone())
                }
                None => {}
            }
        }
        if wanted.is_empty() {
            return;
        }
        if self.queue.len() >= MAX_QUEUED {
            self.queue.pop_front();
            bump(&c.binary_handles_skipped);
        }
        self.queue.push_back((proc_dir, wanted));
    }

    /// Walks to the files queued, oldest record first, within the round's budget.
    pub(crate) fn take_queued(&mut self, c: &Counters) {
        while let Some((dir, maps)) = self.queue.pop_front() {
            self.take(&dir, &maps, c);
        }
    }

    /// Takes a handle of each mapping not yet held, resolving it inside the root of the
    /// process whose `/proc/<pid>` directory is `proc_dir`. Failures are counted and
    /// leave the broker's path walk as the way to the file.
    pub(crate) fn take(&mut self, proc_dir: &OwnedFd, mappings: &[Mapping], c: &Counters) {
        if self.max == 0 {
            return;
        }
        let mut root = None;
        for m in mappings {
            let id = file_id(m);
            if let Some(h) = self.by_file.get_mut(&id) {
                h.used = self.round;
                continue;
            }
            match crate::broker::walkable(m) {
                Ok(()) => {}
                Err(Refusal::OpenFailed) => {
                    bump(&c.binary_handles_unwalkable);
                    continue;
                }
                Err(_) => continue,
            }
            if self
                .failed
                .get(&id)
                .is_some_and(|&at| self.round.saturating_sub(at) < FAILED_ROUNDS)
            {
                bump(&c.binary_handles_failed_recently);
                continue;
            }
            if self.steps_left == 0 {
                // A process can map many files behind long symlink chains; what it
                // can make the sampler walk per round is bounded. Its binaries are
                // still reached by the broker's walk while it lives.
                bump(&c.binary_handles_skipped);
                continue;
            }
            if root.is_none() {
                match crate::broker::open_root(proc_dir) {
                    Ok(r) => root = Some(r),
                    Err(_) => {
                        bump(&c.binary_handles_failed);
                        return;
                    }
                }
            }
            let Some(root) = root.as_ref() else { return };
            match crate::broker::checked_handle(root, m, &mut self.steps_left) {
                Ok(fd) => {
                    if self.by_file.len() >= self.max {
                        self.evict_oldest(c);
                    }
                    self.by_file.insert(
                        id,
                        Held {
                            fd,
                            used: self.round,
                        },
                    );
                    bump(&c.binary_handles_taken);
                }
                // The budget ran out on the way: not the file's fault.
                Err(_) if self.steps_left == 0 => bump(&c.binary_handles_skipped),
                Err(_) => {
                    bump(&c.binary_handles_failed);
                    if self.failed.len() >= MAX_FAILED {
                        let round = self.round;
                        self.failed
                            .retain(|_, &mut at| round.saturating_sub(at) < FAILED_ROUNDS);
                        if self.failed.len() >= MAX_FAILED {
                            self.failed.clear();
                        }
                    }
                    self.failed.insert(id, self.round);
                }
            }
        }
    }

    /// Opens the held file `id` read-only, if a handle of it is held. A request does not
    /// extend the handle's life: only records read do, so a client asking again and
    /// again cannot keep a file (and its mount) pinned.
    pub(crate) fn open(&self, id: FileId) -> Option<Result<OwnedFd, Refusal>> {
        let h = self.by_file.get(&id)?;
        Some(crate::broker::reopen_read_only(&h.fd))
    }

    /// Starts round `round`: handles unused for [`IDLE_ROUNDS`] are closed and the
    /// round's walks are available again.
    pub(crate) fn end_round(&mut self, round: u64, c: &Counters) {
        self.round = round;
        self.steps_left = STEPS_PER_ROUND;
        let before = self.by_file.len();
        self.by_file
            .retain(|_, h| round.saturating_sub(h.used) < IDLE_ROUNDS);
        crate::counters::add(
            &c.binary_handles_expired,
            (before - self.by_file.len()) as u64,
        );
        self.failed
            .retain(|_, &mut at| round.saturating_sub(at) < FAILED_ROUNDS);
    }

    fn evict_oldest(&mut self, c: &Counters) {
        if let Some((&id, _)) = self.by_file.iter().min_by_key(|(_, h)| h.used) {
            self.by_file.remove(&id);
            bump(&c.binary_handles_evicted);
        }
    }
}

/// Raises the soft RLIMIT_NOFILE to the hard one (setup, before confinement) and
/// returns how many handles fit beside [`RESERVED_FDS`].
pub(crate) fn fit_to_fd_limit(wanted: usize) -> usize {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return 0;
    };
    let soft = if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        hard
    } else {
        soft
    };
    let room = usize::try_from(soft)
        .unwrap_or(usize::MAX)
        .saturating_sub(RESERVED_FDS);
    wanted.min(room)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::fcntl::OFlag;
    use nix::sys::stat::{fstat, Mode};
    use std::os::fd::AsFd;

    fn mapping_of(path: &std::path::Path) -> Mapping {
        let st = fstat(
            nix::fcntl::open(path, OFlag::O_PATH, Mode::empty())
                .unwrap()
                .as_fd(),
        )
        .unwrap();
        Mapping {
            start: 0x1000,
            end: 0x2000,
            offset: 0,
            dev_major: libc::major(st.st_dev),
            dev_minor: libc::minor(st.st_dev),
            inode: st.st_ino,
            path: path.as_os_str().as_encoded_bytes().into(),
            cut: false,
        }
    }

    fn own_proc() -> OwnedFd {
        nix::fcntl::open(
            "/proc/self",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY,
            Mode::empty(),
        )
        .unwrap()
    }

    #[test]
    fn a_held_file_opens_after_its_name_is_gone_and_ages_out() {
        let c = Counters::default();
        let dir = std::env::temp_dir().join(format!("firn-handles-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("bin");
        std::fs::write(&file, b"the mapped file").unwrap();
        let m = mapping_of(&file);
        let mut h = Handles::new(8);
        h.take(&own_proc(), std::slice::from_ref(&m), &c);
        h.take(&own_proc(), std::slice::from_ref(&m), &c);
        assert_eq!(
            (h.len(), c.binary_handles_taken.get()),
            (1, 1),
            "one per file"
        );
        // Deleted and its name reused by another file: the handle still opens the first.
        std::fs::remove_file(&file).unwrap();
        std::fs::write(&file, b"another file").unwrap();
        let fd = h.open(file_id(&m)).unwrap().unwrap();
        let text = std::fs::read(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&fd)
        ))
        .unwrap();
        assert_eq!(text, b"the mapped file");
        // Used in round 0; closed once IDLE_ROUNDS pass without use.
        h.end_round(IDLE_ROUNDS - 1, &c);
        assert_eq!(h.len(), 1);
        h.end_round(IDLE_ROUNDS, &c);
        assert!(h.is_empty());
        assert_eq!(c.binary_handles_expired.get(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_count_bound_drops_the_oldest() {
        let c = Counters::default();
        let dir = std::env::temp_dir().join(format!("firn-handles-n-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut h = Handles::new(2);
        let mut ids = Vec::new();
        for (round, name) in ["a", "b", "c"].iter().enumerate() {
            let f = dir.join(name);
            std::fs::write(&f, name).unwrap();
            let m = mapping_of(&f);
            ids.push(file_id(&m));
            h.end_round(round as u64, &c);
            h.take(&own_proc(), &[m], &c);
        }
        assert_eq!(h.len(), 2);
        assert!(h.open(ids[0]).is_none(), "the oldest went");
        assert!(h.open(ids[2]).is_some());
        assert_eq!(c.binary_handles_evicted.get(), 1);
        // A special file is never held.
        let mut fifo = mapping_of(&dir.join("a"));
        fifo.path = b"/dev/null"[..].into();
        h.take(&own_proc(), &[fifo], &c);
        assert_eq!(c.binary_handles_failed.get(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cut_deep_and_failed_paths_are_not_walked_again() {
        let c = Counters::default();
        let dir = std::env::temp_dir().join(format!("firn-handles-d-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("bin");
        std::fs::write(&f, b"x").unwrap();
        let mut h = Handles::new(8);
        let mut cut = mapping_of(&f);
        cut.cut = true;
        let mut deep = mapping_of(&f);
        deep.path = b"/d".repeat(crate::broker::MAX_DEPTH + 1).into();
        h.take(&own_proc(), &[cut, deep], &c);
        assert_eq!(c.binary_handles_unwalkable.get(), 2);
        assert_eq!(h.steps_left, STEPS_PER_ROUND, "nothing was walked");
        // A path that does not lead to the file fails once, then is left alone.
        let mut wrong = mapping_of(&f);
        wrong.path = dir.join("missing").as_os_str().as_encoded_bytes().into();
        h.take(&own_proc(), std::slice::from_ref(&wrong), &c);
        let spent = STEPS_PER_ROUND - h.steps_left;
        h.take(&own_proc(), std::slice::from_ref(&wrong), &c);
        assert_eq!(c.binary_handles_failed.get(), 1);
        assert_eq!(c.binary_handles_failed_recently.get(), 1);
        assert_eq!(STEPS_PER_ROUND - h.steps_left, spent);
        h.end_round(FAILED_ROUNDS, &c);
        h.take(&own_proc(), std::slice::from_ref(&wrong), &c);
        assert_eq!(
            c.binary_handles_failed.get(),
            2,
            "walked again after a while"
        );
        // Queued walks wait for take_queued.
        let other = dir.join("other");
        std::fs::write(&other, b"y").unwrap();
        let good = mapping_of(&other);
        h.queue(own_proc(), std::slice::from_ref(&good), &c);
        assert!(h.is_empty());
        h.take_queued(&c);
        assert_eq!(h.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn walks_per_round_are_bounded() {
        let c = Counters::default();
        let dir = std::env::temp_dir().join(format!("firn-handles-w-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let maps: Vec<Mapping> = ["a", "b"]
            .iter()
            .map(|n| {
                let f = dir.join(n);
                std::fs::write(&f, n).unwrap();
                mapping_of(&f)
            })
            .collect();
        let mut h = Handles::new(8);
        // Enough for the first path's components only.
        h.steps_left = maps[0]
            .path
            .split(|&b| b == b'/')
            .filter(|c| !c.is_empty())
            .count() as u32;
        h.take(&own_proc(), &maps, &c);
        assert_eq!((h.len(), c.binary_handles_skipped.get()), (1, 1));
        // The next round walks again.
        h.end_round(1, &c);
        h.take(&own_proc(), &maps, &c);
        assert_eq!(h.len(), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

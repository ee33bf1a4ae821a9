//! Unwind tables for the sampler's BPF unwinder: built here from each binary's CFI
//! (the sampler parses no ELF or DWARF), sent over the subscription in chunks.

pub mod build;
pub(crate) mod cache;
mod cfi;
#[cfg(test)]
mod identity_tests;
mod order;
#[doc(hidden)]
pub mod synthetic;

use std::collections::HashMap;

pub use build::{build, build_with, BuildError, Table, Walk};

/// Largest file a table is built from (the file is mapped, not read).
const MAX_FILE_BYTES: u64 = 2 << 30;

/// What became of a file's table within one subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    /// In the sampler's maps.
    Loaded,
    /// Building or sending failed in a way worth another try from this round on.
    Retry(u64),
    /// The sampler refused it, or it has no usable CFI: not asked again this session.
    Given,
}

/// Per subscription: tables are the sampler's only while the subscription lasts.
#[derive(Debug, Default)]
pub(crate) struct Sent {
    by_file: HashMap<(u64, u64), State>,
    /// The sampler's `unwind_tables_evicted` when last seen.
    evicted: u64,
}

impl Sent {
    /// Whether the file `(dev, inode)` still wants a table in round `round`.
    pub(crate) fn wants(&self, file: (u64, u64), round: u64) -> bool {
        match self.by_file.get(&file) {
            None => true,
            Some(State::Retry(from)) => round >= *from,
            Some(_) => false,
        }
    }

    pub(crate) fn set(&mut self, file: (u64, u64), s: State) {
        self.by_file.insert(file, s);
    }

    /// The sampler evicted tables (to make room) since last seen: which ones it does not
    /// say, so every loaded file is sent again when a sampled process maps it.
    pub(crate) fn note_evictions(&mut self, evicted: u64) {
        if evicted > self.evicted {
            self.by_file.retain(|_, s| *s != State::Loaded);
        }
        self.evicted = evicted;
    }

    #[cfg(test)]
    pub(crate) fn loaded(&self) -> usize {
        self.by_file
            .values()
            .filter(|s| **s == State::Loaded)
            .count()
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum LoadError {
    #[error("reading the binary: {0}")]
    Io(#[from] std::io::Error),
    #[error("the binary is {0} bytes, over the {MAX_FILE_BYTES}-byte bound")]
    TooLarge(u64),
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error("the table builder panicked on a malformed binary")]
    Panicked,
}

/// Maps a brokered file whole, read-only (never written), for its table and any other
/// analysis of it.
pub(crate) fn map_file(file: &std::fs::File) -> Result<memmap2::Mmap, LoadError> {
    let len = file.metadata()?.len();
    if len > MAX_FILE_BYTES {
        return Err(LoadError::TooLarge(len));
    }
    // SAFETY: a read-only private mapping of a brokered file. Another process could
    // truncate the file under us (SIGBUS); the sampler brokers only regular files that
    // processes have mapped executable, which are not truncated in practice.
    Ok(unsafe { memmap2::Mmap::map(file)? })
}

/// Builds the table of a mapped file, a panic contained.
pub(crate) fn build_from_map(map: &[u8]) -> Result<Table, LoadError> {
    crate::symbolize::contained(|| build(map))
        .ok_or(LoadError::Panicked)?
        .map_err(LoadError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_sent_once_retried_when_due_and_again_after_evictions() {
        let mut s = Sent::default();
        let (a, b) = ((1, 10), (1, 11));
        assert!(s.wants(a, 1));
        s.set(a, State::Loaded);
        s.set(b, State::Retry(5));
        assert!(!s.wants(a, 2));
        assert!(!s.wants(b, 4) && s.wants(b, 5));
        s.note_evictions(0);
        assert!(!s.wants(a, 3), "no eviction yet");
        s.note_evictions(2);
        assert!(s.wants(a, 3), "evicted somewhere: sent again");
        assert!(!s.wants(b, 4), "retries keep their round");
        assert_eq!(s.loaded(), 0);
    }
}

//! `proc_epoch`: the word of the program's `.bss` that every CPU's memos of processes,
//! mappings and rows are tagged with (profile.bpf.c). A word of `.bss` rather than an
//! array map of its own: a sample reads it on the same cache line as the program's other
//! globals, without a map lookup. The sampler moves it through its own shared mapping of
//! `.bss`, made before confinement and held until exit, so moving it is a store, not a
//! map command.

use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use nix::sys::mman::munmap;

#[derive(Debug, thiserror::Error)]
pub(crate) enum EpochError {
    #[error("proc_epoch at byte {offset} does not lie in .bss's {size} bytes")]
    Outside { offset: usize, size: usize },
    #[error("mapping the program's .bss: {0}")]
    Map(nix::errno::Errno),
}

/// The sampler's mapping of `.bss` and the offset of `proc_epoch` in it.
pub(crate) struct ProcEpoch {
    map: NonNull<std::ffi::c_void>,
    len: usize,
    offset: usize,
}

impl ProcEpoch {
    /// Maps `.bss` (`fd`, a value of `size` bytes) shared, for the u32 at `offset`.
    pub(crate) fn map(fd: BorrowedFd<'_>, size: usize, offset: usize) -> Result<Self, EpochError> {
        if !offset.is_multiple_of(4) || offset.checked_add(4).is_none_or(|end| end > size) {
            return Err(EpochError::Outside { offset, size });
        }
        let len = size.div_ceil(super::rows::page_size()) * super::rows::page_size();
        let nonzero =
            std::num::NonZeroUsize::new(len).ok_or(EpochError::Outside { offset, size })?;
        // Rust refers to the word only through the atomic in `bump`.
        let map = super::rows::map_shared(fd, nonzero, 0).map_err(EpochError::Map)?;
        Ok(Self { map, len, offset })
    }

    /// Moves the epoch by one. Called after the map changes it stands for (the map
    /// commands have returned): a sample that reads the new value does its lookups after
    /// the changes; one that read the old value tags its memos with that value, so no
    /// later sample takes them. SeqCst orders the store after everything before it.
    pub(crate) fn bump(&self) {
        // SAFETY: `offset + 4 <= len` and 4-aligned (checked in `map`; the mapping is
        // page-aligned); the word stays mapped while `self` lives, and is only ever
        // accessed atomically here (the program reads it with plain 4-byte loads).
        let word = unsafe {
            AtomicU32::from_ptr(
                self.map
                    .as_ptr()
                    .cast::<u8>()
                    .add(self.offset)
                    .cast::<u32>(),
            )
        };
        word.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for ProcEpoch {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, `len` bytes; nothing refers to it after this.
        if let Err(errno) = unsafe { munmap(self.map, self.len) } {
            tracing::debug!(%errno, "unmapping .bss at exit");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libbpf_rs::{MapCore, MapFlags, MapHandle, MapType};
    use std::os::fd::AsFd;

    fn required() -> bool {
        std::env::var("CI").is_ok_and(|v| v == "true")
            || std::env::var("FIRN_REQUIRE_BPF").is_ok_and(|v| v == "1")
    }

    #[test]
    fn a_word_not_wholly_in_the_value_is_refused() {
        let null = std::fs::File::open("/dev/null").expect("/dev/null");
        for (size, offset) in [(64, 62), (64, 61), (64, 64), (64, usize::MAX - 1), (0, 0)] {
            assert!(
                matches!(
                    ProcEpoch::map(null.as_fd(), size, offset),
                    Err(EpochError::Outside { .. })
                ),
                "size {size}, offset {offset}"
            );
        }
    }

    /// The store lands in the map's value, where the program reads it, and nowhere else.
    #[test]
    fn a_bump_moves_the_word_in_the_map() {
        let opts = libbpf_rs::libbpf_sys::bpf_map_create_opts {
            sz: std::mem::size_of::<libbpf_rs::libbpf_sys::bpf_map_create_opts>() as _,
            map_flags: libbpf_rs::libbpf_sys::BPF_F_MMAPABLE,
            ..Default::default()
        };
        let map = match MapHandle::create(MapType::Array, Some("firn_epoch_t"), 4, 64, 1, &opts) {
            Ok(m) => m,
            Err(e) if !required() => {
                eprintln!("skipped: no BPF map ({e}); run as root");
                return;
            }
            Err(e) => panic!("creating an mmapable array: {e}"),
        };
        let epoch = ProcEpoch::map(map.as_fd(), 64, 4).expect("mapped");
        epoch.bump();
        epoch.bump();
        let value = map
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
            .expect("lookup")
            .expect("an array has its entry");
        let mut want = [0u8; 64];
        want[4..8].copy_from_slice(&2u32.to_ne_bytes());
        assert_eq!(value, want);
    }
}

//! The sample log (`samples` in profile.bpf.c): the program puts each sample's key in
//! the next slot of its CPU's run in the active set's half, a line of memory where a
//! counts map lookup searched a hash (a fifth of a sample's cost at 99 Hz). When a set
//! is drained the sampler maps that half, adds up the keys it finds and frees their
//! slots; a run that comes round to a slot not freed yet sends the rest of the round's
//! samples to the counts map, so a full log loses nothing.
//!
//! A small log (both halves within [`KEEP_BYTES`]) stays mapped for the sampler's life:
//! mapping and unmapping a half each round were nine tenths of the log's drain in a
//! profile of an idle node. A longer one is mapped per drain, so that the sampler's RSS
//! does not carry it.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;

use nix::sys::mman::munmap;

use crate::drain::KEY_SIZE;

/// Bytes of a slot (`union firn_log_slot`): one key.
const SLOT: usize = std::mem::size_of::<firn_sampler_bpf::types::firn_log_slot>();
const _: () = assert!(SLOT == KEY_SIZE);
/// Bytes of the whole log at most (both sets, every CPU): a node with many CPUs gets
/// shorter runs, and a round that outruns its run goes on in the counts map.
const MAX_BYTES: u64 = 8 << 20;
/// Bytes of the whole log (both sets) at most for it to stay mapped: 16 CPUs at 19 Hz,
/// 3 at 99 Hz with 10 s rounds and 4 KiB pages. The pages are the map's, charged already; a mapping
/// only counts them in the sampler's RSS too.
const KEEP_BYTES: usize = 512 << 10;

#[derive(Debug, thiserror::Error)]
pub(crate) enum LogError {
    #[error("mapping the sample log (its samples stay for the set's next drain): {0}")]
    Map(nix::errno::Errno),
    #[error("unmapping the sample log (its samples were taken): {0}")]
    Unmap(nix::errno::Errno),
}

/// A round's samples on one CPU at `frequency`, with a quarter to spare (rounds run
/// late): the default run.
pub(crate) fn round_samples(frequency: u32, round_seconds: u32) -> u32 {
    let want = u64::from(frequency) * u64::from(round_seconds.max(1)) * 5 / 4 + 1;
    u32::try_from(want).unwrap_or(u32::MAX)
}

/// Slots of one CPU's run in one set for `want`: whole pages, so that each set's half
/// is page-aligned for its mapping, within [`MAX_BYTES`] over `cpus` CPUs. 0 (no log)
/// for `want` 0, or if even one page a run would pass the bound.
pub(crate) fn run_slots(want: u32, cpus: u32) -> u32 {
    if want == 0 {
        return 0;
    }
    let per_page = (crate::unwind::page_size() / SLOT).max(1) as u64;
    let cap = MAX_BYTES / (2 * u64::from(cpus.max(1)) * SLOT as u64);
    let slots = (u64::from(want).div_ceil(per_page) * per_page).min(cap / per_page * per_page);
    u32::try_from(slots).unwrap_or(0)
}

/// The sampler's handle on the log: a duplicate of the map's fd, its shape, and the
/// mapping of both halves if the log is small enough to keep it.
pub(crate) struct SampleLog {
    fd: OwnedFd,
    cpus: u32,
    slots: u32,
    kept: Option<NonNull<std::ffi::c_void>>,
}

impl SampleLog {
    pub(crate) fn new(fd: OwnedFd, cpus: u32, slots: u32) -> Self {
        Self::kept_within(fd, cpus, slots, KEEP_BYTES)
    }

    fn kept_within(fd: OwnedFd, cpus: u32, slots: u32, keep: usize) -> Self {
        let mut log = Self {
            fd,
            cpus,
            slots,
            kept: None,
        };
        let whole = log.half_bytes().saturating_mul(2);
        if whole <= keep {
            if let Some(len) = NonZeroUsize::new(whole) {
                // Not kept if this fails: mapped per drain instead, nothing lost, only
                // the older cost each round. Said once, at setup.
                match crate::unwind::map_shared(log.fd.as_fd(), len, 0) {
                    Ok(map) => log.kept = Some(map),
                    Err(e) => tracing::warn!(
                        error = %e,
                        bytes = whole,
                        "the sample log could not stay mapped; it is mapped at each drain instead"
                    ),
                }
            }
        }
        log
    }

    fn half_bytes(&self) -> usize {
        (self.cpus as usize)
            .saturating_mul(self.slots as usize)
            .saturating_mul(SLOT)
    }

    /// Whether both halves stay mapped (tests).
    #[cfg(test)]
    fn is_kept(&self) -> bool {
        self.kept.is_some()
    }

    /// Adds up the keys in set `set`'s half, each distinct key once with its count, and
    /// frees their slots. Called after the set's grace period, when no program writes
    /// it. Returns the samples found; on `Map` nothing was taken (the samples stay for
    /// the set's next drain), on `Unmap` everything was.
    pub(crate) fn take(&self, set: u32, mut f: impl FnMut(&[u8], u64)) -> Result<u64, LogError> {
        let half = self.half_bytes();
        let Some(len) = NonZeroUsize::new(half) else {
            return Ok(0);
        };
        let at = (set & 1) as usize * half;
        let (base, own) = match self.kept {
            // SAFETY: the kept mapping holds both halves, `2 * half` bytes.
            Some(whole) => (unsafe { whole.as_ptr().cast::<u8>().add(at) }, None),
            None => {
                let offset =
                    i64::try_from(at).map_err(|_| LogError::Map(nix::errno::Errno::EOVERFLOW))?;
                let map = crate::unwind::map_shared(self.fd.as_fd(), len, offset)
                    .map_err(LogError::Map)?;
                (map.as_ptr().cast::<u8>(), Some(map))
            }
        };
        let mut counts: HashMap<[u8; SLOT], u64> = HashMap::new();
        let mut found = 0u64;
        for i in 0..half / SLOT {
            let mut key = [0u8; SLOT];
            // SAFETY: slot `i` lies within the `half` bytes mapped; no program writes
            // this set now, and Rust holds no reference into the mapping.
            unsafe { std::ptr::copy_nonoverlapping(base.add(i * SLOT), key.as_mut_ptr(), SLOT) };
            // tgid (the key's first word) 0: a free slot.
            if key[..4] == [0; 4] {
                continue;
            }
            *counts.entry(key).or_insert(0) += 1;
            found += 1;
            // SAFETY: as above; the slot is freed for the set's next turn.
            unsafe { std::ptr::write_bytes(base.add(i * SLOT), 0, SLOT) };
        }
        // The frees are seen before the flip that makes this set active again.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // The samples first: their slots are free already, so they go out whatever
        // munmap says.
        for (key, n) in &counts {
            f(key, *n);
        }
        if let Some(map) = own {
            // SAFETY: the mapping made above, `half` bytes; nothing refers to it after this.
            unsafe { munmap(map, half) }.map_err(LogError::Unmap)?;
        }
        Ok(found)
    }
}

impl Drop for SampleLog {
    fn drop(&mut self) {
        if let Some(whole) = self.kept.take() {
            // SAFETY: the mapping made in `new`, both halves; nothing refers to it after.
            let _ = unsafe { munmap(whole, 2 * self.half_bytes()) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_fit_a_round_in_whole_pages_within_the_bound() {
        let per_page = (crate::unwind::page_size() / SLOT) as u32;
        let s = run_slots(round_samples(99, 10), 2);
        assert!(s >= 99 * 10 * 5 / 4 && s.is_multiple_of(per_page), "{s}");
        // One slot asked for: a page of them.
        assert_eq!(run_slots(1, 2), per_page);
        // 1,000 CPUs at 999 Hz: capped, still whole pages, the whole log within the bound.
        let s = run_slots(round_samples(999, 10), 1000);
        assert!(s.is_multiple_of(per_page));
        assert!(2 * 1000 * u64::from(s) * SLOT as u64 <= MAX_BYTES);
        // None asked for, or not one page a run within the bound: no log at all.
        assert_eq!(run_slots(0, 2), 0);
        assert_eq!(run_slots(round_samples(99, 10), 1 << 20), 0);
    }

    /// A real mmapable array, written as the program writes it: the keys come back
    /// added up, only from the set asked for, and their slots are free after.
    #[test]
    fn keys_are_added_up_and_their_slots_freed() {
        use libbpf_rs::libbpf_sys;
        let (cpus, slots) = (2u32, run_slots(1, 2));
        let entries = 2 * cpus * slots;
        let opts = libbpf_sys::bpf_map_create_opts {
            sz: std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as _,
            map_flags: libbpf_sys::BPF_F_MMAPABLE,
            ..Default::default()
        };
        // SAFETY: a plain map creation; the name is a NUL-terminated literal.
        let fd = unsafe {
            libbpf_sys::bpf_map_create(
                libbpf_sys::BPF_MAP_TYPE_ARRAY,
                c"firn_test_log".as_ptr(),
                4,
                SLOT as u32,
                entries,
                &opts,
            )
        };
        if fd < 0 {
            assert!(
                std::env::var_os("CI").is_none() && std::env::var_os("FIRN_REQUIRE_BPF").is_none(),
                "no BPF map: {}",
                std::io::Error::last_os_error()
            );
            return;
        }
        // SAFETY: a fresh fd this test owns.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let key = |tgid: u32, tid: u32| {
            let mut k = [0u8; SLOT];
            k[..4].copy_from_slice(&tgid.to_ne_bytes());
            k[4..8].copy_from_slice(&tid.to_ne_bytes());
            k
        };
        let write = |index: u32, k: &[u8; SLOT]| {
            let at = index.to_ne_bytes();
            // SAFETY: key and value buffers of the map's sizes.
            let r = unsafe {
                libbpf_sys::bpf_map_update_elem(
                    std::os::fd::AsRawFd::as_raw_fd(&fd),
                    at.as_ptr().cast(),
                    k.as_ptr().cast(),
                    0,
                )
            };
            assert_eq!(r, 0);
        };
        // Mapped for the log's life, and mapped per drain: the same samples either way.
        for keep in [KEEP_BYTES, 0] {
            // Set 0: CPU 0's run holds (7, 1) twice and (7, 2); CPU 1's run (9, 3) at its end.
            write(0, &key(7, 1));
            write(1, &key(7, 2));
            write(2, &key(7, 1));
            write(2 * slots - 1, &key(9, 3));
            // Set 1: one key, not taken with set 0.
            write(cpus * slots, &key(11, 4));
            let dup = fd.try_clone().expect("dup");
            let log = SampleLog::kept_within(dup, cpus, slots, keep);
            assert_eq!(log.is_kept(), keep > 0, "keep {keep}");
            let mut got = Vec::new();
            let n = log.take(0, |k, c| got.push((k[0], k[4], c))).expect("take");
            got.sort();
            assert_eq!(n, 4);
            assert_eq!(got, vec![(7, 1, 2), (7, 2, 1), (9, 3, 1)]);
            // Freed: a second take finds nothing; set 1 still holds its key.
            assert_eq!(log.take(0, |_, _| panic!("freed")).expect("take"), 0);
            let mut one = Vec::new();
            assert_eq!(log.take(1, |k, c| one.push((k[0], c))).expect("take"), 1);
            assert_eq!(one, vec![(11, 1)]);
            // A later round's sample, written after the log was mapped, is seen.
            write(3, &key(5, 6));
            let mut later = Vec::new();
            assert_eq!(log.take(0, |k, c| later.push((k[0], c))).expect("take"), 1);
            assert_eq!(later, vec![(5, 1)]);
        }
    }
}

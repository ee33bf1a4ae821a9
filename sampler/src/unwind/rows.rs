//! Checking unwind table rows, and the runs of the row pool they are written into.

use firn_schema::unwind_row::{self as row_kinds, Row};

use std::os::fd::{AsFd, OwnedFd};

use super::ROW_BYTES;

/// What is wrong with a chunk or a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    #[error("the rows are not a whole number of {ROW_BYTES}-byte rows")]
    Ragged,
    #[error("an empty table or chunk")]
    Empty,
    #[error("row {0}: its pc is not above the previous row's")]
    Unsorted(u32),
    #[error("row {0}: unknown CFA or rbp kind")]
    BadKind(u32),
    #[error("row {0}: an offset out of range for its kind")]
    BadOffset(u32),
    #[error("chunk does not continue the pending table (first row, total or file)")]
    OutOfOrder,
    #[error("{rows} rows: over the table limit of {limit} (--unwind-table-rows)")]
    TooLarge { rows: u32, limit: u32 },
    #[error("no room for {rows} rows in the row pool: every table in it is of a file a live process maps (raise --unwind-rows)")]
    NoRoom { rows: u32 },
    #[error("another subscription provides the tables")]
    NotOwner,
    #[error("writing the BPF maps failed: {0}")]
    Map(i32),
}

impl TableError {
    /// A lie or a bug of the sender, not a budget: the connection is closed.
    pub(crate) fn is_malformed(&self) -> bool {
        matches!(
            self,
            Self::Ragged | Self::Empty | Self::Unsorted(_) | Self::BadKind(_) | Self::BadOffset(_)
        )
    }
}

/// Checks the rows of one chunk, numbered from `first`; `prev_pc` is the last pc of
/// the rows before it. Returns the last pc.
pub fn check_rows(bytes: &[u8], first: u32, prev_pc: Option<u32>) -> Result<u32, TableError> {
    check_rows_with(bytes, first, prev_pc, |_| {})
}

/// [`check_rows`], handing each row's pc to `on_row` once the row passed (the page
/// directory is built in the same pass, while the row is in a register). A chunk that
/// fails may have handed over the rows before the bad one.
#[inline]
pub fn check_rows_with(
    bytes: &[u8],
    first: u32,
    prev_pc: Option<u32>,
    mut on_row: impl FnMut(u32),
) -> Result<u32, TableError> {
    if !bytes.len().is_multiple_of(ROW_BYTES) {
        return Err(TableError::Ragged);
    }
    if bytes.is_empty() {
        return Err(TableError::Empty);
    }
    let mut prev = prev_pc;
    for (i, row) in bytes.chunks_exact(ROW_BYTES).enumerate() {
        let n = first.saturating_add(i as u32);
        let mut b = [0u8; ROW_BYTES];
        b.copy_from_slice(row);
        let r = Row::from_bytes(b);
        if prev.is_some_and(|p| r.pc <= p) {
            return Err(TableError::Unsorted(n));
        }
        prev = Some(r.pc);
        if r.cfa >= row_kinds::CFA_KINDS || r.rbp >= row_kinds::RBP_KINDS || b[6] & 0x80 != 0 {
            return Err(TableError::BadKind(n));
        }
        if !r.valid() {
            return Err(TableError::BadOffset(n));
        }
        on_row(r.pc);
    }
    Ok(prev.unwrap_or(0))
}

/// Runs of the `rows` array: first fit, freed runs merged.
#[derive(Debug)]
pub struct Pool {
    /// Free runs (first, len), sorted, never adjacent.
    free: Vec<(u32, u32)>,
    capacity: u32,
}

impl Pool {
    pub fn new(capacity: u32) -> Self {
        Self {
            free: if capacity > 0 {
                vec![(0, capacity)]
            } else {
                Vec::new()
            },
            capacity,
        }
    }

    pub fn alloc(&mut self, n: u32) -> Option<u32> {
        if n == 0 {
            return None;
        }
        let i = self.free.iter().position(|&(_, len)| len >= n)?;
        let (first, len) = self.free[i];
        if len == n {
            self.free.remove(i);
        } else {
            self.free[i] = (first + n, len - n);
        }
        Some(first)
    }

    pub fn release(&mut self, first: u32, n: u32) {
        if n == 0 || first.checked_add(n).is_none_or(|end| end > self.capacity) {
            return;
        }
        let i = self.free.partition_point(|&(f, _)| f < first);
        self.free.insert(i, (first, n));
        // Merge with the next, then with the previous.
        if i + 1 < self.free.len() && first + n == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == first {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }

    pub fn free_rows(&self) -> u32 {
        self.free.iter().map(|&(_, n)| n).sum()
    }
}

/// Copies rows into the `rows` array from index `at`, through a shared mapping of the
/// pages that hold them, unmapped again at once (the sampler's RSS does not keep the
/// pool). The array is mmapable (`BPF_F_MMAPABLE`): its values lie back to back, 8 bytes
/// each, as the program reads them. The rows were checked before they come here.
pub(super) fn write_rows(rows: &OwnedFd, at: u32, bytes: &[u8]) -> Result<(), TableError> {
    use nix::sys::mman::munmap;
    if bytes.is_empty() {
        return Ok(());
    }
    let page = page_size();
    let start = at as usize * ROW_BYTES;
    let offset = start - start % page;
    let len = (start - offset + bytes.len()).div_ceil(page) * page;
    let (Some(nonzero), Ok(off)) = (std::num::NonZeroUsize::new(len), i64::try_from(offset)) else {
        return Err(TableError::Map(-libc::EINVAL));
    };
    // Only the window's bytes from `start - offset` on are written, within `len` (the
    // pool's runs lie inside the array, so the kernel refuses nothing in range).
    let window =
        map_shared(rows.as_fd(), nonzero, off).map_err(|e| TableError::Map(-(e as i32)))?;
    // SAFETY: the window is `len` bytes, writable; the copy's end `start - offset +
    // bytes.len()` is at most `len`, and `bytes` is not in the window.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            window.as_ptr().cast::<u8>().add(start - offset),
            bytes.len(),
        );
    }
    // SAFETY: the window mapped above, `len` bytes; nothing refers to it after this.
    unsafe { munmap(window, len) }.map_err(|e| TableError::Map(-(e as i32)))
}

/// A fresh read-write shared mapping of `len` bytes of an mmapable map's value from
/// `offset` (a multiple of the page size): how the sampler writes rows and the epoch
/// the program reads, and takes the sample log it writes, without a map command per
/// element.
pub(crate) fn map_shared(
    fd: std::os::fd::BorrowedFd<'_>,
    len: std::num::NonZeroUsize,
    offset: i64,
) -> nix::Result<std::ptr::NonNull<std::ffi::c_void>> {
    use nix::sys::mman::{mmap, MapFlags, ProtFlags};
    // SAFETY: no address is asked for, so the mapping is new and overlaps nothing Rust
    // refers to; callers reach it through raw pointers only, within `len`.
    unsafe {
        mmap(
            None,
            len,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED,
            fd,
            offset,
        )
    }
}

pub(crate) fn page_size() -> usize {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|p| usize::try_from(p).ok())
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(pc: u32, cfa_offset: u16, cfa: u8, rbp: u8, rbp8: i8) -> [u8; 8] {
        let mut r = [0u8; 8];
        r[..4].copy_from_slice(&pc.to_le_bytes());
        r[4..6].copy_from_slice(&cfa_offset.to_le_bytes());
        r[6] = cfa | rbp << 4;
        r[7] = rbp8 as u8;
        r
    }

    fn rows(rs: &[[u8; 8]]) -> Vec<u8> {
        rs.concat()
    }

    #[test]
    fn good_rows_pass() {
        let t = rows(&[
            row(0x1000, 8, 1, 0, 0),
            row(0x1001, 16, 1, 1, -2),
            row(0x1004, 16, 2, 1, -2),
            row(0x1010, 11, 3, 0, 0),
            row(0x1020, 0, 6, 0, 0),
            row(0x1030, 0, 0, 0, 0),
        ]);
        assert_eq!(check_rows(&t, 0, None), Ok(0x1030));
        // A chunk continues after the previous chunk's last pc.
        assert_eq!(
            check_rows(&rows(&[row(0x1000, 8, 1, 0, 0)]), 6, Some(0x1000)),
            Err(TableError::Unsorted(6))
        );
    }

    #[test]
    fn bad_rows_are_named() {
        assert_eq!(check_rows(&[0u8; 7], 0, None), Err(TableError::Ragged));
        assert_eq!(check_rows(&[], 0, None), Err(TableError::Empty));
        let unsorted = rows(&[row(0x20, 8, 1, 0, 0), row(0x10, 8, 1, 0, 0)]);
        assert_eq!(check_rows(&unsorted, 0, None), Err(TableError::Unsorted(1)));
        let equal = rows(&[row(0x20, 8, 1, 0, 0), row(0x20, 8, 1, 0, 0)]);
        assert_eq!(check_rows(&equal, 0, None), Err(TableError::Unsorted(1)));
        assert_eq!(
            check_rows(&row(0, 8, 7, 0, 0), 0, None),
            Err(TableError::BadKind(0))
        );
        assert_eq!(
            check_rows(&row(0, 8, 1, 3, 0), 0, None),
            Err(TableError::BadKind(0))
        );
        // rsp + 0 would put the return address below the stack pointer.
        assert_eq!(
            check_rows(&row(0, 0, 1, 0, 0), 0, None),
            Err(TableError::BadOffset(0))
        );
        // A saved rbp above the CFA, or an offset on a kind without one.
        assert_eq!(
            check_rows(&row(0, 16, 1, 1, 1), 0, None),
            Err(TableError::BadOffset(0))
        );
        assert_eq!(
            check_rows(&row(0, 16, 1, 0, -2), 0, None),
            Err(TableError::BadOffset(0))
        );
        assert_eq!(
            check_rows(&row(0, 17, 3, 0, 0), 0, None),
            Err(TableError::BadOffset(0))
        );
        assert_eq!(
            check_rows(&row(0, 8, 6, 0, 0), 0, None),
            Err(TableError::BadOffset(0))
        );
        // Offsets that are not whole words, and rbp-based CFAs far from rbp.
        for (off, kind) in [(12, 1), (9, 1), (12, 2), (264, 2)] {
            assert_eq!(
                check_rows(&row(0, off, kind, 0, 0), 0, None),
                Err(TableError::BadOffset(0)),
                "offset {off} of kind {kind}"
            );
        }
        assert_eq!(check_rows(&row(0, 256, 2, 0, 0), 0, None), Ok(0));
        assert_eq!(check_rows(&row(0, 65528, 1, 0, 0), 0, None), Ok(0));
        assert!(TableError::Unsorted(3).is_malformed());
        assert!(!TableError::NoRoom { rows: 1 }.is_malformed());
    }

    #[test]
    fn the_pool_reuses_and_merges_runs() {
        let mut p = Pool::new(100);
        let a = p.alloc(40).unwrap();
        let b = p.alloc(40).unwrap();
        assert_eq!((a, b), (0, 40));
        assert_eq!(p.alloc(30), None);
        p.release(a, 40);
        assert_eq!(p.alloc(30), Some(0));
        p.release(0, 30);
        p.release(b, 40);
        assert_eq!(p.free_rows(), 100);
        assert_eq!(p.free, vec![(0, 100)], "merged back into one run");
        p.release(90, 20);
        assert_eq!(p.free_rows(), 100, "a run past the end is ignored");
        assert_eq!(Pool::new(0).alloc(1), None);
    }
}

//! The sampler's allocator: the system's, except that one freed block of a table chunk's
//! size is kept for the next such allocation instead of being unmapped at once.
//!
//! Cap'n Proto reads each incoming message into a fresh zeroed buffer, and a table chunk
//! (32,768 rows, 256 KiB) is over the heap's mmap threshold (`trim.rs`): a mapping of its
//! own, whose 64 pages the kernel allocates and zeroes one fault at a time as the socket's
//! bytes land, then unmaps. On this project's VMs that is ~150 µs a chunk, ~4.6 ns a row,
//! more than the rows' checks. Kept, the next chunk's buffer is the same resident pages,
//! zeroed by `memset` (~7 µs). Blocks are kept only once a table chunk came in this round
//! ([`keep_freed`]); the block goes back at the start of the round's end ([`release`],
//! before its drain and batch) and whenever a large allocation cannot use it, so a round
//! without tables keeps nothing (the batch's own large segments are unmapped as before).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};

/// Blocks kept: larger than the mapped first segment of every outgoing message
/// (`rpc/guard.rs`, 128 KiB: one a reply, mostly untouched, would take the place), up to
/// a whole table chunk's message with its header and segment table.
const KEEP_ABOVE: usize = (128 << 10) + 4096;
const KEEP_UP_TO: usize = (256 << 10) + (16 << 10);
/// The system allocator's alignment: a block it gave one request serves another.
const ALIGN: usize = 16;

/// The block kept, its size in its first word; null: none.
static KEPT: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
/// Whether freed blocks are kept: from a table chunk's arrival to the round's end.
static KEEPING: AtomicBool = AtomicBool::new(false);
static REUSED: AtomicU64 = AtomicU64::new(0);

/// The allocator (`main.rs` installs it; the library's tests run on the system's).
pub struct Allocator;

fn keepable(layout: Layout) -> bool {
    layout.align() <= ALIGN && layout.size() > KEEP_ABOVE && layout.size() <= KEEP_UP_TO
}

/// A layout the system allocator frees any of its blocks with (glibc's `free` reads the
/// size from the block's own header).
fn any_size() -> Layout {
    Layout::new::<usize>()
}

/// The kept block, when it holds `layout`; a kept block too small for it goes back.
fn take(layout: Layout) -> Option<*mut u8> {
    if !keepable(layout) {
        return None;
    }
    let p = KEPT.swap(std::ptr::null_mut(), Ordering::AcqRel);
    if p.is_null() {
        return None;
    }
    // SAFETY: a kept block is a live system block of at least KEEP_ABOVE bytes whose
    // first word `dealloc` wrote; the swap made it ours alone.
    let size = unsafe { p.cast::<usize>().read() };
    if size >= layout.size() {
        REUSED.fetch_add(1, Ordering::Relaxed);
        return Some(p);
    }
    // SAFETY: the system allocated it, and nothing else refers to it.
    unsafe { System.dealloc(p, any_size()) };
    None
}

// SAFETY: every block comes from `System`, with its alignment at most ALIGN where a kept
// block serves; a kept block is owned by whoever swapped it out of KEPT, so no two
// holders exist; a reused block is at least the size asked for.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match take(layout) {
            Some(p) => p,
            // SAFETY: the caller's layout, as GlobalAlloc requires.
            None => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match take(layout) {
            Some(p) => {
                // SAFETY: the block holds at least layout.size() bytes.
                unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
                p
            }
            // SAFETY: the caller's layout.
            None => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        if !keepable(layout) || !KEEPING.load(Ordering::Relaxed) {
            // SAFETY: p was allocated by this allocator with this layout.
            return unsafe { System.dealloc(p, layout) };
        }
        // What the block holds, which may be more than this layout asked of it (a
        // chunk buffer kept through a smaller last chunk still serves the next table's
        // first). glibc's own count: no system call.
        // SAFETY: p is a live block of the system allocator.
        let size = unsafe { libc::malloc_usable_size(p.cast()) }.max(layout.size());
        // SAFETY: the block is ours again and holds more than a word.
        unsafe { p.cast::<usize>().write(size) };
        let old = KEPT.swap(p, Ordering::AcqRel);
        if !old.is_null() {
            // SAFETY: the block kept before, a system block no one else holds.
            unsafe { System.dealloc(old, any_size()) };
        }
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // A reused block is a system block (larger than `layout` says, which glibc's
        // realloc does not read).
        // SAFETY: the caller's pointer and layout.
        unsafe { System.realloc(p, layout, new_size) }
    }
}

/// Freed blocks of a chunk's size are kept from now until [`release`]: a table chunk
/// came in, and the next one's buffer is likely the same size.
pub(crate) fn keep_freed() {
    KEEPING.store(true, Ordering::Relaxed);
}

/// Gives the kept block back and keeps no more until [`keep_freed`] (at each round's
/// end: nothing stays between table waves).
pub(crate) fn release() {
    KEEPING.store(false, Ordering::Relaxed);
    let p = KEPT.swap(std::ptr::null_mut(), Ordering::AcqRel);
    if !p.is_null() {
        // SAFETY: the kept block, a system block no one else holds.
        unsafe { System.dealloc(p, any_size()) };
    }
}

/// Large allocations served by the kept block so far.
pub(crate) fn reused() -> u64 {
    REUSED.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_chunk_buffer_serves_the_next_and_goes_back_at_release() {
        let a = Allocator;
        let chunk = Layout::from_size_align(262_160, 8).expect("layout");
        let before = reused();
        // SAFETY: layouts with a non-zero size; each block is freed once.
        unsafe {
            // Not keeping yet (no table chunk came in): freed blocks go back at once.
            let p = a.alloc_zeroed(Layout::from_size_align(262_160, 8).expect("layout"));
            a.dealloc(p, Layout::from_size_align(262_160, 8).expect("layout"));
            assert!(KEPT.load(Ordering::Acquire).is_null());
            keep_freed();
            let p = a.alloc_zeroed(chunk);
            assert!(!p.is_null());
            p.write_bytes(0xa5, chunk.size());
            a.dealloc(p, chunk);
            // The same block, zeroed again, for a request no larger.
            let smaller = Layout::from_size_align(200_000, 8).expect("layout");
            let q = a.alloc_zeroed(smaller);
            assert_eq!(q, p);
            assert_eq!(reused(), before + 1);
            assert!(std::slice::from_raw_parts(q, smaller.size())
                .iter()
                .all(|&b| b == 0));
            a.dealloc(q, smaller);
            // Kept with what it holds, not what it was last asked for: the larger
            // request gets it again.
            let r = a.alloc(chunk);
            assert_eq!(r, p);
            assert_eq!(reused(), before + 2);
            a.dealloc(r, chunk);
            // A request larger than the block: it goes back, a new one is made.
            let larger = Layout::from_size_align(270_000, 8).expect("layout");
            let t = a.alloc(larger);
            assert_eq!(reused(), before + 2);
            assert!(KEPT.load(Ordering::Acquire).is_null());
            a.dealloc(t, larger);
            release();
            assert!(KEPT.load(Ordering::Acquire).is_null());
            keep_freed();
            // Reply segments and small blocks pass through.
            let reply = Layout::from_size_align(128 << 10, 8).expect("layout");
            let s = a.alloc_zeroed(reply);
            a.dealloc(s, reply);
            assert!(KEPT.load(Ordering::Acquire).is_null());
            let big = Layout::from_size_align(1 << 20, 4096).expect("layout");
            assert!(!keepable(big));
            release();
        }
    }
}

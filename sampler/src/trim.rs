//! Setup pages out of the steady state's RSS.
//!
//! Once set up, most of the sampler's resident memory is code and read-only data it
//! will not run again: libbpf's loader, the embedded BPF object, argument parsing,
//! preflight. Those are clean file pages (page cache, shared with every other mapper),
//! yet they count in the process's RSS. Dropping them from our page tables
//! (`MADV_DONTNEED`) leaves resident only what the rounds fault back in.
//!
//! Only private mappings that cannot be written and hold no private copy of any page
//! are dropped: their pages come back from the file unchanged. A read-only mapping that
//! was written before being protected (RELRO, relocated data) holds private copies
//! (`Anonymous:` in smaps) and is left alone, since dropping would lose them.

/// Heap blocks from this size get a mapping of their own, unmapped when freed. Set by
/// hand so that it stays put: glibc's own threshold rises to the largest block freed, so
/// after the first 256 KiB table message every later round's batch segments would come
/// from the heap, zeroed in full, and leave holes between long-lived records there that
/// only a trim could return (and `malloc_trim`'s madvise is refused after confinement).
const MMAP_THRESHOLD: libc::c_int = 128 << 10;

/// Fixes the allocator's mmap threshold, before set-up allocates. glibc's own setting:
/// no system call, and the heap's top is still given back by brk as blocks are freed.
pub(crate) fn fix_heap_threshold() {
    // SAFETY: mallopt has no preconditions; it only changes glibc's malloc parameters.
    if unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) } != 1 {
        tracing::warn!("the allocator refused its mmap threshold; freed memory may stay resident");
    }
}

/// The allocator's heap now: bytes in use (small blocks and mapped ones) and bytes held
/// free in the heap (holes and the top a trim has not given back). glibc's own tally:
/// no system call.
pub(crate) fn heap_bytes() -> (u64, u64) {
    // SAFETY: mallinfo2 has no preconditions; it reads the allocator's state under its
    // own locks.
    let i = unsafe { libc::mallinfo2() };
    let used = i.uordblks.saturating_add(i.hblkhd);
    (used as u64, i.fordblks as u64)
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum TrimError {
    #[error("reading /proc/self/smaps: {0}")]
    Read(#[from] std::io::Error),
}

/// One mapping of `/proc/self/smaps` that may be dropped.
#[derive(Debug, PartialEq, Eq)]
struct Candidate {
    start: usize,
    len: usize,
    rss_kib: u64,
}

/// Mappings of an smaps text that are private, not writable, file-backed and hold no
/// private copies.
fn candidates(smaps: &str) -> Vec<Candidate> {
    let mut out = Vec::new();
    // The mapping being read: (start, end, eligible by its header, rss, anonymous).
    let mut cur: Option<(usize, usize, bool, u64, u64)> = None;
    let mut finish = |c: Option<(usize, usize, bool, u64, u64)>| {
        if let Some((start, end, true, rss, 0)) = c {
            if rss > 0 && end > start {
                out.push(Candidate {
                    start,
                    len: end - start,
                    rss_kib: rss,
                });
            }
        }
    };
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let Some(first) = f.next() else { continue };
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(start), Ok(end)) =
                (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                finish(cur.take());
                let perms = f.next().unwrap_or("");
                let inode = f.nth(2).unwrap_or("0");
                let path = f.next().unwrap_or("");
                let p = perms.as_bytes();
                let eligible = p.len() == 4
                    && p[1] == b'-'
                    && p[3] == b'p'
                    && inode != "0"
                    && path.starts_with('/');
                cur = Some((start, end, eligible, 0, 0));
                continue;
            }
        }
        let value: Option<u64> = f.next().and_then(|v| v.parse().ok());
        if let Some(c) = cur.as_mut() {
            match first {
                "Rss:" => c.3 = value.unwrap_or(0),
                // Any private copy (or an unreadable count) keeps the mapping.
                "Anonymous:" => c.4 = value.unwrap_or(1),
                _ => {}
            }
        }
    }
    finish(cur.take());
    out
}

/// Drops the resident pages of eligible mappings; returns the KiB they held.
pub(crate) fn drop_setup_pages() -> Result<u64, TrimError> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut dropped = 0;
    for c in candidates(&smaps) {
        // SAFETY: the range is a whole mapping of this process that is private, not
        // writable and holds no private page, so MADV_DONTNEED only discards page-table
        // entries; the next access reads the same bytes from the file again.
        let r = unsafe { libc::madvise(c.start as *mut libc::c_void, c.len, libc::MADV_DONTNEED) };
        if r == 0 {
            dropped += c.rss_kib;
        }
    }
    Ok(dropped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_clean_read_only_file_mappings() {
        let smaps = "\
1000-3000 r-xp 00001000 fe:00 42                         /usr/bin/x
Rss:                   8 kB
Anonymous:             0 kB
3000-4000 r--p 00003000 fe:00 42                         /usr/bin/x
Rss:                   4 kB
Anonymous:             4 kB
4000-5000 rw-p 00004000 fe:00 42                         /usr/bin/x
Rss:                   4 kB
Anonymous:             0 kB
5000-6000 r--s 00000000 00:10 1044                       anon_inode:bpf-map
Rss:                   4 kB
Anonymous:             0 kB
6000-8000 r--p 00000000 00:00 0 
Rss:                   8 kB
Anonymous:             0 kB
8000-9000 r--p 00000000 fe:00 43                         /usr/lib/libc.so.6
Rss:                   4 kB
Anonymous:             0 kB
";
        assert_eq!(
            candidates(smaps),
            vec![
                Candidate {
                    start: 0x1000,
                    len: 0x2000,
                    rss_kib: 8
                },
                Candidate {
                    start: 0x8000,
                    len: 0x1000,
                    rss_kib: 4
                },
            ]
        );
    }

    /// On this very process: dropped pages come back intact when touched.
    #[test]
    fn dropping_keeps_the_program_running() {
        let before: Vec<u8> = (0..64u8).collect();
        let kib = drop_setup_pages().expect("smaps");
        assert!(kib > 0, "a test binary has clean code pages");
        let after: Vec<u8> = (0..64u8).collect();
        assert_eq!(before, after);
        assert!(std::fs::read_to_string("/proc/self/status").is_ok());
    }
}

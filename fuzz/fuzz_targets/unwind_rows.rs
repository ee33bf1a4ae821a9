//! The sampler's checks of unwind table chunks from a subscriber: arbitrary bytes as a
//! chunk never panic, and whatever passes is sorted and in range (what the BPF unwinder
//! is given: whole-word offsets only), and its page directory, built in the check loop
//! or after it, finds the rows a search of the whole table finds. The row pool's
//! allocator, driven by the same bytes, never hands out overlapping runs or more rows
//! than it has.
#![no_main]

use firn_sampler::{check_rows, check_rows_with, pages, PageIndex, Pool, ROW_BYTES};
use firn_schema::unwind_row::Row;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 5 {
        return;
    }
    let first = u32::from(data[0]);
    let prev = (data[1] & 1 == 1).then(|| u32::from_le_bytes([data[1], data[2], data[3], data[4]]));
    let rows = &data[5..];
    if let Ok(last) = check_rows(rows, first, prev) {
        let parsed: Vec<Row> = rows
            .chunks_exact(ROW_BYTES)
            .map(|c| Row::from_bytes(c.try_into().expect("8 bytes")))
            .collect();
        assert!(parsed.iter().all(Row::valid));
        // What the unwinder's safety rests on, stated apart from `valid`: whole-word
        // offsets, an rbp-based CFA near rbp, a saved rbp below the CFA.
        use firn_schema::unwind_row as k;
        for r in &parsed {
            if r.cfa == k::CFA_RSP || r.cfa == k::CFA_RBP {
                assert!(r.cfa_offset >= 8 && r.cfa_offset.is_multiple_of(8), "{r:?}");
            }
            if r.cfa == k::CFA_RBP {
                assert!(r.cfa_offset <= k::MAX_RBP_CFA_OFFSET, "{r:?}");
            }
            if r.rbp == k::RBP_AT_CFA {
                assert!(r.rbp_offset8 < 0, "{r:?}");
            }
        }
        assert!(parsed.windows(2).all(|w| w[0].pc < w[1].pc));
        assert!(prev.is_none_or(|p| parsed[0].pc > p));
        assert_eq!(parsed.last().map(|r| r.pc), Some(last));

        // The page directory the sampler builds from these rows: within its room, and
        // the search from an offset's page finds the row a search of the whole table does.
        let pcs: Vec<u32> = parsed.iter().map(|r| r.pc).collect();
        let mut ix = PageIndex::new(pcs.len() as u32);
        pcs.iter().for_each(|&pc| ix.push(pc));
        let dir = ix.finish();
        assert!(dir.entries.len() as u32 <= pages::capacity(pcs.len() as u32));
        // Built as the sampler does: in the check loop, pages sized up front from the
        // span (any lower bound of it gives the same directory).
        let mut ix = PageIndex::new(pcs.len() as u32);
        let span = pcs[pcs.len() - 1] - pcs[0];
        ix.expect_span(span >> (data[0] & 7));
        assert_eq!(check_rows_with(rows, first, prev, |pc| ix.push(pc)), Ok(last));
        assert_eq!(ix.finish(), dir, "built in one pass");
        let mut offs: Vec<u32> = vec![0, u32::MAX, u32::from_le_bytes([data[1], data[2], data[3], data[4]])];
        for &pc in &pcs {
            offs.extend([pc.wrapping_sub(1), pc, pc.wrapping_add(1), pc.wrapping_add(4096)]);
        }
        // Each page: a run within the table that starts at or below the page, and the
        // offsets at its edges.
        for (p, &e) in dir.entries.iter().enumerate() {
            let (lo, hi) = (e as u32 as usize, (e >> 32) as usize);
            let start = u64::from(dir.base) + ((p as u64) << dir.shift);
            assert!(lo < hi && hi <= pcs.len(), "page {p}: {lo}..{hi}");
            assert!(u64::from(pcs[lo]) <= start || lo == 0, "page {p}");
            for o in [start.wrapping_sub(1), start, start + 1] {
                offs.push(o.min(u64::from(u32::MAX)) as u32);
            }
        }
        for off in offs {
            let whole = pcs.partition_point(|&pc| pc <= off).checked_sub(1);
            assert_eq!(pages::find(&pcs, &dir, off).0, whole, "off {off:#x}");
        }
    }

    // Pool: alloc (even byte) or release (odd byte) runs, checked against a model.
    let capacity = 1024;
    let mut pool = Pool::new(capacity);
    let mut held: Vec<(u32, u32)> = Vec::new();
    for pair in data.chunks_exact(2) {
        let n = u32::from(pair[1]) + 1;
        if pair[0] % 2 == 0 {
            if let Some(at) = pool.alloc(n) {
                assert!(at + n <= capacity);
                assert!(held.iter().all(|&(a, m)| at + n <= a || a + m <= at), "overlap");
                held.push((at, n));
            }
        } else if !held.is_empty() {
            let (a, m) = held.swap_remove(usize::from(pair[0]) % held.len());
            pool.release(a, m);
        }
        let used: u32 = held.iter().map(|&(_, m)| m).sum();
        assert_eq!(pool.free_rows() + used, capacity);
    }
});

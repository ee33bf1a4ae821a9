//! A page index of a table's rows, built by the sampler from the rows it checked, so the
//! BPF search of a frame's row starts from the few rows of its page instead of the whole
//! table (libc: ~4 steps instead of 15). The table's text, from its first row's pc on,
//! is cut into pages of 2^shift bytes, as small as the directory's room allows; each page
//! has one 8-byte entry after the table's rows in the pool: the last row at or below the
//! page's start and the first row at or past its end. The search between them finds the
//! row a search of the whole table finds, whatever the rows are (a test and a fuzz
//! target compare the two), so the enricher can make a directory slow, never wrong.

use super::ROW_BYTES;

/// Directory entries of one table at most (64 KiB in the pool): a large table gets
/// larger pages rather than a larger directory.
pub const MAX_PAGES: u32 = 8192;
/// Rows per page at least, on average: the directory takes at most an eighth of the
/// room of its table's rows.
const ROWS_PER_PAGE: u32 = 8;
/// The last page's end, not known until the table's last row.
const OPEN: u32 = u32::MAX;

/// Directory entries a table of `total` rows may need: what the pool holds for it
/// beside its rows until the table is complete.
pub fn capacity(total: u32) -> u32 {
    (total / ROWS_PER_PAGE).clamp(1, MAX_PAGES)
}

/// The text rows' pcs span (last pc − first pc), 0 under two rows; no row is checked.
fn span_of(rows: &[u8]) -> u32 {
    let pc = |at: usize| {
        rows.get(at..at + 4)
            .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let n = rows.len() / ROW_BYTES;
    if n < 2 {
        return 0;
    }
    pc((n - 1) * ROW_BYTES).saturating_sub(pc(0))
}

/// A table's directory as the BPF program reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Directory {
    /// The pc of the table's first row: page 0 starts there.
    pub base: u32,
    /// Pages are 2^shift bytes (≤ 32).
    pub shift: u8,
    /// Per page: the last row at or below its start (low half), the first row at or
    /// past its end (high half); the last page's end is the table's.
    pub entries: Vec<u64>,
}

/// Builds a directory row by row, as a table's chunks arrive: when the pages outgrow
/// the room, neighbours merge (pages twice as large), so nothing is read twice.
#[derive(Debug)]
pub struct PageIndex {
    cap: u32,
    base: u32,
    shift: u8,
    /// (lo, hi) per page, as in [`Directory::entries`]; the last page's hi is `OPEN`.
    pages: Vec<(u32, u32)>,
    rows: u32,
    last: u32,
    /// A pc came out of order: the directory becomes one page, the whole table.
    disordered: bool,
}

impl PageIndex {
    /// For a table of `total` rows.
    pub fn new(total: u32) -> Self {
        Self {
            cap: capacity(total),
            base: 0,
            shift: 0,
            pages: Vec::new(),
            rows: 0,
            last: 0,
            disordered: false,
        }
    }

    /// For a table of `total` rows whose first chunk (rows as the pool holds them, pc
    /// first) is `first_chunk`, its pages sized before the first row: strictly rising pcs
    /// span at least a byte a row, and at least the first chunk's own span. That span is
    /// read before the chunk's check; should its rows fail, the table (and this) goes.
    pub fn for_first_chunk(total: u32, first_chunk: &[u8]) -> Self {
        let mut ix = Self::new(total);
        ix.expect_span(total.saturating_sub(1).max(span_of(first_chunk)));
        ix
    }

    /// Pages as large as a table spanning at least `span` bytes of text (last pc − first
    /// pc) needs, set before the first row: the pages row-by-row building would merge
    /// into these are never made. Only a lower bound of the true span gives the same
    /// directory; a larger one gives larger pages (a slower search, never a wrong one).
    pub fn expect_span(&mut self, span: u32) {
        if self.rows == 0 {
            self.shift = shift_for(span, self.cap);
        }
    }

    /// Takes the next row's pc. Rows come in order with strictly rising pcs
    /// (`check_rows` saw to it); should one not, the directory is one page holding the
    /// whole table, which the search then covers as it would without a directory.
    #[inline]
    pub fn push(&mut self, pc: u32) {
        // Most rows start in the last page: no call, no store but the count's.
        if self.rows > 0 && !self.disordered && pc > self.last {
            let p = u64::from(pc - self.base) >> self.shift;
            if p < self.pages.len() as u64 {
                self.rows += 1;
                self.last = pc;
                return;
            }
        }
        self.push_page(pc);
    }

    #[inline(never)]
    fn push_page(&mut self, pc: u32) {
        let i = self.rows;
        self.rows = i.saturating_add(1);
        if i == 0 {
            self.base = pc;
            self.last = pc;
            self.pages.reserve_exact(self.cap as usize);
            self.pages.push((0, OPEN));
            return;
        }
        if self.disordered || pc <= self.last {
            self.disordered = true;
            return;
        }
        self.last = pc;
        let rel = u64::from(pc - self.base);
        let mut p = rel >> self.shift;
        while p >= u64::from(self.cap) {
            self.coarsen();
            p = rel >> self.shift;
        }
        let cur = self.pages.len() - 1;
        let p = p as usize;
        if p <= cur {
            return;
        }
        self.pages[cur].1 = i;
        // Pages no row starts in: the row before holds for all of them.
        self.pages.resize(p, (i - 1, i));
        let at_start = rel & ((1u64 << self.shift) - 1) == 0;
        self.pages.push((if at_start { i } else { i - 1 }, OPEN));
    }

    /// Pages twice as large: each pair of neighbours becomes one, in place.
    fn coarsen(&mut self) {
        self.shift += 1;
        let n = self.pages.len();
        for k in 0..n.div_ceil(2) {
            let hi = self.pages[(2 * k + 1).min(n - 1)].1;
            self.pages[k] = (self.pages[2 * k].0, hi);
        }
        self.pages.truncate(n.div_ceil(2));
    }

    /// The directory of the rows taken.
    pub fn finish(self) -> Directory {
        let rows = self.rows;
        if self.disordered {
            return Directory {
                base: 0,
                shift: 32,
                entries: vec![u64::from(rows) << 32],
            };
        }
        Directory {
            base: self.base,
            shift: self.shift,
            entries: self
                .pages
                .iter()
                .map(|&(lo, hi)| u64::from(lo) | u64::from(hi.min(rows)) << 32)
                .collect(),
        }
    }
}

/// The smallest page shift that keeps pages over `span` bytes within `cap` entries.
fn shift_for(span: u32, cap: u32) -> u8 {
    let mut s = 0u8;
    while s < 32 && u64::from(span) >> s >= u64::from(cap) {
        s += 1;
    }
    s
}

/// The row the BPF program finds for file offset `off` (`None`: no row at or below it),
/// and the search's steps: `find_row` in mappings.bpf.h, step for step, for tests and
/// the fuzz target to hold against a search of the whole table.
pub fn find(pcs: &[u32], dir: &Directory, off: u32) -> (Option<usize>, u32) {
    let count = pcs.len() as u32;
    if off < dir.base || dir.entries.is_empty() {
        return (None, 0);
    }
    let page = (u64::from(off - dir.base) >> dir.shift).min(dir.entries.len() as u64 - 1);
    let e = dir.entries[page as usize];
    let (mut lo, mut hi) = (e as u32, ((e >> 32) as u32).min(count));
    let mut found = None;
    let mut steps = 0;
    while steps < 24 && lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pcs[mid as usize] <= off {
            found = Some(mid as usize);
            lo = mid + 1;
        } else {
            hi = mid;
        }
        steps += 1;
    }
    (found, steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(pcs: &[u32]) -> Directory {
        let mut ix = PageIndex::new(pcs.len() as u32);
        for &pc in pcs {
            ix.push(pc);
        }
        ix.finish()
    }

    /// Every offset that matters: each row's pc and its neighbours, page edges, the ends.
    fn check(pcs: &[u32]) -> f64 {
        let dir = index(pcs);
        assert!(dir.entries.len() as u32 <= capacity(pcs.len() as u32));
        let mut offs: Vec<u32> = vec![0, u32::MAX, dir.base];
        for &pc in pcs {
            offs.extend([pc.saturating_sub(1), pc, pc.saturating_add(1)]);
        }
        for p in 0..dir.entries.len() as u64 {
            let start = u64::from(dir.base) + (p << dir.shift);
            for o in [start.saturating_sub(1), start, start + 1] {
                offs.push(o.min(u64::from(u32::MAX)) as u32);
            }
        }
        let mut steps = 0;
        for &off in &offs {
            let whole = pcs.partition_point(|&pc| pc <= off).checked_sub(1);
            let (got, n) = find(pcs, &dir, off);
            assert_eq!(got, whole, "off {off:#x} in {dir:?}");
            steps += n;
        }
        f64::from(steps) / offs.len() as f64
    }

    fn table(n: usize, seed: u64, gap_every: usize, gap: u32) -> Vec<u32> {
        let mut x = seed;
        let mut pc = 0x1000u32;
        let t: Vec<u32> = (0..n)
            .map(|i| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                pc += 1 + (x >> 59) as u32 * 4;
                if gap_every > 0 && i % gap_every == gap_every - 1 {
                    pc += gap;
                }
                pc
            })
            .collect();
        assert!(t.windows(2).all(|w| w[0] < w[1]), "rows strictly rising");
        t
    }

    #[test]
    fn the_page_search_finds_the_whole_tables_row() {
        for n in [1, 2, 3, 7, 8, 9, 64, 500, 4097, 30_000] {
            check(&table(n, n as u64, 0, 0));
            check(&table(n, 7, 13, 64 << 10));
        }
        // Rows at page edges, a last pc at the top of the range, one huge gap.
        check(&[0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32]);
        check(&[5, u32::MAX]);
        check(&[0, 1 << 31, (1 << 31) + 8, u32::MAX - 1, u32::MAX]);
    }

    #[test]
    fn a_dense_table_takes_few_steps_and_gaps_coarsen_the_pages() {
        // libc-like: 28 k rows over ~1.5 MiB of text.
        let t = table(28_000, 1, 0, 0);
        let steps = check(&t);
        assert!(steps < 6.0, "{steps} steps on average");
        let dir = index(&t);
        // Pages merge in pairs: the directory ends between half its room and all of it.
        let len = dir.entries.len() as u32;
        assert!(
            len > capacity(28_000) / 2 && len <= capacity(28_000),
            "{len}"
        );
        // Gaps of 16 MiB every 100 rows: pages grow until the directory fits.
        let t = table(20_000, 3, 100, 16 << 20);
        let dir = index(&t);
        assert!(dir.entries.len() as u32 <= capacity(20_000));
        assert!(dir.shift > 20, "{}", dir.shift);
        check(&t);
    }

    #[test]
    fn pages_sized_up_front_make_the_same_directory() {
        let tables = [
            table(28_000, 1, 0, 0),
            table(20_000, 3, 100, 16 << 20),
            table(9, 2, 0, 0),
            vec![5, u32::MAX],
        ];
        for t in &tables {
            let plain = index(t);
            let span = t[t.len() - 1] - t[0];
            // Any lower bound of the span: the exact one, the rows' count, none.
            for bound in [span, span / 3, t.len() as u32 - 1, 0] {
                let mut ix = PageIndex::new(t.len() as u32);
                ix.expect_span(bound);
                t.iter().for_each(|&pc| ix.push(pc));
                assert_eq!(ix.finish(), plain, "bound {bound}");
            }
            // From a first chunk's rows, whatever its length: the same directory.
            let rows: Vec<u8> = t
                .iter()
                .flat_map(|pc| {
                    let mut r = [0u8; ROW_BYTES];
                    r[..4].copy_from_slice(&pc.to_le_bytes());
                    r
                })
                .collect();
            for k in [0, 1, 2, t.len() / 2, t.len()] {
                let mut ix = PageIndex::for_first_chunk(t.len() as u32, &rows[..k * ROW_BYTES]);
                t.iter().for_each(|&pc| ix.push(pc));
                assert_eq!(ix.finish(), plain, "first chunk of {k} rows");
            }
            // Too large a guess: larger pages, still the whole table's rows.
            let mut ix = PageIndex::new(t.len() as u32);
            ix.expect_span(u32::MAX);
            t.iter().for_each(|&pc| ix.push(pc));
            let dir = ix.finish();
            assert!(dir.shift >= plain.shift);
            for &pc in t {
                let whole = t.partition_point(|&p| p <= pc).checked_sub(1);
                assert_eq!(find(t, &dir, pc).0, whole);
            }
        }
    }

    #[test]
    fn a_first_chunk_out_of_order_or_cut_sizes_without_panic() {
        let mut rows = vec![0u8; 3 * ROW_BYTES + 5];
        rows[..4].copy_from_slice(&900u32.to_le_bytes());
        rows[2 * ROW_BYTES..2 * ROW_BYTES + 4].copy_from_slice(&100u32.to_le_bytes());
        assert_eq!(span_of(&rows), 0);
        assert_eq!(span_of(&rows[..ROW_BYTES + 3]), 0);
        let _ = PageIndex::for_first_chunk(0, &rows);
    }

    #[test]
    fn rows_out_of_order_make_one_page_of_the_whole_table() {
        let dir = index(&[100, 300, 200, 400]);
        let whole = Directory {
            base: 0,
            shift: 32,
            entries: vec![4 << 32],
        };
        assert_eq!(dir, whole);
    }
}

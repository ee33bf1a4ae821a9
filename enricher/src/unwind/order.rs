//! The order of a table's rows: sorted by pc as a stable sort would leave them, one
//! row per pc, each rule once.

use firn_schema::unwind_row::{self as k, Row};

/// The rows of one FDE (its rules and its end marker): `raw[start..end]`, the first at
/// `pc`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Run {
    pub(super) pc: u32,
    pub(super) start: usize,
    pub(super) end: usize,
}

/// The order of the rows' sort key: by pc, markers before rules; rows of one key stay in
/// the order of their FDEs in the file.
fn sort_key(r: &Row) -> (u32, bool) {
    (r.pc, r.cfa != k::CFA_NONE)
}

/// The table of a binary's rows: sorted as a stable sort by `sort_key` would leave them,
/// then tidied. An FDE's rows come in address order, so the FDEs are sorted by their
/// first pc and their rows laid end to end, and tidied as they are laid: a binary whose
/// FDEs are out of address order (hot and cold parts of functions, LTO) then costs a
/// sort of its FDEs, not of all its rows, and no copy of them. Where that order is not
/// what the stable sort gives (FDEs that overlap, rows out of order inside one), the
/// rows are sorted whole.
pub(super) fn table(mut raw: Vec<Row>, mut runs: Vec<Run>) -> Vec<Row> {
    let mut t = Tidy::with_capacity(raw.len());
    if laid_out(&raw, &mut runs, |r| t.push(r)) {
        return t.finish();
    }
    raw.sort_by_key(sort_key);
    Tidy::in_place(raw)
}

/// Gives `each` the runs' rows, the runs sorted by first pc, while that is the stable
/// sort's order (each row's key and its index in `raw` rise strictly); false where it
/// is not, or where a row is in no run.
fn laid_out(raw: &[Row], runs: &mut [Run], mut each: impl FnMut(Row)) -> bool {
    runs.sort_unstable_by_key(|r| (r.pc, r.start));
    let mut last: Option<((u32, bool), usize)> = None;
    let mut given = 0;
    for run in runs.iter() {
        for (i, r) in raw.iter().enumerate().take(run.end).skip(run.start) {
            let now = (sort_key(r), i);
            if last.is_some_and(|l| l >= now) {
                return false;
            }
            last = Some(now);
            each(*r);
            given += 1;
        }
    }
    given == raw.len()
}

/// Rows in sort order become the table's: one row per pc (a function's rule beats the
/// end marker of the one before it), rows that repeat the rule of the row kept before
/// them dropped, no marker first.
struct Tidy {
    /// The rows kept are `out[..kept]`; in place, the rest are those still to come.
    out: Vec<Row>,
    kept: usize,
    /// The last row given: kept once a row of another pc comes.
    pending: Option<Row>,
}

impl Tidy {
    fn with_capacity(n: usize) -> Self {
        Tidy {
            out: Vec::with_capacity(n),
            kept: 0,
            pending: None,
        }
    }

    /// Sorted rows tidied in their own buffer: a big binary's rows (rustc's 1.1 M) are
    /// not copied. A row is kept at an index below the one it was read from.
    fn in_place(rows: Vec<Row>) -> Vec<Row> {
        let n = rows.len();
        let mut t = Tidy {
            out: rows,
            kept: 0,
            pending: None,
        };
        for i in 0..n {
            let r = t.out[i];
            t.push(r);
        }
        t.finish()
    }

    /// Sorted stably: among rows of one pc, markers come first and the last row is kept,
    /// so a rule wins, and of two rules the later FDE's (a PLT's FDE ends with an empty
    /// row at the next one's start).
    #[inline]
    fn push(&mut self, r: Row) {
        if let Some(p) = self.pending.replace(r) {
            if p.pc != r.pc {
                self.keep(p);
            }
        }
    }

    #[inline]
    fn keep(&mut self, r: Row) {
        let same_rule = |a: &Row| {
            (a.cfa, a.cfa_offset, a.rbp, a.rbp_offset8)
                == (r.cfa, r.cfa_offset, r.rbp, r.rbp_offset8)
        };
        if self.kept > 0 && same_rule(&self.out[self.kept - 1]) {
            return;
        }
        if self.kept < self.out.len() {
            self.out[self.kept] = r;
        } else {
            self.out.push(r);
        }
        self.kept += 1;
    }

    fn finish(mut self) -> Vec<Row> {
        if let Some(p) = self.pending.take() {
            self.keep(p);
        }
        self.out.truncate(self.kept);
        // A table that begins with a marker says nothing at its start.
        if self.out.first().is_some_and(|r| r.cfa == k::CFA_NONE) {
            self.out.remove(0);
        }
        self.out.shrink_to_fit();
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(pc: u32, cfa: u8, off: u16) -> Row {
        Row {
            pc,
            cfa_offset: off,
            cfa,
            rbp: k::RBP_SAME,
            rbp_offset8: 0,
        }
    }

    /// The rows in the order `table` tidies them.
    fn in_order(raw: Vec<Row>, mut runs: Vec<Run>) -> Vec<Row> {
        let mut out = Vec::new();
        if laid_out(&raw, &mut runs, |r| out.push(r)) {
            return out;
        }
        let mut raw = raw;
        raw.sort_by_key(sort_key);
        raw
    }

    /// Sorted rows, tidied (in place and into a new buffer alike).
    fn tidy(sorted: Vec<Row>) -> Vec<Row> {
        let mut t = Tidy::with_capacity(sorted.len());
        sorted.iter().for_each(|r| t.push(*r));
        let streamed = t.finish();
        let in_place = Tidy::in_place(sorted);
        assert_eq!(streamed, in_place);
        in_place
    }

    /// Rows in one run, so `table` sorts them whole.
    fn sorted(mut raw: Vec<Row>) -> Vec<Row> {
        raw.sort_by_key(sort_key);
        raw
    }

    #[test]
    fn tidy_sorts_merges_and_prefers_rules_over_markers() {
        let cases = [
            (
                "a rule beats the marker of the FDE before",
                vec![
                    row(0x20, k::CFA_RSP, 8),
                    row(0x10, k::CFA_RSP, 8),
                    row(0x18, k::CFA_RSP, 16),
                    row(0x20, k::CFA_NONE, 0),
                    row(0x28, k::CFA_RSP, 16),
                    row(0x30, k::CFA_NONE, 0),
                ],
                vec![
                    row(0x10, k::CFA_RSP, 8),
                    row(0x18, k::CFA_RSP, 16),
                    row(0x20, k::CFA_RSP, 8),
                    row(0x28, k::CFA_RSP, 16),
                    row(0x30, k::CFA_NONE, 0),
                ],
            ),
            (
                "of two rules at one pc, the later FDE's (a PLT's empty last row, then .plt.got)",
                vec![
                    row(0x10, k::CFA_RSP, 16),
                    row(0x20, k::CFA_PLT, 11),
                    row(0x20, k::CFA_NONE, 0),
                    row(0x20, k::CFA_RSP, 8),
                    row(0x28, k::CFA_NONE, 0),
                ],
                vec![
                    row(0x10, k::CFA_RSP, 16),
                    row(0x20, k::CFA_RSP, 8),
                    row(0x28, k::CFA_NONE, 0),
                ],
            ),
        ];
        for (why, raw, want) in cases {
            assert_eq!(tidy(sorted(raw)), want, "{why}");
        }
    }

    /// Rows laid out as FDEs of a pseudo-random binary: FDEs in shuffled order, some
    /// overlapping or starting where another ends, some with rows out of order.
    fn fdes(seed: u64, n: usize, overlaps: bool) -> (Vec<Row>, Vec<Run>) {
        let mut x = seed;
        let mut next = move |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        let mut starts: Vec<u32> = (0..n as u32).map(|i| i * 0x40).collect();
        for i in (1..starts.len()).rev() {
            starts.swap(i, next(i as u64 + 1) as usize);
        }
        let (mut raw, mut runs) = (Vec::new(), Vec::new());
        for s in starts {
            let s = if overlaps && next(4) == 0 {
                s + 0x10 * next(8) as u32
            } else {
                s
            };
            let start = raw.len();
            let mut pc = s;
            for _ in 0..=next(4) {
                raw.push(row(pc, k::CFA_RSP, 8 * (1 + next(3) as u16)));
                pc += if overlaps && next(10) == 0 {
                    0
                } else {
                    1 + next(0x10) as u32
                };
            }
            let end = if overlaps && next(10) == 0 {
                s + 0x20
            } else {
                s + 0x40
            };
            raw.push(row(end, k::CFA_NONE, 0));
            runs.push(Run {
                pc: s,
                start,
                end: raw.len(),
            });
        }
        (raw, runs)
    }

    #[test]
    fn fdes_laid_in_order_are_what_a_stable_sort_of_the_rows_gives() {
        let mut fell_back = 0;
        for seed in 0..200 {
            for overlaps in [false, true] {
                let (raw, runs) = fdes(seed, 1 + seed as usize % 50, overlaps);
                let mut sorted = raw.clone();
                sorted.sort_by_key(sort_key);
                let laid = laid_out(&raw, &mut runs.clone(), |_| {});
                if overlaps {
                    fell_back += usize::from(!laid);
                } else {
                    assert!(laid, "seed {seed}: FDEs apart are laid out");
                }
                assert_eq!(
                    table(raw.clone(), runs.clone()),
                    tidy(sorted.clone()),
                    "seed {seed}, overlaps {overlaps}"
                );
                assert_eq!(
                    in_order(raw, runs),
                    sorted,
                    "seed {seed}, overlaps {overlaps}"
                );
            }
        }
        assert!(
            fell_back > 20,
            "overlapping FDEs are sorted whole ({fell_back})"
        );
    }
}

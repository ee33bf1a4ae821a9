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

/// The rows sorted as a stable sort by `sort_key` would leave them. An FDE's rows come
/// in address order, so the FDEs are sorted by their first pc and their rows laid end to
/// end: a binary whose FDEs are out of address order (hot and cold parts of functions,
/// LTO) then costs a sort of its FDEs, not of all its rows (it was most of a build).
/// Where that order is not what the stable sort gives (FDEs that overlap, rows out of
/// order inside one), the rows are sorted whole, as before.
pub(super) fn in_order(mut raw: Vec<Row>, mut runs: Vec<Run>) -> Vec<Row> {
    laid_out(&raw, &mut runs).unwrap_or_else(|| {
        raw.sort_by_key(sort_key);
        raw
    })
}

/// The runs' rows, the runs sorted by first pc, if that is the stable sort's order:
/// each row's key and its index in `raw` rise strictly.
fn laid_out(raw: &[Row], runs: &mut [Run]) -> Option<Vec<Row>> {
    runs.sort_by_key(|r| r.pc);
    let mut out: Vec<Row> = Vec::with_capacity(raw.len());
    let mut last: Option<((u32, bool), usize)> = None;
    for run in runs.iter() {
        for (i, r) in raw.iter().enumerate().take(run.end).skip(run.start) {
            let now = (sort_key(r), i);
            if last.is_some_and(|l| l >= now) {
                return None;
            }
            last = Some(now);
            out.push(*r);
        }
    }
    // Every row in some run (rows_of lays them so).
    (out.len() == raw.len()).then_some(out)
}

/// Rows sorted by `in_order` with one row per pc (a function's rule beats the end marker
/// of the one before it), rows that repeat their predecessor's rule dropped. In place: a
/// big binary's rows (rustc's 1.1 M) are not copied again; the capacity left over goes
/// back.
pub(super) fn tidy(mut raw: Vec<Row>) -> Vec<Row> {
    // Sorted stably: among rows of one pc, markers come first and the last row is kept,
    // so a rule wins, and of two rules the later FDE's (a PLT's FDE ends with an empty
    // row at the next one's start).
    debug_assert!(raw.is_sorted_by_key(sort_key));
    let mut kept = 0;
    for i in 0..raw.len() {
        let r = raw[i];
        if kept > 0 && raw[kept - 1].pc == r.pc {
            raw[kept - 1] = r;
        } else {
            raw[kept] = r;
            kept += 1;
        }
    }
    raw.truncate(kept);
    // Then each rule once: a row that repeats the rule of the row before it goes.
    let same_rule = |a: &Row, b: &Row| {
        (a.cfa, a.cfa_offset, a.rbp, a.rbp_offset8) == (b.cfa, b.cfa_offset, b.rbp, b.rbp_offset8)
    };
    raw.dedup_by(|r, last| same_rule(r, last));
    // A table that begins with a marker says nothing at its start.
    if raw.first().is_some_and(|r| r.cfa == k::CFA_NONE) {
        raw.remove(0);
    }
    raw.shrink_to_fit();
    raw
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

    /// Rows in one run, so `in_order` sorts them whole.
    fn sorted(raw: Vec<Row>) -> Vec<Row> {
        let end = raw.len();
        in_order(
            raw,
            vec![Run {
                pc: 0,
                start: 0,
                end,
            }],
        )
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
                let laid = laid_out(&raw, &mut runs.clone());
                if overlaps {
                    fell_back += usize::from(laid.is_none());
                } else {
                    assert!(laid.is_some(), "seed {seed}: FDEs apart are laid out");
                }
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

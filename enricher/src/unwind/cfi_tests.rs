//! The fast CFI walk against gimli's on synthetic `.eh_frame` sections.

use super::super::build::{Table, Walk};
use super::super::synthetic::{build, eh_frame};

/// Both walks over one synthetic section: the same table (or the same error); returns
/// how many FDEs the fast walk left to gimli.
fn same(caf: u64, daf: i64, cie: &[u8], fdes: &[(u32, u32, &[u8])]) -> usize {
    same_of(caf, daf, cie, fdes).0
}

/// `same`, and the fast walk's table.
fn same_of(caf: u64, daf: i64, cie: &[u8], fdes: &[(u32, u32, &[u8])]) -> (usize, Option<Table>) {
    let bytes = eh_frame(caf, daf, cie, fdes);
    let (fast, gimli) = (build(&bytes, Walk::Fast), build(&bytes, Walk::Gimli));
    match (fast, gimli) {
        (Ok(f), Ok(g)) => {
            assert_eq!(f.rows, g.rows, "rows of {cie:x?} {fdes:x?}");
            assert_eq!(
                (f.fdes, f.unsupported, f.outside),
                (g.fdes, g.unsupported, g.outside),
                "counts of {cie:x?} {fdes:x?}"
            );
            (f.fallback, Some(f))
        }
        (f, g) => {
            assert_eq!(format!("{f:?}"), format!("{g:?}"));
            (0, None)
        }
    }
}

/// def_cfa rsp+8; offset r16 at cfa-8 (what gcc and clang emit).
const CIE: &[u8] = &[0x0c, 7, 8, 0x90, 1];
const PLT: &[u8] = &[
    0x0f, 11, 0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22,
];

#[test]
fn a_function_with_a_frame_is_walked_without_gimli() {
    // push rbp; mov rbp, rsp; ...; leave; ret.
    let f: &[u8] = &[0x41, 0x0e, 16, 0x86, 2, 0x43, 0x0d, 6, 0x4a, 0x0c, 7, 8];
    assert_eq!(
        same(1, -8, CIE, &[(0x1000, 0x40, f), (0x2000, 0x10, PLT)]),
        0
    );
    let t = build(&eh_frame(1, -8, CIE, &[(0x1000, 0x40, f)]), Walk::Fast).expect("a table");
    // Entry, after push, after mov (rbp-based), after leave, the end marker.
    assert_eq!(t.rows.len(), 5, "{:?}", t.rows);
}

#[test]
fn the_stack_depth_limits_are_gimlis() {
    // One rule in the CIE: three remembers fit, the fourth fails in gimli too.
    let three: &[u8] = &[0x0a, 0x41, 0x0a, 0x41, 0x0a, 0x41, 0x0b, 0x41, 0x0b, 0x0b];
    assert_eq!(same(1, -8, CIE, &[(0x100, 0x20, three)]), 0);
    let four: &[u8] = &[0x0a, 0x0a, 0x0a, 0x41, 0x0a, 0x41];
    assert_eq!(same(1, -8, CIE, &[(0x100, 0x20, four)]), 1);
    // Two rules in the CIE: gimli keeps a copy under the row, so two fit.
    let cie2: &[u8] = &[0x0c, 7, 8, 0x90, 1, 0x08, 3];
    assert_eq!(same(1, -8, cie2, &[(0x100, 0x20, &three[..6])]), 1);
    assert_eq!(same(1, -8, cie2, &[(0x100, 0x20, &three[..4])]), 0);
    // A restore without a remember.
    assert_eq!(same(1, -8, CIE, &[(0x100, 0x20, &[0x41, 0x0b, 0x41])]), 1);
}

#[test]
fn restore_brings_back_the_cies_rule_or_none() {
    let f: &[u8] = &[
        0x41, 0x8a, 3, 0x86, 2, 0x90, 3, 0x41, 0xc6, 0xd0, 0x41, 0xca,
    ];
    assert_eq!(same(1, -8, CIE, &[(0x100, 0x20, f)]), 0);
    let cie_rbp: &[u8] = &[0x0c, 7, 8, 0x90, 1, 0x86, 2];
    assert_eq!(same(1, -8, cie_rbp, &[(0x100, 0x20, f)]), 0);
}

#[test]
fn the_cfa_offset_cannot_change_under_an_expression() {
    let f: &[u8] = &[0x41, 0x0e, 16];
    let g = [PLT, f].concat();
    assert_eq!(same(1, -8, CIE, &[(0x100, 0x20, &g)]), 1);
    let cie_expr = [CIE, PLT].concat();
    assert_eq!(
        same(1, -8, &cie_expr, &[(0x100, 0x20, &[0x41, 0x0c, 7, 16])]),
        0
    );
}

#[test]
fn addresses_that_overflow_end_the_fde_as_in_gimli() {
    let f: &[u8] = &[0x41, 0x04, 0xff, 0xff, 0xff, 0xff, 0x41];
    assert_eq!(same(u64::MAX / 3, -8, CIE, &[(0x100, 0x20, f)]), 1);
    // An advance of zero repeats the address.
    assert_eq!(
        same(1, -8, CIE, &[(0x100, 0x20, &[0x40, 0x0e, 16, 0x40])]),
        0
    );
}

#[test]
fn cies_the_walk_does_not_model_leave_their_fdes_to_gimli() {
    let f: &[u8] = &[0x41, 0x0e, 16];
    // A CIE that advances, restores, remembers, or names a register above 63.
    for cie in [&[0x0c, 7, 8, 0x41][..], &[0xc6], &[0x0a], &[0x07, 70]] {
        let all = [CIE, cie].concat();
        assert_eq!(same(1, -8, &all, &[(0x100, 0x20, f)]), 1, "{cie:x?}");
    }
}

/// A small deterministic generator (xorshift), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn instruction(r: &mut Rng, out: &mut Vec<u8>) {
    const REGS: [u8; 12] = [6, 7, 16, 6, 7, 16, 6, 16, 3, 12, 63, 70];
    let reg = REGS[r.below(REGS.len() as u64) as usize];
    let small = r.below(40) as u8;
    match r.below(26) {
        0..=5 => out.push(0x40 | (r.below(4) as u8)),
        6 | 7 => out.extend_from_slice(&[0x0e, small]),
        8 | 9 if reg < 64 => out.extend_from_slice(&[0x80 | reg, r.below(4) as u8]),
        10 if reg < 64 => out.push(0xc0 | reg),
        11 => out.extend_from_slice(&[0x05, reg, small]),
        12 => out.extend_from_slice(&[0x06, reg]),
        13 => out.extend_from_slice(&[0x07, reg]),
        14 => out.extend_from_slice(&[0x08, reg]),
        15 => out.extend_from_slice(&[0x09, reg, 7]),
        16 => out.push(0x0a),
        17 => out.push(0x0b),
        18 => out.extend_from_slice(&[0x0c, reg, small]),
        19 => out.extend_from_slice(&[0x0d, reg]),
        20 => out.extend_from_slice(PLT),
        21 => out.extend_from_slice(&[0x10, reg, 1, 0x30]),
        22 => out.extend_from_slice(&[0x11, reg, 0x7e]),
        23 => out.extend_from_slice(&[0x12, reg, 0x7e, 0x13, 0x7f]),
        24 => out.extend_from_slice(&[0x14, reg, 1, 0x15, reg, 0x7f, 0x2e, 8]),
        _ => out.extend_from_slice(&[0x02, small, 0x03, 1, 0, 0x00]),
    }
}

#[test]
fn random_programs_give_gimlis_rows() {
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut fell_back, mut walked) = (0, 0);
    for _ in 0..4000 {
        let mut cie = CIE.to_vec();
        for _ in 0..r.below(3) {
            instruction(&mut r, &mut cie);
        }
        let mut programs = Vec::new();
        for _ in 0..1 + r.below(3) {
            let mut p = Vec::new();
            for _ in 0..r.below(24) {
                instruction(&mut r, &mut p);
            }
            programs.push(p);
        }
        let fdes: Vec<(u32, u32, &[u8])> = programs
            .iter()
            .enumerate()
            .map(|(i, p)| (0x1000 * (i as u32 + 1), 0x80, p.as_slice()))
            .collect();
        let (back, t) = same_of(1, -8, &cie, &fdes);
        fell_back += back;
        walked += t.map_or(0, |t| t.fdes - t.fallback);
    }
    // Both paths were taken, often.
    assert!(
        fell_back > 1000 && walked > 2000,
        "{fell_back} fallbacks, {walked} walked"
    );
}

//! The fast CFI walk against gimli's `UnwindTable` on arbitrary call frame programs, put
//! in a synthetic `.eh_frame`: the head of the input picks the alignment factors and the
//! CIE's program, the rest is cut into FDE programs. Both walks give the same table (or
//! the same error). Reaches the stack-depth, LEB, overflow and expression edges that
//! mutating whole binaries rarely does.
#![no_main]

use firn_enricher::{unwind_synthetic, UnwindWalk};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [caf, daf, cie_len, rest @ ..] = data else {
        return;
    };
    // Factors as compilers use them (1, -8) most of the time, anything otherwise.
    let caf = if *caf < 0xf0 { 1 } else { u64::from(*caf).wrapping_mul(0x0101_0101_0101) };
    let daf = if *daf < 0xf0 { -8 } else { i64::from(*daf as i8) };
    let cie_len = usize::from(*cie_len % 16).min(rest.len());
    let (cie, mut rest) = rest.split_at(cie_len);
    let mut fdes = Vec::new();
    let mut start = 0x1000u32;
    while let [len, tail @ ..] = rest {
        let len = usize::from(*len).min(tail.len());
        let (program, tail) = tail.split_at(len);
        fdes.push((start, 0x100, program));
        start += 0x1000;
        rest = tail;
    }
    let bytes = unwind_synthetic::eh_frame(caf, daf, cie, &fdes);
    let fast = unwind_synthetic::build(&bytes, UnwindWalk::Fast);
    let gimli = unwind_synthetic::build(&bytes, UnwindWalk::Gimli);
    match (fast, gimli) {
        (Ok(f), Ok(g)) => {
            assert_eq!(f.rows, g.rows);
            assert_eq!(
                (f.fdes, f.unsupported, f.outside),
                (g.fdes, g.unsupported, g.outside)
            );
        }
        (f, g) => assert_eq!(format!("{:?}", f.err()), format!("{:?}", g.err())),
    }
});

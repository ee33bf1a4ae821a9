//! The enricher's unwind table builder on arbitrary bytes as if the broker had opened
//! them as a mapped binary: an error or a table, never a panic; a table is sorted and
//! every row is one the sampler accepts, and the fast CFI walk gives gimli's table.
#![no_main]

use firn_enricher::{build_unwind_table_with, UnwindWalk};
use firn_schema::unwind_row::Row;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let fast = build_unwind_table_with(data, UnwindWalk::Fast);
    let gimli = build_unwind_table_with(data, UnwindWalk::Gimli);
    match (fast, gimli) {
        (Ok(f), Ok(g)) => {
            assert!(f.rows.iter().all(Row::valid));
            assert!(f.rows.windows(2).all(|w| w[0].pc < w[1].pc));
            assert_eq!(f.rows, g.rows);
            assert_eq!(
                (f.fdes, f.unsupported, f.outside),
                (g.fdes, g.unsupported, g.outside)
            );
        }
        (f, g) => assert_eq!(format!("{:?}", f.err()), format!("{:?}", g.err())),
    }
});

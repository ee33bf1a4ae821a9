//! The enricher's unwind table builder on arbitrary bytes as if the broker had opened
//! them as a mapped binary: an error or a table, never a panic; a table is sorted and
//! every row is one the sampler accepts.
#![no_main]

use firn_schema::unwind_row::Row;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(t) = firn_enricher::build_unwind_table(data) {
        assert!(t.rows.iter().all(Row::valid));
        assert!(t.rows.windows(2).all(|w| w[0].pc < w[1].pc));
    }
});

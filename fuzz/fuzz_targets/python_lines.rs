//! The line-table decoders on arbitrary bytes, as BPF would copy them out of a hostile
//! process: a line or none, never a panic, and work bounded by the table's length.
#![no_main]

use firn_enricher::cpython::{line_at, line_ranges, LineFormat};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((head, table)) = data.split_first_chunk::<8>() else {
        return;
    };
    let first = i32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    let at = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    for f in [LineFormat::Pairs, LineFormat::Locations] {
        let _ = line_at(f, table, first, at);
        assert!(line_ranges(f, table, first).len() <= table.len());
    }
});

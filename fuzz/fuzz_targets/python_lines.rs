//! The decoders of what BPF copies out of a hostile process, on arbitrary bytes: the
//! line tables (a line or none, never a panic, work bounded by the table's length) and
//! the code blobs that carry names and tables (kept or refused, never a panic).
#![no_main]

use firn_enricher::cpython::{line_at, line_ranges, LineFormat, Names};
use firn_schema::python_code::{frame, CodeBlob};
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
    // The same bytes as a blob, and as the table of a well-formed one.
    let mut names = Names::default();
    let _ = names.take(data);
    if let Some(b) = CodeBlob::parse(data) {
        assert_eq!(b.to_bytes(), data, "one encoding per blob");
        let _ = names.line(frame::TAG | b.id << frame::INDEX_BITS | u64::from(at & 0xfffff));
    }
    let cut = &table[..table.len().min(3584)];
    let blob = CodeBlob {
        id: u64::from(at),
        first_line: first as u32,
        minor: head[0] % 16,
        flags: head[1],
        name: b"f",
        file: b"f.py",
        table: cut,
    }
    .to_bytes();
    let _ = names.take(&blob);
    let _ = names.line(frame::TAG | u64::from(at) << frame::INDEX_BITS | u64::from(first as u32 & 0xfffff));
});

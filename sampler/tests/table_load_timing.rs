//! The sampler's CPU work a row of table loads, apart from the map writes: the checks of
//! each chunk and the page directory built from its rows, over real tables (the unwind
//! cache the enricher writes, `target/workloads/unwind-cache` after a bench run, or
//! `FIRN_TABLES`). A timing, not a test: `cargo test --release -p firn-sampler --test
//! table_load_timing -- --ignored --nocapture`.

use std::time::Instant;

use firn_sampler::pages::Directory;
use firn_sampler::{check_rows, check_rows_with, PageIndex, ROW_BYTES};

/// A cached table file: 48 bytes of header, then its rows.
const HEADER: usize = 48;
const CHUNK_ROWS: usize = firn_schema::limits::MAX_TABLE_CHUNK_ROWS as usize;

fn tables() -> Vec<Vec<u8>> {
    let dir = std::env::var("FIRN_TABLES").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/workloads/unwind-cache"
        )
        .into()
    });
    let mut out = Vec::new();
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir}: {e}"));
    for e in entries.flatten() {
        let Ok(data) = std::fs::read(e.path()) else {
            continue;
        };
        if data.len() > HEADER && (data.len() - HEADER).is_multiple_of(ROW_BYTES) {
            out.push(data[HEADER..].to_vec());
        }
    }
    assert!(!out.is_empty(), "no tables in {dir}");
    out
}

/// Checks each chunk, then pushes its rows' pcs into the directory: the load path
/// before the directory was built inside the check loop.
fn two_passes(table: &[u8]) -> Directory {
    let total = (table.len() / ROW_BYTES) as u32;
    let mut ix = PageIndex::new(total);
    let mut prev = None;
    for (c, chunk) in table.chunks(CHUNK_ROWS * ROW_BYTES).enumerate() {
        let first = (c * CHUNK_ROWS) as u32;
        prev = Some(check_rows(chunk, first, prev).expect("cached rows pass"));
        for row in chunk.chunks_exact(ROW_BYTES) {
            ix.push(u32::from_le_bytes([row[0], row[1], row[2], row[3]]));
        }
    }
    ix.finish()
}

/// The load path now: the directory built in the check loop, its pages sized up front.
fn one_pass(table: &[u8]) -> Directory {
    let total = (table.len() / ROW_BYTES) as u32;
    let first_chunk = &table[..table.len().min(CHUNK_ROWS * ROW_BYTES)];
    let mut ix = PageIndex::for_first_chunk(total, first_chunk);
    let mut prev = None;
    for (c, chunk) in table.chunks(CHUNK_ROWS * ROW_BYTES).enumerate() {
        let first = (c * CHUNK_ROWS) as u32;
        let r = check_rows_with(chunk, first, prev, |pc| ix.push(pc));
        prev = Some(r.expect("cached rows pass"));
    }
    ix.finish()
}

fn checks_only(table: &[u8]) -> Directory {
    let mut prev = None;
    for (c, chunk) in table.chunks(CHUNK_ROWS * ROW_BYTES).enumerate() {
        prev = Some(check_rows(chunk, (c * CHUNK_ROWS) as u32, prev).expect("cached rows pass"));
    }
    Directory {
        base: prev.unwrap_or(0),
        shift: 0,
        entries: Vec::new(),
    }
}

fn time(name: &str, tables: &[Vec<u8>], f: fn(&[u8]) -> Directory) {
    let rows: usize = tables.iter().map(|t| t.len() / ROW_BYTES).sum();
    let mut best = f64::MAX;
    let mut sink = 0;
    for _ in 0..15 {
        let t0 = Instant::now();
        for t in tables {
            sink += f(t).entries.len();
        }
        best = best.min(t0.elapsed().as_nanos() as f64 / rows as f64);
    }
    println!(
        "{name:>14}: {best:5.2} ns a row, best of 15 over {} tables, {rows} rows ({sink})",
        tables.len()
    );
}

#[test]
#[ignore = "a timing: run it on its own, in release"]
fn table_load_cpu_per_row() {
    let t = tables();
    for table in &t {
        assert_eq!(one_pass(table), two_passes(table), "the same directory");
    }
    for _ in 0..2 {
        time("checks only", &t, checks_only);
        time("two passes", &t, two_passes);
        time("one pass", &t, one_pass);
    }
}

//! Time to build the unwind table of a binary from its CFI: libc (≈2 MiB) and firn's own
//! enricher release binary (≈90 MiB with its line tables; the "large binary" case).
//! The file is read into memory first; only the build is timed. Each is also built with
//! gimli evaluating every FDE (`/gimli`), the baseline of the fast CFI walk.
//!
//! Run: `cargo bench -p firn-enricher --bench unwind_tables`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use firn_enricher::UnwindWalk;

fn inputs() -> Vec<(String, Vec<u8>)> {
    let big = std::env::var("FIRN_BENCH_BIG_BINARY").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/release/firn-enricher"
        )
        .to_string()
    });
    let mut out = Vec::new();
    for path in ["/lib/x86_64-linux-gnu/libc.so.6".to_string(), big] {
        match std::fs::read(&path) {
            Ok(data) => out.push((path, data)),
            Err(e) => eprintln!("skipping {path}: {e}"),
        }
    }
    out
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("unwind_table_build");
    g.sample_size(10);
    for (path, data) in inputs() {
        let t = firn_enricher::build_unwind_table(&data).expect("a table");
        let name = std::path::Path::new(&path)
            .file_name()
            .map_or(path.clone(), |n| n.to_string_lossy().into_owned());
        eprintln!(
            "{name}: {} MiB, {} FDEs, {} rows ({} KiB), {} unsupported",
            data.len() >> 20,
            t.fdes,
            t.rows.len(),
            t.rows.len() * 8 / 1024,
            t.unsupported
        );
        g.throughput(Throughput::Bytes(data.len() as u64));
        g.bench_function(name.clone(), |b| {
            b.iter(|| firn_enricher::build_unwind_table(&data))
        });
        // The baseline in the same run: every FDE evaluated by gimli's UnwindTable.
        g.bench_function(format!("{name}/gimli"), |b| {
            b.iter(|| firn_enricher::build_unwind_table_with(&data, UnwindWalk::Gimli))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! The fast CFI walk against gimli's over every ELF file on the machine (minutes, so
//! ignored): `cargo test --release -p firn-enricher --lib identity -- --ignored --nocapture`.
//! Set FIRN_IDENTITY_DIRS (colon-separated) to walk other directories.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::build::{build_with, Walk};

fn elf_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let Ok(kind) = e.file_type() else { continue };
        let path = e.path();
        if kind.is_dir() {
            elf_files(&path, out);
        } else if kind.is_file() {
            let mut magic = [0u8; 4];
            let is_elf = std::fs::File::open(&path)
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
                .is_ok()
                && magic == *b"\x7fELF";
            if is_elf {
                out.push(path);
            }
        }
    }
}

#[test]
#[ignore = "reads every ELF file on the machine: minutes"]
fn the_fast_walk_gives_gimlis_tables_for_every_elf_file_here() {
    let home = std::env::var("HOME").unwrap_or_default();
    let dirs = std::env::var("FIRN_IDENTITY_DIRS").unwrap_or_else(|_| {
        format!(
            "/usr/bin:/usr/sbin:/usr/lib:/usr/libexec:/usr/local:{home}/.pyenv/versions:{}/../target/release",
            env!("CARGO_MANIFEST_DIR")
        )
    });
    let mut files = Vec::new();
    for d in dirs.split(':') {
        elf_files(Path::new(d), &mut files);
    }
    let (mut tables, mut rows, mut fdes, mut fallback) = (0, 0, 0, 0);
    let (mut fast_time, mut gimli_time) = (Duration::ZERO, Duration::ZERO);
    for path in &files {
        let Ok(data) = std::fs::read(path) else {
            continue;
        };
        let t0 = Instant::now();
        let g = build_with(&data, Walk::Gimli);
        let t1 = Instant::now();
        let f = build_with(&data, Walk::Fast);
        gimli_time += t1 - t0;
        fast_time += t1.elapsed();
        match (f, g) {
            (Ok(f), Ok(g)) => {
                assert!(f.rows == g.rows, "{}: rows differ", path.display());
                assert_eq!(
                    (f.fdes, f.unsupported, f.outside, f.source),
                    (g.fdes, g.unsupported, g.outside, g.source),
                    "{}",
                    path.display()
                );
                tables += 1;
                rows += f.rows.len();
                fdes += f.fdes;
                fallback += f.fallback;
            }
            (f, g) => assert_eq!(
                format!("{:?}", f.err()),
                format!("{:?}", g.err()),
                "{}",
                path.display()
            ),
        }
    }
    eprintln!(
        "{} ELF files, {tables} tables, {rows} rows, {fdes} FDEs of which {fallback} left to gimli; \
         gimli {:.2} s, fast {:.2} s",
        files.len(),
        gimli_time.as_secs_f64(),
        fast_time.as_secs_f64()
    );
    assert!(tables > 100, "too few tables to say anything: {tables}");
}

/// Against tables an earlier build of firn kept on disk (the cache's key covers firn's
/// version and the table format, so an entry found is one this version must reproduce
/// byte for byte): the ordering and tidying, which both walks share, did not change.
/// FIRN_IDENTITY_CACHE names the cache directory (copied first: reads touch entries).
#[test]
#[ignore = "reads every ELF file on the machine and a table cache: minutes"]
fn tables_are_those_an_earlier_build_kept_in_the_cache() {
    let Ok(dir) = std::env::var("FIRN_IDENTITY_CACHE") else {
        panic!("set FIRN_IDENTITY_CACHE to a copy of an unwind table cache directory");
    };
    let mut cache = super::cache::Cache::open(Path::new(&dir), u64::MAX, 0).expect("the cache");
    let home = std::env::var("HOME").unwrap_or_default();
    let mut files = Vec::new();
    let workloads = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/workloads");
    let pyenv = format!("{home}/.pyenv/versions");
    for d in ["/usr/bin", "/usr/lib", "/usr/local", &pyenv, workloads] {
        elf_files(Path::new(d), &mut files);
    }
    let (mut compared, mut rows) = (0, 0);
    for path in &files {
        let (Ok(file), Ok(data)) = (std::fs::File::open(path), std::fs::read(path)) else {
            continue;
        };
        let Some(key) = super::cache::key_of(&file, &data) else {
            continue;
        };
        let super::cache::Found::Rows(kept) = cache.get(&key) else {
            continue;
        };
        let built = super::build::build(&data).expect("a table for a cached file");
        rows += built.rows.len();
        assert!(
            built.into_bytes() == kept,
            "{}: differs from the cached table",
            path.display()
        );
        compared += 1;
    }
    eprintln!("{compared} tables ({rows} rows) equal to the cached ones");
    assert!(compared > 20, "too few cached tables found: {compared}");
}

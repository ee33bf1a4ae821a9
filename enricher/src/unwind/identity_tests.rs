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

//! The scan against blazesym's own answers from the same symbol tables.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolizer};

use super::*;
use crate::symbolize::elf::{elf_facts, hex, ElfFacts};

/// Files with symbol tables of each kind this machine has: this Rust test binary
/// (a large `.symtab`), libc (`.dynsym` only) and its debug file if libc6-dbg is in,
/// libstdc++ (C++ names), pyenv's libpython if there. Each with the file whose
/// segments give the addresses asked (a debug file's segments have no file bytes).
fn files() -> Vec<(PathBuf, PathBuf)> {
    let lib = Path::new("/usr/lib/x86_64-linux-gnu");
    let mut v: Vec<PathBuf> = vec![std::env::current_exe().unwrap()];
    v.push(lib.join("libc.so.6"));
    v.push(lib.join("libstdc++.so.6"));
    let py = Path::new("/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0");
    v.extend(py.exists().then(|| py.to_path_buf()));
    let mut v: Vec<(PathBuf, PathBuf)> = v.into_iter().map(|p| (p.clone(), p)).collect();
    if let Ok(Some(id)) = blazesym::helper::read_elf_build_id(&lib.join("libc.so.6")) {
        let debug = PathBuf::from(format!(
            "/usr/lib/debug/.build-id/{:02x}/{}.debug",
            id[0],
            hex(&id[1..])
        ));
        v.extend(debug.exists().then(|| (debug, lib.join("libc.so.6"))));
    }
    v
}

/// Addresses over every loaded segment, 1 in `step` bytes, and each symbol's first and
/// last byte that blazesym finds at those.
fn addresses(facts: &ElfFacts, step: u64) -> Vec<u64> {
    facts
        .loads
        .iter()
        .flat_map(|s| {
            (0..s.size.max(1))
                .step_by(step as usize)
                .map(|d| s.address + d)
        })
        .collect()
}

fn blazesym_names(path: &Path, addrs: &[u64]) -> Vec<Option<(String, u64, Option<usize>)>> {
    let s = Symbolizer::builder().enable_code_info(false).build();
    let mut elf = Elf::new(path);
    elf.debug_syms = false;
    s.symbolize(&Source::Elf(elf), Input::VirtOffset(addrs))
        .unwrap()
        .into_iter()
        .map(|r| r.as_sym().map(|s| (s.name.to_string(), s.addr, s.size)))
        .collect()
}

/// Every symbol's names (demangled) by address and size, read by `object`.
fn symbols_by_place(path: &Path) -> std::collections::HashMap<(u64, u64), Vec<String>> {
    use object::{Object, ObjectSymbol};
    let data = std::fs::read(path).unwrap();
    let file = object::File::parse(&*data).unwrap();
    let mut by = std::collections::HashMap::<_, Vec<String>>::new();
    for s in file.symbols().chain(file.dynamic_symbols()) {
        if let Ok(n) = s.name() {
            by.entry((s.address(), s.size()))
                .or_default()
                .push(demangled(n));
        }
    }
    by
}

#[test]
fn the_scan_names_what_blazesym_names_from_symbol_tables() {
    for (path, layout) in files() {
        let file = std::fs::File::open(&path).unwrap();
        let facts = elf_facts(file.try_clone().unwrap()).expect("an ELF file");
        let tables = facts.tables.expect("a 64-bit file");
        let layout = elf_facts(std::fs::File::open(&layout).unwrap()).unwrap();
        let addrs = addresses(&layout, 61);
        let want = blazesym_names(&path, &addrs);
        let got = names(file.as_fd(), &tables, &addrs).unwrap();
        // The symbol each table answers with, as blazesym reads them: .symtab first.
        let mut found = vec![None; addrs.len()];
        for (table, dynamic) in [(tables.symtab, false), (tables.dynsym, true)] {
            let Some(table) = table else { continue };
            for (f, s) in found
                .iter_mut()
                .zip(scan(file.as_fd(), table, &addrs, dynamic).unwrap())
            {
                *f = f.or(s.map(|(v, c)| (v, (c.size > 0).then_some(c.size as usize))));
            }
        }
        let places = symbols_by_place(&path);
        let (mut named, mut aliases) = (0, 0);
        for (((a, w), g), f) in addrs.iter().zip(&want).zip(&got).zip(&found) {
            // blazesym's lower bound returns the last, not the first, of the symbols at
            // the table's lowest address (0: version and link-warning symbols, no code),
            // so it answers there with the smallest of them.
            if f.is_some_and(|(v, _)| v == 0) {
                continue;
            }
            let g = g.as_ref().map(|l| l[0].function.to_string());
            named += usize::from(g.is_some());
            // The same place and size: blazesym's symbol, or one of its aliases (it
            // orders equal symbols by an unstable sort).
            assert_eq!(
                w.as_ref().map(|w| (w.1, w.2)),
                *f,
                "{}: {a:#x}: {w:?}",
                path.display()
            );
            if let (Some(w), Some(g)) = (w, &g) {
                if &w.0 != g {
                    let at = &places[&(w.1, w.2.unwrap_or(0) as u64)];
                    assert!(
                        at.contains(g) && at.contains(&w.0),
                        "{a:#x}: {w:?} / {g} not aliases"
                    );
                    aliases += 1;
                }
            } else {
                assert_eq!(w.as_ref().map(|w| &w.0), g.as_ref(), "{a:#x}");
            }
        }
        eprintln!(
            "{}: {} addresses, {named} named, {aliases} by another alias",
            path.display(),
            addrs.len()
        );
        assert!(named > addrs.len() / 10, "{}: few names", path.display());
    }
}

/// Tables a file's headers lie about: past the file's end, a string table cut short,
/// offsets at the top of the range. Nothing is named that is not there, and nothing
/// panics.
#[test]
fn lying_table_headers_name_nothing_they_do_not_hold() {
    let me = std::env::current_exe().unwrap();
    let file = std::fs::File::open(&me).unwrap();
    let facts = elf_facts(file.try_clone().unwrap()).unwrap();
    let real = facts.tables.unwrap().symtab.unwrap();
    let addrs = addresses(&facts, 4099);
    let len = file.metadata().unwrap().len();
    let lies = [
        Table {
            syms: (len + 24, 1 << 20),
            ..real
        },
        Table {
            syms: (u64::MAX - 23, 48),
            strs: (u64::MAX - 4, u64::MAX),
        },
        Table {
            strs: (real.strs.0, 1),
            ..real
        },
        Table {
            strs: (len - 1, 1 << 30),
            ..real
        },
    ];
    for lie in lies {
        let tables = Tables {
            symtab: Some(lie),
            dynsym: None,
        };
        let got = names(file.as_fd(), &tables, &addrs).unwrap_or_default();
        assert!(got.iter().all(Option::is_none), "{lie:?}");
    }
}

use super::*;

/// Every input the symbolize_elf fuzz target ever crashed on: a panic inside
/// blazesym is contained, counted, and poisons only that binary.
#[test]
fn fuzz_regressions_are_contained() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions/symbolize_elf");
    let metrics = Arc::new(Metrics::default());
    let mut inputs = 0;
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        inputs += 1;
        let limits = Limits {
            binaries: 2,
            ..Limits::default()
        };
        let mut sym = Symbolizer::new(limits, metrics.clone());
        let file = std::fs::File::open(entry.path()).unwrap();
        let Ok(id) = sym.load(file.into()) else {
            continue;
        };
        let len = entry.metadata().unwrap().len();
        let offsets: Vec<u64> = (0..64u64).map(|i| i * (len / 48 + 1)).collect();
        assert_eq!(sym.symbolize(&id, &offsets).len(), offsets.len());
        // A binary the parser panicked on answers without parsing again.
        assert_eq!(sym.symbolize(&id, &offsets).len(), offsets.len());
    }
    assert!(inputs > 0, "no regression inputs under {}", dir.display());
    assert!(
        metrics
            .symbolizer_panics
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1,
        "the known blazesym panic was not met (fixed upstream? then this input is just a regression)"
    );
}

/// File offset of code in this test binary.
fn own_offset(addr: usize) -> u64 {
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || std::path::Path::new(f[5]) != exe {
            continue;
        }
        let (a, b) = f[0].split_once('-').unwrap();
        let (start, end) = (
            usize::from_str_radix(a, 16).unwrap(),
            usize::from_str_radix(b, 16).unwrap(),
        );
        if (start..end).contains(&addr) {
            return (addr - start) as u64 + u64::from_str_radix(f[2], 16).unwrap();
        }
    }
    panic!("{addr:#x} not in {}", exe.display());
}

#[inline(never)]
fn marker_function() -> u64 {
    std::hint::black_box(42)
}

fn symbolize_self(budget_bytes: u64) -> (Option<Lines>, Symbolizer, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::default());
    let limits = Limits {
        budget_bytes,
        ..Limits::default()
    };
    let mut sym = Symbolizer::new(limits, metrics.clone());
    let id = sym
        .load(std::fs::File::open("/proc/self/exe").unwrap().into())
        .unwrap();
    marker_function();
    let off = own_offset(marker_function as *const () as usize);
    let lines = sym.symbolize(&id, &[off]).remove(0);
    (lines, sym, metrics)
}

#[test]
fn within_the_budget_frames_have_lines_and_the_parse_is_held() {
    let (lines, sym, _) = symbolize_self(u64::MAX);
    let lines = lines.expect("named");
    assert!(lines.last().unwrap().function.contains("marker_function"));
    assert!(lines
        .iter()
        .any(|l| l.file.ends_with("tests.rs") && l.line > 0));
    assert!(sym.bytes_held() > 0);
}

#[test]
fn over_the_budget_frames_are_named_from_the_symbol_table_and_nothing_is_held() {
    let (lines, sym, metrics) = symbolize_self(0);
    let lines = lines.expect("named from .symtab");
    assert_eq!(lines.len(), 1, "no inline frames without DWARF");
    assert!(lines[0].function.contains("marker_function"));
    assert_eq!(&*lines[0].file, "");
    assert_eq!(sym.bytes_held(), 0);
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(n(&metrics.binaries_over_symbol_budget), 1);
    assert_eq!(n(&metrics.symbol_parses_transient), 1);
}

/// A parse already held that meets new offsets needs no room: the others stay held.
#[test]
fn a_held_parse_meeting_new_offsets_drops_no_other() {
    let libc = "/usr/lib/x86_64-linux-gnu/libc.so.6";
    let open = |p: &str| std::fs::File::open(p).unwrap().into();
    let libc_offset = 0x30000;
    // Each parse's cost, with room for all.
    let (_, mut sym, _) = symbolize_self(u64::MAX);
    let own = sym.bytes_held();
    let id = sym.load(open(libc)).unwrap();
    sym.symbolize(&id, &[libc_offset]);
    let both = sym.bytes_held();
    assert!(both > own && own > 0, "{own} {both}");
    // A budget that holds both exactly.
    let (_, mut sym, metrics) = symbolize_self(both);
    let id = sym.load(open(libc)).unwrap();
    sym.symbolize(&id, &[libc_offset]);
    assert_eq!(sym.bytes_held(), both);
    let me = sym.load(open("/proc/self/exe")).unwrap();
    let other = own_offset(own_offset as *const () as usize);
    assert!(sym.symbolize(&me, &[other])[0].is_some());
    assert_eq!(sym.bytes_held(), both, "libc's parse was dropped");
    let dropped = metrics
        .symbol_parses_dropped
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(dropped, 0);
}

/// Two parses that do not fit the budget together, each needed every round (new
/// frames in both): one stays held and the other is made for the round and not kept,
/// instead of each dropping the other every round.
#[test]
fn parses_that_do_not_fit_together_do_not_push_each_other_out_every_round() {
    const ROUNDS: u64 = 8;
    let libc = "/usr/lib/x86_64-linux-gnu/libc.so.6";
    let open = |p: &str| std::fs::File::open(p).unwrap().into();
    let (_, mut sym, _) = symbolize_self(u64::MAX);
    let own = sym.bytes_held();
    let id = sym.load(open(libc)).unwrap();
    sym.symbolize(&id, &[0x30000]);
    let theirs = sym.bytes_held() - own;
    // Room for either, not both.
    let (_, mut sym, metrics) = symbolize_self(own.max(theirs));
    let me = sym.load(open("/proc/self/exe")).unwrap();
    let libc = sym.load(open(libc)).unwrap();
    let mine = own_offset(marker_function as *const () as usize);
    // What each parse takes, pinned (measured, they would make the test's outcome
    // depend on the machine's load): libc's costs three times as much a byte. After
    // each call the binary just needed gets the credit its pinned time gives.
    let ns_of = |id: &BinaryId| if *id == libc { 3 * theirs } else { own };
    let call = |sym: &mut Symbolizer, id: &BinaryId, offset: u64| {
        if let Some(b) = sym.binaries.peek_mut(id).filter(|b| b.parse_ns.is_some()) {
            b.parse_ns = Some(ns_of(id));
        }
        sym.symbolize(id, &[offset]);
        let floor = sym.floor;
        if let Some(b) = sym.binaries.peek_mut(id) {
            b.parse_ns = Some(ns_of(id));
            if b.parsed.is_some() {
                b.credit = floor.credit(ns_of(id), b.cost);
            }
        }
    };
    for round in 1..=ROUNDS {
        // New offsets each round: misses, so each binary needs its parse.
        call(&mut sym, &libc, 0x30000 + round * 0x1000);
        call(&mut sym, &me, mine + round * 16);
        assert!(sym.bytes_held() <= own.max(theirs));
    }
    assert!(
        sym.binaries.peek(&libc).is_some_and(|b| b.parsed.is_some()),
        "the dearer parse is kept"
    );
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    let parses = n(&metrics.binaries_loaded)
        + n(&metrics.symbol_reparses)
        + n(&metrics.symbol_parses_not_kept);
    // Dropping the least recently used made 2 parses a round.
    assert!(
        parses <= ROUNDS + 2,
        "{parses} parses in {ROUNDS} rounds: reparsed {}, not kept {}",
        n(&metrics.symbol_reparses),
        n(&metrics.symbol_parses_not_kept)
    );
    assert!(n(&metrics.symbol_parses_not_kept) >= ROUNDS - 2);
}

/// A copy of this test binary whose DWARF is in a separate file: named by its
/// `.gnu_debuglink` next to it (one section kept, so it has DWARF of its own too), and
/// returned as the debug directory `dir/debug` holds it by build id.
fn with_separate_debug_file(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let bin = dir.join("split");
    let debug = dir.join("split.debug");
    let me = std::env::current_exe().unwrap();
    let id = blazesym::helper::read_elf_build_id(&me).unwrap().unwrap();
    let by_id = dir.join(format!(
        "debug/.build-id/{:02x}/{}.debug",
        id[0],
        hex(&id[1..])
    ));
    let run = |args: &[&std::ffi::OsStr]| {
        let ok = std::process::Command::new("objcopy")
            .args(args)
            .status()
            .expect("objcopy (binutils)");
        assert!(ok.success(), "objcopy {args:?}");
    };
    run(&["--only-keep-debug".as_ref(), me.as_ref(), debug.as_ref()]);
    run(&[
        "--strip-debug".as_ref(),
        "--keep-section=.debug_abbrev".as_ref(),
        "--add-gnu-debuglink".as_ref(),
        debug.as_ref(),
        me.as_ref(),
        bin.as_ref(),
    ]);
    std::fs::create_dir_all(by_id.parent().unwrap()).unwrap();
    std::fs::copy(&debug, &by_id).unwrap();
    (bin, by_id)
}

/// Dropping a parse frees all it held, the separate debug file too: blazesym keeps a
/// debug file under its own path, and evicting only the binary's path left it mapped
/// (libc's DWARF from libc6-dbg, 10 MiB inflated, stayed after every drop).
#[test]
fn a_dropped_parse_unmaps_its_separate_debug_file() {
    let dir = std::env::temp_dir().join(format!("firn-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (bin, debug) = with_separate_debug_file(&dir);
    let mapped = || {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .contains(debug.to_str().unwrap())
    };
    let open = |p: &std::path::Path| std::fs::File::open(p).unwrap().into();
    marker_function();
    let off = own_offset(marker_function as *const () as usize);
    let debug_dirs = [dir.join("debug")];
    let debug_dirs = [debug_dirs[0].as_path()];
    let mut sym = Symbolizer::new(
        Limits {
            budget_bytes: u64::MAX >> 1,
            ..Limits::default()
        },
        Arc::new(Metrics::default()),
    )
    .with_debug_dirs(&debug_dirs);
    let id = sym.load(open(&bin)).unwrap();
    let lines = sym.symbolize(&id, &[off]).remove(0).expect("named");
    assert!(
        lines.iter().any(|l| l.file.ends_with("tests.rs")),
        "file:line from the debug file: {lines:?}"
    );
    assert!(mapped(), "the debug file is parsed in place");
    let cost = sym.bytes_held();
    let dwarf = elf_facts(std::fs::File::open(&debug).unwrap())
        .unwrap()
        .debug_bytes;
    assert!(
        cost > dwarf,
        "the debug file's DWARF ({dwarf} B) counts: {cost} B held"
    );
    drop(sym);
    assert!(!mapped());
    // Room for it alone: another binary's parse drops it.
    let metrics = Arc::new(Metrics::default());
    let limits = Limits {
        budget_bytes: cost,
        ..Limits::default()
    };
    let mut sym = Symbolizer::new(limits, metrics.clone()).with_debug_dirs(&debug_dirs);
    let id = sym.load(open(&bin)).unwrap();
    sym.symbolize(&id, &[off]);
    assert!(mapped());
    let libc = sym
        .load(open("/usr/lib/x86_64-linux-gnu/libc.so.6".as_ref()))
        .unwrap();
    sym.symbolize(&libc, &[0x30000]);
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(n(&metrics.symbol_parses_dropped), 1);
    assert!(!mapped(), "the dropped parse's debug file is still mapped");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unstripped_copy_replaces_a_stripped_one_with_its_build_id() {
    let stripped = std::env::temp_dir().join(format!("firn-stripped-{}", std::process::id()));
    let ok = std::process::Command::new("strip")
        .args(["--strip-all", "-o"])
        .arg(&stripped)
        // Not /proc/self/exe: strip would read itself.
        .arg(std::env::current_exe().unwrap())
        .status()
        .expect("strip (binutils)");
    assert!(ok.success());
    let metrics = Arc::new(Metrics::default());
    let mut sym = Symbolizer::new(Limits::default(), metrics.clone());
    let id = sym
        .load(std::fs::File::open(&stripped).unwrap().into())
        .unwrap();
    assert_eq!(sym.stripped(&id), Some(true));
    let again = sym
        .load(std::fs::File::open("/proc/self/exe").unwrap().into())
        .unwrap();
    assert_eq!(id, again, "same build id");
    assert_eq!(
        sym.stripped(&id),
        Some(false),
        "the copy with .symtab serves"
    );
    marker_function();
    let off = own_offset(marker_function as *const () as usize);
    let lines = sym.symbolize(&id, &[off]).remove(0).expect("named");
    assert!(lines.last().unwrap().function.contains("marker_function"));
    // A stripped copy arriving later does not replace it.
    sym.load(std::fs::File::open(&stripped).unwrap().into())
        .unwrap();
    assert_eq!(sym.stripped(&id), Some(false));
    let _ = std::fs::remove_file(&stripped);
}

#[test]
fn symtab_detection() {
    let me = std::fs::File::open("/proc/self/exe").unwrap();
    let facts = super::elf_facts(me).unwrap();
    assert!(facts.symtab);
    assert!(facts.debug_bytes > 0, "test binaries carry DWARF");
    let text = std::fs::File::open("/proc/self/status").unwrap();
    assert!(super::elf_facts(text).is_none());
}

/// The headers-only reading agrees with `object`'s whole-file parser, on this test
/// binary with its DWARF as it is and compressed both ways, and on libc.
#[test]
fn facts_from_the_headers_agree_with_object_s_parser() {
    use object::read::{Object, ObjectSection, ObjectSegment};
    let dir = std::env::temp_dir().join(format!("firn-facts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let me = std::env::current_exe().unwrap();
    let mut files = vec![me.clone(), "/usr/lib/x86_64-linux-gnu/libc.so.6".into()];
    for how in ["zlib", "zlib-gnu"] {
        let out = dir.join(how);
        let arg = format!("--compress-debug-sections={how}");
        let ok = std::process::Command::new("objcopy")
            .args([arg.as_ref(), me.as_os_str(), out.as_os_str()])
            .status()
            .expect("objcopy (binutils)");
        assert!(ok.success(), "objcopy {arg}");
        files.push(out);
    }
    for path in &files {
        let bytes = std::fs::read(path).unwrap();
        let file = object::File::parse(&*bytes).unwrap();
        let (mut sym_bytes, mut debug_bytes) = (0, 0);
        for s in file.sections() {
            let name = s.name().unwrap();
            if matches!(name, ".symtab" | ".strtab" | ".dynsym" | ".dynstr") {
                sym_bytes += s.size();
            } else if name.starts_with(".debug_") || name.starts_with(".zdebug_") {
                debug_bytes += s.compressed_file_range().unwrap().uncompressed_size;
            }
        }
        let loads: Vec<(u64, u64, u64)> = file
            .segments()
            .map(|s| (s.file_range().0, s.file_range().1, s.address()))
            .collect();
        let facts = super::elf_facts(std::fs::File::open(path).unwrap()).unwrap();
        let what = path.display();
        assert_eq!(facts.sym_bytes, sym_bytes, "{what}");
        assert_eq!(facts.debug_bytes, debug_bytes, "{what}");
        assert_eq!(facts.loads.len(), loads.len(), "{what}");
        for (s, l) in facts.loads.iter().zip(&loads) {
            assert_eq!(
                super::elf::address_of(std::slice::from_ref(s), l.0),
                Some(l.2),
                "{what}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `f`'s result, or a failed test if it has not returned in 20 s (it opened a FIFO).
fn unless_it_hangs<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(20))
        .expect("the symbolizer hung opening a FIFO")
}

/// A binary's links (`.gnu_debuglink` and the like) are its author's to write, and
/// what they name any local user's: a FIFO there would block whoever opens it (the
/// enricher's round, had blazesym followed the link), a file there could hold any
/// DWARF at all. Links are not followed; a debug file is looked up by build id in the
/// debug directories only, and one there that is not a regular file is not read.
#[test]
fn a_binary_s_debug_link_is_not_followed() {
    let dir = std::env::temp_dir().join(format!("firn-fifo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (bin, by_id) = with_separate_debug_file(&dir);
    let fifo = |p: &std::path::Path| {
        std::fs::remove_file(p).unwrap();
        nix::unistd::mkfifo(p, nix::sys::stat::Mode::S_IRWXU).unwrap();
    };
    fifo(&dir.join("split.debug"));
    fifo(&by_id);
    marker_function();
    let off = own_offset(marker_function as *const () as usize);
    let metrics = Arc::new(Metrics::default());
    let debug_dir = dir.join("debug");
    let m = metrics.clone();
    let lines = unless_it_hangs(move || {
        let limits = Limits {
            budget_bytes: u64::MAX >> 1,
            ..Limits::default()
        };
        let mut sym = Symbolizer::new(limits, m).with_debug_dirs(&[&debug_dir]);
        let id = sym.load(std::fs::File::open(&bin).unwrap().into()).unwrap();
        sym.symbolize(&id, &[off]).remove(0)
    });
    let _ = std::fs::remove_dir_all(&dir);
    let lines = lines.expect("named from the binary's own symbol table");
    assert!(
        lines.iter().any(|l| l.function.contains("marker_function")),
        "{lines:?}"
    );
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(n(&metrics.debug_files_refused), 1);
    assert_eq!(n(&metrics.debug_links_not_followed), 1);
}

/// A debug file's own link to a supplementary file (dwz's `.gnu_debugaltlink`) is
/// resolved by build id in the debug directories too, and counted; when what is there
/// cannot be read, the debug file's DWARF is not read (its symbol table still names).
#[test]
fn a_debug_file_s_supplementary_file_that_cannot_be_read_leaves_its_dwarf_unread() {
    let dir = std::env::temp_dir().join(format!("firn-alt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (bin, by_id) = with_separate_debug_file(&dir);
    let alt_id = [0xa1u8; 20];
    let section = dir.join("altlink");
    let mut data = b"/usr/lib/debug/.dwz/none.debug\0".to_vec();
    data.extend_from_slice(&alt_id);
    std::fs::write(&section, data).unwrap();
    let plain = dir.join("plain.debug");
    std::fs::rename(&by_id, &plain).unwrap();
    let arg = format!(".gnu_debugaltlink={}", section.display());
    let ok = std::process::Command::new("objcopy")
        .args([
            "--add-section".as_ref(),
            arg.as_ref(),
            plain.as_os_str(),
            by_id.as_os_str(),
        ])
        .status()
        .expect("objcopy (binutils)");
    assert!(ok.success());
    let alt = dir.join(format!("debug/.build-id/a1/{}.debug", hex(&alt_id[1..])));
    std::fs::create_dir_all(alt.parent().unwrap()).unwrap();
    nix::unistd::mkfifo(&alt, nix::sys::stat::Mode::S_IRWXU).unwrap();
    marker_function();
    let off = own_offset(marker_function as *const () as usize);
    let metrics = Arc::new(Metrics::default());
    let limits = Limits {
        budget_bytes: u64::MAX >> 1,
        ..Limits::default()
    };
    let debug_dir = dir.join("debug");
    let m = metrics.clone();
    let (lines, held) = unless_it_hangs(move || {
        let mut sym = Symbolizer::new(limits, m).with_debug_dirs(&[&debug_dir]);
        let id = sym.load(std::fs::File::open(&bin).unwrap().into()).unwrap();
        (sym.symbolize(&id, &[off]).remove(0), sym.bytes_held())
    });
    let lines = lines.expect("named");
    let facts = |p: &std::path::Path| elf_facts(std::fs::File::open(p).unwrap()).unwrap();
    let symbols = facts(&dir.join("split")).sym_bytes + facts(&by_id).sym_bytes;
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        lines.iter().any(|l| l.function.contains("marker_function")),
        "{lines:?}"
    );
    assert!(
        lines.iter().all(|l| l.file.is_empty()),
        "no file:line without DWARF: {lines:?}"
    );
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(n(&metrics.debug_links_not_followed), 1);
    assert_eq!(held, symbols, "symbol tables only are held");
}

/// A binary whose symbol tables claim a gigabyte is not parsed at all (a parse would
/// hold a third of that on the heap, every round that met one of its frames).
#[test]
fn symbol_tables_over_the_ceiling_are_not_parsed() {
    use object::read::elf::FileHeader;
    let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    let header = object::elf::FileHeader64::<object::Endianness>::parse(&*me).unwrap();
    let endian = header.endian().unwrap();
    let sections = header.sections(endian, &*me).unwrap();
    let (index, _) = sections
        .iter()
        .enumerate()
        .find(|(_, s)| sections.section_name(endian, s) == Ok(&b".symtab"[..]))
        .expect("this test binary has a .symtab");
    // Elf64_Shdr: sh_size at byte 32 of 64.
    let at = usize::try_from(header.e_shoff(endian)).unwrap() + index * 64 + 32;
    let mut huge = me.clone();
    huge[at..at + 8].copy_from_slice(&(1u64 << 30).to_le_bytes());
    let path = std::env::temp_dir().join(format!("firn-huge-{}", std::process::id()));
    std::fs::write(&path, &huge).unwrap();
    let metrics = Arc::new(Metrics::default());
    let mut sym = Symbolizer::new(Limits::default(), metrics.clone());
    let id = sym
        .load(std::fs::File::open(&path).unwrap().into())
        .unwrap();
    let _ = std::fs::remove_file(&path);
    marker_function();
    let off = own_offset(marker_function as *const () as usize);
    assert_eq!(sym.symbolize(&id, &[off]), vec![None]);
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(n(&metrics.binaries_over_symbol_ceiling), 1);
    assert_eq!(n(&metrics.symbolize_ns), 0, "nothing parsed");
    assert_eq!(sym.bytes_held(), 0);
}

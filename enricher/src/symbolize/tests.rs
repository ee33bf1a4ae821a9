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
pub(super) fn own_offset(addr: usize) -> u64 {
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
pub(super) fn marker_function() -> u64 {
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

/// A symbolizer with room for this test binary's parse or libc's, not both; this
/// binary's parsed first (its marker's lines), both loaded.
struct RoomForOne {
    lines: Option<Lines>,
    sym: Symbolizer,
    metrics: Arc<Metrics>,
    own: u64,
    theirs: u64,
    me: BinaryId,
    libc: BinaryId,
}

fn room_for_one() -> RoomForOne {
    let libc = "/usr/lib/x86_64-linux-gnu/libc.so.6";
    let open = |p: &str| std::fs::File::open(p).unwrap().into();
    let (_, mut sym, _) = symbolize_self(u64::MAX);
    let own = sym.bytes_held();
    let id = sym.load(open(libc)).unwrap();
    sym.symbolize(&id, &[0x30000]);
    let theirs = sym.bytes_held() - own;
    let (lines, mut sym, metrics) = symbolize_self(own.max(theirs));
    let me = sym.load(open("/proc/self/exe")).unwrap();
    let libc = sym.load(open(libc)).unwrap();
    RoomForOne {
        lines,
        sym,
        metrics,
        own,
        theirs,
        me,
        libc,
    }
}

/// Two parses that do not fit the budget together, each needed every round (new
/// frames in both): one stays held and the other is made for the round and not kept,
/// instead of each dropping the other every round.
#[test]
fn parses_that_do_not_fit_together_do_not_push_each_other_out_every_round() {
    const ROUNDS: u64 = 8;
    let RoomForOne {
        mut sym,
        metrics,
        own,
        theirs,
        me,
        libc,
        ..
    } = room_for_one();
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

/// A parse never made is priced at what those made cost a byte: with that rate made
/// low, libc's first parse is worth less than this binary's and is made for the round,
/// where unpriced it was let in and pushed this binary's parse out.
#[test]
fn a_first_parse_is_priced_at_the_rate_of_those_made() {
    let RoomForOne {
        mut sym,
        metrics,
        me,
        libc,
        ..
    } = room_for_one();
    sym.rate = super::Rate::default();
    sym.rate.add(1, u64::MAX >> 8);
    sym.symbolize(&libc, &[0x30000]);
    assert!(sym.binaries.peek(&libc).is_some_and(|b| b.parsed.is_none()));
    assert!(sym.binaries.peek(&me).is_some_and(|b| b.parsed.is_some()));
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(n(&metrics.symbol_parses_not_kept), 1);
    assert_eq!(n(&metrics.symbol_parses_dropped), 0);
}

/// A held parse whose binary is asked every round is needed, even when its frames are
/// all cached: it does not age out under another binary asked with new frames, and is
/// not made again when it meets a new frame later (an idle node's libc beside an
/// interpreter sampled now and then: a reparse of libc every few minutes).
#[test]
fn a_parse_asked_for_cached_frames_does_not_age_out() {
    const ROUNDS: u64 = 12;
    let RoomForOne {
        mut sym,
        metrics,
        own,
        theirs,
        me,
        libc,
        ..
    } = room_for_one();
    let mine = own_offset(marker_function as *const () as usize);
    // Pinned parse times, as in the test above: libc's three times dearer a byte.
    let ns_of = |id: &BinaryId| if *id == libc { 3 * theirs } else { own };
    let pin = |sym: &mut Symbolizer| {
        let floor = sym.floor;
        for id in [&me, &libc] {
            if let Some(b) = sym.binaries.peek_mut(id) {
                if b.parse_ns.is_some_and(|ns| ns != ns_of(id)) {
                    // Just parsed: credited as its pinned time would have it.
                    b.parse_ns = Some(ns_of(id));
                    if b.parsed.is_some() {
                        b.credit = floor.credit(ns_of(id), b.cost);
                    }
                }
            }
        }
    };
    sym.symbolize(&libc, &[0x30000]);
    pin(&mut sym);
    assert!(sym.binaries.peek(&libc).is_some_and(|b| b.parsed.is_some()));
    for round in 1..=ROUNDS {
        // libc: its cached frame every round, a new one now and then.
        let mut offsets = vec![0x30000];
        if round % 4 == 0 {
            offsets.push(0x30000 + round * 0x1000);
        }
        sym.symbolize(&libc, &offsets);
        pin(&mut sym);
        sym.symbolize(&me, &[mine + round * 16]);
        pin(&mut sym);
    }
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(n(&metrics.symbol_reparses), 0, "libc made again");
    assert!(sym.binaries.peek(&libc).is_some_and(|b| b.parsed.is_some()));
    assert_eq!(n(&metrics.symbol_parses_not_kept), ROUNDS);
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

/// A parse that is not kept (worth less than the held one it would push out) reads no
/// DWARF: made whole it would sit on a full budget. Its frames are named from the
/// symbol table for the round and not cached, and the time of the whole parse stays
/// what its credit is made of.
#[test]
fn a_parse_not_kept_is_made_from_the_symbol_tables_and_not_cached() {
    // This binary first, then libc (a newcomer, let in).
    let RoomForOne {
        lines,
        mut sym,
        metrics,
        me,
        libc,
        ..
    } = room_for_one();
    assert!(lines.is_some_and(|l| l.iter().any(|l| !l.file.is_empty())));
    sym.symbolize(&libc, &[0x30000]);
    // This binary's whole parse made cheap: worth less than libc's.
    sym.binaries.peek_mut(&me).unwrap().parse_ns = Some(1);
    let frames = sym.frames_cached();
    let off = own_offset(marker_function as *const () as usize) + 1;
    for _ in 0..2 {
        let lines = sym.symbolize(&me, &[off]).remove(0).expect("named");
        assert!(lines.iter().any(|l| l.function.contains("marker_function")));
        assert!(lines.iter().all(|l| l.file.is_empty()), "{lines:?}");
    }
    let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        n(&metrics.symbol_parses_lean),
        2,
        "not cached: parsed each time"
    );
    // Read through a small buffer, not parsed by blazesym.
    assert_eq!(n(&metrics.symbol_table_scans), 2);
    assert_eq!(sym.frames_cached(), frames);
    assert_eq!(sym.binaries.peek(&me).unwrap().parse_ns, Some(1));
    assert!(sym.binaries.peek(&libc).unwrap().parsed.is_some());
}

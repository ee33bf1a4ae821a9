//! What the symbolizer reads of a file, and what it refuses to: separate debug
//! files, links to other files, files that changed or may change, huge tables.

use super::tests::{marker_function, own_offset};
use super::*;

/// A copy of this test binary whose DWARF is in a separate file: named by its
/// `.gnu_debuglink` next to it (one section kept, so it has DWARF of its own too), and
/// returned as the debug directory `dir/debug` holds it by build id.
fn with_separate_debug_file(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
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
    assert_eq!(n(&metrics.symbol_parses_dropped), 1);
    assert!(!mapped(), "the dropped parse's debug file is still mapped");
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
    assert_eq!(n(&metrics.debug_files_refused), 1);
    // Counted only for DWARF of its own left unread (this one has no .debug_info,
    // like a distro binary whose debug package is not installed).
    assert_eq!(n(&metrics.debug_links_not_followed), 0);
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
    assert_eq!(n(&metrics.binaries_over_symbol_ceiling), 1);
    assert_eq!(n(&metrics.symbolize_ns), 0, "nothing parsed");
    assert_eq!(sym.bytes_held(), 0);
}

/// A copy of this test binary in `dir`, under `name`.
fn copy_of_me(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::copy(std::env::current_exe().unwrap(), &path).unwrap();
    path
}

fn symbolizer(metrics: &Arc<Metrics>) -> Symbolizer {
    let limits = Limits {
        budget_bytes: u64::MAX >> 1,
        ..Limits::default()
    };
    Symbolizer::new(limits, metrics.clone())
}

fn n(c: &std::sync::atomic::AtomicU64) -> u64 {
    c.load(std::sync::atomic::Ordering::Relaxed)
}

/// DWARF is read from a binary only root may write: blazesym maps the file again at
/// each parse, and a link written into it after its headers were read would be
/// followed. A world-writable copy is named from its symbol table only; a copy
/// written to after its load is not parsed at all.
#[test]
fn a_binary_others_may_write_gives_names_without_its_dwarf_and_one_written_to_none() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("firn-writable-{}", std::process::id()));
    let writable = copy_of_me(&dir, "writable");
    std::fs::set_permissions(&writable, std::fs::Permissions::from_mode(0o777)).unwrap();
    marker_function();
    let off = own_offset(marker_function as *const () as usize);
    let metrics = Arc::new(Metrics::default());
    let mut sym = symbolizer(&metrics);
    let id = sym
        .load(std::fs::File::open(&writable).unwrap().into())
        .unwrap();
    let lines = sym.symbolize(&id, &[off]).remove(0).expect("named");
    assert!(
        lines.iter().any(|l| l.function.contains("marker_function")),
        "{lines:?}"
    );
    assert!(
        lines.iter().all(|l| l.file.is_empty()),
        "no file:line: {lines:?}"
    );
    assert_eq!(n(&metrics.dwarf_not_read_writable), 1);

    let changed = copy_of_me(&dir, "changed");
    let mut sym = symbolizer(&metrics);
    let id = sym
        .load(std::fs::File::open(&changed).unwrap().into())
        .unwrap();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&changed)
        .unwrap();
    std::io::Write::write_all(&mut f, b"more").unwrap();
    assert_eq!(sym.symbolize(&id, &[off]), vec![None]);
    assert_eq!(n(&metrics.binaries_changed_after_load), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A file in the other byte order is read differently by blazesym (which reads every
/// ELF in this machine's order) and by the header reader: its headers are not
/// trusted, so its DWARF is not read.
#[test]
fn a_binary_in_the_other_byte_order_is_not_read_for_dwarf() {
    let dir = std::env::temp_dir().join(format!("firn-endian-{}", std::process::id()));
    let path = copy_of_me(&dir, "big-endian");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[5] = 2; // EI_DATA: ELFDATA2MSB
    std::fs::write(&path, &bytes).unwrap();
    assert!(super::elf_facts(std::fs::File::open(&path).unwrap()).is_none());
    let metrics = Arc::new(Metrics::default());
    let mut sym = symbolizer(&metrics);
    marker_function();
    let off = own_offset(marker_function as *const () as usize);
    if let Ok(id) = sym.load(std::fs::File::open(&path).unwrap().into()) {
        let lines = sym.symbolize(&id, &[off]).remove(0);
        assert!(
            lines
                .iter()
                .flat_map(|l| l.iter())
                .all(|l| l.file.is_empty()),
            "no file:line: {lines:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A binary stripped of its DWARF and naming no debug file still gets file:line from
/// its debug file under the debug directories, by build id (as gdb and perf find it).
#[test]
fn a_stripped_binary_without_a_link_finds_its_debug_file_by_build_id() {
    let dir = std::env::temp_dir().join(format!("firn-byid-{}", std::process::id()));
    let (split, _) = with_separate_debug_file(&dir);
    let bare = dir.join("bare");
    let ok = std::process::Command::new("objcopy")
        .args([
            "--remove-section=.gnu_debuglink".as_ref(),
            "--remove-section=.debug_abbrev".as_ref(),
            split.as_os_str(),
            bare.as_os_str(),
        ])
        .status()
        .expect("objcopy (binutils)");
    assert!(ok.success());
    let facts = super::elf_facts(std::fs::File::open(&bare).unwrap()).unwrap();
    assert!(!facts.links() && !facts.debug_info, "{facts:?}");
    marker_function();
    let off = own_offset(marker_function as *const () as usize);
    let metrics = Arc::new(Metrics::default());
    let debug_dir = dir.join("debug");
    let mut sym = symbolizer(&metrics).with_debug_dirs(&[&debug_dir]);
    let id = sym
        .load(std::fs::File::open(&bare).unwrap().into())
        .unwrap();
    let lines = sym.symbolize(&id, &[off]).remove(0).expect("named");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        lines.iter().any(|l| l.file.ends_with("tests.rs")),
        "file:line from the debug file: {lines:?}"
    );
}

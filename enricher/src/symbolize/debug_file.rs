//! Separate debug files: found by the binary's build id in the debug directories,
//! opened by us, read by blazesym by address.
//!
//! A binary's links to its DWARF (`.gnu_debuglink`, `.gnu_debugaltlink`, `.debug_sup`)
//! are its author's to write, and the paths they name any local user's: blazesym
//! follows them by path, so a FIFO there blocked the enricher's round (opening a FIFO
//! waits for a writer) and a file there could hold any amount of DWARF, uncounted in
//! the budget. So blazesym never reads a binary's DWARF when the binary has links, nor
//! when someone other than root may write the file (a link written after we read its
//! headers would be followed); its debug file is looked up here by build id only,
//! under directories root writes (`/usr/lib/debug`), as gdb and perf look them up.
//! That file's own links (dwz's supplementary file) are then resolved from those
//! directories, and counted.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolizer};

use super::contained;
use super::elf::{address_of, elf_facts, hex, owned_lines, ElfFacts, Segment};
use super::symtab::Tables;
use crate::metrics::Metrics;
use crate::model::Lines;

/// A binary's separate debug file, held open while the binary is cached; blazesym
/// reads it as `/proc/self/fd/N`.
pub(super) struct DebugFile {
    owned: OwnedFd,
    path: PathBuf,
    /// The binary's segments: frames are file offsets in the binary, and the debug
    /// file's segments have no file bytes to find them in.
    loads: Vec<Segment>,
    /// Where its symbol tables lie (a 64-bit file).
    pub(super) tables: Option<Tables>,
}

impl DebugFile {
    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.owned.as_fd()
    }
}

/// A debug file found, with what its parse would hold.
struct Opened {
    file: DebugFile,
    /// Its DWARF with its supplementary file's; 0 when a link of its own could not be
    /// sized (then only its symbol table is read).
    debug_bytes: u64,
    sym_bytes: u64,
}

enum Found {
    File(std::fs::File, ElfFacts),
    /// Something that is not a regular ELF file is there: not read.
    Refused,
    Nothing,
}

/// The file at `.build-id/xx/rest.debug` under the first of `dirs` that has one.
fn find(dirs: &[PathBuf], build_id: &[u8]) -> Found {
    use std::os::unix::fs::OpenOptionsExt;
    // blazesym's rule too: shorter ids are bogus.
    if build_id.len() < 8 {
        return Found::Nothing;
    }
    let name = format!(
        ".build-id/{:02x}/{}.debug",
        build_id[0],
        hex(&build_id[1..])
    );
    for dir in dirs {
        // Non-blocking: opening a FIFO would wait for a writer.
        let Ok(file) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY)
            .open(dir.join(&name))
        else {
            continue;
        };
        if !file.metadata().is_ok_and(|m| m.is_file()) {
            return Found::Refused;
        }
        return match file
            .try_clone()
            .ok()
            .and_then(|f| contained(|| elf_facts(f)).flatten())
        {
            Some(facts) => Found::File(file, facts),
            None => Found::Refused,
        };
    }
    Found::Nothing
}

/// The separate debug file of the binary with `build_id` and segments `loads`.
fn open(dirs: &[PathBuf], build_id: &[u8], loads: &[Segment], metrics: &Metrics) -> Option<Opened> {
    let (file, facts) = match find(dirs, build_id) {
        Found::File(file, facts) => (file, facts),
        Found::Refused => {
            Metrics::inc(&metrics.debug_files_refused);
            tracing::info!(
                build_id = hex(build_id),
                "the debug file for this build id is not a regular ELF file: not read"
            );
            return None;
        }
        Found::Nothing => return None,
    };
    let linked = match (&facts.alt_link, facts.debug_link) {
        (_, true) => None,
        (None, false) => Some(0),
        (Some(alt), false) => match find(dirs, alt) {
            Found::File(_, f) => Some(f.debug_bytes),
            _ => None,
        },
    };
    if linked.is_none() {
        Metrics::inc(&metrics.debug_links_not_followed);
    }
    let fd = OwnedFd::from(file);
    Some(Opened {
        file: DebugFile {
            path: PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())),
            owned: fd,
            loads: loads.to_vec(),
            tables: facts.tables,
        },
        debug_bytes: linked.map_or(0, |l| facts.debug_bytes.saturating_add(l)),
        sym_bytes: facts.sym_bytes,
    })
}

/// What a binary's parse reads, and its size in the budget's bytes.
pub(super) struct Plan {
    pub(super) debug: Option<DebugFile>,
    /// Symbol tables: the binary's and its debug file's.
    pub(super) sym_bytes: u64,
    /// DWARF: its debug file's (with its supplementary file's), else its own if that
    /// may be read, else 0.
    pub(super) debug_bytes: u64,
}

/// A binary's own DWARF is read only when it has no links and only root can change
/// it: blazesym maps the file again at each parse, and a link written into it after
/// we read its headers would be followed. Its debug file by build id is looked up
/// when its own DWARF is not read, unless that file's symbol tables would put the
/// parse over `ceiling`.
pub(super) fn plan(
    dirs: &[PathBuf],
    build_id: Option<&[u8]>,
    facts: Option<&ElfFacts>,
    st: &nix::sys::stat::FileStat,
    ceiling: u64,
    metrics: &Metrics,
) -> Plan {
    // A file whose headers we cannot read may still be parsed by blazesym: its
    // whole size stands for what the parse may hold, and its DWARF is not read.
    let Some(facts) = facts else {
        return Plan {
            debug: None,
            sym_bytes: u64::try_from(st.st_size).unwrap_or(u64::MAX),
            debug_bytes: 0,
        };
    };
    let root_only = st.st_uid == 0 && st.st_mode & 0o022 == 0;
    let own = facts.debug_info && root_only && !facts.links();
    let debug = match build_id {
        Some(b) if !own => open(dirs, b, &facts.loads, metrics)
            .filter(|d| facts.sym_bytes.saturating_add(d.sym_bytes) <= ceiling),
        _ => None,
    };
    if debug.is_none() && !own && facts.debug_info {
        Metrics::inc(if facts.links() {
            &metrics.debug_links_not_followed
        } else {
            &metrics.dwarf_not_read_writable
        });
    }
    match debug {
        Some(d) => Plan {
            sym_bytes: facts.sym_bytes.saturating_add(d.sym_bytes),
            debug_bytes: d.debug_bytes,
            debug: Some(d.file),
        },
        None => Plan {
            debug: None,
            sym_bytes: facts.sym_bytes,
            debug_bytes: if own { facts.debug_bytes } else { 0 },
        },
    }
}

pub(super) type Looked = Result<Vec<Option<Lines>>, blazesym::Error>;

/// Names for `misses`, file offsets in the binary at `bin`: from its debug file by
/// address when it has one, what that does not name from the binary's own symbols.
/// `dwarf`: read DWARF (the debug file's, else the binary's own).
pub(super) fn lookup(
    parsed: &Symbolizer,
    bin: &Path,
    dwarf: bool,
    debug: Option<&DebugFile>,
    misses: &[u64],
) -> Looked {
    let own = |offsets: &[u64], debug_syms: bool| -> Looked {
        let mut elf = Elf::new(bin);
        elf.debug_syms = debug_syms;
        let r = parsed.symbolize(&Source::Elf(elf), Input::FileOffset(offsets))?;
        Ok(r.into_iter().map(owned_lines).collect())
    };
    let Some(debug) = debug else {
        return own(misses, dwarf);
    };
    let mut out = vec![None; misses.len()];
    let (at, addresses): (Vec<usize>, Vec<u64>) = misses
        .iter()
        .enumerate()
        .filter_map(|(i, &o)| Some((i, address_of(&debug.loads, o)?)))
        .unzip();
    if !addresses.is_empty() {
        let mut elf = Elf::new(&debug.path);
        elf.debug_syms = dwarf;
        match parsed.symbolize(&Source::Elf(elf), Input::VirtOffset(&addresses)) {
            Ok(r) => {
                for (i, s) in at.into_iter().zip(r) {
                    out[i] = owned_lines(s);
                }
            }
            // The binary's own symbols still name what they can.
            Err(e) => tracing::debug!(error = %e, "the separate debug file could not be read"),
        }
    }
    let rest: Vec<usize> = (0..misses.len()).filter(|&i| out[i].is_none()).collect();
    if !rest.is_empty() {
        let offsets: Vec<u64> = rest.iter().map(|&i| misses[i]).collect();
        for (i, lines) in rest.into_iter().zip(own(&offsets, false)?) {
            out[i] = lines;
        }
    }
    Ok(out)
}

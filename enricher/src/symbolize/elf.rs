//! What the symbolizer reads of a binary besides blazesym's answers: section sizes,
//! whether it has a symbol table and links to other files' DWARF, and its segments
//! (from the headers alone), and blazesym's symbols turned into pprof lines.

use std::sync::Arc;

use blazesym::symbolize::{CodeInfo, Sym, Symbolized};
use object::read::ReadCache;

use super::symtab::{Table, Tables};
use crate::model::{Line, Lines};

pub(super) fn owned_lines(r: Symbolized<'_>) -> Option<Lines> {
    match r {
        Symbolized::Sym(sym) => Some(lines_of(&sym)),
        Symbolized::Unknown(_) => None,
    }
}

#[derive(Debug, Clone, Default)]
pub(super) struct ElfFacts {
    /// Has a `.symtab` section.
    pub(super) symtab: bool,
    /// Uncompressed size of its DWARF sections (`.debug_*`, `.zdebug_*`).
    pub(super) debug_bytes: u64,
    /// Has `.debug_info`: DWARF worth reading (a Rust binary stripped of it keeps
    /// `.debug_gdb_scripts`).
    pub(super) debug_info: bool,
    /// Size of its symbol and string tables (`.symtab`, `.strtab`, `.dynsym`, `.dynstr`).
    pub(super) sym_bytes: u64,
    /// Names another file by path for its DWARF (`.gnu_debuglink`, `.debug_sup`).
    pub(super) debug_link: bool,
    /// `.gnu_debugaltlink`: the build id of the supplementary DWARF file it names
    /// (empty when the section cannot be read).
    pub(super) alt_link: Option<Vec<u8>>,
    /// Its `PT_LOAD` segments, to turn file offsets into addresses.
    pub(super) loads: Vec<Segment>,
    /// Where its symbol tables lie, for a 64-bit file ([`super::symtab`]).
    pub(super) tables: Option<Tables>,
}

impl ElfFacts {
    /// Whether blazesym, asked for its DWARF, would open other files by path.
    pub(super) fn links(&self) -> bool {
        self.debug_link || self.alt_link.is_some()
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Segment {
    pub(super) offset: u64,
    pub(super) size: u64,
    pub(super) address: u64,
}

/// The address a file offset is loaded at, as blazesym finds it for a file offset
/// (the first `PT_LOAD` whose file bytes hold it).
pub(super) fn address_of(loads: &[Segment], offset: u64) -> Option<u64> {
    loads.iter().find_map(|s| {
        (offset >= s.offset && offset - s.offset < s.size).then(|| offset - s.offset + s.address)
    })
}

/// A path (PATH_MAX) and a build id: a longer `.gnu_debugaltlink` is not read.
const ALT_LINK_MAX: u64 = 4096 + 1 + 64;

/// Reads only the ELF, program and section headers and the link sections (through a
/// read cache, never the whole file: `object`'s `ElfFile` would read every symbol
/// table, 26 MiB of rustc's libLLVM, for a load that wants their sizes).
pub(super) fn elf_facts(file: std::fs::File) -> Option<ElfFacts> {
    use object::elf::{FileHeader32, FileHeader64, PT_LOAD};
    use object::read::elf::{CompressionHeader, FileHeader, ProgramHeader, SectionHeader};
    use object::{Endianness, ReadRef};
    fn of<'a, E: FileHeader<Endian = Endianness>, R: ReadRef<'a>>(data: R) -> Option<ElfFacts> {
        let header = E::parse(data).ok()?;
        let endian = header.endian().ok()?;
        // blazesym reads every ELF in this machine's byte order, whatever its header
        // says: a file in the other order is read two ways, and the section names one
        // parser sees are not the other's.
        if endian != Endianness::default() {
            return None;
        }
        let sections = header.sections(endian, data).ok()?;
        let mut facts = ElfFacts::default();
        let (mut seen, mut ranges) = ([false; 4], [None; 4]);
        let mut minidebuginfo = false;
        for s in sections.iter() {
            // A name we cannot read might be a link blazesym can: taken as one.
            let Ok(name) = sections.section_name(endian, s) else {
                facts.debug_link = true;
                continue;
            };
            let size: u64 = s.sh_size(endian).into();
            match name {
                b".symtab" | b".strtab" | b".dynsym" | b".dynstr" => {
                    facts.symtab |= name == b".symtab";
                    facts.sym_bytes = facts.sym_bytes.saturating_add(size);
                    // The first of each name, as blazesym takes them (string tables
                    // by name too, not by link); no file bytes, no table.
                    let i = [b".symtab", b".strtab", b".dynsym", b".dynstr"]
                        .iter()
                        .position(|n| &n[..] == name)
                        .unwrap_or(0);
                    if !seen[i] {
                        seen[i] = true;
                        ranges[i] = s.file_range(endian);
                    }
                }
                // MiniDebugInfo: blazesym reads an xz-compressed symbol table; the scan
                // does not.
                b".gnu_debugdata" => minidebuginfo = true,
                b".gnu_debuglink" | b".debug_sup" => facts.debug_link = true,
                b".gnu_debugaltlink" => {
                    // A path, NUL, then the build id; read at most that much.
                    let bytes = s
                        .file_range(endian)
                        .filter(|&(_, size)| size <= ALT_LINK_MAX)
                        .and_then(|(at, size)| data.read_bytes_at(at, size).ok())
                        .unwrap_or_default();
                    let id = bytes
                        .iter()
                        .position(|&b| b == 0)
                        .map_or(&[][..], |n| &bytes[n + 1..]);
                    facts.alt_link = Some(id.to_vec());
                }
                n if n.starts_with(b".debug_") || n.starts_with(b".zdebug_") => {
                    facts.debug_info |= matches!(n, b".debug_info" | b".zdebug_info");
                    let inflated = match s.compression(endian, data) {
                        Ok(Some((ch, _, _))) => Some(ch.ch_size(endian).into()),
                        // GNU style: "ZLIB" and the size, big-endian.
                        _ if n.starts_with(b".zdebug_") => s
                            .file_range(endian)
                            .and_then(|(at, _)| data.read_bytes_at(at, 12).ok())
                            .filter(|h| h.starts_with(b"ZLIB"))
                            .and_then(|h| h[4..].try_into().ok())
                            .map(u64::from_be_bytes),
                        _ => None,
                    };
                    facts.debug_bytes = facts.debug_bytes.saturating_add(inflated.unwrap_or(size));
                }
                _ => {}
            }
        }
        facts.loads = header
            .program_headers(endian, data)
            .ok()?
            .iter()
            .filter(|p| p.p_type(endian) == PT_LOAD)
            .map(|p| Segment {
                offset: p.p_offset(endian).into(),
                size: p.p_filesz(endian).into(),
                address: p.p_vaddr(endian).into(),
            })
            .collect();
        let table = |syms: Option<(u64, u64)>, strs| {
            Some(Table {
                syms: syms?,
                strs: strs?,
            })
        };
        facts.tables = (header.is_type_64() && !minidebuginfo).then(|| Tables {
            symtab: table(ranges[0], ranges[1]),
            dynsym: table(ranges[2], ranges[3]),
        });
        Some(facts)
    }
    let cache = ReadCache::new(file);
    match object::FileKind::parse(&cache).ok()? {
        object::FileKind::Elf64 => of::<FileHeader64<Endianness>, _>(&cache),
        object::FileKind::Elf32 => of::<FileHeader32<Endianness>, _>(&cache),
        _ => None,
    }
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub(super) fn file_of(ci: Option<&CodeInfo<'_>>) -> (Arc<str>, u32) {
    match ci {
        Some(ci) => (
            Arc::from(ci.to_path().to_string_lossy().as_ref()),
            ci.line.unwrap_or(0),
        ),
        None => (Arc::from(""), 0),
    }
}

/// blazesym reports the function, its code position, and the inlined calls from the
/// outermost to the innermost, each with the position of its call site. pprof wants
/// the innermost first: each inlined function at the position of the next call (or,
/// for the innermost, of the instruction), the real function last.
pub(super) fn lines_of(sym: &Sym<'_>) -> Lines {
    let mut lines = Vec::with_capacity(sym.inlined.len() + 1);
    let mut position = file_of(sym.code_info.as_deref());
    for inl in sym.inlined.iter().rev() {
        lines.push(Line {
            function: Arc::from(inl.name.as_ref()),
            file: position.0.clone(),
            line: position.1,
        });
        position = file_of(inl.code_info.as_ref());
    }
    lines.push(Line {
        function: Arc::from(sym.name.as_ref()),
        file: position.0,
        line: position.1,
    });
    lines.into()
}

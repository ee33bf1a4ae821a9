//! What the symbolizer reads of a binary besides blazesym's answers: section sizes,
//! whether it has a symbol table and links to other files' DWARF, and its segments
//! (from the headers alone), and blazesym's symbols turned into pprof lines.

use std::sync::Arc;

use blazesym::symbolize::{CodeInfo, Sym, Symbolized};

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
    /// Size of its symbol and string tables (`.symtab`, `.strtab`, `.dynsym`, `.dynstr`).
    pub(super) sym_bytes: u64,
    /// Names another file by path for its DWARF (`.gnu_debuglink`, `.debug_sup`).
    pub(super) debug_link: bool,
    /// `.gnu_debugaltlink`: the build id of the supplementary DWARF file it names
    /// (empty when the section cannot be read).
    pub(super) alt_link: Option<Vec<u8>>,
    /// Its `PT_LOAD` segments, to turn file offsets into addresses.
    pub(super) loads: Vec<Segment>,
}

impl ElfFacts {
    /// Whether blazesym, asked for its DWARF, would open other files by path.
    pub(super) fn links(&self) -> bool {
        self.debug_link || self.alt_link.is_some()
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Segment {
    offset: u64,
    size: u64,
    address: u64,
}

/// The address a file offset is loaded at, as blazesym finds it for a file offset
/// (the first `PT_LOAD` whose file bytes hold it).
pub(super) fn address_of(loads: &[Segment], offset: u64) -> Option<u64> {
    loads.iter().find_map(|s| {
        (offset >= s.offset && offset - s.offset < s.size).then(|| offset - s.offset + s.address)
    })
}

/// Reads only the ELF, program and section headers and the link sections (through a
/// read cache, never the whole file).
pub(super) fn elf_facts(file: std::fs::File) -> Option<ElfFacts> {
    use object::read::elf::{ElfFile32, ElfFile64};
    use object::read::{Object, ObjectSection, ObjectSegment, ReadCache};
    fn of<'a, O: Object<'a>>(o: &O) -> ElfFacts {
        let mut facts = ElfFacts::default();
        for s in o.sections() {
            // A name we cannot read might be a link blazesym can: taken as one.
            let Ok(name) = s.name() else {
                facts.debug_link = true;
                continue;
            };
            if matches!(name, ".symtab" | ".strtab" | ".dynsym" | ".dynstr") {
                facts.symtab |= name == ".symtab";
                facts.sym_bytes = facts.sym_bytes.saturating_add(s.size());
            } else if matches!(name, ".gnu_debuglink" | ".debug_sup") {
                facts.debug_link = true;
            } else if name == ".gnu_debugaltlink" {
                // A path, NUL, then the build id.
                let data = s.data().unwrap_or_default();
                let id = data
                    .iter()
                    .position(|&b| b == 0)
                    .map_or(&[][..], |n| &data[n + 1..]);
                facts.alt_link = Some(id.to_vec());
            } else if name.starts_with(".debug_") || name.starts_with(".zdebug_") {
                let size = s
                    .compressed_file_range()
                    .map_or(s.size(), |r| r.uncompressed_size);
                facts.debug_bytes = facts.debug_bytes.saturating_add(size);
            }
        }
        facts.loads = o
            .segments()
            .map(|s| {
                let (offset, size) = s.file_range();
                Segment {
                    offset,
                    size,
                    address: s.address(),
                }
            })
            .collect();
        facts
    }
    let cache = ReadCache::new(file);
    match object::FileKind::parse(&cache).ok()? {
        object::FileKind::Elf64 => {
            Some(of(&ElfFile64::<object::Endianness, _>::parse(&cache).ok()?))
        }
        object::FileKind::Elf32 => {
            Some(of(&ElfFile32::<object::Endianness, _>::parse(&cache).ok()?))
        }
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

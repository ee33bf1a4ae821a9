//! What the symbolizer reads of a binary besides blazesym's answers: section sizes and
//! whether it has a symbol table (from the headers alone), its separate debug file's
//! size, and blazesym's symbols turned into pprof lines.

use std::sync::Arc;

use blazesym::symbolize::{CodeInfo, Sym, Symbolized};

use super::{contained, DEBUG_DIRS};
use crate::model::{Line, Lines};

pub(super) fn owned_lines(r: Symbolized<'_>) -> Option<Lines> {
    match r {
        Symbolized::Sym(sym) => Some(lines_of(&sym)),
        Symbolized::Unknown(_) => None,
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct ElfFacts {
    /// Has a `.symtab` section.
    pub(super) symtab: bool,
    /// Uncompressed size of its DWARF sections (`.debug_*`, `.zdebug_*`).
    pub(super) debug_bytes: u64,
    /// Size of its symbol and string tables (`.symtab`, `.strtab`, `.dynsym`, `.dynstr`).
    pub(super) sym_bytes: u64,
}

/// Reads only the ELF and section headers (through a read cache, never the whole file).
pub(super) fn elf_facts(file: std::fs::File) -> Option<ElfFacts> {
    use object::read::elf::{ElfFile32, ElfFile64};
    use object::read::{Object, ObjectSection, ReadCache};
    fn of<'a, O: Object<'a>>(o: &O) -> ElfFacts {
        let mut facts = ElfFacts {
            symtab: false,
            debug_bytes: 0,
            sym_bytes: 0,
        };
        for s in o.sections() {
            let name = s.name().unwrap_or_default();
            if matches!(name, ".symtab" | ".strtab" | ".dynsym" | ".dynstr") {
                facts.symtab |= name == ".symtab";
                facts.sym_bytes = facts.sym_bytes.saturating_add(s.size());
            } else if name.starts_with(".debug_") || name.starts_with(".zdebug_") {
                let size = s
                    .compressed_file_range()
                    .map_or(s.size(), |r| r.uncompressed_size);
                facts.debug_bytes = facts.debug_bytes.saturating_add(size);
            }
        }
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

/// DWARF bytes of the separate debug file blazesym would find for this build id.
pub(super) fn separate_debug_bytes(build_id: &[u8]) -> u64 {
    let [first, rest @ ..] = build_id else {
        return 0;
    };
    if rest.is_empty() {
        return 0;
    }
    let name = format!(".build-id/{first:02x}/{}.debug", hex(rest));
    DEBUG_DIRS
        .iter()
        .find_map(|d| std::fs::File::open(std::path::Path::new(d).join(&name)).ok())
        .and_then(|f| contained(|| elf_facts(f)).flatten())
        .map_or(0, |f| f.debug_bytes)
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

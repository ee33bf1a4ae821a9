//! Kernel symbol table from `/proc/kallsyms`, read while the sampler still holds
//! CAP_SYSLOG (the kernel decides at open time whether addresses are shown).
//! Only names ever leave the sampler; addresses stay here (DESIGN.md rule 3).

use std::fs::File;
use std::io::{BufRead, BufReader};

/// Farthest an address may lie past a symbol's start and still be given its name.
const MAX_SYMBOL_SPAN: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub(crate) enum KallsymsError {
    #[error("reading /proc/kallsyms: {0}")]
    Read(#[from] std::io::Error),
}

/// Marks a boundary symbol (a `__pfx_` padding area) that has no name of its own.
const NO_NAME: u32 = u32::MAX;

/// Sorted text symbols, stored compactly (the sampler's RSS budget is 8 MiB): a 32-bit
/// offset from the lowest address and a 32-bit name offset per symbol. `__pfx_` padding
/// symbols (half of a modern kernel's table) keep only their boundary, no name.
pub(crate) struct Kallsyms {
    base: u64,
    offsets: Vec<u32>,
    name_starts: Vec<u32>,
    names: Vec<u8>,
}

impl Kallsyms {
    /// An empty table: every kernel frame resolves to nothing.
    pub(crate) fn empty() -> Self {
        Self {
            base: 0,
            offsets: Vec::new(),
            name_starts: Vec::new(),
            names: Vec::new(),
        }
    }

    /// Streams the file line by line (it is several MiB of text; it is never held whole).
    pub(crate) fn read(file: File) -> Result<Self, KallsymsError> {
        let mut reader = BufReader::with_capacity(64 * 1024, file);
        let mut line = Vec::with_capacity(256);
        let mut b = Builder::default();
        loop {
            line.clear();
            if reader.read_until(b'\n', &mut line)? == 0 {
                break;
            }
            b.line(&line);
        }
        Ok(b.finish())
    }

    /// Parses `ADDR TYPE NAME[\t[module]]` lines, keeping text symbols. A table whose
    /// addresses are all zero (kptr_restrict, no CAP_SYSLOG) comes out empty.
    #[cfg(test)]
    pub(crate) fn parse(text: &[u8]) -> Self {
        let mut b = Builder::default();
        text.split(|&c| c == b'\n').for_each(|l| b.line(l));
        b.finish()
    }

    pub(crate) fn len(&self) -> usize {
        self.offsets.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// Index of the symbol containing `addr`, if any.
    pub(crate) fn lookup(&self, addr: u64) -> Option<u32> {
        let off = u32::try_from(addr.checked_sub(self.base)?).ok()?;
        let i = self.offsets.partition_point(|&a| a <= off).checked_sub(1)?;
        if u64::from(off - self.offsets[i]) > MAX_SYMBOL_SPAN || self.name_starts[i] == NO_NAME {
            return None;
        }
        u32::try_from(i).ok()
    }

    /// Name of the symbol at `index` (from [`Kallsyms::lookup`]).
    pub(crate) fn name(&self, index: u32) -> &[u8] {
        let i = index as usize;
        let start = self.name_starts[i] as usize;
        let end = self.names[start..]
            .iter()
            .position(|&c| c == 0)
            .map_or(self.names.len(), |e| start + e);
        &self.names[start..end]
    }
}

#[derive(Default)]
struct Builder {
    entries: Vec<(u64, u32)>,
    names: Vec<u8>,
}

impl Builder {
    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let mut fields = line.split(|&c| c == b' ');
        let (Some(addr), Some(kind), Some(rest)) = (fields.next(), fields.next(), fields.next())
        else {
            return;
        };
        if !matches!(kind, b"t" | b"T" | b"w" | b"W") {
            return;
        }
        let Some(addr) = std::str::from_utf8(addr)
            .ok()
            .and_then(|a| u64::from_str_radix(a, 16).ok())
            .filter(|&a| a != 0)
        else {
            return;
        };
        let name = rest.split(|&c| c == b'\t').next().unwrap_or(rest);
        if name.is_empty() || name.len() > firn_schema::limits::MAX_SYMBOL_BYTES as usize {
            return;
        }
        if name.starts_with(b"__pfx_") {
            self.entries.push((addr, NO_NAME));
            return;
        }
        let Ok(start) = u32::try_from(self.names.len()) else {
            return;
        };
        self.names.extend_from_slice(name);
        self.names.push(0);
        self.entries.push((addr, start));
    }

    fn finish(mut self) -> Kallsyms {
        self.entries.sort_unstable_by_key(|e| e.0);
        let base = self.entries.first().map_or(0, |e| e.0);
        // Kernel text and modules span well under 4 GiB; anything beyond is dropped.
        self.entries.retain(|e| e.0 - base <= u64::from(u32::MAX));
        let mut names = self.names;
        names.shrink_to_fit();
        Kallsyms {
            base,
            offsets: self.entries.iter().map(|e| (e.0 - base) as u32).collect(),
            name_starts: self.entries.iter().map(|e| e.1).collect(),
            names,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_inside_symbols_and_skips_data_and_zero_addresses() {
        let text = b"ffffffff81000000 T _stext\n\
ffffffff81000100 t do_thing\n\
ffffffff810001f0 t __pfx_next_fn\n\
ffffffff81000200 D some_data\n\
ffffffffc0001000 t mod_fn\t[kvm]\n\
0000000000000000 T hidden\n";
        let k = Kallsyms::parse(text);
        assert_eq!(k.len(), 4);
        assert_eq!(k.lookup(0xffffffff810001f4), None, "padding has no name");
        assert_eq!(k.name(k.lookup(0xffffffff81000150).unwrap()), b"do_thing");
        assert_eq!(k.name(k.lookup(0xffffffff81000000).unwrap()), b"_stext");
        assert_eq!(k.name(k.lookup(0xffffffffc0001004).unwrap()), b"mod_fn");
        assert_eq!(k.lookup(0xffffffff80000000), None);
        assert_eq!(k.lookup(0xffffffffc0001000 + (2 << 20)), None);
    }

    #[test]
    fn restricted_table_is_empty() {
        let k = Kallsyms::parse(b"0000000000000000 T _stext\n0000000000000000 t x\n");
        assert_eq!(k.len(), 0);
        assert_eq!(k.lookup(0xffffffff81000000), None);
    }
}

//! Kernel symbol table from `/proc/kallsyms`, read while the sampler still holds
//! CAP_SYSLOG (the kernel decides at open time whether addresses are shown).
//! Only names ever leave the sampler; addresses stay here (DESIGN.md rule 3).

use std::fs::File;
use std::io::Read;

/// Farthest an address may lie past a symbol's start and still be given its name.
const MAX_SYMBOL_SPAN: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum KallsymsError {
    #[error("reading /proc/kallsyms: {0}")]
    Read(#[from] std::io::Error),
}

/// Sorted text symbols, stored compactly: one address and one name offset each.
pub struct Kallsyms {
    addrs: Vec<u64>,
    name_starts: Vec<u32>,
    names: Vec<u8>,
}

impl Kallsyms {
    /// An empty table: every kernel frame resolves to nothing.
    pub fn empty() -> Self {
        Self {
            addrs: Vec::new(),
            name_starts: Vec::new(),
            names: Vec::new(),
        }
    }

    pub fn read(mut file: File) -> Result<Self, KallsymsError> {
        let mut text = Vec::with_capacity(8 << 20);
        file.read_to_end(&mut text)?;
        Ok(Self::parse(&text))
    }

    /// Parses `ADDR TYPE NAME[\t[module]]` lines, keeping text symbols. A table whose
    /// addresses are all zero (kptr_restrict, no CAP_SYSLOG) comes out empty.
    pub fn parse(text: &[u8]) -> Self {
        let mut entries: Vec<(u64, &[u8])> = Vec::new();
        for line in text.split(|&b| b == b'\n') {
            let mut fields = line.split(|&b| b == b' ');
            let (Some(addr), Some(kind), Some(rest)) = (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            if !matches!(kind, b"t" | b"T" | b"w" | b"W") {
                continue;
            }
            let Some(addr) = std::str::from_utf8(addr)
                .ok()
                .and_then(|a| u64::from_str_radix(a, 16).ok())
            else {
                continue;
            };
            if addr == 0 {
                continue;
            }
            let name = rest.split(|&b| b == b'\t').next().unwrap_or(rest);
            if name.is_empty() || name.len() > firn_schema::limits::MAX_SYMBOL_BYTES as usize {
                continue;
            }
            entries.push((addr, name));
        }
        entries.sort_by_key(|e| e.0);
        let mut table = Self {
            addrs: Vec::with_capacity(entries.len()),
            name_starts: Vec::with_capacity(entries.len()),
            names: Vec::with_capacity(entries.iter().map(|e| e.1.len()).sum()),
        };
        for (addr, name) in entries {
            let Ok(start) = u32::try_from(table.names.len()) else {
                break;
            };
            table.addrs.push(addr);
            table.name_starts.push(start);
            table.names.extend_from_slice(name);
        }
        table
    }

    pub fn len(&self) -> usize {
        self.addrs.len()
    }

    /// Index of the symbol containing `addr`, if any.
    pub fn lookup(&self, addr: u64) -> Option<u32> {
        let i = self.addrs.partition_point(|&a| a <= addr).checked_sub(1)?;
        if addr - self.addrs[i] > MAX_SYMBOL_SPAN {
            return None;
        }
        u32::try_from(i).ok()
    }

    /// Name of the symbol at `index` (from [`Kallsyms::lookup`]).
    pub fn name(&self, index: u32) -> &[u8] {
        let i = index as usize;
        let start = self.name_starts[i] as usize;
        let end = self
            .name_starts
            .get(i + 1)
            .map_or(self.names.len(), |&e| e as usize);
        &self.names[start..end]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_inside_symbols_and_skips_data_and_zero_addresses() {
        let text = b"ffffffff81000000 T _stext\n\
ffffffff81000100 t do_thing\n\
ffffffff81000200 D some_data\n\
ffffffffc0001000 t mod_fn\t[kvm]\n\
0000000000000000 T hidden\n";
        let k = Kallsyms::parse(text);
        assert_eq!(k.len(), 3);
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

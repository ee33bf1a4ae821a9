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

/// Every this many names one is stored whole, and where it starts is indexed.
const CHECKPOINT: usize = 16;

/// Sorted named text symbols, stored compactly (the sampler's RSS budget is 8 MiB; the
/// table is most of its heap): a 32-bit offset from the lowest address per symbol, and
/// names front-coded in address order. Each name is stored as the length of the prefix
/// it shares with the one before it (a byte) and the rest, NUL-ended; every
/// [`CHECKPOINT`]-th is whole. Kernel names cluster by source file in address order
/// (`ext4_`, `tcp_`), which keeps about three quarters of the bytes. The `__pfx_`
/// padding symbols (half of a modern kernel's table) are not entries: each named symbol
/// keeps the bytes of padding just before it (`pads`), which resolve to nothing; padding
/// not just before a symbol is an entry of its own, with no name.
pub(crate) struct Kallsyms {
    base: u64,
    offsets: Vec<u32>,
    pads: Vec<u8>,
    checkpoints: Vec<u32>,
    names: Vec<u8>,
}

impl Kallsyms {
    /// An empty table: every kernel frame resolves to nothing.
    pub(crate) fn empty() -> Self {
        Self {
            base: 0,
            offsets: Vec::new(),
            pads: Vec::new(),
            checkpoints: Vec::new(),
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

    /// Symbols held (and padding areas too wide to be told by the symbol after them).
    pub(crate) fn len(&self) -> usize {
        self.offsets.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// Bytes the table holds.
    pub(crate) fn bytes(&self) -> usize {
        self.offsets.capacity() * 4
            + self.pads.capacity()
            + self.checkpoints.capacity() * 4
            + self.names.capacity()
    }

    /// Index of the symbol containing `addr`, if any.
    pub(crate) fn lookup(&self, addr: u64) -> Option<u32> {
        let off = u32::try_from(addr.checked_sub(self.base)?).ok()?;
        let i = self.offsets.partition_point(|&a| a <= off).checked_sub(1)?;
        if u64::from(off - self.offsets[i]) > MAX_SYMBOL_SPAN || self.pads[i] == NAMELESS {
            return None;
        }
        // The padding before the next symbol is no one's.
        if let (Some(&next), Some(&pad)) = (self.offsets.get(i + 1), self.pads.get(i + 1)) {
            if pad != NAMELESS && off >= next.saturating_sub(u32::from(pad)) {
                return None;
            }
        }
        u32::try_from(i).ok()
    }

    /// Name of the symbol at `index` (from [`Kallsyms::lookup`]): decoded from the
    /// whole name before it, at most [`CHECKPOINT`] - 1 names back.
    pub(crate) fn name(&self, index: u32) -> Vec<u8> {
        let i = index as usize;
        let c = i / CHECKPOINT;
        let mut name = Vec::new();
        let Some(&start) = self.checkpoints.get(c) else {
            return name;
        };
        let mut pos = start as usize;
        for _ in c * CHECKPOINT..=i {
            let Some(&shared) = self.names.get(pos) else {
                return Vec::new();
            };
            let rest = self.names.get(pos + 1..).unwrap_or_default();
            let len = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
            name.truncate(usize::from(shared));
            name.extend_from_slice(&rest[..len]);
            pos += len + 2;
        }
        name
    }
}

#[derive(Default)]
struct Builder {
    /// (address, where its name starts in `names` or [`NO_NAME`]).
    entries: Vec<(u64, u32)>,
    /// The names as read, each NUL-ended.
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
        // Padding first where it shares an address with a symbol (it cannot, but then
        // the symbol wins).
        self.entries
            .sort_unstable_by_key(|&(a, n)| (a, n != NO_NAME, n));
        let base = self.entries.first().map_or(0, |e| e.0);
        // Kernel text and modules span well under 4 GiB; anything beyond is dropped.
        self.entries.retain(|e| e.0 - base <= u64::from(u32::MAX));
        let named = self.entries.iter().filter(|e| e.1 != NO_NAME).count();
        let mut k = Kallsyms {
            base,
            offsets: Vec::with_capacity(named),
            pads: Vec::with_capacity(named),
            checkpoints: Vec::with_capacity(named.div_ceil(CHECKPOINT)),
            names: Vec::new(),
        };
        let mut coder = Coder::default();
        let mut padding_from: Option<u64> = None;
        for &(addr, start) in &self.entries {
            if start == NO_NAME {
                padding_from.get_or_insert(addr);
                continue;
            }
            let raw = self.names.get(start as usize..).unwrap_or_default();
            let name = &raw[..raw.iter().position(|&b| b == 0).unwrap_or(raw.len())];
            let pad = match padding_from.take().map(|p| (p, addr - p)) {
                None => 0,
                Some((_, d)) if d < u64::from(NAMELESS) => d as u8,
                // Wider than a byte tells: an entry of its own.
                Some((p, _)) => {
                    coder.push(&mut k, p - base, NAMELESS, b"");
                    0
                }
            };
            coder.push(&mut k, addr - base, pad, name);
        }
        if let Some(p) = padding_from {
            coder.push(&mut k, p - base, NAMELESS, b"");
        }
        // Padding entries may have grown the lists past the named symbols' count.
        k.offsets.shrink_to_fit();
        k.pads.shrink_to_fit();
        k.checkpoints.shrink_to_fit();
        k.names.shrink_to_fit();
        k
    }
}

/// A `pads` value: the entry is padding (no name), not a symbol.
const NAMELESS: u8 = u8::MAX;

/// Front-codes names into a table, in address order.
#[derive(Default)]
struct Coder {
    prev: Vec<u8>,
}

impl Coder {
    fn push(&mut self, k: &mut Kallsyms, offset: u64, pad: u8, name: &[u8]) {
        let Ok(pos) = u32::try_from(k.names.len()) else {
            return;
        };
        let shared = if k.offsets.len().is_multiple_of(CHECKPOINT) {
            k.checkpoints.push(pos);
            0
        } else {
            self.prev
                .iter()
                .zip(name)
                .take_while(|(a, b)| a == b)
                .count()
                .min(usize::from(u8::MAX))
        };
        k.names.push(shared as u8);
        k.names.extend_from_slice(&name[shared..]);
        k.names.push(0);
        self.prev.clear();
        self.prev.extend_from_slice(name);
        k.offsets.push(offset as u32);
        k.pads.push(pad);
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

    /// What the table answers, the plain way: every entry kept whole, padding included.
    fn reference(text: &[u8]) -> impl Fn(u64) -> Option<Vec<u8>> {
        let mut entries: Vec<(u64, bool, usize, Vec<u8>)> = Vec::new();
        for (order, line) in text.split(|&c| c == b'\n').enumerate() {
            let f: Vec<&[u8]> = line.split(|&c| c == b' ').collect();
            if f.len() < 3 || !matches!(f[1], b"t" | b"T" | b"w" | b"W") {
                continue;
            }
            let addr = u64::from_str_radix(std::str::from_utf8(f[0]).unwrap(), 16).unwrap();
            let name = f[2].split(|&c| c == b'\t').next().unwrap().to_vec();
            if addr == 0 || name.is_empty() || name.len() > 512 {
                continue;
            }
            let named = !name.starts_with(b"__pfx_");
            entries.push((addr, named, order, name));
        }
        entries.sort();
        move |a| {
            let i = entries.partition_point(|e| e.0 <= a).checked_sub(1)?;
            let (start, named, _, name) = &entries[i];
            (*named && a - start <= MAX_SYMBOL_SPAN).then(|| name.clone())
        }
    }

    /// Every symbol's start, the bytes around it and its padding's, against the plain
    /// table.
    fn check_against_reference(text: &[u8]) -> usize {
        let k = Kallsyms::parse(text);
        let plain = reference(text);
        let mut checked = 0;
        for line in text.split(|&c| c == b'\n') {
            let Some(addr) = line
                .split(|&c| c == b' ')
                .next()
                .and_then(|a| std::str::from_utf8(a).ok())
                .and_then(|a| u64::from_str_radix(a, 16).ok())
                .filter(|&a| a > 16)
            else {
                continue;
            };
            for a in [addr - 16, addr - 1, addr, addr + 1, addr + 15] {
                let ours = k.lookup(a).map(|i| k.name(i));
                assert_eq!(
                    ours.as_deref().map(String::from_utf8_lossy),
                    plain(a).as_deref().map(String::from_utf8_lossy),
                    "at {a:#x}"
                );
                checked += 1;
            }
        }
        checked
    }

    #[test]
    fn padding_just_before_a_symbol_is_no_ones_and_names_decode_across_checkpoints() {
        let mut text = String::new();
        let mut addr = 0xffff_ffff_8100_0000_u64;
        for i in 0..100 {
            let file = ["ext4_", "tcp_v4_", "x", "tcp_"][i % 4];
            if i % 3 != 0 {
                text += &format!("{addr:x} t __pfx_{file}fn{i}\n");
                addr += 16;
            }
            text += &format!("{addr:x} T {file}fn{i}\n");
            addr += 0x40 + (i as u64 % 7) * 0x30;
            if i % 10 == 0 {
                // Padding far from the next symbol: an entry of its own.
                text += &format!("{addr:x} t __pfx_gone{i}\n");
                addr += 0x1000;
            }
        }
        // Padding of 254 and 255 bytes (the widest a byte tells, and one more), several
        // padding symbols before one symbol, aliases, padding at a symbol's address, and
        // names longer than 255 bytes sharing more than that.
        let long = "k".repeat(300);
        for (i, pad) in [254_u64, 255, 16].into_iter().enumerate() {
            text += &format!("{addr:x} t __pfx_wide{i}\n");
            addr += pad;
            text += &format!("{addr:x} t wide{i}\n");
            addr += 0x80;
        }
        text += &format!("{addr:x} t __pfx_twice\n{:x} t __pfx_twice\n", addr + 8);
        addr += 16;
        text += &format!("{addr:x} t twice\n{addr:x} t twice_alias\n");
        addr += 0x40;
        text += &format!("{addr:x} t __pfx_same\n{addr:x} t same\n");
        addr += 0x40;
        text += &format!("{addr:x} t {long}a\n");
        addr += 0x40;
        text += &format!("{addr:x} t {long}b\n");
        addr += 0x40;
        // Padding last, with nothing after it.
        text += &format!("{addr:x} t __pfx_end\n");
        // Lines out of address order.
        let mut lines: Vec<&str> = text.lines().collect();
        lines.reverse();
        let text = lines.join("\n");
        let k = Kallsyms::parse(text.as_bytes());
        let first = k.lookup(0xffff_ffff_8100_0000).expect("the first symbol");
        assert_eq!(k.name(first), b"ext4_fn0");
        let b = k.lookup(addr - 0x40).expect("the last symbol");
        assert_eq!(k.name(b), format!("{long}b").as_bytes());
        assert_eq!(k.lookup(addr + 1), None, "padding at the end");
        assert!(check_against_reference(text.as_bytes()) > 500);
        assert!(k.name(u32::MAX).is_empty());
        assert!(Kallsyms::empty().name(0).is_empty());
    }

    #[test]
    fn this_machines_kernel_symbols_resolve_as_the_plain_table_does() {
        // Addresses are shown to root only (CAP_SYSLOG); otherwise all zero.
        let Ok(text) = std::fs::read("/proc/kallsyms") else {
            return;
        };
        let k = Kallsyms::parse(&text);
        if k.is_empty() {
            return;
        }
        let checked = check_against_reference(&text);
        let raw: usize = text.len();
        eprintln!(
            "{} entries, {checked} addresses checked; {} bytes held for {raw} bytes of text",
            k.len(),
            k.bytes()
        );
    }

    #[test]
    fn restricted_table_is_empty() {
        let k = Kallsyms::parse(b"0000000000000000 T _stext\n0000000000000000 t x\n");
        assert_eq!(k.len(), 0);
        assert_eq!(k.lookup(0xffffffff81000000), None);
    }
}

//! The symbolizer's memory bounds.

/// Memory bounds of the symbolizer. Parsed DWARF is most of the enricher's memory: a
/// binary's debug sections are mapped and read whole, and its function and line
/// tables are built on the heap.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Binaries kept open (LRU; each holds one fd, two with a separate debug file).
    pub binaries: usize,
    /// Bytes of symbol tables and DWARF (uncompressed debug sections, the binary's own or
    /// its separate debug file's) whose parsed state is held at once. Past it parses are
    /// dropped, those cheapest to make again and longest unneeded first (their frames
    /// already named stay cached); a parse worth less than those it would push out (one
    /// never made is priced at what the others cost a byte) is made for the round from its
    /// symbol tables alone, its frames not cached. A binary whose tables and DWARF together
    /// are larger is named from its symbol tables only: functions, no file:line and no
    /// inline frames; one whose symbol tables alone are larger is parsed for the round and
    /// dropped at once, up to [`Limits::ceiling`].
    pub budget_bytes: u64,
    /// Named frames remembered over all binaries (LRU).
    pub frames: usize,
}

impl Limits {
    /// Symbol tables larger than this are not parsed at all (their frames stay
    /// addresses): 4 × the budget, at least 4 × the default. A parse holds on the heap
    /// about a third of its symbol tables' bytes (an 8-byte index per 24-byte
    /// symbol), so a binary with a gigabyte of symbols would have grown the enricher
    /// by 350 MiB, every round that met it. rustc's libLLVM (26 MiB) is parsed.
    pub fn ceiling(&self) -> u64 {
        self.budget_bytes
            .max(Limits::default().budget_bytes)
            .saturating_mul(4)
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            binaries: 256,
            budget_bytes: 24 << 20,
            frames: 32 << 10,
        }
    }
}

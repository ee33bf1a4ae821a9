//! Unwind rows from a binary's call frame information (x86_64 ELF).
//!
//! Parsed with gimli: `.eh_frame` (found by section or, without section headers,
//! through `PT_GNU_EH_FRAME`), else `.debug_frame` (compressed or not, which is what Go
//! binaries carry). Each FDE row becomes one 8-byte row keyed by file offset, so the
//! sampler and the BPF program need nothing but /proc/PID/maps to find it. A marker row
//! ends each FDE, rows equal to their predecessor are dropped.

use std::collections::HashMap;

use gimli::{
    BaseAddresses, CfaRule, CieOrFde, DebugFrame, EhFrame, EhFrameHdr, EndianSlice, LittleEndian,
    Reader, Register, RegisterRule, UnwindContext, UnwindContextStorage, UnwindSection,
    UnwindTableRow,
};
use object::elf;
use object::read::elf::{ElfFile64, FileHeader, ProgramHeader};
use object::{Object, ObjectSection};

use super::cfi::{self, Cfa, Rule, State};
use super::order::{table, Run};
use firn_schema::unwind_row::{self as k, Row};

type R<'a> = EndianSlice<'a, LittleEndian>;

/// x86_64 DWARF registers.
const RBP: Register = Register(cfi::RBP);
const RSP: Register = Register(7);
const RA: Register = Register(cfi::RA);

/// The PLT's CFA expression (binutils): rsp + 8 + ((rip & 15) >= N) << 3, N = 10 or 11.
const PLT_EXPR_HEAD: [u8; 7] = [0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x00];
const PLT_EXPR_TAIL: [u8; 4] = [0x2a, 0x33, 0x24, 0x22];

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("not a 64-bit little-endian ELF file: {0}")]
    Elf(#[from] object::Error),
    #[error("not an x86_64 binary (e_machine {0})")]
    Arch(u16),
    #[error("no .eh_frame and no .debug_frame")]
    NoCfi,
    #[error("the call frame information is malformed: {0}")]
    Cfi(#[from] gimli::Error),
    /// gimli names where it ran out by the reader's address, which differs between two
    /// builds of one file whenever the section is a copy (`.debug_frame`): the offset
    /// in the section says where, and the same each time.
    #[error("the call frame information ends early, at byte {0} of its section")]
    CfiEnds(usize),
    #[error("a compressed .debug_frame could not be inflated")]
    Inflate,
    #[error("no executable segment")]
    NoText,
}

/// Where the rows came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    EhFrame,
    DebugFrame,
}

/// A built table and what went into it.
#[derive(Debug)]
pub struct Table {
    pub rows: Vec<Row>,
    pub(crate) source: Source,
    pub fdes: usize,
    /// Rows whose CFA rule the unwinder cannot follow (kept, so it stops cleanly there).
    pub unsupported: usize,
    /// FDE rows outside every executable segment (dropped).
    pub outside: usize,
    /// FDEs whose program gimli evaluated: the fast walk's fallbacks (every FDE with
    /// `Walk::Gimli`).
    pub fallback: usize,
}

impl Table {
    /// The rows as sent, in one buffer of their exact size (grown by doubling, it held
    /// up to twice the bytes while the rows were alive too).
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.rows.len() * 8);
        for r in self.rows {
            out.extend_from_slice(&r.to_bytes());
        }
        out
    }
}

/// The rows of a bare `.eh_frame` section at address 0, its text the first 4 GiB of the
/// file (synthetic sections in tests and fuzzing).
pub(super) fn rows_of_eh_frame(bytes: &[u8], walk: Walk) -> Result<Table, BuildError> {
    let segments = [Segment {
        vaddr: 0,
        filesz: 1 << 32,
        offset: 0,
    }];
    let bases = BaseAddresses::default().set_eh_frame(0);
    let section = EhFrame::new(bytes, LittleEndian);
    rows_of(&section, &bases, &segments, Source::EhFrame, walk)
}

/// An executable PT_LOAD: vaddr range and the file offset of its start.
#[derive(Debug, Clone, Copy)]
struct Segment {
    vaddr: u64,
    filesz: u64,
    offset: u64,
}

fn file_offset(segments: &[Segment], vaddr: u64) -> Option<u32> {
    let s = segments
        .iter()
        .find(|s| vaddr >= s.vaddr && vaddr - s.vaddr < s.filesz)?;
    u32::try_from(vaddr - s.vaddr + s.offset).ok()
}

/// Builds the table of an ELF file's bytes. Never panics on malformed input.
pub fn build(data: &[u8]) -> Result<Table, BuildError> {
    build_with(data, Walk::Fast)
}

/// `build` with the FDE programs evaluated as `walk` says.
pub fn build_with(data: &[u8], walk: Walk) -> Result<Table, BuildError> {
    let file = ElfFile64::<object::Endianness>::parse(data)?;
    let header = file.elf_header();
    let endian = file.endian();
    let machine = header.e_machine(endian);
    if machine != elf::EM_X86_64 {
        return Err(BuildError::Arch(machine.0));
    }
    let mut segments = Vec::new();
    let mut eh_frame_hdr: Option<(u64, &[u8])> = None;
    for ph in header.program_headers(endian, data)? {
        let (ty, flags) = (ph.p_type(endian), ph.p_flags(endian));
        if ty == elf::PT_LOAD && (flags & elf::PF_X).0 != 0 {
            segments.push(Segment {
                vaddr: ph.p_vaddr(endian),
                filesz: ph.p_filesz(endian),
                offset: ph.p_offset(endian),
            });
        }
        if ty == elf::PT_GNU_EH_FRAME {
            if let Ok(bytes) = ph.data(endian, data) {
                eh_frame_hdr = Some((ph.p_vaddr(endian), bytes));
            }
        }
    }
    if segments.is_empty() {
        return Err(BuildError::NoText);
    }
    let text = file.section_by_name(".text").map(|s| s.address());
    let mut bases = BaseAddresses::default();
    if let Some(t) = text {
        bases = bases.set_text(t);
    }
    if let Some(got) = file.section_by_name(".got").map(|s| s.address()) {
        bases = bases.set_got(got);
    }

    if let Some(s) = file.section_by_name(".eh_frame") {
        if let Ok(bytes) = s.data() {
            if !bytes.is_empty() {
                let bases = bases.clone().set_eh_frame(s.address());
                let section = EhFrame::new(bytes, LittleEndian);
                return rows_of(&section, &bases, &segments, Source::EhFrame, walk);
            }
        }
    }
    // No section headers (or no .eh_frame section): .eh_frame_hdr names .eh_frame.
    if let Some((hdr_addr, hdr)) = eh_frame_hdr {
        let hdr_bases = bases.clone().set_eh_frame_hdr(hdr_addr);
        let parsed = EhFrameHdr::new(hdr, LittleEndian).parse(&hdr_bases, 8)?;
        if let gimli::Pointer::Direct(addr) = parsed.eh_frame_ptr() {
            if let Some(bytes) = segment_bytes(&file, data, addr) {
                let bases = hdr_bases.set_eh_frame(addr);
                let section = EhFrame::new(bytes, LittleEndian);
                return rows_of(&section, &bases, &segments, Source::EhFrame, walk);
            }
        }
    }
    if let Some(s) = file.section_by_name(".debug_frame") {
        let bytes = section_bytes(&s)?;
        let mut section = DebugFrame::new(&bytes, LittleEndian);
        section.set_address_size(8);
        return rows_of(&section, &bases, &segments, Source::DebugFrame, walk);
    }
    Err(BuildError::NoCfi)
}

/// A CFI error with an early end named by its offset in `section`.
fn located(section: &R<'_>, e: gimli::Error) -> BuildError {
    match e {
        gimli::Error::UnexpectedEof(id) => section
            .lookup_offset_id(id)
            .map_or(BuildError::Cfi(e), BuildError::CfiEnds),
        e => BuildError::Cfi(e),
    }
}

/// The bytes from `addr` to the end of the loaded segment holding it.
fn segment_bytes<'d>(
    file: &ElfFile64<'d, object::Endianness>,
    data: &'d [u8],
    addr: u64,
) -> Option<&'d [u8]> {
    let endian = file.endian();
    let ph = file.elf_program_headers().iter().find(|ph| {
        ph.p_type(endian) == elf::PT_LOAD
            && addr >= ph.p_vaddr(endian)
            && addr - ph.p_vaddr(endian) < ph.p_filesz(endian)
    })?;
    let start = usize::try_from(addr - ph.p_vaddr(endian) + ph.p_offset(endian)).ok()?;
    let end = usize::try_from(ph.p_offset(endian).checked_add(ph.p_filesz(endian))?).ok()?;
    data.get(start..end)
}

/// A section's bytes, inflated if compressed (SHF_COMPRESSED with zlib).
fn section_bytes(
    s: &object::read::elf::ElfSection64<'_, '_, object::Endianness>,
) -> Result<Vec<u8>, BuildError> {
    let c = s.compressed_data()?;
    match c.format {
        object::CompressionFormat::None => Ok(c.data.to_vec()),
        object::CompressionFormat::Zlib => {
            use std::io::Read;
            // Bounded by what the header declares, and by 256 MiB whatever it declares.
            let max = c.uncompressed_size.min(256 << 20);
            let mut out = Vec::new();
            flate2::read::ZlibDecoder::new(c.data)
                .take(max)
                .read_to_end(&mut out)
                .map_err(|_| BuildError::Inflate)?;
            Ok(out)
        }
        _ => Err(BuildError::Inflate),
    }
}

fn is_plt(expr: &[u8]) -> Option<u16> {
    if expr.len() != PLT_EXPR_HEAD.len() + PLT_EXPR_TAIL.len() {
        return None;
    }
    let (head, tail) = expr.split_at(PLT_EXPR_HEAD.len());
    if head[..6] != PLT_EXPR_HEAD[..6] || tail != PLT_EXPR_TAIL {
        return None;
    }
    // DW_OP_lit10 or DW_OP_lit11.
    match head[6] {
        0x3a => Some(10),
        0x3b => Some(11),
        _ => None,
    }
}

/// gimli's unwind state, with room for 64 register rules a row instead of its default
/// 192: every row is copied whole a few times as it is made, and 192 rules made those
/// copies a seventh of a build. x86_64 has 17 general registers with the return
/// address; a row with more than 64 rules ends its FDE as gimli's own limit would.
struct Storage;

impl UnwindContextStorage<usize> for Storage {
    type Rules = [(Register, RegisterRule<usize>); 64];
    type Stack = Box<[UnwindTableRow<usize, Self>; 4]>;
}

fn unsupported() -> (u8, u16) {
    (k::CFA_UNSUPPORTED, 0)
}

/// How an FDE's program is evaluated: `Fast` by `cfi`'s evaluator with gimli where it
/// bails, `Gimli` by gimli's `UnwindTable` alone (the reference the tests compare with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Walk {
    Fast,
    Gimli,
}

/// A table row from the rules that hold at file offset `pc`.
fn row_at(pc: u32, signal: bool, cfa: Cfa, ra: Rule, rbp: Rule) -> Row {
    let (cfa, cfa_offset) = if signal {
        (k::CFA_SIGNAL, 0)
    } else {
        match cfa {
            Cfa::Reg(register, offset) => {
                let kind = match Register(register) {
                    RSP => k::CFA_RSP,
                    RBP => k::CFA_RBP,
                    _ => k::CFA_UNSUPPORTED,
                };
                // Offsets the sampler refuses (an rbp-based CFA far from rbp or
                // unaligned) become a stop here instead.
                match u16::try_from(offset) {
                    Ok(o)
                        if kind != k::CFA_UNSUPPORTED
                            && Row::valid(&Row {
                                pc: 0,
                                cfa_offset: o,
                                cfa: kind,
                                rbp: k::RBP_SAME,
                                rbp_offset8: 0,
                            }) =>
                    {
                        (kind, o)
                    }
                    _ => unsupported(),
                }
            }
            Cfa::Expr(plt) => plt.map_or_else(unsupported, |n| (k::CFA_PLT, n)),
        }
    };
    let (cfa, cfa_offset) = match ra {
        Rule::Undefined if !signal => (k::CFA_STOP, 0),
        Rule::Default | Rule::Offset(-8) => (cfa, cfa_offset),
        _ if signal => (cfa, cfa_offset),
        _ => unsupported(),
    };
    let (rbp, rbp_offset8) = match rbp {
        Rule::Default | Rule::Same | Rule::Undefined => (k::RBP_SAME, 0),
        Rule::Offset(o) if o % 8 == 0 && (-1024..0).contains(&o) => (k::RBP_AT_CFA, (o / 8) as i8),
        _ => (k::RBP_UNKNOWN, 0),
    };
    let (rbp, rbp_offset8) = if matches!(cfa, k::CFA_SIGNAL | k::CFA_STOP | k::CFA_UNSUPPORTED) {
        (k::RBP_SAME, 0)
    } else {
        (rbp, rbp_offset8)
    };
    Row {
        pc,
        cfa_offset,
        cfa,
        rbp,
        rbp_offset8,
    }
}

/// The rows built so far and their counts.
struct Rows<'s> {
    raw: Vec<Row>,
    segments: &'s [Segment],
    unsupported: usize,
    outside: usize,
}

impl Rows<'_> {
    #[inline]
    fn push(&mut self, at: u64, signal: bool, s: &State) {
        let Some(pc) = file_offset(self.segments, at) else {
            self.outside += 1;
            return;
        };
        let row = row_at(pc, signal, s.cfa, s.ra, s.rbp);
        if row.cfa == k::CFA_UNSUPPORTED {
            self.unsupported += 1;
        }
        self.raw.push(row);
    }
}

fn rows_of<'a, S: UnwindSection<R<'a>>>(
    section: &S,
    bases: &BaseAddresses,
    segments: &[Segment],
    source: Source,
    walk: Walk,
) -> Result<Table, BuildError>
where
    S::Offset: gimli::UnwindOffset,
{
    let mut ctx = Box::new(UnwindContext::<usize, Storage>::new_in());
    // Sized for the section up front (measured: 5.3-5.5 bytes of CFI a row, 40 or more
    // an FDE), so the rows are not copied as they grow; capped, and an allocation this
    // size is a fresh mapping whose untouched pages cost nothing.
    let cfi_bytes = section.section().len();
    let mut out = Rows {
        raw: Vec::with_capacity((cfi_bytes / 5).min(1 << 20)),
        segments,
        unsupported: 0,
        outside: 0,
    };
    let mut runs: Vec<Run> = Vec::with_capacity((cfi_bytes / 40).min(1 << 18));
    // Most FDEs of a binary share a CIE or two: each is parsed once, not once an FDE,
    // and its initial rules evaluated once.
    let mut cies: HashMap<usize, gimli::CommonInformationEntry<R<'a>>> = HashMap::new();
    let mut fast: HashMap<usize, Option<cfi::Cie>> = HashMap::new();
    let mut last_cie: Option<(usize, gimli::CommonInformationEntry<R<'a>>)> = None;
    let mut last_fast: Option<(usize, Option<cfi::Cie>)> = None;
    let plt =
        |e: gimli::UnwindExpression<usize>| e.get(section).ok().and_then(|e| is_plt(e.0.slice()));
    let (mut fdes, mut fallback) = (0, 0);
    let mut entries = section.entries(bases);
    while let Some(entry) = entries.next().map_err(|e| located(section.section(), e))? {
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let parsed = partial.parse(|section, bases, offset| {
            let at: usize = gimli::UnwindOffset::into(offset);
            // Runs of FDEs share a CIE: the last one is at hand without a hash.
            if let Some((_, cie)) = last_cie.as_ref().filter(|(o, _)| *o == at) {
                return Ok(cie.clone());
            }
            let cie = match cies.get(&at) {
                Some(cie) => cie.clone(),
                None => {
                    let cie = S::cie_from_offset(section, bases, offset)?;
                    cies.insert(at, cie.clone());
                    cie
                }
            };
            last_cie = Some((at, cie.clone()));
            Ok(cie)
        });
        let Ok(fde) = parsed else {
            // One bad FDE costs its function, not the binary.
            continue;
        };
        fdes += 1;
        let run_start = out.raw.len();
        let signal = fde.cie().is_signal_trampoline();
        let cie = match walk {
            Walk::Fast => match last_fast {
                Some((at, cie)) if at == fde.cie().offset() => cie,
                _ => {
                    let cie = *fast.entry(fde.cie().offset()).or_insert_with(|| {
                        cfi::cie(fde.cie(), fde.cie().instructions(section, bases), plt)
                    });
                    last_fast = Some((fde.cie().offset(), cie));
                    cie
                }
            },
            Walk::Gimli => None,
        };
        let counts = (out.unsupported, out.outside);
        let program = cie.and_then(|cie| {
            let bytes = section.section().slice();
            Some((cie, cfi::program(bytes, fde.offset(), &cie)?))
        });
        let fast_rows = program.is_some_and(|(cie, program)| {
            cfi::rows(&cie, program, plt, fde.initial_address(), |at, s| {
                out.push(at, signal, s)
            })
            .is_ok()
        });
        if !fast_rows {
            fallback += 1;
            out.raw.truncate(run_start);
            (out.unsupported, out.outside) = counts;
            let mut table = match fde.rows(section, bases, &mut ctx) {
                Ok(t) => t,
                Err(_) => continue,
            };
            while let Ok(Some(row)) = table.next_row() {
                let cfa = match row.cfa() {
                    CfaRule::RegisterAndOffset { register, offset } => {
                        Cfa::Reg(register.0, *offset)
                    }
                    CfaRule::Expression(e) => Cfa::Expr(plt(*e)),
                };
                let s = State::of(cfa, Rule::of(row.register(RA)), Rule::of(row.register(RBP)));
                out.push(row.start_address(), signal, &s);
            }
        }
        // Past the function's end no rule holds, unless another FDE starts there.
        if let Some(end) = fde
            .initial_address()
            .checked_add(fde.len())
            .and_then(|end| {
                file_offset(segments, end).or_else(|| file_offset(segments, end - 1).map(|o| o + 1))
            })
        {
            out.raw.push(Row {
                pc: end,
                cfa_offset: 0,
                cfa: k::CFA_NONE,
                rbp: k::RBP_SAME,
                rbp_offset8: 0,
            });
        }
        if let Some(first) = out.raw.get(run_start) {
            runs.push(Run {
                pc: first.pc,
                start: run_start,
                end: out.raw.len(),
            });
        }
    }
    Ok(Table {
        rows: table(out.raw, runs),
        source,
        fdes,
        unsupported: out.unsupported,
        outside: out.outside,
        fallback,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plt_expressions_are_recognised() {
        let mut e = PLT_EXPR_HEAD.to_vec();
        e[6] = 0x3b;
        e.extend_from_slice(&PLT_EXPR_TAIL);
        assert_eq!(is_plt(&e), Some(11));
        e[6] = 0x3a;
        assert_eq!(is_plt(&e), Some(10));
        e[6] = 0x39;
        assert_eq!(is_plt(&e), None);
        assert_eq!(is_plt(&e[1..]), None);
    }

    #[test]
    fn libc_and_this_test_binary_build_valid_sorted_tables() {
        for path in ["/proc/self/exe", "/lib/x86_64-linux-gnu/libc.so.6"] {
            let Ok(data) = std::fs::read(path) else {
                continue;
            };
            let t = build(&data).expect(path);
            assert_eq!(t.source, Source::EhFrame);
            assert!(t.rows.len() > 1000, "{path}: {} rows", t.rows.len());
            assert!(
                t.rows.windows(2).all(|w| w[0].pc < w[1].pc),
                "{path}: sorted"
            );
            assert!(t.rows.iter().all(Row::valid), "{path}: every row in range");
            if path.contains("libc") {
                // Its PLT and the signal return trampoline (__restore_rt).
                assert!(
                    t.rows.iter().any(|r| r.cfa == k::CFA_PLT),
                    "{path}: PLT rows"
                );
                assert!(
                    t.rows.iter().any(|r| r.cfa == k::CFA_SIGNAL),
                    "{path}: signal frame rows"
                );
            }
            assert!(
                t.rows.iter().any(|r| r.rbp == k::RBP_AT_CFA),
                "{path}: saved rbp"
            );
        }
    }

    #[test]
    fn an_early_end_is_named_by_its_offset_in_the_section() {
        // A CIE that says 16 bytes follow, and 4 do: the error says where, not at which
        // address the copy lay (the fuzz target compares two builds' errors).
        let cut = [16u8, 0, 0, 0, 0, 0, 0, 0];
        for walk in [Walk::Fast, Walk::Gimli] {
            let e = rows_of_eh_frame(&cut, walk).err();
            assert!(matches!(e, Some(BuildError::CfiEnds(4..=8))), "{e:?}");
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(build(b"").is_err());
        assert!(build(b"\x7fELF garbage").is_err());
        let mut data = std::fs::read("/proc/self/exe").expect("own binary");
        // Truncated in the middle: an error or a smaller table, never a panic.
        data.truncate(data.len() / 3);
        let _ = build(&data);
    }
}

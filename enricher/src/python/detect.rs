//! Is this mapped file a CPython interpreter, and what does its walk need? Read from the
//! brokered file alone: its symbols (`.dynsym` is enough, so Debian's stripped python3
//! qualifies), `Py_Version`, and for 3.13 on the `_Py_DebugOffsets` in its `.data`.

use std::ops::Range;

use gimli::{BaseAddresses, CieOrFde, EhFrame, LittleEndian, UnwindSection};
use object::elf;
use object::read::elf::{ElfFile64, FileHeader, ProgramHeader};
use object::{Object, ObjectSection, ObjectSymbol};

use super::layout::{self, DebugOffsetsError, Layout, Position};

/// The eval loop: where the native walk hands over to the Python one.
const EVAL: &str = "_PyEval_EvalFrameDefault";
const EVAL_COLD: &str = "_PyEval_EvalFrameDefault.cold";

/// CPython's version, as `PY_VERSION_HEX` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Version {
    pub major: u8,
    pub minor: u8,
    /// `None` when the file does not say (3.10 has no `Py_Version`).
    pub micro: Option<u8>,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if let Some(m) = self.micro {
            write!(f, ".{m}")?;
        }
        Ok(())
    }
}

/// What the BPF walk needs of one interpreter file. The eval loop's ranges are file
/// offsets, as the unwind rows' pcs are; the objects are the file's virtual addresses,
/// which a process has at `mapping start − mapping offset − text_delta + address`, the
/// mapping being the executable one that holds the eval loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interpreter {
    pub version: Version,
    /// `p_vaddr − p_offset` of the segment holding the eval loop.
    pub text_delta: u64,
    pub runtime: u64,
    pub code_type: u64,
    pub str_type: u64,
    pub bytes_type: u64,
    pub eval: Range<u64>,
    /// The eval loop's cold part, which gcc splits off (named only in `.symtab`).
    pub eval_cold: Option<Range<u64>>,
    pub layout: Layout,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnalysisError {
    #[error("not a 64-bit little-endian x86_64 ELF file")]
    Elf,
    #[error("not a CPython interpreter (no {0} defined)")]
    NotCpython(&'static str),
    #[error("CPython {0}.{1} is not a version firn reads frames of")]
    UnknownVersion(u8, u8),
    #[error("the file's name says 3.{named}, its Py_Version 3.{found}")]
    NameMismatch { named: u8, found: u8 },
    #[error("no version: no Py_Version and no python3.N in the file's name")]
    NoVersion,
    #[error("{symbol} is not in the file's bytes (not a loaded, file-backed address)")]
    NotInFile { symbol: &'static str },
    #[error("{what}: the file has {found}, this version's layout {expected}")]
    Layout {
        what: &'static str,
        expected: u64,
        found: u64,
    },
    #[error("_Py_DebugOffsets: {0}")]
    DebugOffsets(#[from] DebugOffsetsError),
}

impl AnalysisError {
    /// Whether the file is a CPython firn cannot read (counted), not some other file.
    pub fn is_cpython(&self) -> bool {
        !matches!(self, Self::Elf | Self::NotCpython(_))
    }
}

/// The minor version in a file name such as `python3.11`, `libpython3.12.so.1.0`.
pub fn minor_from_name(name: &str) -> Option<u8> {
    let base = name.rsplit('/').next().unwrap_or(name);
    let at = base.find("python3.")?;
    let digits: String = base[at + 8..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Whether a mapped file is worth opening as a possible interpreter.
pub fn might_be_cpython(name: &str) -> bool {
    minor_from_name(name).is_some()
}

struct Symbol {
    address: u64,
    size: u64,
}

struct File<'a> {
    data: &'a [u8],
    /// Loaded segments: (vaddr, file offset, bytes in the file).
    segments: Vec<(u64, u64, u64)>,
}

impl File<'_> {
    /// The file offset of `vaddr`, checked: a crafted segment offset can push it past
    /// 2^64, and a release build would wrap it.
    fn offset(&self, vaddr: u64) -> Option<u64> {
        let &(v, off, _) = self.segment(vaddr)?;
        (vaddr - v).checked_add(off)
    }

    /// The (vaddr, file offset) of the loaded segment whose file bytes hold `vaddr`.
    fn segment_of(&self, vaddr: u64) -> Option<(u64, u64)> {
        self.segment(vaddr).map(|&(v, off, _)| (v, off))
    }

    fn segment(&self, vaddr: u64) -> Option<&(u64, u64, u64)> {
        self.segments
            .iter()
            .find(|(v, _, n)| vaddr >= *v && vaddr - v < *n)
    }

    fn bytes(&self, vaddr: u64, len: u64, symbol: &'static str) -> Result<&[u8], AnalysisError> {
        let not = || AnalysisError::NotInFile { symbol };
        let &(v, _, n) = self.segment(vaddr).ok_or_else(not)?;
        // The whole range lies in the one segment's file bytes.
        if len > n - (vaddr - v) {
            return Err(not());
        }
        let start = usize::try_from(self.offset(vaddr).ok_or_else(not)?).map_err(|_| not())?;
        let end = start
            .checked_add(usize::try_from(len).map_err(|_| not())?)
            .ok_or_else(not)?;
        self.data.get(start..end).ok_or_else(not)
    }

    fn u64_at(&self, vaddr: u64, symbol: &'static str) -> Result<u64, AnalysisError> {
        let b = self.bytes(vaddr, 8, symbol)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }
}

/// Analyses one file. `name` is its path in the process's maps (for the version of a
/// 3.10, which has no `Py_Version`, and as a cross-check). Never panics.
pub fn analyze(data: &[u8], name: &str) -> Result<Interpreter, AnalysisError> {
    let obj = ElfFile64::<object::Endianness>::parse(data).map_err(|_| AnalysisError::Elf)?;
    let endian = obj.endian();
    if obj.elf_header().e_machine(endian) != elf::EM_X86_64 {
        return Err(AnalysisError::Elf);
    }
    let mut segments = Vec::new();
    for ph in obj
        .elf_header()
        .program_headers(endian, data)
        .map_err(|_| AnalysisError::Elf)?
    {
        if ph.p_type(endian) == elf::PT_LOAD {
            let filesz = ph.p_filesz(endian).min(ph.p_memsz(endian));
            segments.push((ph.p_vaddr(endian), ph.p_offset(endian), filesz));
        }
    }
    let file = File { data, segments };
    let find = |wanted: &str| -> Option<Symbol> {
        obj.dynamic_symbols()
            .chain(obj.symbols())
            .find(|s| !s.is_undefined() && s.name() == Ok(wanted))
            .map(|s| Symbol {
                address: s.address(),
                size: s.size(),
            })
    };
    let need = |wanted: &'static str| find(wanted).ok_or(AnalysisError::NotCpython(wanted));
    let runtime = need("_PyRuntime")?;
    let eval = need(EVAL)?;
    let code_type = need("PyCode_Type")?;
    let str_type = need("PyUnicode_Type")?;
    let bytes_type = need("PyBytes_Type")?;

    let (version, py_version) = version(&file, find("Py_Version"), name)?;
    let layout = match version.minor {
        10..=12 => layout::known(version.minor)
            .ok_or(AnalysisError::UnknownVersion(version.major, version.minor))?,
        13 => {
            let len = runtime.size.min(4096);
            layout::from_debug_offsets(file.bytes(runtime.address, len, "_PyRuntime")?, py_version)?
        }
        m => return Err(AnalysisError::UnknownVersion(version.major, m)),
    };
    check(&file, &layout, &runtime, &code_type, &bytes_type)?;

    // A crafted segment's offset can push the range past the end of the address space:
    // such a file is refused, not recorded with an end before its start (fuzzing found it).
    let (text_delta, eval_range) = file
        .segment_of(eval.address)
        .and_then(|(v, off)| {
            let start = file.offset(eval.address)?;
            Some((
                v.wrapping_sub(off),
                start..start.checked_add(eval.size.max(1))?,
            ))
        })
        .ok_or(AnalysisError::NotInFile { symbol: EVAL })?;
    let eval_cold = find(EVAL_COLD)
        .and_then(|s| fde_range(&obj, s.address))
        .and_then(|r| {
            let start = file.offset(r.start)?;
            let end = file.offset(r.end.checked_sub(1)?)?.checked_add(1)?;
            (start < end).then_some(start..end)
        });
    Ok(Interpreter {
        version,
        text_delta,
        runtime: runtime.address,
        code_type: code_type.address,
        str_type: str_type.address,
        bytes_type: bytes_type.address,
        eval: eval_range,
        eval_cold,
        layout,
    })
}

/// The version from `Py_Version` (3.11 on), else from the name; with both, they agree.
fn version(
    file: &File<'_>,
    py_version: Option<Symbol>,
    name: &str,
) -> Result<(Version, u32), AnalysisError> {
    let named = minor_from_name(name);
    let Some(sym) = py_version else {
        let minor = named.ok_or(AnalysisError::NoVersion)?;
        let v = Version {
            major: 3,
            minor,
            micro: None,
        };
        return Ok((v, 0x0300_0000 | (u32::from(minor) << 16)));
    };
    let b = file.bytes(sym.address, 4, "Py_Version")?;
    let hex = u32::from_le_bytes(b.try_into().unwrap_or_default());
    let [major, minor, micro, _] = hex.to_be_bytes();
    if major != 3 {
        return Err(AnalysisError::UnknownVersion(major, minor));
    }
    if let Some(n) = named.filter(|n| *n != minor) {
        return Err(AnalysisError::NameMismatch {
            named: n,
            found: minor,
        });
    }
    Ok((
        Version {
            major,
            minor,
            micro: Some(micro),
        },
        hex,
    ))
}

/// What the file's own bytes can confirm of the layout: the runtime's size (the symbol's
/// size) and the code and bytes types' basic sizes (`tp_basicsize` in their static type
/// objects, which need no relocation).
fn check(
    file: &File<'_>,
    layout: &Layout,
    runtime: &Symbol,
    code_type: &Symbol,
    bytes_type: &Symbol,
) -> Result<(), AnalysisError> {
    let expect = |what, expected: u64, found: u64| {
        if expected == found {
            Ok(())
        } else {
            Err(AnalysisError::Layout {
                what,
                expected,
                found,
            })
        }
    };
    expect("sizeof(_PyRuntimeState)", layout.runtime_size, runtime.size)?;
    let basicsize = u64::from(layout.type_basicsize);
    let code = file.u64_at(code_type.address + basicsize, "PyCode_Type")?;
    // From 3.11 the bytecode is the code object's variable part: the basic size ends
    // where it starts.
    let code_basic = match layout.position {
        Position::Pointer { code_adaptive } => u64::from(code_adaptive),
        Position::LastiIndex => layout.code_size,
    };
    expect("PyCode_Type.tp_basicsize", code_basic, code)?;
    let bytes = file.u64_at(bytes_type.address + basicsize, "PyBytes_Type")?;
    // PyBytesObject_SIZE: the characters' offset plus the terminating NUL.
    expect(
        "PyBytes_Type.tp_basicsize",
        u64::from(layout.bytes_data) + 1,
        bytes,
    )
}

/// The address range of the FDE that covers `address` in `.eh_frame`.
fn fde_range(obj: &ElfFile64<'_, object::Endianness>, address: u64) -> Option<Range<u64>> {
    let section = obj.section_by_name(".eh_frame")?;
    let bytes = section.data().ok()?;
    let eh = EhFrame::new(bytes, LittleEndian);
    let mut bases = BaseAddresses::default().set_eh_frame(section.address());
    if let Some(t) = obj.section_by_name(".text") {
        bases = bases.set_text(t.address());
    }
    let mut entries = eh.entries(&bases);
    // Bounded by the section: each entry consumes bytes.
    while let Ok(Some(entry)) = entries.next() {
        if let CieOrFde::Fde(partial) = entry {
            let Ok(fde) = partial.parse(EhFrame::cie_from_offset) else {
                continue;
            };
            if fde.contains(address) && fde.len() > 0 {
                return Some(fde.initial_address()..fde.end_address());
            }
        }
    }
    None
}

impl Interpreter {
    /// The record the sampler checks (`firn_schema::python_record`).
    pub fn to_record(&self) -> firn_schema::python_record::Record {
        use firn_schema::python_record as r;
        let l = &self.layout;
        let (position, code_adaptive) = match l.position {
            Position::LastiIndex => (r::POSITION_LASTI, 0),
            Position::Pointer { code_adaptive } => (r::POSITION_POINTER, code_adaptive),
        };
        let (boundary, boundary_offset, cstack) = match l.boundary {
            layout::Boundary::OneFramePerCall => (r::BOUNDARY_ONE_FRAME, 0, 0),
            layout::Boundary::IsEntry(o) => (r::BOUNDARY_IS_ENTRY, o, 0),
            layout::Boundary::Owner { offset, cstack } => (r::BOUNDARY_OWNER, offset, cstack),
        };
        r::Record {
            minor: self.version.minor,
            micro: self.version.micro.unwrap_or(u8::MAX),
            position,
            boundary,
            cstack,
            code_tag_bits: l.frame_code_tag_bits,
            text_delta: self.text_delta,
            runtime: self.runtime,
            code_type: self.code_type,
            str_type: self.str_type,
            bytes_type: self.bytes_type,
            eval: (self.eval.start, self.eval.end),
            eval_cold: self.eval_cold.clone().map_or((0, 0), |c| (c.start, c.end)),
            runtime_interpreters: l.runtime_interpreters,
            interp_threads_head: l.interp_threads_head,
            tstate_next: l.tstate_next,
            tstate_thread_id: l.tstate_thread_id,
            tstate_frame: l.tstate_frame,
            cframe_frame: l.cframe_frame.unwrap_or(r::NONE),
            frame_previous: l.frame_previous,
            frame_code: l.frame_code,
            frame_instr: l.frame_instr,
            boundary_offset,
            code_adaptive,
            // Bounded by MAX_OFFSET in both layouts' sources, so it fits.
            code_size: u16::try_from(l.code_size).unwrap_or(u16::MAX),
            code_filename: l.code_filename,
            code_name: l.code_name,
            code_linetable: l.code_linetable,
            code_firstlineno: l.code_firstlineno,
            object_type: l.object_type,
            type_name: l.type_name,
            str_state: l.str_state,
            str_length: l.str_length,
            str_ascii_data: l.str_ascii_data,
            bytes_size: l.bytes_size,
            bytes_data: l.bytes_data,
        }
    }
}

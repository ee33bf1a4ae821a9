//! The symbolized round, as every later stage reads it: its stacks, their frames and
//! mappings, label sets, source lines, binary identities. Types only: this module
//! imports none of the stages that make or read them.

use std::sync::Arc;

/// Identity of a binary: its build id when it has one, else the file's identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BinaryId {
    BuildId(Vec<u8>),
    File {
        dev: u64,
        ino: u64,
        size: i64,
        mtime: i64,
    },
}

/// One pprof line: a function (possibly inlined) at a source position.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Line {
    pub function: Arc<str>,
    pub file: Arc<str>,
    pub line: u32,
}

/// The lines of one frame, innermost (most deeply inlined) first, the function that
/// holds the code last (pprof's order).
pub type Lines = Arc<[Line]>;

/// The symbolized content of one round.
pub struct Round {
    /// The sampler session the round belongs to: rounds count from 1 in each.
    pub session_id: u64,
    pub round: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    pub frequency_hz: u32,
    /// Off-CPU time is measured: profiles carry its sample type.
    pub off_cpu: bool,
    pub stacks: Vec<StackSample>,
}

/// A mapping of a process as pprof shows it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MappingSpec {
    pub start: u64,
    pub limit: u64,
    pub offset: u64,
    pub file: Arc<str>,
    /// Hex build id, or empty.
    pub build_id: Arc<str>,
    pub symbolized: bool,
}

#[derive(Debug, Clone)]
pub enum Frame {
    /// A user frame: its address, its mapping when one contains it, and its lines
    /// when it was symbolized (an unsymbolized frame keeps address and mapping only).
    User {
        mapping: Option<Arc<MappingSpec>>,
        address: u64,
        lines: Option<Lines>,
    },
    /// A kernel frame, named by the sampler.
    Kernel(Arc<str>),
}

/// The mapping every Python frame is shown in: pprof readers, the web view and the
/// uploads tell Python frames by it (the peers name theirs alike).
pub const PYTHON_MAPPING: &str = "[python]";

/// What ran a frame: the view colours by it, OTLP sends it as `profile.frame.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    Native = 0,
    Kernel = 1,
    Python = 2,
}

impl Frame {
    pub fn kind(&self) -> FrameKind {
        match self {
            Frame::Kernel(_) => FrameKind::Kernel,
            Frame::User {
                mapping: Some(m), ..
            } if &*m.file == PYTHON_MAPPING => FrameKind::Python,
            Frame::User { .. } => FrameKind::Native,
        }
    }
}

/// The names one frame stands for, callers first: its inline chain, a kernel symbol, or
/// `file+0xoffset` for code no symbol names (the web view and OpenSearch show these).
pub(crate) fn frame_names(f: &Frame, out: &mut Vec<Arc<str>>) {
    match f {
        Frame::Kernel(name) => out.push(name.clone()),
        Frame::User {
            lines: Some(lines), ..
        } => out.extend(lines.iter().rev().map(|l| l.function.clone())),
        Frame::User {
            mapping, address, ..
        } => {
            let name = match mapping {
                Some(m) => {
                    let base = m.file.rsplit('/').next().unwrap_or(&m.file);
                    format!(
                        "{base}+{:#x}",
                        address.wrapping_sub(m.start).wrapping_add(m.offset)
                    )
                }
                None => format!("{address:#x}"),
            };
            out.push(Arc::from(name.as_str()));
        }
    }
}

/// Labels, sorted by name.
pub type LabelSet = Vec<(String, String)>;

/// One stack of one label set with its sample count.
#[derive(Debug, Clone)]
pub struct StackSample {
    /// The sampler's id of the process (profiles per process group by it).
    pub process_id: u64,
    pub labels: Arc<LabelSet>,
    /// Leaf first.
    pub frames: Arc<[Frame]>,
    /// Samples on CPU.
    pub count: u64,
    /// Nanoseconds off CPU (the sampler's --off-cpu); a stack has one or the other.
    pub off_cpu_ns: u64,
}

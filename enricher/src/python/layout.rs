//! Where CPython keeps what the frame walk reads, per minor version (x86_64, release
//! build with the GIL). 3.10 to 3.12 come from tables below, written from `offsetof()`
//! against each version's own headers (the test `layouts_match_the_headers` compiles that
//! check again wherever the headers are installed); 3.13 on describe themselves in
//! `_Py_DebugOffsets`, the first member of `_PyRuntime`, which is read from the file.

/// Largest structure offset the BPF walk accepts (the sampler's record rule).
const MAX_OFFSET: u64 = firn_schema::python_record::MAX_OFFSET as u64;

/// How one eval call's Python frames end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boundary {
    /// 3.10: every Python frame has a C eval call of its own.
    OneFramePerCall,
    /// 3.11: the first frame an eval call pushed has `is_entry` set (a byte at this offset).
    IsEntry(u16),
    /// 3.12 on: the eval call's shim frame has `owner` (a byte at `offset`) of at least
    /// `cstack`; it is not a Python frame.
    Owner { offset: u16, cstack: u8 },
}

/// What the frame says about its position in the bytecode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// 3.10: `f_lasti`, an `int` counting code units from `co_code`'s bytes.
    LastiIndex,
    /// 3.11 on: a pointer into the code object itself, `co_code_adaptive` bytes in.
    Pointer { code_adaptive: u16 },
}

/// Field offsets, in bytes, that the walk and the name copies need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// `_PyRuntime` → the first (3.10–3.12: main) interpreter.
    pub runtime_interpreters: u16,
    /// The size of `_PyRuntimeState`, checked against the symbol's size.
    pub runtime_size: u64,
    pub interp_threads_head: u16,
    pub tstate_next: u16,
    /// `thread_id`: the thread's `pthread_t`, which is the thread pointer (fs base) on
    /// x86_64 glibc and musl, and so the same in every pid namespace.
    pub tstate_thread_id: u16,
    /// The current frame (3.10: a `PyFrameObject`; on: an `_PyInterpreterFrame`), or
    /// with `cframe` set, the `_PyCFrame` that holds it at `cframe`'s offset (3.11, 3.12).
    pub tstate_frame: u16,
    pub cframe_frame: Option<u16>,
    pub frame_previous: u16,
    pub frame_code: u16,
    /// 3.14 tags the code pointer (`_PyStackRef`): the low bits to clear.
    pub frame_code_tag_bits: u8,
    pub frame_instr: u16,
    pub position: Position,
    pub boundary: Boundary,
    pub code_size: u64,
    pub code_filename: u16,
    /// `co_qualname` (3.11 on), else `co_name`.
    pub code_name: u16,
    pub code_linetable: u16,
    pub code_firstlineno: u16,
    pub object_type: u16,
    pub type_name: u16,
    pub type_basicsize: u16,
    pub bytes_size: u16,
    pub bytes_data: u16,
    pub str_state: u16,
    pub str_length: u16,
    /// `sizeof(PyASCIIObject)`: where a compact ASCII string's characters start.
    pub str_ascii_data: u16,
}

/// 3.10 (checked on 3.10.13).
const V3_10: Layout = Layout {
    runtime_interpreters: 40,
    runtime_size: 672,
    interp_threads_head: 8,
    tstate_next: 8,
    tstate_thread_id: 176,
    tstate_frame: 24,
    cframe_frame: None,
    frame_previous: 24,
    frame_code: 32,
    frame_code_tag_bits: 0,
    frame_instr: 96,
    position: Position::LastiIndex,
    boundary: Boundary::OneFramePerCall,
    code_size: 176,
    code_filename: 104,
    code_name: 112,
    code_linetable: 120,
    code_firstlineno: 40,
    object_type: 8,
    type_name: 24,
    type_basicsize: 32,
    bytes_size: 16,
    bytes_data: 32,
    str_state: 32,
    str_length: 16,
    str_ascii_data: 48,
};

/// 3.11 (checked on 3.11.2, Debian's, and 3.11.7).
const V3_11: Layout = Layout {
    runtime_interpreters: 48,
    runtime_size: 166_688,
    interp_threads_head: 16,
    tstate_next: 8,
    tstate_thread_id: 152,
    tstate_frame: 56,
    cframe_frame: Some(8),
    frame_previous: 48,
    frame_code: 32,
    frame_code_tag_bits: 0,
    frame_instr: 56,
    position: Position::Pointer { code_adaptive: 184 },
    boundary: Boundary::IsEntry(68),
    code_size: 192,
    code_filename: 112,
    code_name: 128,
    code_linetable: 136,
    code_firstlineno: 72,
    object_type: 8,
    type_name: 24,
    type_basicsize: 32,
    bytes_size: 16,
    bytes_data: 32,
    str_state: 32,
    str_length: 16,
    str_ascii_data: 48,
};

/// 3.12 (checked on 3.12.1).
const V3_12: Layout = Layout {
    runtime_interpreters: 48,
    runtime_size: 459_944,
    interp_threads_head: 72,
    tstate_next: 8,
    tstate_thread_id: 136,
    tstate_frame: 56,
    cframe_frame: Some(0),
    frame_previous: 8,
    frame_code: 0,
    frame_code_tag_bits: 0,
    frame_instr: 56,
    position: Position::Pointer { code_adaptive: 192 },
    boundary: Boundary::Owner {
        offset: 70,
        cstack: 3,
    },
    code_size: 200,
    code_filename: 112,
    code_name: 128,
    code_linetable: 136,
    code_firstlineno: 68,
    object_type: 8,
    type_name: 24,
    type_basicsize: 32,
    bytes_size: 16,
    bytes_data: 32,
    str_state: 32,
    str_length: 16,
    str_ascii_data: 40,
};

/// The table of a minor version that has one.
pub(crate) fn known(minor: u8) -> Option<Layout> {
    match minor {
        10 => Some(V3_10),
        11 => Some(V3_11),
        12 => Some(V3_12),
        _ => None,
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DebugOffsetsError {
    #[error("no \"xdebugpy\" cookie at the start of _PyRuntime")]
    Cookie,
    #[error("_Py_DebugOffsets is cut short")]
    Short,
    #[error("_Py_DebugOffsets says version {found:#x}, Py_Version says {expected:#x}")]
    Version { found: u64, expected: u32 },
    #[error("a free-threaded build (its frames and objects are laid out otherwise)")]
    FreeThreaded,
    #[error("_Py_DebugOffsets of a version this firn does not know ({0:#x})")]
    Unknown(u64),
    #[error("offset {name} = {value} is beyond what the walk accepts or its structure")]
    OutOfRange { name: &'static str, value: u64 },
}

/// Word indices in 3.13's `_Py_DebugOffsets` (after the 8-byte cookie, all `uint64_t`).
mod v3_13 {
    pub(super) const VERSION: usize = 0;
    pub(super) const FREE_THREADED: usize = 1;
    pub(super) const RUNTIME_SIZE: usize = 2;
    pub(super) const RUNTIME_INTERPRETERS_HEAD: usize = 4;
    pub(super) const INTERP_SIZE: usize = 5;
    pub(super) const INTERP_THREADS_HEAD: usize = 8;
    pub(super) const TSTATE_SIZE: usize = 18;
    pub(super) const TSTATE_NEXT: usize = 20;
    pub(super) const TSTATE_CURRENT_FRAME: usize = 22;
    pub(super) const TSTATE_THREAD_ID: usize = 23;
    pub(super) const FRAME_SIZE: usize = 27;
    pub(super) const FRAME_PREVIOUS: usize = 28;
    pub(super) const FRAME_EXECUTABLE: usize = 29;
    pub(super) const FRAME_INSTR_PTR: usize = 30;
    pub(super) const FRAME_OWNER: usize = 32;
    pub(super) const CODE_SIZE: usize = 33;
    pub(super) const CODE_FILENAME: usize = 34;
    pub(super) const CODE_QUALNAME: usize = 36;
    pub(super) const CODE_LINETABLE: usize = 37;
    pub(super) const CODE_FIRSTLINENO: usize = 38;
    pub(super) const CODE_ADAPTIVE: usize = 42;
    pub(super) const OBJECT_SIZE: usize = 43;
    pub(super) const OBJECT_TYPE: usize = 44;
    pub(super) const TYPE_SIZE: usize = 45;
    pub(super) const TYPE_NAME: usize = 46;
    pub(super) const BYTES_SIZE: usize = 63;
    pub(super) const BYTES_OB_SIZE: usize = 64;
    pub(super) const BYTES_SVAL: usize = 65;
    pub(super) const STR_SIZE: usize = 66;
    pub(super) const STR_STATE: usize = 67;
    pub(super) const STR_LENGTH: usize = 68;
    pub(super) const STR_ASCII_SIZE: usize = 69;
    /// Words read (the structure goes on with the GC's offsets).
    pub(super) const WORDS: usize = 70;
}

/// 3.13's layout from the bytes of `_PyRuntime` in the file. `py_version` is the file's
/// `Py_Version`, which the offsets must name.
pub(crate) fn from_debug_offsets(
    runtime: &[u8],
    py_version: u32,
) -> Result<Layout, DebugOffsetsError> {
    use v3_13 as w;
    if runtime.get(..8) != Some(b"xdebugpy".as_slice()) {
        return Err(DebugOffsetsError::Cookie);
    }
    let words: Vec<u64> = runtime[8..]
        .chunks_exact(8)
        .take(w::WORDS)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect();
    if words.len() < w::WORDS {
        return Err(DebugOffsetsError::Short);
    }
    let version = words[w::VERSION];
    if version != u64::from(py_version) {
        return Err(DebugOffsetsError::Version {
            found: version,
            expected: py_version,
        });
    }
    if version >> 16 != 0x030D {
        return Err(DebugOffsetsError::Unknown(version));
    }
    if words[w::FREE_THREADED] != 0 {
        return Err(DebugOffsetsError::FreeThreaded);
    }
    // Each offset must fall inside the structure it is an offset of.
    let within = |name: &'static str, i: usize, size: usize| -> Result<u16, DebugOffsetsError> {
        let (value, size) = (words[i], words[size]);
        if value.saturating_add(8) > size.min(MAX_OFFSET) {
            return Err(DebugOffsetsError::OutOfRange { name, value });
        }
        u16::try_from(value).map_err(|_| DebugOffsetsError::OutOfRange { name, value })
    };
    let code_size = words[w::CODE_SIZE];
    if code_size > MAX_OFFSET {
        return Err(DebugOffsetsError::OutOfRange {
            name: "code_object.size",
            value: code_size,
        });
    }
    Ok(Layout {
        runtime_interpreters: within(
            "runtime_state.interpreters_head",
            w::RUNTIME_INTERPRETERS_HEAD,
            w::RUNTIME_SIZE,
        )?,
        runtime_size: words[w::RUNTIME_SIZE],
        interp_threads_head: within(
            "interpreter_state.threads_head",
            w::INTERP_THREADS_HEAD,
            w::INTERP_SIZE,
        )?,
        tstate_next: within("thread_state.next", w::TSTATE_NEXT, w::TSTATE_SIZE)?,
        tstate_thread_id: within(
            "thread_state.thread_id",
            w::TSTATE_THREAD_ID,
            w::TSTATE_SIZE,
        )?,
        tstate_frame: within(
            "thread_state.current_frame",
            w::TSTATE_CURRENT_FRAME,
            w::TSTATE_SIZE,
        )?,
        cframe_frame: None,
        frame_previous: within(
            "interpreter_frame.previous",
            w::FRAME_PREVIOUS,
            w::FRAME_SIZE,
        )?,
        frame_code: within(
            "interpreter_frame.executable",
            w::FRAME_EXECUTABLE,
            w::FRAME_SIZE,
        )?,
        frame_code_tag_bits: 0,
        frame_instr: within(
            "interpreter_frame.instr_ptr",
            w::FRAME_INSTR_PTR,
            w::FRAME_SIZE,
        )?,
        position: Position::Pointer {
            code_adaptive: within(
                "code_object.co_code_adaptive",
                w::CODE_ADAPTIVE,
                w::CODE_SIZE,
            )?,
        },
        boundary: Boundary::Owner {
            // A one-byte field: `within` allows 8 bytes, which a byte also fits.
            offset: within("interpreter_frame.owner", w::FRAME_OWNER, w::FRAME_SIZE)?,
            cstack: 3,
        },
        code_size,
        code_filename: within("code_object.filename", w::CODE_FILENAME, w::CODE_SIZE)?,
        code_name: within("code_object.qualname", w::CODE_QUALNAME, w::CODE_SIZE)?,
        code_linetable: within("code_object.linetable", w::CODE_LINETABLE, w::CODE_SIZE)?,
        code_firstlineno: within("code_object.firstlineno", w::CODE_FIRSTLINENO, w::CODE_SIZE)?,
        object_type: within("pyobject.ob_type", w::OBJECT_TYPE, w::OBJECT_SIZE)?,
        type_name: within("type_object.tp_name", w::TYPE_NAME, w::TYPE_SIZE)?,
        // Not in the offsets; fixed since Python 2 (after refcount, type, size, name).
        type_basicsize: 32,
        bytes_size: within("bytes_object.ob_size", w::BYTES_OB_SIZE, w::BYTES_SIZE)?,
        bytes_data: u16::try_from(words[w::BYTES_SVAL])
            .ok()
            .filter(|v| u64::from(*v) < words[w::BYTES_SIZE].min(MAX_OFFSET))
            .ok_or(DebugOffsetsError::OutOfRange {
                name: "bytes_object.ob_sval",
                value: words[w::BYTES_SVAL],
            })?,
        str_state: within("unicode_object.state", w::STR_STATE, w::STR_SIZE)?,
        str_length: within("unicode_object.length", w::STR_LENGTH, w::STR_SIZE)?,
        str_ascii_data: u16::try_from(words[w::STR_ASCII_SIZE])
            .ok()
            .filter(|v| u64::from(*v) <= MAX_OFFSET)
            .ok_or(DebugOffsetsError::OutOfRange {
                name: "unicode_object.asciiobject_size",
                value: words[w::STR_ASCII_SIZE],
            })?,
    })
}

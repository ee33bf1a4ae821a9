//! The CPython interpreter record (128 bytes, little-endian): what the enricher reads
//! from an interpreter's file and the sampler will hand to the BPF walk. The enricher
//! builds it; the sampler checks it with [`Record::check`] and forwards nothing it has
//! not checked. A record only says where to look: the BPF walk still verifies, in the
//! process's own memory, that what it finds there is the interpreter's code, str and
//! bytes objects before anything leaves it (DESIGN rule 9).

/// Bytes of one record.
pub const RECORD_BYTES: usize = 128;
/// The record's own format, its first byte.
pub const FORMAT: u8 = 1;
/// Minor versions of CPython 3 the walk knows the frame rules of.
pub const MINORS: std::ops::RangeInclusive<u8> = 10..=13;
/// Largest offset of any field: every read stays near the object it starts from.
pub const MAX_OFFSET: u16 = 8192;
/// Largest code object (fixed part): CPython's are 176 to 208 bytes.
pub const MAX_CODE_SIZE: u16 = 1024;
/// Largest eval loop, hot or cold part (CPython 3.13's is 48 KiB).
pub const MAX_EVAL_BYTES: u64 = 1 << 20;
/// User addresses end here (x86_64, 4-level paging).
pub const USER_END: u64 = 1 << 47;
/// `cframe` absent.
pub const NONE: u16 = u16::MAX;

/// The offsets (in [`Record`]'s wire order: runtime_interpreters, interp_threads_head,
/// tstate_next, tstate_thread_id, tstate_frame, cframe_frame, frame_previous,
/// frame_code, frame_instr, boundary_offset, code_adaptive, code_size, code_filename,
/// code_name, code_linetable, code_firstlineno, object_type, type_name, str_state,
/// str_length, str_ascii_data, bytes_size, bytes_data) of each version's standard
/// (non-debug, GIL) build, checked by the enricher's tests against the headers of
/// 3.10.13, 3.11.2, 3.11.7, 3.12.1 and 3.13.0's `_Py_DebugOffsets`.
pub const LAYOUTS: [(u8, [u16; 23]); 4] = [
    (
        10,
        [
            40, 8, 8, 176, 24, NONE, 24, 32, 96, 0, 0, 176, 104, 112, 120, 40, 8, 24, 32, 16, 48,
            16, 32,
        ],
    ),
    (
        11,
        [
            48, 16, 8, 152, 56, 8, 48, 32, 56, 68, 184, 192, 112, 128, 136, 72, 8, 24, 32, 16, 48,
            16, 32,
        ],
    ),
    (
        12,
        [
            48, 72, 8, 136, 56, 0, 8, 0, 56, 70, 192, 200, 112, 128, 136, 68, 8, 24, 32, 16, 40,
            16, 32,
        ],
    ),
    (
        13,
        [
            632, 7344, 8, 152, 72, NONE, 8, 0, 56, 70, 200, 208, 112, 128, 136, 68, 8, 24, 32, 16,
            40, 16, 32,
        ],
    ),
];

/// How the bytecode position is kept.
pub const POSITION_LASTI: u8 = 0;
pub const POSITION_POINTER: u8 = 1;
/// How an eval call's frames end.
pub const BOUNDARY_ONE_FRAME: u8 = 0;
pub const BOUNDARY_IS_ENTRY: u8 = 1;
pub const BOUNDARY_OWNER: u8 = 2;

/// One record, field by field (offsets in bytes; addresses as the file's virtual
/// addresses, the eval loop's ranges as file offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Record {
    pub minor: u8,
    /// `u8::MAX` when the file does not say.
    pub micro: u8,
    pub position: u8,
    pub boundary: u8,
    /// The `owner` value from which a frame is the eval call's shim.
    pub cstack: u8,
    pub code_tag_bits: u8,
    pub text_delta: u64,
    pub runtime: u64,
    pub code_type: u64,
    pub str_type: u64,
    pub bytes_type: u64,
    pub eval: (u64, u64),
    /// (0, 0) when the file has no cold part (or does not name it).
    pub eval_cold: (u64, u64),
    pub runtime_interpreters: u16,
    pub interp_threads_head: u16,
    pub tstate_next: u16,
    pub tstate_thread_id: u16,
    pub tstate_frame: u16,
    pub cframe_frame: u16,
    pub frame_previous: u16,
    pub frame_code: u16,
    pub frame_instr: u16,
    pub boundary_offset: u16,
    pub code_adaptive: u16,
    pub code_size: u16,
    pub code_filename: u16,
    pub code_name: u16,
    pub code_linetable: u16,
    pub code_firstlineno: u16,
    pub object_type: u16,
    pub type_name: u16,
    pub str_state: u16,
    pub str_length: u16,
    pub str_ascii_data: u16,
    pub bytes_size: u16,
    pub bytes_data: u16,
}

/// Why the sampler refuses a record (each reason is one counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalid {
    Format,
    Version,
    /// Position or boundary rules that are not this version's.
    Rules,
    Address,
    EvalRange,
    Offset,
    Alignment,
    /// Offsets that are not those of the version's standard build (see [`LAYOUTS`]).
    Layout,
}

impl Invalid {
    pub fn name(self) -> &'static str {
        match self {
            Self::Format => "format",
            Self::Version => "version",
            Self::Rules => "rules",
            Self::Address => "address",
            Self::EvalRange => "eval_range",
            Self::Offset => "offset",
            Self::Alignment => "alignment",
            Self::Layout => "layout",
        }
    }
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Record {
    /// The u16 offsets in their wire order.
    fn offsets(&self) -> [u16; 23] {
        [
            self.runtime_interpreters,
            self.interp_threads_head,
            self.tstate_next,
            self.tstate_thread_id,
            self.tstate_frame,
            self.cframe_frame,
            self.frame_previous,
            self.frame_code,
            self.frame_instr,
            self.boundary_offset,
            self.code_adaptive,
            self.code_size,
            self.code_filename,
            self.code_name,
            self.code_linetable,
            self.code_firstlineno,
            self.object_type,
            self.type_name,
            self.str_state,
            self.str_length,
            self.str_ascii_data,
            self.bytes_size,
            self.bytes_data,
        ]
    }

    pub fn to_bytes(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[..8].copy_from_slice(&[
            FORMAT,
            self.minor,
            self.micro,
            self.position,
            self.boundary,
            self.cstack,
            self.code_tag_bits,
            0,
        ]);
        let words = [
            self.text_delta,
            self.runtime,
            self.code_type,
            self.str_type,
            self.bytes_type,
            self.eval.0,
            self.eval.1,
            self.eval_cold.0,
            self.eval_cold.1,
        ];
        for (i, w) in words.iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&w.to_le_bytes());
        }
        for (i, o) in self.offsets().iter().enumerate() {
            b[80 + 2 * i..82 + 2 * i].copy_from_slice(&o.to_le_bytes());
        }
        b
    }

    /// Decodes a record; `None` when the length or the format byte is not this one's.
    /// Reserved bytes must be zero, so one record has one encoding.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let b: &[u8; RECORD_BYTES] = b.try_into().ok()?;
        if b[0] != FORMAT || b[7] != 0 || b[126..].iter().any(|x| *x != 0) {
            return None;
        }
        let w = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[8 + 8 * i..16 + 8 * i]);
            u64::from_le_bytes(a)
        };
        let o = |i: usize| u16::from_le_bytes([b[80 + 2 * i], b[81 + 2 * i]]);
        Some(Self {
            minor: b[1],
            micro: b[2],
            position: b[3],
            boundary: b[4],
            cstack: b[5],
            code_tag_bits: b[6],
            text_delta: w(0),
            runtime: w(1),
            code_type: w(2),
            str_type: w(3),
            bytes_type: w(4),
            eval: (w(5), w(6)),
            eval_cold: (w(7), w(8)),
            runtime_interpreters: o(0),
            interp_threads_head: o(1),
            tstate_next: o(2),
            tstate_thread_id: o(3),
            tstate_frame: o(4),
            cframe_frame: o(5),
            frame_previous: o(6),
            frame_code: o(7),
            frame_instr: o(8),
            boundary_offset: o(9),
            code_adaptive: o(10),
            code_size: o(11),
            code_filename: o(12),
            code_name: o(13),
            code_linetable: o(14),
            code_firstlineno: o(15),
            object_type: o(16),
            type_name: o(17),
            str_state: o(18),
            str_length: o(19),
            str_ascii_data: o(20),
            bytes_size: o(21),
            bytes_data: o(22),
        })
    }

    /// The sampler's rules, field by field.
    pub fn check(&self) -> Result<(), Invalid> {
        if !MINORS.contains(&self.minor) {
            return Err(Invalid::Version);
        }
        self.check_rules()?;
        // Objects: user addresses of the file, word-aligned (a 0 is no address).
        for a in [self.runtime, self.code_type, self.str_type, self.bytes_type] {
            if a == 0 || a >= USER_END {
                return Err(Invalid::Address);
            }
            if !a.is_multiple_of(8) {
                return Err(Invalid::Alignment);
            }
        }
        let (s, e) = self.eval;
        if s >= e || e - s > MAX_EVAL_BYTES || e > u64::from(u32::MAX) {
            return Err(Invalid::EvalRange);
        }
        let (cs, ce) = self.eval_cold;
        if (cs, ce) != (0, 0)
            && (cs >= ce
                || ce - cs > MAX_EVAL_BYTES
                || ce > u64::from(u32::MAX)
                || (cs < e && s < ce))
        {
            return Err(Invalid::EvalRange);
        }
        self.check_offsets()?;
        self.check_layout()
    }

    /// The offsets must be exactly those of the version's standard build: a record can
    /// then only say where an interpreter's objects are, never which of their bytes the
    /// walk copies (a lying offset could aim a name's copy at a neighbour's bytes).
    fn check_layout(&self) -> Result<(), Invalid> {
        let want = LAYOUTS
            .iter()
            .find(|(m, _)| *m == self.minor)
            .map(|(_, o)| o);
        if want == Some(&self.offsets()) {
            Ok(())
        } else {
            Err(Invalid::Layout)
        }
    }

    fn check_rules(&self) -> Result<(), Invalid> {
        let rules = (self.position, self.boundary, self.cframe_frame != NONE);
        let ok = match self.minor {
            10 => rules == (POSITION_LASTI, BOUNDARY_ONE_FRAME, false) && self.code_adaptive == 0,
            11 => rules == (POSITION_POINTER, BOUNDARY_IS_ENTRY, true),
            12 => rules == (POSITION_POINTER, BOUNDARY_OWNER, true),
            _ => rules == (POSITION_POINTER, BOUNDARY_OWNER, false),
        };
        let cstack_ok = match self.boundary {
            BOUNDARY_OWNER => self.cstack == 3,
            _ => {
                self.cstack == 0
                    && (self.boundary == BOUNDARY_IS_ENTRY || self.boundary_offset == 0)
            }
        };
        // Tagged code pointers start with 3.14, which the walk does not know yet.
        if ok && cstack_ok && self.code_tag_bits == 0 {
            Ok(())
        } else {
            Err(Invalid::Rules)
        }
    }

    fn check_offsets(&self) -> Result<(), Invalid> {
        if self.code_size == 0 || self.code_size > MAX_CODE_SIZE {
            return Err(Invalid::Offset);
        }
        // Pointers and sizes are read as whole, aligned words.
        let words = [
            self.runtime_interpreters,
            self.interp_threads_head,
            self.tstate_next,
            self.tstate_thread_id,
            self.tstate_frame,
            self.frame_previous,
            self.frame_code,
            self.object_type,
            self.type_name,
            self.str_length,
            self.bytes_size,
        ];
        let code_words = [self.code_filename, self.code_name, self.code_linetable];
        // `prev_instr`/`instr_ptr` are pointers; 3.10's `f_lasti` is an int.
        let instr_align = if self.position == POSITION_POINTER {
            8
        } else {
            4
        };
        let mut all = words.to_vec();
        all.extend(code_words);
        all.extend([
            self.frame_instr,
            self.boundary_offset,
            self.code_firstlineno,
            self.str_state,
            self.str_ascii_data,
            self.bytes_data,
            self.code_adaptive,
        ]);
        if self.cframe_frame != NONE {
            all.push(self.cframe_frame);
        }
        if all.iter().any(|o| *o > MAX_OFFSET) {
            return Err(Invalid::Offset);
        }
        // A code object's fields lie inside its fixed part; the bytecode starts at its end
        // or before.
        let inside_code = code_words
            .iter()
            .chain(&[self.code_firstlineno])
            .all(|o| o + 8 <= self.code_size)
            && self.code_adaptive <= self.code_size;
        if !inside_code {
            return Err(Invalid::Offset);
        }
        let aligned = words.iter().chain(&code_words).all(|o| o.is_multiple_of(8))
            && (self.cframe_frame == NONE || self.cframe_frame.is_multiple_of(8))
            && self.frame_instr.is_multiple_of(instr_align)
            && self.code_firstlineno.is_multiple_of(4)
            && self.str_state.is_multiple_of(4)
            && self.code_adaptive.is_multiple_of(8)
            && self.str_ascii_data.is_multiple_of(8)
            && self.bytes_data.is_multiple_of(8);
        if aligned {
            Ok(())
        } else {
            Err(Invalid::Alignment)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPython 3.12.1's record, as the enricher makes it from pyenv's libpython.
    fn v3_12() -> Record {
        Record {
            minor: 12,
            micro: 1,
            position: POSITION_POINTER,
            boundary: BOUNDARY_OWNER,
            cstack: 3,
            code_tag_bits: 0,
            text_delta: 0,
            runtime: 0x64_3340,
            code_type: 0x54_9e80,
            str_type: 0x56_3c20,
            bytes_type: 0x54_8840,
            eval: (0x10_bdc0, 0x11_882d),
            eval_cold: (0x10_ba24, 0x10_bdb0),
            runtime_interpreters: 48,
            interp_threads_head: 72,
            tstate_next: 8,
            tstate_thread_id: 136,
            tstate_frame: 56,
            cframe_frame: 0,
            frame_previous: 8,
            frame_code: 0,
            frame_instr: 56,
            boundary_offset: 70,
            code_adaptive: 192,
            code_size: 200,
            code_filename: 112,
            code_name: 128,
            code_linetable: 136,
            code_firstlineno: 68,
            object_type: 8,
            type_name: 24,
            str_state: 32,
            str_length: 16,
            str_ascii_data: 40,
            bytes_size: 16,
            bytes_data: 32,
        }
    }

    #[test]
    fn a_real_record_passes_and_round_trips() {
        let r = v3_12();
        assert_eq!(r.check(), Ok(()));
        assert_eq!(Record::from_bytes(&r.to_bytes()), Some(r));
        let mut b = r.to_bytes();
        b[0] = 2;
        assert_eq!(Record::from_bytes(&b), None, "another format");
        assert_eq!(Record::from_bytes(&b[..64]), None, "short");
        let mut b = r.to_bytes();
        b[127] = 1;
        assert_eq!(Record::from_bytes(&b), None, "reserved bytes set");
    }

    #[test]
    fn every_lie_is_named() {
        type Lie = (fn(&mut Record), Invalid);
        let lies: &[Lie] = &[
            (|r| r.minor = 9, Invalid::Version),
            (|r| r.minor = 14, Invalid::Version),
            (|r| r.boundary = BOUNDARY_IS_ENTRY, Invalid::Rules),
            (|r| r.cframe_frame = NONE, Invalid::Rules),
            (|r| r.cstack = 4, Invalid::Rules),
            (|r| r.code_tag_bits = 3, Invalid::Rules),
            (|r| r.runtime = 0, Invalid::Address),
            (|r| r.code_type = USER_END, Invalid::Address),
            (|r| r.str_type += 4, Invalid::Alignment),
            (|r| r.eval = (10, 10), Invalid::EvalRange),
            (|r| r.eval = (0, MAX_EVAL_BYTES + 1), Invalid::EvalRange),
            (|r| r.eval_cold = (0x10_be00, 0x10_bf00), Invalid::EvalRange),
            (|r| r.tstate_frame = MAX_OFFSET + 8, Invalid::Offset),
            (|r| r.code_size = 4096, Invalid::Offset),
            (|r| r.code_name = 200, Invalid::Offset),
            (|r| r.code_adaptive = 208, Invalid::Offset),
            (|r| r.frame_previous = 12, Invalid::Alignment),
            (|r| r.type_name = 25, Invalid::Alignment),
            (|r| r.frame_instr = 60, Invalid::Alignment),
            (|r| r.code_firstlineno = 66, Invalid::Alignment),
            (|r| r.str_ascii_data = 48, Invalid::Layout),
            (|r| r.code_name = 120, Invalid::Layout),
        ];
        for (i, (lie, why)) in lies.iter().enumerate() {
            let mut r = v3_12();
            lie(&mut r);
            assert_eq!(r.check(), Err(*why), "lie {i}: {r:?}");
        }
    }
}

//! The Cap'n Proto contract between `firn-sampler` and `firn-enricher`, plus the limits
//! both sides enforce when reading it.

#[allow(
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks,
    missing_docs,
    unused_qualifications
)]
pub mod firn_capnp {
    include!(concat!(env!("OUT_DIR"), "/firn_capnp.rs"));
}

pub use firn_capnp::PROTOCOL_VERSION;

/// Now as Unix time in nanoseconds: the clock of every time on the wire (round spans,
/// process start times are boot-relative and say so).
pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// CLOCK_BOOTTIME in ns: the clock of `Process.firstSampleNs`, the same for the sampler
/// and the enricher on one node (0 if unreadable).
pub fn boot_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to write.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut t) } != 0 {
        return 0;
    }
    u64::try_from(t.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(t.tv_nsec).unwrap_or(0)
}

/// Upper bounds on every list either side accepts. A message beyond one is rejected.
/// The sampler's counters that are gauges (a value now, that goes down as well as up),
/// for readers that export them with their type. The sampler's tests keep this list and
/// its counters' texts ("a gauge") in step.
pub const SAMPLER_GAUGES: &[&str] = &[
    "unwind_rows_in_use",
    "heap_used_bytes",
    "heap_free_bytes",
    "processes_known",
    "python_interpreters_in_use",
];

pub mod limits {
    /// Samples in one batch: the BPF counts map holds at most this many keys.
    pub const MAX_SAMPLES: u32 = 16_384;
    /// Process records in one batch, and forgotten process ids.
    pub const MAX_PROCESSES: u32 = 65_536;
    /// Frames of one stack (`PERF_MAX_STACK_DEPTH`).
    pub const MAX_FRAMES: u32 = 127;
    /// Distinct kernel symbols in one batch.
    pub const MAX_KERNEL_SYMBOLS: u32 = 65_536;
    /// Bytes of one kernel symbol name.
    pub const MAX_SYMBOL_BYTES: u32 = 512;
    /// Executable mappings of one process.
    pub const MAX_MAPPINGS: u32 = 4_096;
    /// Arguments kept from a command line, and bytes in all.
    pub const MAX_CMDLINE_ARGS: u32 = 64;
    pub const MAX_CMDLINE_BYTES: u32 = 4_096;
    /// Bytes of a path, comm or cgroup field.
    pub const MAX_PATH_BYTES: u32 = 4_096;
    /// Counters in a batch or info reply.
    pub const MAX_COUNTERS: u32 = 256;
    /// Rows in one loadUnwindTable chunk (256 KiB: well within the sampler's reader).
    pub const MAX_TABLE_CHUNK_ROWS: u32 = crate::firn_capnp::MAX_TABLE_CHUNK_ROWS;
    /// Python code blobs in one batch, and bytes of one.
    pub const MAX_PYTHON_CODES: u32 = crate::firn_capnp::MAX_PYTHON_CODES;
    pub const PYTHON_CODE_MAX_BYTES: u32 = crate::firn_capnp::PYTHON_CODE_MAX_BYTES;
}

/// The unwind row of `loadUnwindTable` (8 bytes, little-endian): the enricher builds
/// rows, the sampler checks them and writes them for the BPF unwinder, whose header
/// (`profile.bpf.h`) has the same kinds (the sampler asserts they agree).
pub mod unwind_row {
    /// No row covers the pc (past the end of a function).
    pub const CFA_NONE: u8 = 0;
    /// CFA = rsp + cfa_offset.
    pub const CFA_RSP: u8 = 1;
    /// CFA = rbp + cfa_offset.
    pub const CFA_RBP: u8 = 2;
    /// PLT entry: CFA = rsp + 8, + 8 when (pc & 15) >= cfa_offset.
    pub const CFA_PLT: u8 = 3;
    /// Signal trampoline: registers come from the ucontext at rsp.
    pub const CFA_SIGNAL: u8 = 4;
    /// A rule the unwinder cannot follow.
    pub const CFA_UNSUPPORTED: u8 = 5;
    /// Return address undefined: the outermost frame.
    pub const CFA_STOP: u8 = 6;
    pub const CFA_KINDS: u8 = 7;
    /// The caller's rbp is this frame's.
    pub const RBP_SAME: u8 = 0;
    /// Saved at CFA + 8 * rbp_offset8.
    pub const RBP_AT_CFA: u8 = 1;
    /// Not recoverable.
    pub const RBP_UNKNOWN: u8 = 2;
    pub const RBP_KINDS: u8 = 3;
    /// Largest offset of an rbp-based CFA (`FIRN_MAX_RBP_CFA_OFFSET`): real binaries use
    /// rbp + 16, hand-written assembly up to rbp + 128 (measured over 3,574 ELF files).
    pub const MAX_RBP_CFA_OFFSET: u16 = 256;

    /// One row.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Row {
        pub pc: u32,
        pub cfa_offset: u16,
        pub cfa: u8,
        pub rbp: u8,
        pub rbp_offset8: i8,
    }

    impl Row {
        pub fn to_bytes(self) -> [u8; 8] {
            let mut b = [0u8; 8];
            b[..4].copy_from_slice(&self.pc.to_le_bytes());
            b[4..6].copy_from_slice(&self.cfa_offset.to_le_bytes());
            b[6] = self.cfa | self.rbp << 4;
            b[7] = self.rbp_offset8 as u8;
            b
        }

        pub fn from_bytes(b: [u8; 8]) -> Self {
            Self {
                pc: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                cfa_offset: u16::from_le_bytes([b[4], b[5]]),
                cfa: b[6] & 0xf,
                rbp: b[6] >> 4,
                rbp_offset8: b[7] as i8,
            }
        }

        /// The sampler's range rules for one row (what it refuses as malformed).
        pub fn valid(&self) -> bool {
            if self.cfa >= CFA_KINDS || self.rbp >= RBP_KINDS {
                return false;
            }
            let cfa_ok = match self.cfa {
                // The return address is at CFA - 8, above the stack pointer, and every
                // offset is whole words: a row can never make the unwinder read a word
                // made of the bytes of two (a handful of real leaf functions move rsp
                // by odd amounts; the enricher marks those rows unsupported).
                CFA_RSP => self.cfa_offset >= 8 && self.cfa_offset.is_multiple_of(8),
                CFA_RBP => {
                    self.cfa_offset >= 8
                        && self.cfa_offset <= MAX_RBP_CFA_OFFSET
                        && self.cfa_offset.is_multiple_of(8)
                }
                // A threshold on the pc's low four bits.
                CFA_PLT => self.cfa_offset <= 16,
                _ => self.cfa_offset == 0,
            };
            // A saved rbp lies below the CFA; other kinds carry no offset.
            let rbp_ok = if self.rbp == RBP_AT_CFA {
                self.rbp_offset8 < 0
            } else {
                self.rbp_offset8 == 0
            };
            cfa_ok && rbp_ok
        }
    }
}

pub mod python_code;
pub mod python_record;

/// Reader limits for what the enricher receives (batches can be tens of MiB).
pub fn enricher_reader_options() -> capnp::message::ReaderOptions {
    let mut o = capnp::message::ReaderOptions::new();
    // 16 Mi words = 128 MiB of traversal: above the largest legal batch, far below RAM.
    o.traversal_limit_in_words(Some(16 * 1024 * 1024));
    o.nesting_limit(16);
    o
}

/// Reader limits for what the sampler receives: only small requests are legal.
pub fn sampler_reader_options() -> capnp::message::ReaderOptions {
    let mut o = capnp::message::ReaderOptions::new();
    o.traversal_limit_in_words(Some(64 * 1024));
    o.nesting_limit(8);
    o
}

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

/// Upper bounds on every list either side accepts. A message beyond one is rejected.
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
}

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

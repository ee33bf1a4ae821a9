//! firn's BPF sampling program, compiled by clang at build time, as a libbpf-rs skeleton.
//!
//! The C side lives in `src/bpf/`; `profile.bpf.h` defines the key and counter layout
//! that the sampler reads back, and the skeleton generates their Rust types from the
//! program's BTF (`types::firn_sample_key`, `types::firn_counter`): one definition.

#[allow(
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks,
    missing_docs,
    non_camel_case_types
)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/profile.skel.rs"));
}

pub use skel::*;

// The key (`types::firn_sample_key`) and the per-CPU counter slots
// (`types::firn_counter`) are generated from `profile.bpf.h` through the program's BTF.

/// Deepest stack the program records (`PERF_MAX_STACK_DEPTH`).
pub const MAX_STACK_DEPTH: usize = 127;
/// Length of a task's comm, NUL included.
pub const COMM_LEN: usize = 16;

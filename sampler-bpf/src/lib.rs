//! firn's BPF sampling program, compiled by clang at build time, as a libbpf-rs skeleton.
//!
//! The C side lives in `src/bpf/`; `profile.bpf.h` defines the key and counter layout
//! that the sampler reads back.

#[allow(clippy::all, clippy::pedantic, missing_docs, non_camel_case_types)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/profile.skel.rs"));
}

pub use skel::*;

/// Per-CPU counter slots, mirroring `enum firn_counter` in `profile.bpf.h`.
pub mod counter {
    pub const SAMPLES: u32 = 0;
    pub const IDLE: u32 = 1;
    pub const USER_STACK_FULL: u32 = 2;
    pub const KERN_STACK_FULL: u32 = 3;
    pub const USER_STACK_ERR: u32 = 4;
    pub const KERN_STACK_ERR: u32 = 5;
    pub const COUNTS_FULL: u32 = 6;
    pub const COUNT: u32 = 7;
}

/// Deepest stack the program records (`PERF_MAX_STACK_DEPTH`).
pub const MAX_STACK_DEPTH: usize = 127;
/// Length of a task's comm, NUL included.
pub const COMM_LEN: usize = 16;

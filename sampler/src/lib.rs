//! firn-sampler as a library: [`main`] runs it (`src/main.rs` is only its entry); the
//! fuzz targets and tests drive the connection handling and read the tables below.

mod alloc;
mod assemble;
mod attach;
mod broker;
mod cgroups;
mod cli;
mod counters;
mod cpus;
mod drain;
mod drop;
mod events;
mod facts;
mod handles;
mod hub;
mod kallsyms;
mod layouts;
mod lifecycle;
mod listen;
mod preflight;
#[cfg(feature = "forbidden-probe")]
mod probe;
mod processes;
mod procfs;
mod reading;
mod rounds;
mod rpc;
mod run;
mod sample_log;
mod texts;
mod trim;
mod unwind;
mod wire;

pub use lifecycle::main;

// What the fuzz targets and tests drive.
pub use alloc::Allocator;
pub use counters::Counters;
pub use drop::{ALLOWED, RARE, SETUP};
pub use handles::Handles;
pub use hub::Hub;
pub use procfs::MAX_RECORD_BYTES;
pub use rpc::{handle as handle_connection, Identity, Shared};
pub use unwind::pages::{self, PageIndex};
pub use unwind::{check_rows, check_rows_with, Pool, Unwind, ROW_BYTES};

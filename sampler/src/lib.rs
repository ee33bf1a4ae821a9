//! firn-sampler as a library: the binary (`src/main.rs`) runs it; the fuzz targets
//! drive the connection handling directly.

pub mod assemble;
pub mod attach;
pub mod broker;
pub mod cli;
pub mod counters;
pub mod drain;
pub mod drop;
pub mod events;
pub mod handles;
pub mod hub;
pub mod kallsyms;
pub mod listen;
pub mod preflight;
#[cfg(feature = "forbidden-probe")]
pub mod probe;
pub mod processes;
pub mod procfs;
pub mod rounds;
pub mod rpc;
pub mod run;
pub mod trim;
pub mod unwind;
pub mod wire;

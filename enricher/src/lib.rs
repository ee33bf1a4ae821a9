//! firn-enricher as a library: the binary (`src/main.rs`) wires these stages together;
//! the benchmarks drive them directly.

pub mod batch;
pub mod broker;
pub mod cli;
pub mod client;
pub mod config;
pub mod encode;
pub mod enrich;
pub mod http;
pub mod labels;
pub mod metrics;
pub mod processes;
pub mod profile;
pub mod sinks;
pub mod summary;
pub mod symbolize;
pub mod unwind;
pub mod upload;
pub mod view;

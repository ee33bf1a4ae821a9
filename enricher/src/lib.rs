//! firn-enricher as a library: [`main`] runs it (`src/main.rs` is only its entry); the
//! benchmarks, fuzz targets and tests drive the stages through the re-exports below.

mod batch;
mod broker;
mod client;
mod confine;
mod credentials;
mod enrich;
mod gzip;
mod heap;
mod labels;
mod metrics;
mod model;
mod output;
mod pprof;
mod processes;
mod python;
mod run;
mod settings;
mod summary;
mod symbolize;
mod unwind;

pub use run::{confine_as_enricher, main};

// What the benchmarks, fuzz targets and tests drive.
pub use batch::decode as decode_batch;
pub use enrich::Enricher;
pub use labels::cgroup;
pub use labels::relabel;
pub use labels::{Labeler, System};
pub use metrics::Metrics;
pub use model::{BinaryId, Frame, LabelSet, Line, Lines, MappingSpec, Round, StackSample};
pub use pprof::{encode_gz, Builder as PprofBuilder};
pub use settings::file::{parse as parse_config, Labeling, Parsed as ParsedConfig};
pub use settings::ProfileBy;
pub use symbolize::{panic_is_contained, Limits as SymbolLimits, Symbolizer};
pub use unwind::build as build_unwind_table;
pub use unwind::{
    build_with as build_unwind_table_with, synthetic as unwind_synthetic, Walk as UnwindWalk,
};

/// The encodings of a round, as the outputs make them.
pub mod encodings {
    pub use crate::output::group::{groups, per_label_set, Encoded, Groups};
    pub use crate::output::http::view::{build as view, Query as ViewQuery};
    pub use crate::output::layout::RoundLayout;
    pub use crate::output::opensearch::{encode as opensearch, Format as OpenSearchFormat};
    pub use crate::output::otlp::encode as otlp;
    pub use crate::output::parca::encode as parca;
}

/// CPython interpreters: their analysis from the file and their line tables (driven by
/// the fuzz targets and tests until the BPF walk uses them).
pub mod cpython {
    pub use crate::python::*;
}

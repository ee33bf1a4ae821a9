//! CPython: what the BPF walk needs to read a process's Python frames, found in the
//! interpreter's own file (DESIGN rule 1: the sampler parses no ELF), and the decoders
//! for what BPF copies out of a process (names and line tables).

mod detect;
mod layout;
mod lines;
mod names;

pub use detect::{analyze, might_be_cpython, minor_from_name, AnalysisError, Interpreter, Version};
pub use layout::{Boundary, DebugOffsetsError, Layout, Position};
pub use lines::{line_at, ranges as line_ranges, Format as LineFormat};
pub use names::{Names, Taken};

#[cfg(test)]
mod tests;

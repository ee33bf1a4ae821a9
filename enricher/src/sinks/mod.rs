//! Where profiles go. The local directory is the embedded default.

pub mod local;

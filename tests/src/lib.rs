//! Helpers for firn's end-to-end tests: they run the real release binaries against
//! real workloads on this kernel. They need root; when BPF cannot be used they skip,
//! unless `CI=true` or `FIRN_REQUIRE_BPF=1`, where they fail.

mod cgroups;
pub mod containers;
mod env;
mod firn;
pub mod liar;
mod proc;
mod profiles;
pub mod pyframes;
mod receivers;
mod workloads;

pub use cgroups::*;
pub use env::*;
pub use firn::*;
pub use firn_schema::now_ns;
pub use proc::*;
pub use profiles::*;
pub use receivers::*;
pub use serde_json::Value;
pub use workloads::*;

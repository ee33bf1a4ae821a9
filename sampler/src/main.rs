//! firn-sampler: setup while privileged, then drop, confine, and run rounds.

/// The system's allocator, keeping one freed table-chunk buffer for the next (`alloc.rs`).
#[global_allocator]
static ALLOCATOR: firn_sampler::Allocator = firn_sampler::Allocator;

fn main() -> std::process::ExitCode {
    firn_sampler::main()
}

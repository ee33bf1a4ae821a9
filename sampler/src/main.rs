//! firn-sampler: setup while privileged, then drop, confine, and run rounds.

fn main() -> std::process::ExitCode {
    firn_sampler::main()
}

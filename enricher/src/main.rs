//! firn-enricher: subscribes to the sampler, symbolizes, encodes pprof, writes the
//! local sink and serves HTTP. Unprivileged by design.

fn main() -> std::process::ExitCode {
    firn_enricher::main()
}

//! Prints how to start firn the way the end-to-end tests do, as one JSON line, for
//! tests/bench/firn_bench.py: the same user, directories, flags and readiness lines,
//! from one definition (`firn_tests::Plan`). It prepares the directory and the user; it
//! starts nothing.
//!
//!   firn-plan DIR USER HTTP_ADDRESS [SAMPLER FLAGS…]

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, user, http, sampler @ ..] = args.as_slice() else {
        eprintln!("usage: firn-plan DIR USER HTTP_ADDRESS [SAMPLER FLAGS…]");
        std::process::exit(2);
    };
    let dir = std::path::Path::new(dir);
    if !dir.is_dir() {
        eprintln!("firn-plan: {} is not a directory", dir.display());
        std::process::exit(2);
    }
    let flags: Vec<&str> = sampler.iter().map(String::as_str).collect();
    let plan = firn_tests::Plan::prepare(dir, user, &flags);
    let line = serde_json::json!({
        "plan": plan,
        "enricher": plan.enricher(http, &[]),
    });
    println!("{line}");
}

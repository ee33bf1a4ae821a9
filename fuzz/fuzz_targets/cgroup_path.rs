//! /proc/<pid>/cgroup text (forwarded as bytes by the sampler, so attacker-shaped for a
//! process that can rename its cgroups) through the cgroup label parser.
#![no_main]

use firn_enricher::cgroup;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let facts = cgroup::facts(&text);
    if let Some(p) = cgroup::pick_path(&text) {
        let _ = cgroup::parse_path(p);
    }
    drop(facts);
});

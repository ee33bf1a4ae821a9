//! The config file parser and Prometheus relabeling: arbitrary text as a config, and
//! if it is accepted, its rules applied to a realistic label set.
#![no_main]

use std::collections::BTreeMap;
use std::path::Path;

use firn_enricher::{parse_config, relabel};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(parsed) = parse_config(text, Path::new("fuzz.yaml")) else {
        return;
    };
    let labels: BTreeMap<String, String> = [
        ("__meta_process_pid", "4242"),
        ("__meta_process_comm", "busy"),
        ("__meta_process_executable", "/usr/bin/busy"),
        ("__meta_cgroup_path", "/system.slice/busy.service"),
        ("__meta_systemd_unit", "busy.service"),
        ("__meta_container_id", ""),
        ("node", "fuzz"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    if let Some(out) = relabel::apply(&parsed.labeling.rules, labels) {
        let _ = relabel::finish(out);
    }
});

//! Human-readable (or JSON) output of the stream, until profiles exist.

use std::collections::HashMap;
use std::io::Write;

use crate::client::Event;

pub struct Printer {
    json: bool,
    top: usize,
}

impl Printer {
    pub fn new(json: bool, top: usize) -> Self {
        Self { json, top }
    }

    pub fn event(&mut self, ev: &Event) {
        let mut out = std::io::stdout().lock();
        let r = match ev {
            Event::Connected(info, _) if self.json => writeln!(
                out,
                "{}",
                serde_json::json!({
                    "connected": {
                        "session_id": info.session_id,
                        "node": info.node,
                        "kernel_release": info.kernel_release,
                        "frequency_hz": info.frequency_hz,
                        "round_seconds": info.round_seconds,
                        "kept_capabilities": info.kept_capabilities,
                        "counters": info.counters,
                    }
                })
            ),
            Event::Connected(info, _) => {
                writeln!(
                out,
                "connected: node {} kernel {} sampling at {} Hz, {} s rounds, sampler keeps {:?}",
                info.node, info.kernel_release, info.frequency_hz, info.round_seconds,
                info.kept_capabilities
            )
            }
            Event::Disconnected if self.json => writeln!(out, "{{\"disconnected\":true}}"),
            Event::Disconnected => writeln!(out, "disconnected; reconnecting"),
            Event::Batch(b) if self.json => match serde_json::to_string(b) {
                Ok(s) => writeln!(out, "{{\"batch\":{s}}}"),
                Err(e) => writeln!(out, "{{\"error\":{:?}}}", e.to_string()),
            },
            Event::Batch(b) => {
                let samples: u64 = b.samples.iter().map(|s| s.count).sum();
                let pids: std::collections::HashSet<u32> =
                    b.samples.iter().map(|s| s.pid).collect();
                let mut by_sym: HashMap<u32, u64> = HashMap::new();
                for s in &b.samples {
                    if let Some(&leaf) = s.kernel_frames.first() {
                        *by_sym.entry(leaf).or_default() += s.count;
                    }
                }
                let mut top: Vec<_> = by_sym.into_iter().collect();
                top.sort_by_key(|t| std::cmp::Reverse(t.1));
                let names: Vec<String> = top
                    .iter()
                    .take(self.top)
                    .map(|(i, n)| format!("{} ({n})", b.kernel_symbols[*i as usize]))
                    .collect();
                writeln!(
                    out,
                    "round {}: {} samples from {} processes ({} new records), {} batches dropped; top kernel: {}",
                    b.round,
                    samples,
                    pids.len(),
                    b.processes.len(),
                    b.dropped_batches,
                    names.join(", ")
                )
            }
        };
        if r.is_err() {
            // stdout closed: nothing to report to.
        }
    }
}

//! `--dump`: the stream as JSON lines on stdout, for debugging and for the tests that
//! inspect exactly what the sampler sent.

use std::io::Write;

use crate::client::Event;

/// The `--dump` printer. Records announced between rounds are printed as an
/// `announce` line (ids only) and again in the next batch's `processes`, so a batch read
/// alone still holds every record its samples need.
#[derive(Default)]
pub(crate) struct Dump {
    announced: Vec<crate::batch::Process>,
    /// The sampler session the announced records belong to.
    session: u64,
}

impl Dump {
    /// Writes one JSON line per event. A closed stdout is not an error worth reporting.
    pub(crate) fn print(&mut self, ev: Event) {
        let ev = match ev {
            Event::Announce(session, p) => {
                if session != self.session {
                    self.announced.clear();
                    self.session = session;
                }
                let ids: Vec<u64> = p.iter().map(|p| p.process_id).collect();
                let pids: Vec<u32> = p.iter().map(|p| p.pid).collect();
                self.announced.extend(p);
                let line = serde_json::json!({ "announce": { "ids": ids, "pids": pids } });
                let _ = writeln!(std::io::stdout().lock(), "{line}");
                return;
            }
            Event::Batch(mut b) => {
                let mut p = std::mem::take(&mut self.announced);
                p.retain(|_| b.session_id == self.session);
                p.append(&mut b.processes);
                b.processes = p;
                Event::Batch(b)
            }
            Event::Connected(..) | Event::Disconnected => ev,
        };
        print(&ev);
    }
}

fn print(ev: &Event) {
    let line = match ev {
        Event::Connected(info, _) => serde_json::json!({
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
        .to_string(),
        Event::Disconnected => "{\"disconnected\":true}".to_string(),
        Event::Batch(b) => match serde_json::to_string(b) {
            Ok(s) => format!("{{\"batch\":{s}}}"),
            Err(e) => serde_json::json!({ "error": e.to_string() }).to_string(),
        },
        Event::Announce(..) => return,
    };
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

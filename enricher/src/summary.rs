//! `--dump`: the stream as JSON lines on stdout, for debugging and for the tests that
//! inspect exactly what the sampler sent.

use std::io::Write;

use crate::client::Event;

/// Writes one JSON line per event. A closed stdout is not an error worth reporting.
pub(crate) fn print(ev: &Event) {
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
    };
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

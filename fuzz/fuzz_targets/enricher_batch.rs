//! A batch as the enricher receives it: arbitrary bytes through its Cap'n Proto reader
//! limits and batch validation, into the process table, labels and the pprof encoder.
#![no_main]

use std::sync::Arc;

use firn_enricher::encodings::{groups, per_label_set};
use firn_enricher::{decode_batch, Enricher, Labeler, Metrics, ProfileBy, Symbolizer, System};
use firn_enricher::SymbolLimits as Limits;
use firn_schema::firn_capnp;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(msg) = capnp::serialize::read_message_from_flat_slice(
        &mut &data[..],
        firn_schema::enricher_reader_options(),
    ) else {
        return;
    };
    let Ok(root) = msg.get_root::<firn_capnp::batch::Reader>() else {
        return;
    };
    let Ok(b) = decode_batch(root) else {
        return;
    };
    let metrics = Arc::new(Metrics::default());
    let system = System {
        node: "fuzz".into(),
        kernel_release: "6.18".into(),
        machine: "x86_64".into(),
    };
    let labeler = Labeler::new(Vec::new(), Vec::new(), system);
    let mut enricher = Enricher::new(Symbolizer::new(Limits { binaries: 8, ..Limits::default() }, metrics.clone()), labeler, metrics);
    let round = enricher.handle_offline(b);
    for by in [ProfileBy::Process, ProfileBy::Container] {
        for e in per_label_set(&round, &groups(&round, by)) {
            assert!(e.samples >= 0);
        }
    }
});

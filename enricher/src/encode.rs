//! A round's stacks grouped into one pprof per label set (one per process for now),
//! gzip-encoded.

use std::collections::HashMap;
use std::sync::Arc;

use crate::enrich::Round;
use crate::profile::{self, LabelSet};

pub struct Encoded {
    pub labels: Arc<LabelSet>,
    pub samples: i64,
    pub gz: Arc<Vec<u8>>,
}

pub fn per_label_set(round: &Round) -> Vec<Encoded> {
    let mut groups: HashMap<Arc<LabelSet>, Vec<usize>> = HashMap::new();
    for (i, s) in round.stacks.iter().enumerate() {
        groups.entry(s.labels.clone()).or_default().push(i);
    }
    let mut out = Vec::with_capacity(groups.len());
    for (labels, idx) in groups {
        let mut b = profile::Builder::new(round.frequency_hz, round.start_ns, round.end_ns);
        for (k, v) in labels.iter() {
            b.comment(&format!("{k}={v}"));
        }
        for i in idx {
            b.add(&round.stacks[i]);
        }
        let p = b.finish();
        let samples = profile::sample_count(&p);
        match profile::encode_gz(&p) {
            Ok(gz) => out.push(Encoded {
                labels,
                samples,
                gz: Arc::new(gz),
            }),
            Err(e) => tracing::warn!(error = %e, "encoding a profile"),
        }
    }
    out
}

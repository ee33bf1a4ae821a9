//! A round's stacks grouped into one pprof per label set (one per process for now),
//! gzip-encoded.

use std::collections::HashMap;
use std::sync::Arc;

use crate::model::{LabelSet, Round};
use crate::pprof::{self, SampleTypes};
use crate::settings::ProfileBy;

pub struct Encoded {
    /// Its index in the round's [`Groups`].
    pub(crate) group: usize,
    pub(crate) labels: Arc<LabelSet>,
    pub samples: i64,
    pub gz: Arc<Vec<u8>>,
}

const PROCESS_LABELS: &[&str] = &["pid", "comm", "executable", "thread_id", "thread_name"];

/// A round's stacks grouped by what one profile covers: each group's label set and the
/// indices of its stacks in `round.stacks`.
pub type Groups = Vec<(Arc<LabelSet>, Vec<usize>)>;

/// Groups a round once; every sink encodes from the same groups.
pub fn groups(round: &Round, by: ProfileBy) -> Groups {
    let mut groups: HashMap<(Arc<LabelSet>, u64), Vec<usize>> = HashMap::new();
    let mut reduced: HashMap<Arc<LabelSet>, Arc<LabelSet>> = HashMap::new();
    for (i, s) in round.stacks.iter().enumerate() {
        let key = match by {
            ProfileBy::Process => (s.labels.clone(), s.process_id),
            ProfileBy::Labels => (s.labels.clone(), 0),
            ProfileBy::Container => {
                let l = reduced
                    .entry(s.labels.clone())
                    .or_insert_with(|| {
                        Arc::new(
                            s.labels
                                .iter()
                                .filter(|(k, _)| !PROCESS_LABELS.contains(&k.as_str()))
                                .cloned()
                                .collect(),
                        )
                    })
                    .clone();
                (l, 0)
            }
        };
        groups.entry(key).or_default().push(i);
    }
    groups.into_iter().map(|((l, _), idx)| (l, idx)).collect()
}

/// Every group's profile as the local files carry it: on-CPU, and off-CPU as a third
/// sample type when the round measured it.
pub fn per_label_set(round: &Round, groups: &Groups) -> Vec<Encoded> {
    let types = match round.off_cpu {
        true => SampleTypes::OnAndOffCpu,
        false => SampleTypes::OnCpu,
    };
    groups
        .iter()
        .enumerate()
        .filter_map(|(g, (labels, idx))| encode(round, g, labels, idx, types))
        .collect()
}

/// Group `group`'s profile of `types` (a backend that wants another dialect than the
/// local files' encodes its own).
pub(crate) fn encode(
    round: &Round,
    group: usize,
    labels: &Arc<LabelSet>,
    idx: &[usize],
    types: SampleTypes,
) -> Option<Encoded> {
    let mut b = pprof::Builder::of(types, round.frequency_hz, round.start_ns, round.end_ns);
    for (k, v) in labels.iter() {
        b.comment(&format!("{k}={v}"));
    }
    for &i in idx {
        let s = &round.stacks[i];
        if Arc::ptr_eq(&s.labels, labels) {
            b.add(s);
        } else {
            // Merged group: the samples carry the group's labels.
            b.add(&crate::model::StackSample {
                labels: labels.clone(),
                ..s.clone()
            });
        }
    }
    let p = b.finish();
    let samples = pprof::sample_count(&p);
    match pprof::encode_gz(&p) {
        Ok(gz) => Some(Encoded {
            group,
            labels: labels.clone(),
            samples,
            gz: Arc::new(gz),
        }),
        Err(e) => {
            tracing::warn!(error = %e, "encoding a profile");
            None
        }
    }
}

//! A round's stacks grouped into one pprof per label set (one per process for now),
//! gzip-encoded.

use std::collections::HashMap;
use std::sync::Arc;

use crate::enrich::Round;
use crate::profile::{self, LabelSet};

pub struct Encoded {
    /// Its index in the round's [`Groups`].
    pub group: usize,
    pub labels: Arc<LabelSet>,
    pub samples: i64,
    pub gz: Arc<Vec<u8>>,
}

/// What one profile covers (`--profile-by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProfileBy {
    /// One profile per process.
    #[default]
    Process,
    /// One per container: processes of a container merge (labels naming a process —
    /// pid, comm, executable — are left out).
    Container,
    /// One per final label set: processes with equal labels merge.
    Labels,
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

pub fn per_label_set(round: &Round, groups: &Groups) -> Vec<Encoded> {
    let mut out = Vec::with_capacity(groups.len());
    for (group, (labels, idx)) in groups.iter().enumerate() {
        let mut b = profile::Builder::new(round.frequency_hz, round.start_ns, round.end_ns);
        for (k, v) in labels.iter() {
            b.comment(&format!("{k}={v}"));
        }
        for &i in idx {
            let s = &round.stacks[i];
            if Arc::ptr_eq(&s.labels, labels) {
                b.add(s);
            } else {
                // Merged group: the samples carry the group's labels.
                b.add(&profile::StackSample {
                    labels: labels.clone(),
                    ..s.clone()
                });
            }
        }
        let p = b.finish();
        let samples = profile::sample_count(&p);
        match profile::encode_gz(&p) {
            Ok(gz) => out.push(Encoded {
                group,
                labels: labels.clone(),
                samples,
                gz: Arc::new(gz),
            }),
            Err(e) => tracing::warn!(error = %e, "encoding a profile"),
        }
    }
    out
}

/// The file stem of each group's profile within its round: `pid-<pid>`, or `set` when
/// the labels have no pid (`--profile-by container`), numbered when taken twice (a pid
/// reused within a round is two processes).
pub fn file_stems(groups: &Groups) -> Vec<String> {
    let mut taken: HashMap<String, u32> = HashMap::new();
    groups
        .iter()
        .map(|(labels, _)| {
            let base = labels
                .iter()
                .find(|(k, _)| k == "pid")
                .map_or_else(|| "set".to_string(), |(_, v)| format!("pid-{v}"));
            let n = taken.entry(base.clone()).or_insert(0);
            *n += 1;
            if *n == 1 {
                base
            } else {
                format!("{base}-{n}")
            }
        })
        .collect()
}

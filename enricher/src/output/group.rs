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

/// The stacks of a round one profile covers.
#[derive(Debug, Clone)]
pub struct Group {
    pub labels: Arc<LabelSet>,
    /// The sampler's process id with `--profile-by process`, else 0. Per process two
    /// groups of a round can carry equal labels (a program that exec'd itself, or was
    /// sampled between its exec and the kernel's count of it): the ids the backends
    /// give a group hash this with the labels, so neither overwrites the other.
    pub process: u64,
    /// Indices of its stacks in `round.stacks`, in the round's order.
    pub stacks: Vec<usize>,
}

/// A round's groups.
pub type Groups = Vec<Group>;

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
    groups
        .into_iter()
        .map(|((labels, process), stacks)| Group {
            labels,
            process,
            stacks,
        })
        .collect()
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
        .filter_map(|(g, gr)| encode(round, g, &gr.labels, &gr.stacks, types))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::StackSample;

    /// Two processes with equal labels (one exec'd itself) and a third of another pid.
    fn round() -> Round {
        let labels = |pid: &str| Arc::new(vec![("pid".to_string(), pid.to_string())]);
        let same = labels("7");
        let stack = |process_id, labels: &Arc<LabelSet>| StackSample {
            process_id,
            labels: labels.clone(),
            frames: Arc::from(Vec::new()),
            count: 1,
            off_cpu_ns: 0,
        };
        Round {
            session_id: 1,
            round: 1,
            start_ns: 0,
            end_ns: 1,
            frequency_hz: 19,
            off_cpu: false,
            stacks: vec![
                stack(1, &same),
                stack(2, &same),
                stack(1, &same),
                stack(3, &labels("8")),
            ],
        }
    }

    fn sorted(g: Groups) -> Vec<(u64, Vec<usize>)> {
        let mut v: Vec<_> = g.into_iter().map(|g| (g.process, g.stacks)).collect();
        v.sort();
        v
    }

    #[test]
    fn per_process_groups_keep_their_process_and_merged_ones_do_not() {
        let r = round();
        assert_eq!(
            sorted(groups(&r, ProfileBy::Process)),
            vec![(1, vec![0, 2]), (2, vec![1]), (3, vec![3])]
        );
        assert_eq!(
            sorted(groups(&r, ProfileBy::Labels)),
            vec![(0, vec![0, 1, 2]), (0, vec![3])]
        );
        let merged = groups(&r, ProfileBy::Container);
        assert_eq!(merged.len(), 1);
        assert_eq!((merged[0].process, merged[0].labels.len()), (0, 0));
    }
}

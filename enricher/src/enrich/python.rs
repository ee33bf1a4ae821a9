//! Python frames: each sampled process whose mappings hold an analysed CPython gets its
//! interpreter record sent to the sampler (once per process and mappings version on a
//! subscription), and the code objects' names the sampler forwarded are kept for
//! naming the round's Python frames.

use std::collections::HashMap;
use std::sync::Arc;

use firn_schema::firn_capnp::InterpreterRefusal;
use firn_schema::python_record::Record;

use super::{dev_of, Enricher, SamplerLink};
use crate::batch::Batch;
use crate::broker::InterpreterSendError;
use crate::metrics::Metrics;
use crate::model::{MappingSpec, PYTHON_MAPPING};
use crate::python::{Names, Taken};

/// Interpreter files remembered (their analysis); past it the oldest half goes.
const MAX_FILES: usize = 4096;
/// Interpreter records sent per round at most.
const MAX_RECORDS_PER_ROUND: usize = 64;

#[derive(Default)]
pub(crate) struct Python {
    /// (device, inode) → the file's record, or None: not a CPython firn knows.
    files: HashMap<(u64, u64), Option<Record>>,
    pub(crate) names: Names,
    mapping: std::sync::OnceLock<Arc<MappingSpec>>,
}

impl Python {
    pub(crate) fn mapping(&self) -> Arc<MappingSpec> {
        self.mapping
            .get_or_init(|| {
                Arc::new(MappingSpec {
                    start: firn_schema::python_code::frame::TAG,
                    limit: u64::MAX,
                    offset: 0,
                    file: Arc::from(PYTHON_MAPPING),
                    build_id: Arc::from(""),
                    symbolized: true,
                })
            })
            .clone()
    }

    pub(crate) fn set_file(&mut self, file: (u64, u64), record: Option<Record>) {
        if self.files.len() >= MAX_FILES && !self.files.contains_key(&file) {
            let drop: Vec<_> = self.files.keys().take(MAX_FILES / 2).copied().collect();
            for k in drop {
                self.files.remove(&k);
            }
        }
        self.files.insert(file, record);
    }
}

impl Enricher {
    /// Sends the interpreter record of each sampled process that maps an analysed
    /// CPython and has not had its record on this subscription.
    pub(super) async fn send_interpreters<L: SamplerLink>(
        &mut self,
        batch: &Batch,
        link: Option<&L>,
    ) {
        let Some(link) = link else { return };
        let ids: Vec<u64> = batch.samples.iter().map(|s| s.process_id).collect();
        self.send_interpreters_of(&ids, link).await;
        let mut sent = link.interpreters().borrow_mut();
        for id in &batch.forgotten_processes {
            sent.remove(id);
        }
    }

    /// The interpreter records of `ids` (in order, each once) not yet sent.
    pub(super) async fn send_interpreters_of<L: SamplerLink>(&mut self, ids: &[u64], link: &L) {
        let mut wanted: Vec<(u64, u32, u32, Record)> = Vec::new();
        {
            let sent = link.interpreters().borrow();
            let mut seen = std::collections::HashSet::new();
            for &process_id in ids {
                if wanted.len() >= MAX_RECORDS_PER_ROUND || !seen.insert(process_id) {
                    continue;
                }
                let Some(e) = self.processes.get(process_id) else {
                    continue;
                };
                let version = e.record.mappings_version;
                if sent.get(&process_id) == Some(&version) {
                    continue;
                }
                // The mapping of an analysed file that holds its eval loop.
                let found = e.record.mappings.iter().enumerate().find_map(|(i, m)| {
                    let rec = self.python.files.get(&(dev_of(m), m.inode))?.as_ref()?;
                    let end = m.file_offset.checked_add(m.end.checked_sub(m.start)?)?;
                    (m.file_offset <= rec.eval.0 && rec.eval.1 <= end).then_some((i, *rec))
                });
                if let Some((i, rec)) = found {
                    wanted.push((process_id, i as u32, version, rec));
                }
            }
        }
        let m = &self.metrics;
        for (process_id, index, version, rec) in wanted {
            let r = link
                .load_interpreter(process_id, index, version, &rec.to_bytes())
                .await;
            let done = match r {
                Ok(()) => {
                    Metrics::inc(&m.python_interpreters_sent);
                    true
                }
                Err(InterpreterSendError::Refused(why)) => {
                    Metrics::inc(&m.python_interpreters_refused);
                    tracing::info!(process_id, reason = ?why, "the sampler refused an interpreter record; this process keeps native frames");
                    // Worth asking again next round: the sampler may not have the
                    // process's mappings yet, or the rate limit passes.
                    !matches!(
                        why,
                        InterpreterRefusal::RateLimited | InterpreterRefusal::UnknownProcess
                    )
                }
                Err(e) => {
                    Metrics::inc(&m.python_interpreters_send_errors);
                    tracing::warn!(process_id, error = %e, "sending an interpreter record failed");
                    false
                }
            };
            if done {
                link.interpreters().borrow_mut().insert(process_id, version);
            }
        }
    }

    /// The round's code objects' names, kept for its Python frames (and later rounds').
    pub(super) fn take_python_code(&mut self, batch: &Batch) {
        let m = &self.metrics;
        self.python.names.next_round();
        let evicted = self.python.names.evicted();
        for blob in &batch.python_code {
            match self.python.names.take(blob) {
                Taken::New => Metrics::inc(&m.python_code_received),
                Taken::Known => {}
                Taken::Malformed => Metrics::inc(&m.python_code_malformed),
            }
        }
        Metrics::add(
            &m.python_code_evicted,
            self.python.names.evicted() - evicted,
        );
    }
}

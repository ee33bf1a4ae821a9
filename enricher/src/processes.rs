//! The enricher's process table, built from the sampler's process records. A process
//! is identified by the sampler-issued id (one per pid and start time, so pid reuse
//! gives a new entry); records of a new mapping version (after dlopen) replace the old
//! mappings. An entry lives until the sampler says it forgot the process (it exited),
//! bounded in number.

use std::collections::HashMap;
use std::rc::Rc;

use crate::batch::{Mapping, Process};
use crate::model::BinaryId;

/// Processes kept at most (the sampler's own bound); past it the least recently
/// sampled goes.
const MAX_ENTRIES: usize = 32_768;

/// What is known of the file behind one mapping.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Binary {
    /// Not asked for yet.
    Unknown,
    /// Loaded into the symbol cache under this identity.
    Known(BinaryId),
    /// The broker refused or loading failed; retried from this round on.
    Failed { retry_round: u64 },
}

pub(crate) struct Entry {
    pub(crate) record: Rc<Process>,
    /// Mappings sorted by start, with their original index in the record.
    pub(crate) sorted: Vec<(usize, Mapping)>,
    pub(crate) binaries: Vec<Binary>,
    /// Samples seen of this process so far (its tables are sent past a threshold).
    pub(crate) samples: u64,
    last_round: u64,
}

impl Entry {
    fn new(record: Process, round: u64) -> Self {
        let mut sorted: Vec<(usize, Mapping)> =
            record.mappings.iter().cloned().enumerate().collect();
        sorted.sort_by_key(|(_, m)| m.start);
        let binaries = vec![Binary::Unknown; record.mappings.len()];
        Self {
            record: Rc::new(record),
            sorted,
            binaries,
            samples: 0,
            last_round: round,
        }
    }

    /// The mapping containing `addr`: (index in the record, mapping).
    pub(crate) fn mapping_of(&self, addr: u64) -> Option<(usize, &Mapping)> {
        let i = self.sorted.partition_point(|(_, m)| m.start <= addr);
        let (idx, m) = self.sorted.get(i.checked_sub(1)?)?;
        (addr < m.end).then_some((*idx, m))
    }
}

#[derive(Default)]
pub(crate) struct ProcessTable {
    by_id: HashMap<u64, Entry>,
    session: u64,
}

impl ProcessTable {
    /// Forgets everything when the sampler session changes: ids are per session.
    pub(crate) fn set_session(&mut self, session: u64) {
        if session != self.session {
            self.by_id.clear();
            self.session = session;
        }
    }

    pub(crate) fn update(&mut self, records: Vec<Process>, round: u64) {
        for r in records {
            match self.by_id.get_mut(&r.process_id) {
                // Same process, same mappings: nothing to redo.
                Some(e) if e.record.mappings_version >= r.mappings_version => e.last_round = round,
                _ => {
                    let id = r.process_id;
                    let samples = self.by_id.get(&id).map_or(0, |e| e.samples);
                    let mut e = Entry::new(r, round);
                    e.samples = samples;
                    self.by_id.insert(id, e);
                }
            }
        }
    }

    pub(crate) fn get(&self, id: u64) -> Option<&Entry> {
        self.by_id.get(&id)
    }

    pub(crate) fn get_mut(&mut self, id: u64) -> Option<&mut Entry> {
        self.by_id.get_mut(&id)
    }

    pub(crate) fn touch(&mut self, id: u64, round: u64, samples: u64) {
        if let Some(e) = self.by_id.get_mut(&id) {
            e.last_round = round;
            e.samples = e.samples.saturating_add(samples);
        }
    }

    /// Drops the records the sampler forgot, after the batch's samples were handled.
    pub(crate) fn forget(&mut self, ids: &[u64]) {
        for id in ids {
            self.by_id.remove(id);
        }
        while self.by_id.len() > MAX_ENTRIES {
            let Some(oldest) = self
                .by_id
                .iter()
                .min_by_key(|(_, e)| e.last_round)
                .map(|(k, _)| *k)
            else {
                break;
            };
            self.by_id.remove(&oldest);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &Entry)> {
        self.by_id.iter().map(|(&id, e)| (id, e))
    }
}

//! One batch in, symbolized stacks out: process table, binaries from the broker,
//! symbolization, label sets.

use std::collections::HashMap;
use std::sync::Arc;

use crate::batch::{Batch, Stack};
use crate::broker::{Broker, BrokerError};
use crate::labels::{Extra, Labeler};
use crate::metrics::Metrics;
use crate::processes::{Binary, Entry, ProcessTable};
use crate::profile::{Frame, LabelSet, MappingSpec, StackSample};
use crate::symbolize::{hex, BinaryId, Lines, Symbolizer};

/// Broker requests at most per round, so a burst of new binaries cannot stall a round.
const MAX_OPENS_PER_ROUND: usize = 256;
/// Rounds before a binary the broker refused is asked for again.
const RETRY_ROUNDS: u64 = 6;
/// Unwind tables built and sent per round at most (a busy node's binaries arrive over a
/// few rounds rather than stalling one).
const MAX_TABLES_PER_ROUND: usize = 24;
/// Time spent building and sending tables per round at most (past it, the rest waits).
const TABLE_TIME_PER_ROUND: std::time::Duration = std::time::Duration::from_millis(500);

/// The symbolized content of one round.
pub struct Round {
    /// The sampler session the round belongs to: rounds count from 1 in each.
    pub session_id: u64,
    pub round: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    pub frequency_hz: u32,
    pub stacks: Vec<StackSample>,
}

pub struct Enricher {
    pub processes: ProcessTable,
    pub symbolizer: Symbolizer,
    pub labeler: Labeler,
    metrics: Arc<Metrics>,
    session: u64,
    /// Samples a process needs before its unwind tables are built and sent.
    pub unwind_min_samples: u64,
}

fn dev_of(m: &crate::batch::Mapping) -> u64 {
    libc::makedev(m.dev_major, m.dev_minor)
}

impl Enricher {
    pub fn new(symbolizer: Symbolizer, labeler: Labeler, metrics: Arc<Metrics>) -> Self {
        Self {
            processes: ProcessTable::default(),
            symbolizer,
            labeler,
            metrics,
            session: 0,
            unwind_min_samples: 1,
        }
    }

    /// Asks the broker for binaries this batch needs and the cache lacks.
    async fn fetch_binaries(&mut self, batch: &Batch, broker: Option<&Broker>) {
        let round = batch.round;
        let mut wanted: Vec<(u64, usize)> = Vec::new();
        let mut asked_files = std::collections::HashSet::new();
        for s in &batch.samples {
            let Some(e) = self.processes.get_mut(s.process_id) else {
                continue;
            };
            for &addr in &s.user_frames {
                let Some((idx, m)) = e.mapping_of(addr) else {
                    continue;
                };
                match e.binaries[idx] {
                    Binary::Known(ref id) if self.symbolizer.contains(id) => continue,
                    Binary::Failed { retry_round } if retry_round > round => continue,
                    _ => {}
                }
                let key = (dev_of(m), m.inode);
                if let Some(id) = self.symbolizer.lookup_file(key.0, key.1) {
                    e.binaries[idx] = Binary::Known(id);
                } else if asked_files.insert(key) {
                    wanted.push((s.process_id, idx));
                }
            }
        }
        let Some(broker) = broker else { return };
        for (pid_id, idx) in wanted.into_iter().take(MAX_OPENS_PER_ROUND) {
            let Some(e) = self.processes.get(pid_id) else {
                continue;
            };
            let version = e.record.mappings_version;
            Metrics::inc(&self.metrics.broker_requests);
            let result = broker.open(pid_id, idx as u32, version).await;
            let outcome = match result {
                Ok(fd) => match self.symbolizer.load(fd) {
                    Ok(id) => Binary::Known(id),
                    Err(e) => {
                        tracing::info!(error = %e, "binary not loadable; its frames stay addresses");
                        Binary::Failed {
                            retry_round: round + RETRY_ROUNDS,
                        }
                    }
                },
                Err(BrokerError::Refused(r)) => {
                    Metrics::inc(&self.metrics.broker_refusals);
                    tracing::info!(process_id = pid_id, mapping = idx, reason = ?r, "broker refused; the frames stay addresses");
                    Binary::Failed {
                        retry_round: round + RETRY_ROUNDS,
                    }
                }
                Err(e) => {
                    Metrics::inc(&self.metrics.broker_errors);
                    tracing::warn!(error = %e, "broker request failed");
                    Binary::Failed {
                        retry_round: round + 1,
                    }
                }
            };
            if let Some(e) = self.processes.get_mut(pid_id) {
                if let Some(slot) = e.binaries.get_mut(idx) {
                    *slot = outcome;
                }
            }
        }
    }

    /// Builds and sends the unwind tables of the files sampled processes map that this
    /// subscription has not sent yet: all executable mappings of each, so that the
    /// unwinder can cross into libraries no frame has reached so far.
    async fn send_tables(&mut self, batch: &Batch, broker: Option<&Broker>) {
        let Some(broker) = broker else { return };
        let round = batch.round;
        if let Some(&(_, n)) = batch
            .counters
            .iter()
            .find(|(k, _)| k == "unwind_tables_evicted")
        {
            broker.tables.borrow_mut().note_evictions(n);
        }
        // The busiest processes first: their stacks are most of the profile, and a node
        // busy with many binaries gets their tables over a few rounds.
        let mut weight: HashMap<u64, u64> = HashMap::new();
        for s in &batch.samples {
            *weight.entry(s.process_id).or_default() += s.count;
        }
        let mut order: Vec<(u64, u64)> = weight.into_iter().collect();
        order.sort_unstable_by_key(|&(id, w)| (std::cmp::Reverse(w), id));
        let mut wanted: Vec<(u64, usize, (u64, u64))> = Vec::new();
        {
            let sent = broker.tables.borrow();
            for (process_id, _) in order {
                if wanted.len() >= MAX_TABLES_PER_ROUND {
                    break;
                }
                let Some(e) = self.processes.get(process_id) else {
                    continue;
                };
                if e.samples < self.unwind_min_samples {
                    // A process woken once for a moment: its stacks are walked by frame
                    // pointers; tables (the sampler's most costly work) wait until it
                    // runs more.
                    Metrics::inc(&self.metrics.unwind_tables_deferred_few_samples);
                    continue;
                }
                for (idx, m) in e.record.mappings.iter().enumerate() {
                    let file = (dev_of(m), m.inode);
                    if sent.wants(file, round)
                        && !wanted.iter().any(|w| w.2 == file)
                        && wanted.len() < MAX_TABLES_PER_ROUND
                    {
                        wanted.push((process_id, idx, file));
                    }
                }
            }
        }
        let t0 = std::time::Instant::now();
        for (pid_id, idx, file) in wanted {
            if t0.elapsed() > TABLE_TIME_PER_ROUND {
                // The rest next round: a round is not held up by a node's big binaries.
                break;
            }
            let Some(e) = self.processes.get(pid_id) else {
                continue;
            };
            let version = e.record.mappings_version;
            let path = e.record.mappings[idx].path.clone();
            let state = self
                .send_table(broker, pid_id, idx as u32, version, &path, round)
                .await;
            broker.tables.borrow_mut().set(file, state);
        }
    }

    async fn send_table(
        &self,
        broker: &Broker,
        pid_id: u64,
        idx: u32,
        version: u32,
        path: &str,
        round: u64,
    ) -> crate::unwind::State {
        use crate::unwind::State;
        let m = &self.metrics;
        Metrics::inc(&m.broker_requests);
        let fd = match broker.open(pid_id, idx, version).await {
            Ok(fd) => fd,
            Err(BrokerError::Refused(r)) => {
                Metrics::inc(&m.broker_refusals);
                tracing::debug!(path, reason = ?r, "broker refused a binary for its unwind table");
                return State::Retry(round + RETRY_ROUNDS);
            }
            Err(e) => {
                Metrics::inc(&m.broker_errors);
                tracing::warn!(error = %e, "broker request failed");
                return State::Retry(round + 1);
            }
        };
        let t0 = std::time::Instant::now();
        let built = crate::unwind::build_from_fd(fd);
        Metrics::add(
            &m.unwind_table_build_ns,
            u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX),
        );
        let table = match built {
            Ok(t) if !t.rows.is_empty() => t,
            Ok(_) | Err(_) => {
                Metrics::inc(&m.unwind_table_build_errors);
                if let Err(e) = built {
                    tracing::info!(path, error = %e, "no unwind table for this binary; its frames are walked by frame pointers");
                }
                return State::Given;
            }
        };
        Metrics::inc(&m.unwind_tables_built);
        let rows = table.rows.len();
        match broker
            .load_table(pid_id, idx, version, &table.bytes())
            .await
        {
            Ok(()) => {
                Metrics::inc(&m.unwind_tables_sent);
                Metrics::add(&m.unwind_table_rows_sent, rows as u64);
                tracing::debug!(path, rows, fdes = table.fdes, source = ?table.source, "unwind table sent");
                State::Loaded
            }
            Err(crate::broker::TableSendError::Refused(r)) => {
                Metrics::inc(&m.unwind_tables_refused);
                tracing::info!(path, rows, reason = ?r, "the sampler refused an unwind table; this binary is walked by frame pointers");
                use firn_schema::firn_capnp::TableRefusal as T;
                match r {
                    T::RateLimited | T::OutOfOrder | T::UnknownProcess | T::UnknownMapping => {
                        State::Retry(round + 1)
                    }
                    // Room may be made, and another subscription's tables go with it.
                    T::NoRoom | T::NotOwner => State::Retry(round + RETRY_ROUNDS),
                    _ => State::Given,
                }
            }
            Err(e) => {
                Metrics::inc(&m.unwind_table_send_errors);
                tracing::warn!(path, error = %e, "sending an unwind table failed");
                State::Retry(round + 1)
            }
        }
    }

    /// Build id (hex) and strippedness of the process's main executable, once its
    /// binary is loaded.
    fn exe_facts(&self, e: &Entry) -> (Option<String>, Option<bool>) {
        let exe = e.record.exe.as_str();
        let id = e
            .record
            .mappings
            .iter()
            .position(|m| m.path == exe)
            .and_then(|i| match &e.binaries[i] {
                Binary::Known(id) => Some(id),
                _ => None,
            });
        match id {
            Some(id) => (
                self.symbolizer.build_id(id).map(hex),
                self.symbolizer.stripped(id),
            ),
            None => (None, None),
        }
    }

    pub async fn handle(&mut self, batch: Batch, broker: Option<&Broker>) -> Round {
        let m = self.metrics.clone();
        if batch.session_id != self.session {
            self.session = batch.session_id;
            self.labeler.clear();
        }
        self.processes.set_session(batch.session_id);
        let records = batch.processes.clone();
        self.processes.update(records, batch.round);
        for s in &batch.samples {
            self.processes.touch(s.process_id, batch.round, s.count);
        }
        self.fetch_binaries(&batch, broker).await;
        self.send_tables(&batch, broker).await;

        // Pass 1: every (binary, offset) to symbolize, per binary.
        let mut wanted: HashMap<BinaryId, Vec<u64>> = HashMap::new();
        for s in &batch.samples {
            let Some(e) = self.processes.get(s.process_id) else {
                continue;
            };
            for (i, &addr) in s.user_frames.iter().enumerate() {
                if let Some((idx, mp)) = e.mapping_of(addr) {
                    if let Binary::Known(id) = &e.binaries[idx] {
                        wanted
                            .entry(id.clone())
                            .or_default()
                            .push(sym_offset(addr, mp, i));
                    }
                }
            }
        }
        let mut resolved: HashMap<(BinaryId, u64), Option<Lines>> = HashMap::new();
        for (id, offsets) in wanted {
            let lines = self.symbolizer.symbolize(&id, &offsets);
            for (o, l) in offsets.into_iter().zip(lines) {
                resolved.insert((id.clone(), o), l);
            }
        }

        // Pass 2: stacks with labels.
        let mut label_sets: HashMap<u64, Option<Arc<LabelSet>>> = HashMap::new();
        let mut mappings: HashMap<(u64, usize), Arc<MappingSpec>> = HashMap::new();
        let kernel_names: Vec<Arc<str>> = batch
            .kernel_symbols
            .iter()
            .map(|s| Arc::from(s.as_str()))
            .collect();
        let mut stacks = Vec::with_capacity(batch.samples.len());
        for s in &batch.samples {
            Metrics::add(&m.samples_received, s.count);
            let entry = self.processes.get(s.process_id);
            if entry.is_none() {
                Metrics::add(&m.samples_without_process, s.count);
            }
            let labels = match label_sets.get(&s.process_id) {
                Some(l) => l.clone(),
                None => {
                    if entry.is_none() {
                        tracing::info!(
                            pid = s.pid,
                            "samples of a process with no record; encoded with comm only"
                        );
                    }
                    let (build_id, stripped) = entry.map_or((None, None), |e| self.exe_facts(e));
                    let extra = Extra {
                        comm: &s.comm,
                        executable_build_id: build_id,
                        executable_stripped: stripped,
                    };
                    let l =
                        self.labeler
                            .labels(s.process_id, entry.map(|e| &*e.record), s.pid, extra);
                    if l.is_none() {
                        Metrics::inc(&m.processes_dropped_by_relabel);
                        tracing::debug!(pid = s.pid, "process dropped by a relabel rule");
                    }
                    label_sets.insert(s.process_id, l.clone());
                    l
                }
            };
            let Some(labels) = labels else {
                Metrics::add(&m.samples_dropped_by_relabel, s.count);
                continue;
            };
            let mut frames: Vec<Frame> = s
                .kernel_frames
                .iter()
                .map(|&k| Frame::Kernel(kernel_names[k as usize].clone()))
                .collect();
            for (i, &addr) in s.user_frames.iter().enumerate() {
                let frame =
                    match entry.and_then(|e| e.mapping_of(addr).map(|(idx, mp)| (e, idx, mp))) {
                        None => {
                            Metrics::inc(&m.frames_unsymbolized_no_mapping);
                            Frame::User {
                                mapping: None,
                                address: addr,
                                lines: None,
                            }
                        }
                        Some((e, idx, mp)) => {
                            let known = match &e.binaries[idx] {
                                Binary::Known(id) => Some(id),
                                _ => None,
                            };
                            let lines = known.and_then(|id| {
                                resolved
                                    .get(&(id.clone(), sym_offset(addr, mp, i)))
                                    .cloned()
                                    .flatten()
                            });
                            match (&known, &lines) {
                                (None, _) => Metrics::inc(&m.frames_unsymbolized_no_binary),
                                (Some(_), None) => Metrics::inc(&m.frames_unsymbolized_no_symbol),
                                (Some(_), Some(_)) => Metrics::inc(&m.frames_symbolized),
                            }
                            let spec = mappings
                                .entry((s.process_id, idx))
                                .or_insert_with(|| {
                                    Arc::new(MappingSpec {
                                        start: mp.start,
                                        limit: mp.end,
                                        offset: mp.file_offset,
                                        file: Arc::from(mp.path.as_str()),
                                        build_id: Arc::from(
                                            known
                                                .and_then(|id| self.symbolizer.build_id(id))
                                                .map(hex)
                                                .unwrap_or_default()
                                                .as_str(),
                                        ),
                                        symbolized: known.is_some(),
                                    })
                                })
                                .clone();
                            Frame::User {
                                mapping: Some(spec),
                                address: addr,
                                lines,
                            }
                        }
                    };
                frames.push(frame);
            }
            if let Some(marker) = s.user_end {
                Metrics::inc(&m.user_stacks_incomplete);
                frames.push(Frame::Kernel(Arc::from(marker)));
            }
            if frames.is_empty() {
                // Neither stack could be read: keep the sample's weight on its process.
                let why = match (s.user_stack, s.kernel_stack) {
                    (Stack::Lost, _) | (_, Stack::Lost) => "[stack lost]",
                    _ => "[no stack]",
                };
                frames.push(Frame::Kernel(Arc::from(why)));
            }
            stacks.push(StackSample {
                process_id: s.process_id,
                labels,
                frames: frames.into(),
                count: s.count,
            });
        }
        self.processes.forget(&batch.forgotten_processes);
        for id in &batch.forgotten_processes {
            self.labeler.forget(*id);
        }
        m.processes_known.store(
            self.processes.len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        m.binaries_cached.store(
            self.symbolizer.len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        m.symbol_bytes_held.store(
            self.symbolizer.bytes_held(),
            std::sync::atomic::Ordering::Relaxed,
        );
        m.symbol_frames_cached.store(
            self.symbolizer.frames_cached() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        Round {
            session_id: batch.session_id,
            round: batch.round,
            start_ns: batch.start_time_ns,
            end_ns: batch.end_time_ns,
            frequency_hz: batch.frequency_hz,
            stacks,
        }
    }
}

/// The file offset to symbolize for frame `i`: callers' return addresses point after
/// the call, so one byte back lands inside the call instruction (and its line).
fn sym_offset(addr: u64, m: &crate::batch::Mapping, i: usize) -> u64 {
    let off = addr - m.start + m.file_offset;
    if i > 0 {
        off.saturating_sub(1)
    } else {
        off
    }
}

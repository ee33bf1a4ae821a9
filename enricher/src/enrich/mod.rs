//! One batch in, one symbolized round out. [`Enricher::handle`] is the round's steps,
//! one call each: the process table, the binaries from the broker (`binaries`), the
//! unwind tables (`tables`), symbolization and the stacks with their labels
//! (`stacks`). What a round needs of the sampler besides the batch sits behind
//! [`SamplerLink`], so the steps are tested with a fake.

mod binaries;
mod early;
mod python;
mod stacks;
mod tables;

use std::cell::RefCell;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::batch::Batch;
use crate::broker::{Broker, BrokerError, InterpreterSendError, TableSendError};
use crate::labels::Labeler;
use crate::metrics::Metrics;
use crate::model::Round;
use crate::processes::ProcessTable;
use crate::symbolize::Symbolizer;

/// Broker requests at most per round, so a burst of new binaries cannot stall a round.
const MAX_OPENS_PER_ROUND: usize = 256;
/// Rounds before a binary the broker refused is asked for again.
const RETRY_ROUNDS: u64 = 6;
/// Unwind tables built and sent per round at most (a busy node's binaries arrive over a
/// few rounds rather than stalling one).
const MAX_TABLES_PER_ROUND: usize = 24;
/// Time spent building and sending tables per round at most (past it, the rest waits).
const TABLE_TIME_PER_ROUND: std::time::Duration = std::time::Duration::from_millis(500);

/// What a round asks of the sampler beyond its batch: the file of a mapping, and
/// loading an unwind table; and what this subscription has sent.
pub(crate) trait SamplerLink {
    async fn open(&self, process_id: u64, index: u32, version: u32)
        -> Result<OwnedFd, BrokerError>;
    async fn load_table(
        &self,
        process_id: u64,
        index: u32,
        version: u32,
        rows: &[u8],
    ) -> Result<(), TableSendError>;
    /// The unwind tables sent on this subscription.
    fn tables(&self) -> &RefCell<crate::unwind::Sent>;
    async fn load_interpreter(
        &self,
        process_id: u64,
        index: u32,
        version: u32,
        record: &[u8],
    ) -> Result<(), InterpreterSendError>;
    /// The interpreter records sent on this subscription: process id → mappings version.
    fn interpreters(&self) -> &RefCell<std::collections::HashMap<u64, u32>>;
}

impl SamplerLink for Broker {
    async fn open(
        &self,
        process_id: u64,
        index: u32,
        version: u32,
    ) -> Result<OwnedFd, BrokerError> {
        Broker::open(self, process_id, index, version).await
    }

    async fn load_table(
        &self,
        process_id: u64,
        index: u32,
        version: u32,
        rows: &[u8],
    ) -> Result<(), TableSendError> {
        Broker::load_table(self, process_id, index, version, rows).await
    }

    fn tables(&self) -> &RefCell<crate::unwind::Sent> {
        &self.tables
    }

    async fn load_interpreter(
        &self,
        process_id: u64,
        index: u32,
        version: u32,
        record: &[u8],
    ) -> Result<(), InterpreterSendError> {
        Broker::load_interpreter(self, process_id, index, version, record).await
    }

    fn interpreters(&self) -> &RefCell<std::collections::HashMap<u64, u32>> {
        &self.interpreters
    }
}

pub struct Enricher {
    pub(crate) processes: ProcessTable,
    pub(crate) symbolizer: Symbolizer,
    pub(crate) labeler: Labeler,
    metrics: Arc<Metrics>,
    session: u64,
    /// The last round handled (announcements between rounds count as in it).
    round: u64,
    /// Files of announced processes waiting for their tables.
    early: early::Early,
    /// Process id → its main thread's comm, where it changed since the record was read.
    pub(crate) main_comms: std::collections::HashMap<u64, String>,
    /// Tables kept on disk between runs (`--unwind-cache-dir`), if any.
    pub(crate) table_cache: Option<crate::unwind::cache::Cache>,
    /// CPython interpreter files analysed (device, inode → record), and the names of
    /// the Python code objects the sampler forwarded.
    pub(crate) python: python::Python,
    /// Bytes of unwind tables built or read since last taken (when to trim the heap).
    table_bytes: u64,
    /// Mapping paths and build ids, one copy each.
    names: stacks::Names,
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
            round: 0,
            early: early::Early::default(),
            table_cache: None,
            main_comms: std::collections::HashMap::new(),
            python: python::Python::default(),
            table_bytes: 0,
            names: stacks::Names::default(),
        }
    }

    /// Bytes of unwind tables built or read from the cache since the last call.
    pub(crate) fn take_table_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.table_bytes)
    }

    /// The round of `batch`. Without a link (the broker channel is down), frames of
    /// binaries not cached stay addresses and no table is sent.
    pub(crate) async fn handle<L: SamplerLink>(&mut self, batch: Batch, link: Option<&L>) -> Round {
        self.take_records(&batch);
        self.fetch_binaries(&batch, link).await;
        self.send_tables(&batch, link).await;
        self.send_interpreters(&batch, link).await;
        self.take_python_code(&batch);
        let resolved = self.symbolize(&batch);
        let stacks = self.stacks(&batch, &resolved);
        self.forget(&batch);
        Round {
            session_id: batch.session_id,
            round: batch.round,
            start_ns: batch.start_time_ns,
            end_ns: batch.end_time_ns,
            frequency_hz: batch.frequency_hz,
            off_cpu: batch.off_cpu,
            stacks,
        }
    }

    /// How long until the tables of announced processes may be worked on again (`None`:
    /// none wait).
    pub(crate) fn early_wait(&mut self) -> Option<std::time::Duration> {
        self.early.wait()
    }

    /// A round driven by the fuzz target and benchmarks, without a sampler.
    pub fn handle_offline(&mut self, batch: Batch) -> Round {
        let round = self.handle::<Broker>(batch, None);
        futures::executor::block_on(round)
    }

    /// A sampler session's ids mean nothing in another: what is keyed by them goes.
    /// Called when connected (announcements may come before the first batch) and with
    /// every batch.
    pub(crate) fn set_session(&mut self, session: u64) {
        if session != self.session {
            self.session = session;
            self.labeler.clear();
            self.python.names.clear();
            self.early.new_session();
            self.round = 0;
            self.main_comms.clear();
        }
        self.processes.set_session(session);
    }

    /// The batch's process records into the table, its samples counted per process.
    fn take_records(&mut self, batch: &Batch) {
        self.set_session(batch.session_id);
        self.round = batch.round;
        self.processes.update(batch.processes.clone(), batch.round);
        for s in &batch.samples {
            self.processes.touch(s.process_id, batch.round, s.count);
        }
    }

    /// Processes the sampler forgot leave the table; the gauges follow.
    fn forget(&mut self, batch: &Batch) {
        self.processes.forget(&batch.forgotten_processes);
        for id in &batch.forgotten_processes {
            self.labeler.forget(*id);
        }
        let m = &self.metrics;
        let set = |g: &std::sync::atomic::AtomicU64, v: u64| g.store(v, Ordering::Relaxed);
        set(&m.processes_known, self.processes.len() as u64);
        set(&m.binaries_cached, self.symbolizer.len() as u64);
        set(&m.symbol_bytes_held, self.symbolizer.bytes_held());
        set(
            &m.symbol_frames_cached,
            self.symbolizer.frames_cached() as u64,
        );
    }
}

#[cfg(test)]
mod tests;

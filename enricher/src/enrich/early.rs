//! Tables from a process's first sample: the sampler announces a new process as soon as
//! it has read it, and the files it maps that have no table yet are queued here and
//! built and sent between rounds, within a budget of work per second. A program that
//! lives a few seconds then has whole stacks in its first round, whatever the round
//! length. A large file's table (a compiler's `libLLVM`: 1.4 M rows, 0.4 s) is built on
//! a blocking thread, one at a time, so a small program announced meanwhile is not held
//! up behind it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use super::tables::{build_timed, Rows};
use super::{dev_of, Enricher, SamplerLink};
use crate::batch::Process;
use crate::metrics::Metrics;
use crate::unwind::{LoadError, State, Table};

/// Table work between rounds per second at most (building and sending, the sampler's
/// row writes included), for small and for large files each: a burst of new binaries
/// is spread out instead of stalling the rounds, which wait meanwhile, and a burst of
/// big ones (a build's compilers, `libLLVM`) does not hold up a small new program.
const RATE: f64 = 0.25;
/// Work that may be done at once after a quiet while.
const BURST: f64 = 1.0;
/// Mappings up to this size are small files (most programs); larger ones have their own
/// budget, and within each the smallest waiting file goes first.
const SMALL_BYTES: u64 = 4 << 20;
/// Files waiting at most; past it the oldest waits for its round (counted).
const MAX_WAITING: usize = 4096;

struct Want {
    process_id: u64,
    index: usize,
    file: (u64, u64),
    /// Bytes of its mapping (the cost's proxy).
    size: u64,
}

impl Want {
    fn class(&self) -> usize {
        usize::from(self.size > SMALL_BYTES)
    }
}

/// A table built off the event loop, and how long the build took; `Err`: the build's
/// thread failed.
pub(crate) type Built = Result<(Result<Table, LoadError>, Duration), tokio::task::JoinError>;

/// The large file whose table is being built off the loop.
struct InFlight {
    want: Want,
    path: String,
    /// Its cache key.
    key: Option<String>,
    /// The sampler session it was asked for (its ids mean nothing in another).
    session: u64,
    started: Instant,
    job: tokio::task::JoinHandle<(Result<Table, LoadError>, Duration)>,
}

/// The queue of files waiting for their table, and the budget it is worked off with.
pub(crate) struct Early {
    queue: VecDeque<Want>,
    /// The files in `queue`.
    queued: HashSet<(u64, u64)>,
    /// Seconds of work that may be spent now, for small and large files (negative: owed).
    tokens: [f64; 2],
    last: Instant,
    /// File → CLOCK_BOOTTIME ns of the first sample of a process that waits for it.
    waiting_since: HashMap<(u64, u64), u64>,
    /// At most one large file's build at a time: others of its class wait for it.
    in_flight: Option<InFlight>,
}

impl Default for Early {
    fn default() -> Self {
        Self {
            queue: VecDeque::new(),
            queued: HashSet::new(),
            tokens: [BURST; 2],
            last: Instant::now(),
            waiting_since: HashMap::new(),
            in_flight: None,
        }
    }
}

impl Early {
    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        for t in &mut self.tokens {
            *t = (*t + dt * RATE).min(BURST);
        }
        self.last = now;
    }

    /// How long until queued work may go on; `None` when nothing waits.
    pub(crate) fn wait(&mut self) -> Option<Duration> {
        self.refill(Instant::now());
        let owed = self
            .queue
            .iter()
            .filter(|w| !self.blocked(w))
            .map(|w| (-self.tokens[w.class()]).max(0.0))
            .reduce(f64::min)?;
        Some(Duration::from_secs_f64(owed / RATE))
    }

    /// The next file to work on: the smallest of a class with budget left.
    fn take(&mut self) -> Option<Want> {
        let i = self
            .queue
            .iter()
            .enumerate()
            .filter(|(_, w)| self.tokens[w.class()] > 0.0 && !self.blocked(w))
            .min_by_key(|(_, w)| w.size)
            .map(|(i, _)| i)?;
        let w = self.queue.remove(i)?;
        self.queued.remove(&w.file);
        Some(w)
    }

    /// A large file waits while another's table is built off the loop, and the file
    /// being built waits for its build, whatever the size of the mapping asking.
    fn blocked(&self, w: &Want) -> bool {
        self.in_flight
            .as_ref()
            .is_some_and(|f| w.class() == 1 || f.want.file == w.file)
    }

    /// Queues a file that wants its table, unless it waits already (false). Past
    /// `MAX_WAITING` the oldest gives way (counted); its round sends it.
    fn push(&mut self, w: Want, m: &Metrics) -> bool {
        if !self.queued.insert(w.file) {
            return false;
        }
        if self.queue.len() >= MAX_WAITING {
            if let Some(old) = self.queue.pop_front() {
                self.queued.remove(&old.file);
                self.waiting_since.remove(&old.file);
            }
            Metrics::inc(&m.unwind_tables_early_overflow);
        }
        self.queue.push_back(w);
        true
    }

    /// Whether a round leaves the table of `file` (mapped `size` bytes by mapping
    /// `index` of process `process_id`) to this queue: a large file's table is built off
    /// the loop, whoever asks for it, so a round does not hold up announcements behind
    /// a compiler's `libLLVM`. It is queued (if it is not already, or being built) and
    /// worked within the large files' budget. Without a runtime (the round's tests, the
    /// fuzz target) the round builds it itself.
    pub(super) fn defer_large(
        &mut self,
        (process_id, index, file): (u64, usize, (u64, u64)),
        size: u64,
        m: &Metrics,
    ) -> bool {
        let w = Want {
            process_id,
            index,
            file,
            size,
        };
        if w.class() == 0 || tokio::runtime::Handle::try_current().is_err() {
            return false;
        }
        if !self.building(file) && self.push(w, m) {
            Metrics::inc(&m.unwind_tables_deferred);
        }
        true
    }

    /// Everything forgotten for a new sampler session, but a build under way: it
    /// cannot be stopped, so it goes on (its table kept on disk when done) and no other
    /// large build starts beside it.
    pub(crate) fn new_session(&mut self) {
        let in_flight = self.in_flight.take();
        *self = Self::default();
        self.in_flight = in_flight;
    }

    /// Whether `file`'s table is being built off the loop.
    pub(crate) fn building(&self, file: (u64, u64)) -> bool {
        self.in_flight.as_ref().is_some_and(|f| f.want.file == file)
    }

    /// When the table of `file` became ready, the time since the first sample of a
    /// process that waited for it (ms), once.
    pub(crate) fn ready(&mut self, file: (u64, u64)) -> Option<u64> {
        let since = self.waiting_since.remove(&file)?;
        Some(firn_schema::boot_ns().saturating_sub(since) / 1_000_000)
    }

    pub(crate) fn forget(&mut self, file: (u64, u64)) {
        self.waiting_since.remove(&file);
    }

    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.queue.len()
    }

    /// Owes `secs` of work, as if it had just been done.
    #[cfg(test)]
    pub(crate) fn spend(&mut self, secs: f64) {
        self.refill(Instant::now());
        for t in &mut self.tokens {
            *t -= secs;
        }
    }
}

impl Enricher {
    /// Records announced between rounds: kept, and their files that want a table queued.
    /// The queue is worked smallest file first within each budget (a new program's own
    /// executable is most often small; the libraries it shares are loaded already).
    pub(crate) async fn announced<L: SamplerLink>(
        &mut self,
        records: Vec<Process>,
        link: Option<&L>,
    ) {
        let round = self.round;
        let ids: Vec<u64> = records.iter().map(|p| p.process_id).collect();
        self.processes.update(records, round);
        let Some(link) = link else { return };
        {
            let sent = link.tables().borrow();
            for &id in &ids {
                let Some(e) = self.processes.get(id) else {
                    continue;
                };
                let mut order: Vec<usize> = (0..e.record.mappings.len()).collect();
                order.sort_by_key(|&i| e.record.mappings[i].path != e.record.exe);
                for i in order {
                    let m = &e.record.mappings[i];
                    let file = (dev_of(m), m.inode);
                    if !sent.wants(file, round) {
                        continue;
                    }
                    let first = e.record.first_sample_ns;
                    if first != 0 {
                        let since = self.early.waiting_since.entry(file).or_insert(first);
                        *since = (*since).min(first);
                    }
                    self.early.push(
                        Want {
                            process_id: id,
                            index: i,
                            file,
                            size: m.end.saturating_sub(m.start),
                        },
                        &self.metrics,
                    );
                }
            }
        }
        self.early_work(link).await;
        // A new process of an interpreter whose file is analysed already (its table
        // sent for an earlier process) gets its record now too, not at the round's end.
        self.send_interpreters_of(&ids, link).await;
    }

    /// Builds and sends queued tables while the budget lasts; the interpreter records of
    /// the processes served follow (they need their file's analysis).
    pub(crate) async fn early_work<L: SamplerLink>(&mut self, link: &L) {
        let round = self.round;
        let mut served = Vec::new();
        loop {
            let now = Instant::now();
            self.early.refill(now);
            let Some(w) = self.early.take() else {
                break;
            };
            // Sent since (by its round), or the process gone or its mappings read again:
            // what happens to the file's table is no longer this queue's to time.
            let Some((version, path)) = self
                .processes
                .get(w.process_id)
                .and_then(|e| {
                    let m = e.record.mappings.get(w.index)?;
                    ((dev_of(m), m.inode) == w.file)
                        .then(|| (e.record.mappings_version, m.path.clone()))
                })
                .filter(|_| link.tables().borrow().wants(w.file, round))
            else {
                self.early.forget(w.file);
                continue;
            };
            let ids = (w.process_id, w.index as u32, version);
            // Off the loop only under a runtime (the round's tests and the fuzz target
            // drive the enricher without one).
            let state = if w.class() == 1 && tokio::runtime::Handle::try_current().is_ok() {
                match self.open_rows(link, ids, (&path, w.file), round).await {
                    Ok(Rows::Build(map, key)) => {
                        let job = tokio::task::spawn_blocking(move || build_timed(&map));
                        Metrics::inc(&self.metrics.unwind_tables_built_aside);
                        self.early.tokens[1] -= now.elapsed().as_secs_f64();
                        served.push(w.process_id);
                        self.early.in_flight = Some(InFlight {
                            want: w,
                            path,
                            key,
                            session: self.session,
                            started: Instant::now(),
                            job,
                        });
                        continue;
                    }
                    Ok(rows) => self.load_rows(link, ids, &path, rows, round).await,
                    Err(state) => state,
                }
            } else {
                self.send_table(link, ids, (&path, w.file), round).await
            };
            tracing::debug!(path, file = ?w.file, ?state, "unwind table tried early");
            link.tables().borrow_mut().set(w.file, state);
            self.note_table(w.file, state);
            if state == State::Loaded {
                Metrics::inc(&self.metrics.unwind_tables_early);
            }
            let spent = now.elapsed().as_secs_f64();
            self.early.tokens[w.class()] -= spent;
            served.push(w.process_id);
        }
        if !served.is_empty() {
            self.send_interpreters_of(&served, link).await;
        }
    }

    /// The outcome of the build off the loop, once done (pending while none runs).
    pub(crate) async fn built_aside(&mut self) -> Built {
        match self.early.in_flight.as_mut() {
            Some(f) => (&mut f.job).await,
            None => std::future::pending().await,
        }
    }

    /// A table built off the loop: kept in the cache and sent, as `early_work` would
    /// have, through a process that maps the file now (the one that asked may have
    /// re-read its mappings or ended meanwhile); the next large file may then start.
    /// Without a link, in another session, or with no process mapping the file any more
    /// it is not sent (counted), and a later round tries the file again.
    pub(crate) async fn finish_aside<L: SamplerLink>(&mut self, built: Built, link: Option<&L>) {
        let Some(f) = self.early.in_flight.take() else {
            return;
        };
        let (built, took) = match built {
            Ok(done) => done,
            Err(e) => {
                tracing::warn!(path = f.path, error = %e, "the thread building an unwind table failed");
                (Err(LoadError::Panicked), f.started.elapsed())
            }
        };
        self.early.tokens[1] -= took.as_secs_f64();
        let rows = self.built_rows(built, took, f.key.as_deref(), &f.path);
        let file = f.want.file;
        let target = (f.session == self.session)
            .then(|| self.holder_of(f.want.process_id, file))
            .flatten();
        let (Some(link), Some((process_id, index, version))) = (link, target) else {
            Metrics::inc(&self.metrics.unwind_tables_aside_unsent);
            tracing::debug!(path = f.path, ?file, "an unwind table built aside was not sent: no link, another session, or no process maps the file now");
            self.early.forget(file);
            return;
        };
        if !link.tables().borrow().wants(file, self.round) {
            self.early.forget(file);
            return;
        }
        let t0 = Instant::now();
        let ids = (process_id, index as u32, version);
        let state = self.load_rows(link, ids, &f.path, rows, self.round).await;
        tracing::debug!(
            path = f.path,
            ?file,
            ?state,
            ?took,
            "unwind table built aside and tried"
        );
        link.tables().borrow_mut().set(file, state);
        self.note_table(file, state);
        if state == State::Loaded {
            Metrics::inc(&self.metrics.unwind_tables_early);
        }
        self.early.tokens[1] -= t0.elapsed().as_secs_f64();
        self.send_interpreters_of(&[process_id], link).await;
    }

    /// A known process that maps `file` now, `prefer` first: its id, the mapping's
    /// index and the record's mappings version.
    fn holder_of(&self, prefer: u64, file: (u64, u64)) -> Option<(u64, usize, u32)> {
        let find = |id: u64, e: &crate::processes::Entry| {
            let i = e
                .record
                .mappings
                .iter()
                .position(|m| (dev_of(m), m.inode) == file)?;
            Some((id, i, e.record.mappings_version))
        };
        self.processes
            .get(prefer)
            .and_then(|e| find(prefer, e))
            .or_else(|| self.processes.iter().find_map(|(id, e)| find(id, e)))
    }

    /// After a table's fate is known: the time from first sample to table, when loaded.
    pub(super) fn note_table(&mut self, file: (u64, u64), state: crate::unwind::State) {
        match state {
            State::Loaded => {
                if let Some(ms) = self.early.ready(file) {
                    self.metrics.unwind_table_ready.observe_ms(ms);
                }
            }
            // Tried again by a later round, if at all: not timed.
            State::Given | State::Retry(_) => self.early.forget(file),
        }
    }
}

//! The unwind tables of the files sampled processes map: built here from each binary's
//! CFI and sent to the sampler, the busiest processes first, within a budget per round.
//! Most arrive earlier, from the process's announcement (`early`); a round sends what
//! that left.

use std::collections::HashMap;

use super::{
    dev_of, Enricher, SamplerLink, MAX_TABLES_PER_ROUND, RETRY_ROUNDS, TABLE_TIME_PER_ROUND,
};
use crate::batch::Batch;
use crate::broker::BrokerError;
use crate::metrics::Metrics;

/// Where a brokered file's table rows come from.
pub(super) enum Rows {
    /// Nothing to send: no usable CFI (counted, logged).
    None,
    /// The rows' bytes and their count, ready to send.
    Ready(Vec<u8>, usize),
    /// To be built from the mapped file, then kept in the cache under the key.
    Build(memmap2::Mmap, Option<String>),
}

/// Builds a table from a mapped file, and how long that took.
pub(super) fn build_timed(
    map: &[u8],
) -> (
    Result<crate::unwind::Table, crate::unwind::LoadError>,
    std::time::Duration,
) {
    let t0 = std::time::Instant::now();
    let built = crate::unwind::build_from_map(map);
    (built, t0.elapsed())
}

impl Enricher {
    /// Builds and sends the unwind tables of the files sampled processes map that this
    /// subscription has not sent yet: all executable mappings of each, so that the
    /// unwinder can cross into libraries no frame has reached so far.
    pub(super) async fn send_tables<L: SamplerLink>(&mut self, batch: &Batch, link: Option<&L>) {
        let Some(link) = link else { return };
        let round = batch.round;
        link.tables()
            .borrow_mut()
            .note_evictions(batch.tables_evicted);
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
            let sent = link.tables().borrow();
            for (process_id, _) in order {
                if wanted.len() >= MAX_TABLES_PER_ROUND {
                    break;
                }
                let Some(e) = self.processes.get(process_id) else {
                    continue;
                };
                for (idx, m) in e.record.mappings.iter().enumerate() {
                    let file = (dev_of(m), m.inode);
                    if sent.wants(file, round)
                        && !self.early.building(file)
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
            let Some(e) = self.processes.get(pid_id) else {
                continue;
            };
            let m = &e.record.mappings[idx];
            let size = m.end.saturating_sub(m.start);
            if self
                .early
                .defer_large((pid_id, idx, file), size, &self.metrics)
            {
                continue;
            }
            if t0.elapsed() > TABLE_TIME_PER_ROUND {
                // The rest next round: a round is not held up by a node's big binaries.
                break;
            }
            let version = e.record.mappings_version;
            let path = e.record.mappings[idx].path.clone();
            let state = self
                .send_table(link, (pid_id, idx as u32, version), (&path, file), round)
                .await;
            tracing::debug!(path, ?file, ?state, "unwind table tried in the round");
            link.tables().borrow_mut().set(file, state);
            self.note_table(file, state);
        }
    }

    pub(super) async fn send_table<L: SamplerLink>(
        &mut self,
        link: &L,
        ids: (u64, u32, u32),
        (path, file): (&str, (u64, u64)),
        round: u64,
    ) -> crate::unwind::State {
        let rows = match self.open_rows(link, ids, (path, file), round).await {
            Ok(Rows::Build(map, key)) => {
                let (built, took) = build_timed(&map);
                drop(map);
                self.built_rows(built, took, key.as_deref(), path)
            }
            Ok(rows) => rows,
            Err(state) => return state,
        };
        self.load_rows(link, ids, path, rows, round).await
    }

    /// The mapping's file, brokered, and where its rows come from; `Err`: the broker
    /// refused or failed, with the state that leaves the file in.
    pub(super) async fn open_rows<L: SamplerLink>(
        &mut self,
        link: &L,
        (pid_id, idx, version): (u64, u32, u32),
        (path, file): (&str, (u64, u64)),
        round: u64,
    ) -> Result<Rows, crate::unwind::State> {
        use crate::unwind::State;
        let m = &*self.metrics;
        Metrics::inc(&m.broker_requests);
        match link.open(pid_id, idx, version).await {
            Ok(fd) => Ok(self.rows_of(fd, path, file)),
            Err(BrokerError::Refused(r)) => {
                Metrics::inc(&m.broker_refusals);
                tracing::debug!(path, reason = ?r, "broker refused a binary for its unwind table");
                // A newer reading of the process's mappings: tried with its announcement.
                use firn_schema::firn_capnp::Refusal as R;
                Err(match r {
                    R::UnknownProcess | R::UnknownMapping => State::Retry(round),
                    _ => State::Retry(round + RETRY_ROUNDS),
                })
            }
            Err(e) => {
                Metrics::inc(&m.broker_errors);
                tracing::warn!(error = %e, "broker request failed");
                Err(State::Retry(round + 1))
            }
        }
    }

    /// Sends ready rows to the sampler: the state that leaves the file in.
    pub(super) async fn load_rows<L: SamplerLink>(
        &mut self,
        link: &L,
        (pid_id, idx, version): (u64, u32, u32),
        path: &str,
        rows: Rows,
        round: u64,
    ) -> crate::unwind::State {
        use crate::unwind::State;
        let Rows::Ready(bytes, rows) = rows else {
            return State::Given;
        };
        let m = &*self.metrics;
        match link.load_table(pid_id, idx, version, &bytes).await {
            Ok(()) => {
                Metrics::inc(&m.unwind_tables_sent);
                Metrics::add(&m.unwind_table_rows_sent, rows as u64);
                tracing::debug!(path, rows, "unwind table sent");
                State::Loaded
            }
            Err(crate::broker::TableSendError::Refused(r)) => {
                Metrics::inc(&m.unwind_tables_refused);
                tracing::info!(path, rows, reason = ?r, "the sampler refused an unwind table; this binary is walked by frame pointers");
                use firn_schema::firn_capnp::TableRefusal as T;
                match r {
                    // The sampler holds a newer reading of the process's mappings (the
                    // first was read while the loader was still mapping libraries): its
                    // announcement follows, and the table goes with it, not a round
                    // later (a Python process's native frames for its first 10 s).
                    T::UnknownProcess | T::UnknownMapping => State::Retry(round),
                    T::RateLimited | T::OutOfOrder => State::Retry(round + 1),
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

    /// Where the table rows of a brokered file come from: the on-disk cache when it
    /// holds them, else a build from the file's CFI (`Rows::Build`, then `built_rows`).
    /// The file is also looked at for a CPython.
    fn rows_of(&mut self, fd: std::os::fd::OwnedFd, path: &str, file: (u64, u64)) -> Rows {
        use crate::unwind::cache::{key_of, Found};
        const ROW: usize = firn_schema::firn_capnp::UNWIND_ROW_BYTES as usize;
        let metrics = self.metrics.clone();
        let m = &*metrics;
        let opened = std::fs::File::from(fd);
        let map = match crate::unwind::map_file(&opened) {
            Ok(map) => map,
            Err(e) => {
                Metrics::inc(&m.unwind_table_build_errors);
                tracing::info!(path, error = %e, "no unwind table for this binary; its frames are walked by frame pointers");
                return Rows::None;
            }
        };
        if crate::python::might_be_cpython(path) {
            let record = self.note_interpreter(&map, path);
            self.python.set_file(file, record);
        }
        let key = self.table_cache.as_ref().and_then(|_| {
            let key = key_of(&opened, &map);
            if key.is_none() {
                Metrics::inc(&m.unwind_table_cache_skipped);
            }
            key
        });
        if let (Some(cache), Some(key)) = (self.table_cache.as_mut(), key.as_deref()) {
            match cache.get(key) {
                Found::Rows(bytes) => {
                    Metrics::inc(&m.unwind_table_cache_hits);
                    self.table_bytes += bytes.len() as u64;
                    let rows = bytes.len() / ROW;
                    tracing::debug!(path, key, rows, "unwind table read from the cache");
                    if rows == 0 {
                        tracing::info!(path, key, "a cached unwind table holds no rows; its frames are walked by frame pointers");
                        return Rows::None;
                    }
                    return Rows::Ready(bytes, rows);
                }
                Found::Missing => Metrics::inc(&m.unwind_table_cache_misses),
                Found::Corrupt => {
                    Metrics::inc(&m.unwind_table_cache_corrupt);
                    tracing::warn!(
                        path,
                        key,
                        "a cached unwind table failed its check; removed and built again"
                    );
                }
            }
        }
        Rows::Build(map, key)
    }

    /// A build's outcome (it took `took`) as rows to send, kept in the cache under `key`.
    pub(super) fn built_rows(
        &mut self,
        built: Result<crate::unwind::Table, crate::unwind::LoadError>,
        took: std::time::Duration,
        key: Option<&str>,
        path: &str,
    ) -> Rows {
        let metrics = self.metrics.clone();
        let m = &*metrics;
        Metrics::add(
            &m.unwind_table_build_ns,
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
        );
        let table = match built {
            Ok(t) if !t.rows.is_empty() => t,
            Ok(_) | Err(_) => {
                Metrics::inc(&m.unwind_table_build_errors);
                match built {
                    Err(e) => {
                        tracing::info!(path, error = %e, "no unwind table for this binary; its frames are walked by frame pointers")
                    }
                    Ok(_) => tracing::info!(
                        path,
                        "this binary's CFI gave no rows; its frames are walked by frame pointers"
                    ),
                }
                return Rows::None;
            }
        };
        Metrics::inc(&m.unwind_tables_built);
        tracing::debug!(path, rows = table.rows.len(), fdes = table.fdes, source = ?table.source, "unwind table built");
        let rows = table.rows.len();
        let bytes = table.into_bytes();
        // What building it took is a few times this (rows, their sort, the bytes).
        self.table_bytes += bytes.len() as u64;
        if let (Some(cache), Some(key)) = (self.table_cache.as_mut(), key) {
            match cache.put(key, &bytes) {
                Ok(Some(evicted)) => Metrics::add(&m.unwind_table_cache_evicted, evicted),
                Ok(None) => Metrics::inc(&m.unwind_table_cache_no_room),
                Err(e) => {
                    Metrics::inc(&m.unwind_table_cache_write_errors);
                    tracing::warn!(error = %e, "keeping an unwind table on disk failed");
                }
            }
            m.unwind_cache_bytes
                .store(cache.bytes(), std::sync::atomic::Ordering::Relaxed);
            m.unwind_cache_entries
                .store(cache.len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
        Rows::Ready(bytes, rows)
    }

    /// A CPython interpreter among a process's files: its version and layout, from the
    /// file alone, as the record the sampler takes. Counted and logged.
    fn note_interpreter(
        &self,
        map: &[u8],
        path: &str,
    ) -> Option<firn_schema::python_record::Record> {
        let m = &self.metrics;
        match crate::symbolize::contained(|| crate::python::analyze(map, path)) {
            Some(Ok(i)) => {
                Metrics::inc(&m.python_interpreters_found);
                tracing::info!(path, version = %i.version, "CPython interpreter found");
                return Some(i.to_record());
            }
            Some(Err(e)) if e.is_cpython() => {
                Metrics::inc(&m.python_interpreters_unknown);
                tracing::info!(path, error = %e, "a CPython whose layout firn does not know");
            }
            Some(Err(_)) => {}
            None => {
                Metrics::inc(&m.python_interpreters_unknown);
                tracing::warn!(
                    path,
                    "the CPython analysis panicked on this file (contained)"
                );
            }
        }
        None
    }
}

//! The table of processes seen in samples: one record per (pid, start time), read from
//! /proc the first time a process shows up, refreshed when a frame falls outside its
//! executable mappings (dlopen), forgotten once it has exited.

use std::collections::HashMap;
use std::rc::Rc;

use crate::counters::Counters;
use crate::procfs::{self, ProcError, ProcessRecord};

/// Processes kept at most; past it the least recently seen is forgotten.
const MAX_PROCESSES: usize = 32_768;
/// Rounds without a sample after which a process is checked for exit.
const IDLE_ROUNDS: u64 = 6;
/// Longest wait, in rounds, between two mapping refreshes that changed nothing (JIT
/// code and the vDSO lie outside every file mapping forever).
const MAX_REFRESH_BACKOFF: u64 = 64;

pub struct Known {
    pub id: u64,
    pub start_ns: u64,
    pub version: u32,
    pub record: Rc<ProcessRecord>,
    ranges: Vec<(u64, u64)>,
    last_seen: u64,
    next_refresh: u64,
    backoff: u64,
}

impl Known {
    fn covers(&self, addr: u64) -> bool {
        let i = self.ranges.partition_point(|r| r.0 <= addr);
        i > 0 && addr < self.ranges[i - 1].1
    }
}

fn ranges_of(rec: &ProcessRecord) -> Vec<(u64, u64)> {
    let mut r: Vec<_> = rec.mappings.iter().map(|m| (m.start, m.end)).collect();
    r.sort_unstable();
    r
}

/// Keyed by (pid, start time): within one round a pid can name two processes (reuse),
/// whose samples arrive interleaved; each keeps its own record and id.
#[derive(Default)]
pub struct ProcessTable {
    by_pid: HashMap<(u32, u64), Known>,
    next_id: u64,
}

impl ProcessTable {
    /// Identifies the process of a sample, reading /proc the first time it is seen.
    /// `comm` is the BPF-seen thread comm, used when /proc cannot be read.
    pub fn observe(
        &mut self,
        tgid: u32,
        start_ns: u64,
        comm: &[u8],
        user: &[u64],
        round: u64,
        counters: &Counters,
    ) -> u64 {
        if let Some(k) = self.by_pid.get_mut(&(tgid, start_ns)) {
            k.last_seen = round;
            if k.record.complete && round >= k.next_refresh && user.iter().any(|&a| !k.covers(a)) {
                refresh(k, round, counters);
            }
            return k.id;
        }
        self.next_id += 1;
        let id = self.next_id;
        let record = match procfs::read_process(tgid, start_ns) {
            Ok(r) => {
                counters
                    .processes_read
                    .set(counters.processes_read.get() + 1);
                r
            }
            Err(e) => {
                match e {
                    ProcError::Gone { .. } | ProcError::Reused { .. } => {
                        counters
                            .processes_gone
                            .set(counters.processes_gone.get() + 1);
                        tracing::info!(
                            pid = tgid,
                            "process gone before /proc could be read; sent with what BPF saw"
                        );
                    }
                    _ => {
                        counters
                            .process_read_errors
                            .set(counters.process_read_errors.get() + 1);
                        tracing::warn!(pid = tgid, error = %e, "process record unreadable");
                    }
                }
                ProcessRecord {
                    pid: tgid,
                    start_ns,
                    comm: comm.split(|&b| b == 0).next().unwrap_or_default().to_vec(),
                    complete: false,
                    ..Default::default()
                }
            }
        };
        let known = Known {
            id,
            start_ns,
            version: 1,
            ranges: ranges_of(&record),
            record: Rc::new(record),
            last_seen: round,
            next_refresh: round + 1,
            backoff: 1,
        };
        if self.by_pid.len() >= MAX_PROCESSES {
            self.evict_oldest(counters);
        }
        self.by_pid.insert((tgid, start_ns), known);
        id
    }

    pub fn get(&self, tgid: u32, start_ns: u64) -> Option<&Known> {
        self.by_pid.get(&(tgid, start_ns))
    }

    /// Forgets processes that have not been sampled for a while and have exited.
    /// Returns the ids forgotten, so subscribers can forget them too.
    pub fn sweep(&mut self, round: u64, counters: &Counters) -> Vec<u64> {
        let mut gone = Vec::new();
        self.by_pid.retain(|&(pid, _), k| {
            if round.saturating_sub(k.last_seen) < IDLE_ROUNDS {
                return true;
            }
            if k.record.complete && procfs::is_alive(pid, k.start_ns) {
                k.last_seen = round;
                return true;
            }
            gone.push(k.id);
            false
        });
        counters
            .processes_forgotten
            .set(counters.processes_forgotten.get() + gone.len() as u64);
        gone
    }

    fn evict_oldest(&mut self, counters: &Counters) {
        if let Some((&key, _)) = self.by_pid.iter().min_by_key(|(_, k)| k.last_seen) {
            self.by_pid.remove(&key);
            counters
                .processes_forgotten
                .set(counters.processes_forgotten.get() + 1);
        }
    }

    pub fn len(&self) -> usize {
        self.by_pid.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_pid.is_empty()
    }
}

fn refresh(k: &mut Known, round: u64, counters: &Counters) {
    counters
        .mapping_refreshes
        .set(counters.mapping_refreshes.get() + 1);
    match procfs::read_mappings(k.record.pid) {
        Ok(maps) if maps != k.record.mappings => {
            let mut rec = (*k.record).clone();
            rec.mappings = maps;
            k.ranges = ranges_of(&rec);
            k.record = Rc::new(rec);
            k.version += 1;
            k.backoff = 1;
        }
        _ => k.backoff = (k.backoff * 2).min(MAX_REFRESH_BACKOFF),
    }
    k.next_refresh = round + k.backoff;
}

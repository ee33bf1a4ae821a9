//! The table of processes seen in samples: one record per (pid, start time), read from
//! /proc the first time a process shows up, refreshed when a frame falls outside its
//! executable mappings (dlopen), forgotten once it has exited.

use std::collections::HashMap;
use std::rc::Rc;

use crate::counters::{add, bump, Counters};
use crate::procfs::{self, ProcError, ProcessRecord};

/// Processes kept at most; past it the least recently seen is forgotten.
const MAX_PROCESSES: usize = 32_768;
/// Rounds without a sample after which a process is checked for exit.
const IDLE_ROUNDS: u64 = 6;
/// Longest wait, in rounds, between two mapping refreshes that changed nothing (JIT
/// code and the vDSO lie outside every file mapping forever).
const MAX_REFRESH_BACKOFF: u64 = 64;
/// Bytes read from /proc per round at most (records and mapping refreshes). Past it, new
/// processes are recorded with what BPF saw and read in a later round; a storm of new
/// processes then costs bounded time and memory per round.
pub const ROUND_READ_BUDGET: usize = 64 << 20;
/// Record bytes the table holds at most; past it the least recently seen is forgotten.
pub const MAX_TABLE_BYTES: usize = 96 << 20;

pub struct Known {
    pub id: u64,
    pub start_ns: u64,
    pub version: u32,
    pub record: Rc<ProcessRecord>,
    ranges: Vec<(u64, u64)>,
    last_seen: u64,
    next_refresh: u64,
    backoff: u64,
    /// Not read yet: the round's read budget was spent when it was first seen.
    deferred: bool,
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
pub struct ProcessTable {
    by_pid: HashMap<(u32, u64), Known>,
    next_id: u64,
    /// Record bytes held (sum of `wire_bytes`).
    bytes: usize,
    /// /proc bytes still to be read this round.
    read_left: usize,
    round_budget: usize,
    max_bytes: usize,
}

impl Default for ProcessTable {
    fn default() -> Self {
        Self::with_budgets(ROUND_READ_BUDGET, MAX_TABLE_BYTES)
    }
}

/// The record read from /proc, trimmed to its bound, or a placeholder of BPF facts.
fn read_record(
    tgid: u32,
    start_ns: u64,
    comm: &[u8],
    counters: &Counters,
) -> (ProcessRecord, usize) {
    match procfs::read_process(tgid, start_ns) {
        Ok((mut r, read)) => {
            bump(&counters.processes_read);
            if r.trim_to(procfs::MAX_RECORD_BYTES) {
                bump(&counters.process_records_trimmed);
                tracing::warn!(
                    pid = tgid,
                    kept_mappings = r.mappings.len(),
                    max_bytes = procfs::MAX_RECORD_BYTES,
                    "process record over its byte bound; mappings past it left out"
                );
            }
            (r, read)
        }
        Err(e) => {
            match e {
                ProcError::Gone { .. } | ProcError::Reused { .. } => {
                    bump(&counters.processes_gone);
                    tracing::info!(
                        pid = tgid,
                        "process gone before /proc could be read; sent with what BPF saw"
                    );
                }
                _ => {
                    bump(&counters.process_read_errors);
                    tracing::warn!(pid = tgid, error = %e, "process record unreadable");
                }
            }
            (placeholder(tgid, start_ns, comm), 0)
        }
    }
}

/// A record of what BPF saw: pid, start time, thread comm.
fn placeholder(tgid: u32, start_ns: u64, comm: &[u8]) -> ProcessRecord {
    ProcessRecord {
        pid: tgid,
        start_ns,
        comm: comm.split(|&b| b == 0).next().unwrap_or_default().to_vec(),
        complete: false,
        ..Default::default()
    }
}

impl ProcessTable {
    /// A table that reads at most `round_budget` /proc bytes per round and holds at most
    /// `max_bytes` of records.
    pub fn with_budgets(round_budget: usize, max_bytes: usize) -> Self {
        Self {
            by_pid: HashMap::new(),
            next_id: 0,
            bytes: 0,
            read_left: round_budget,
            round_budget,
            max_bytes,
        }
    }

    /// Starts a round: the /proc read budget is full again.
    pub fn begin_round(&mut self) {
        self.read_left = self.round_budget;
    }

    /// Identifies the process of a sample, reading /proc the first time it is seen (or,
    /// once the round's read budget is spent, in a later round).
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
            if k.deferred && self.read_left > 0 {
                let (record, read) = read_record(tgid, start_ns, comm, counters);
                self.read_left = self.read_left.saturating_sub(read);
                self.bytes = self.bytes.saturating_sub(k.record.wire_bytes()) + record.wire_bytes();
                k.ranges = ranges_of(&record);
                k.record = Rc::new(record);
                k.version += 1;
                k.deferred = false;
            } else if k.record.complete
                && round >= k.next_refresh
                && user.iter().any(|&a| !k.covers(a))
            {
                let before = k.record.wire_bytes();
                let read = refresh(k, round, counters, self.read_left);
                self.read_left = self.read_left.saturating_sub(read);
                self.bytes = self.bytes.saturating_sub(before) + k.record.wire_bytes();
            }
            let id = k.id;
            self.shrink(counters);
            return id;
        }
        self.next_id += 1;
        let id = self.next_id;
        let (record, deferred) = if self.read_left > 0 {
            let (record, read) = read_record(tgid, start_ns, comm, counters);
            self.read_left = self.read_left.saturating_sub(read);
            (record, false)
        } else {
            bump(&counters.process_reads_deferred);
            tracing::warn!(
                pid = tgid,
                budget_bytes = self.round_budget,
                "this round's /proc read budget is spent; process read in a later round"
            );
            (placeholder(tgid, start_ns, comm), true)
        };
        self.bytes += record.wire_bytes();
        let known = Known {
            id,
            start_ns,
            version: 1,
            ranges: ranges_of(&record),
            record: Rc::new(record),
            last_seen: round,
            next_refresh: round + 1,
            backoff: 1,
            deferred,
        };
        if self.by_pid.len() >= MAX_PROCESSES {
            self.evict_oldest(counters);
        }
        self.by_pid.insert((tgid, start_ns), known);
        self.shrink(counters);
        id
    }

    /// Forgets the least recently seen processes while the table is over its bytes.
    fn shrink(&mut self, counters: &Counters) {
        while self.bytes > self.max_bytes && self.by_pid.len() > 1 {
            self.evict_oldest(counters);
            bump(&counters.processes_evicted_bytes);
        }
    }

    pub fn get(&self, tgid: u32, start_ns: u64) -> Option<&Known> {
        self.by_pid.get(&(tgid, start_ns))
    }

    /// Forgets processes that have not been sampled for a while and have exited.
    /// Returns the ids forgotten, so subscribers can forget them too.
    pub fn sweep(&mut self, round: u64, counters: &Counters) -> Vec<u64> {
        let mut gone = Vec::new();
        let mut freed = 0;
        self.by_pid.retain(|&(pid, _), k| {
            if round.saturating_sub(k.last_seen) < IDLE_ROUNDS {
                return true;
            }
            if k.record.complete && procfs::is_alive(pid, k.start_ns) {
                k.last_seen = round;
                return true;
            }
            gone.push(k.id);
            freed += k.record.wire_bytes();
            false
        });
        self.bytes = self.bytes.saturating_sub(freed);
        add(&counters.processes_forgotten, gone.len() as u64);
        gone
    }

    fn evict_oldest(&mut self, counters: &Counters) {
        if let Some((&key, _)) = self.by_pid.iter().min_by_key(|(_, k)| k.last_seen) {
            if let Some(k) = self.by_pid.remove(&key) {
                self.bytes = self.bytes.saturating_sub(k.record.wire_bytes());
            }
            bump(&counters.processes_forgotten);
        }
    }

    pub fn len(&self) -> usize {
        self.by_pid.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_pid.is_empty()
    }
}

/// Reads the mappings of `k` again if the budget allows; returns the bytes read.
fn refresh(k: &mut Known, round: u64, counters: &Counters, budget: usize) -> usize {
    if budget == 0 {
        // Tried again next round, without backing off.
        return 0;
    }
    bump(&counters.mapping_refreshes);
    let mut read = 0;
    match procfs::read_mappings(k.record.pid) {
        Ok((maps, n)) if maps != k.record.mappings => {
            read = n;
            let mut rec = (*k.record).clone();
            rec.mappings = maps;
            if rec.trim_to(procfs::MAX_RECORD_BYTES) {
                bump(&counters.process_records_trimmed);
            }
            k.ranges = ranges_of(&rec);
            k.record = Rc::new(rec);
            k.version += 1;
            k.backoff = 1;
        }
        Ok((_, n)) => {
            read = n;
            k.backoff = (k.backoff * 2).min(MAX_REFRESH_BACKOFF);
        }
        Err(_) => k.backoff = (k.backoff * 2).min(MAX_REFRESH_BACKOFF),
    }
    k.next_refresh = round + k.backoff;
    read
}

#[cfg(test)]
mod tests {
    use super::*;

    fn child() -> std::process::Child {
        std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep")
    }

    #[test]
    fn a_spent_round_budget_defers_reads_to_the_next_round() {
        let c = Counters::default();
        let mut kids = [child(), child()];
        let pids: Vec<u32> = kids.iter().map(std::process::Child::id).collect();
        let starts: Vec<u64> = pids
            .iter()
            .map(|&p| procfs::start_ns_of(p).expect("a live child"))
            .collect();
        // One byte a round: the first read spends it.
        let mut t = ProcessTable::with_budgets(1, MAX_TABLE_BYTES);
        let a = t.observe(pids[0], starts[0], b"sleep", &[], 1, &c);
        let b = t.observe(pids[1], starts[1], b"sleep", &[], 1, &c);
        assert!(t.get(pids[0], starts[0]).unwrap().record.complete);
        let deferred = t.get(pids[1], starts[1]).unwrap();
        assert!(!deferred.record.complete);
        assert_eq!(deferred.record.comm, b"sleep");
        assert_eq!(c.process_reads_deferred.get(), 1);
        // The next round reads it: same id, a new version for subscribers.
        t.begin_round();
        assert_eq!(t.observe(pids[1], starts[1], b"sleep", &[], 2, &c), b);
        let read = t.get(pids[1], starts[1]).unwrap();
        assert!(read.record.complete);
        assert_eq!(read.version, 2);
        assert_ne!(a, b);
        assert_eq!(c.processes_read.get(), 2);
        for k in &mut kids {
            let _ = k.kill();
            let _ = k.wait();
        }
    }

    #[test]
    fn the_table_keeps_to_its_bytes() {
        let c = Counters::default();
        // Room for about one placeholder record: each new process pushes out the oldest.
        let mut t = ProcessTable::with_budgets(0, 200);
        for (round, pid) in (1..=5u64).zip(u32::MAX - 5..) {
            t.observe(pid, 1, b"gone", &[], round, &c);
        }
        assert_eq!(t.len(), 1);
        assert!(t.get(u32::MAX - 1, 1).is_some(), "the newest stays");
        assert_eq!(c.processes_evicted_bytes.get(), 4);
    }
}

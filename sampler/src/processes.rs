//! The table of processes seen in samples: one record per (pid, start time, exec
//! count), read from /proc when the BPF program announces the process (its first
//! sample) or, failing that, when its samples are assembled; refreshed when a frame
//! falls outside its executable mappings (dlopen); kept after exec or exit until the
//! rounds carrying its last samples have been sent, then forgotten.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use crate::cgroups::Cgroups;
use crate::counters::{add, bump, Counters};
use crate::handles::Handles;
use crate::layouts::{ExeSeen, Layouts};
use crate::procfs::{self, ProcessRecord};
use crate::reading::{placeholder, read_record};
use crate::texts::Texts;

/// Processes kept at most; past it the least recently seen is forgotten.
const MAX_PROCESSES: usize = 32_768;
/// Rounds without a sample after which a process is checked for exit.
const IDLE_ROUNDS: u64 = 6;
/// Rounds a process's record outlives the round in which it exec'd or exited: that
/// round carries its last samples, and the next gives a slow subscriber time to ask for
/// its binaries. Rounds of at least [`ENDED_GRACE_SECS`] give that time in one round,
/// which under an exec storm holds a third fewer records (a round's worth).
const ENDED_ROUNDS: u64 = 2;
const ENDED_GRACE_SECS: u32 = 10;
/// Longest wait, in rounds, between two mapping refreshes that changed nothing (JIT
/// code and the vDSO lie outside every file mapping forever).
const MAX_REFRESH_BACKOFF: u64 = 64;
/// Shortest and longest wait between two mapping reads that the BPF program asked for
/// (its process ran code outside them), doubling while a read changes nothing.
const REMAP_MIN_NS: u64 = 100_000_000;
const REMAP_MAX_NS: u64 = 10_000_000_000;
/// Such reads a second over all processes, and at once: a local user whose processes
/// keep running code in fresh anonymous mappings cannot make the sampler read /proc
/// without end (the events themselves are bounded by the sampling rate); past it, the
/// round's end reads them as before.
const REMAP_READS_PER_SEC: f64 = 50.0;
const REMAP_READS_BURST: f64 = 100.0;
/// Bytes read from /proc per round at most (records and mapping refreshes). Past it, new
/// processes are recorded with what BPF saw and read in a later round; a storm of new
/// processes then costs bounded time and memory per round.
pub(crate) const ROUND_READ_BUDGET: usize = 64 << 20;
/// Record bytes the table holds at most; past it the least recently seen is forgotten.
pub(crate) const MAX_TABLE_BYTES: usize = 96 << 20;

/// One process as the BPF program tells them apart: a reused pid has another start
/// time, an exec another exec count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct ProcKey {
    pub(crate) tgid: u32,
    pub(crate) start_ns: u64,
    pub(crate) exec_id: u32,
}

/// How a process's program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// It exec'd another program: /proc now describes that one.
    Exec,
    /// Its last thread exited.
    Exit,
}

pub(crate) struct Known {
    pub(crate) id: u64,
    pub(crate) start_ns: u64,
    pub(crate) version: u32,
    pub(crate) record: Rc<ProcessRecord>,
    last_seen: u64,
    next_refresh: u64,
    backoff: u64,
    /// Not read yet: the round's read budget was spent when it was first seen.
    deferred: bool,
    /// CLOCK_BOOTTIME ns before which a REMAP event is not acted on, and the wait after
    /// the next read that changes nothing.
    remap_after: u64,
    remap_wait: u64,
    /// The round in progress when it exec'd or exited: /proc no longer describes it.
    ended: Option<u64>,
    /// Its executable as BPF saw it: a read whose mappings do not hold it is another
    /// program's (an exec whose event is still behind in the ring).
    exe: ExeSeen,
}

impl Known {
    /// Whether `addr` lies in the record's file mappings or anonymous code (each in
    /// address order: `Texts::share` saw to it).
    fn covers(&self, addr: u64) -> bool {
        let r = &self.record;
        let i = r.mappings.partition_point(|m| m.start <= addr);
        let j = r.code.partition_point(|c| c.0 <= addr);
        (i > 0 && addr < r.mappings[i - 1].end) || (j > 0 && addr < r.code[j - 1].1)
    }
}

/// Keyed by [`ProcKey`]: within one round a pid can name two processes (reuse) or two
/// programs (exec), whose samples arrive interleaved; each keeps its own record and id.
pub(crate) struct ProcessTable {
    /// Boxed: an exec storm grows the table to 4,096 buckets and more, and a bucket of
    /// 32 bytes (not 152) keeps that growth, and the moment both tables are held while
    /// it rehashes, small; an empty bucket then costs no record's room.
    by_key: HashMap<ProcKey, Box<Known>>,
    next_id: u64,
    /// Record bytes held (sum of `wire_bytes`).
    bytes: usize,
    /// /proc bytes still to be read this round.
    read_left: usize,
    round_budget: usize,
    max_bytes: usize,
    handles: Rc<RefCell<Handles>>,
    /// Processes forgotten while the BPF program may still count them as announced.
    unseen: Vec<ProcKey>,
    /// Records read or re-read since the last `take_fresh` (for the unwinder's maps).
    fresh: Vec<(ProcKey, Rc<ProcessRecord>)>,
    /// Every process forgotten since the last `take_dropped`.
    dropped: Vec<ProcKey>,
    /// The texts records share (paths, cgroup files, command lines).
    texts: Texts,
    /// Ids of records evicted since the last `sweep`, which sends them as forgotten with
    /// its own: a subscriber would otherwise keep their records for good.
    evicted: Vec<u64>,
    /// Cgroup paths by cgroup id (what samples name).
    pub(crate) cgroups: Cgroups,
    /// Where each executable lies, for processes gone before they were read.
    layouts: Layouts,
    /// Mapping reads that REMAP events may ask for.
    remap_reads: firn_logs::TokenBucket,
    /// Rounds an ended process's record is kept after its own ([`ENDED_ROUNDS`]).
    ended_rounds: u64,
}

/// Gives a hash table's room back once it holds a small part of it (after a storm of
/// processes): it never shrinks by itself, and its emptied buckets stay resident.
pub(crate) fn shrink_after_storm<K: std::hash::Hash + Eq, V>(m: &mut HashMap<K, V>) {
    if m.capacity() > 4 * m.len().max(256) {
        m.shrink_to(2 * m.len().max(256));
    }
}

impl Default for ProcessTable {
    fn default() -> Self {
        Self::with_budgets(ROUND_READ_BUDGET, MAX_TABLE_BYTES)
    }
}

impl ProcessTable {
    /// A table that reads at most `round_budget` /proc bytes per round and holds at most
    /// `max_bytes` of records.
    pub(crate) fn with_budgets(round_budget: usize, max_bytes: usize) -> Self {
        Self {
            by_key: HashMap::new(),
            next_id: 0,
            bytes: 0,
            read_left: round_budget,
            round_budget,
            max_bytes,
            handles: Rc::new(RefCell::new(Handles::new(0))),
            unseen: Vec::new(),
            fresh: Vec::new(),
            dropped: Vec::new(),
            evicted: Vec::new(),
            texts: Texts::default(),
            cgroups: Cgroups::default(),
            layouts: Layouts::default(),
            remap_reads: firn_logs::TokenBucket::new(REMAP_READS_PER_SEC, REMAP_READS_BURST),
            ended_rounds: ENDED_ROUNDS,
        }
    }

    /// Keeps ended processes' records for rounds of `seconds`: one round after their
    /// own when that is at least [`ENDED_GRACE_SECS`], else [`ENDED_ROUNDS`].
    pub(crate) fn with_round_seconds(mut self, seconds: u32) -> Self {
        self.ended_rounds = if seconds >= ENDED_GRACE_SECS {
            1
        } else {
            ENDED_ROUNDS
        };
        self
    }

    /// Takes handles of mapped files into `handles` (shared with the broker).
    pub(crate) fn with_handles(mut self, handles: Rc<RefCell<Handles>>) -> Self {
        self.handles = handles;
        self
    }

    /// Starts a round: the /proc read budget is full again, and handles unused for a
    /// while are closed.
    pub(crate) fn begin_round(&mut self, round: u64, counters: &Counters) {
        self.read_left = self.round_budget;
        self.handles.borrow_mut().end_round(round, counters);
    }

    /// A process the BPF program announced (its first sample), while round `round` is in
    /// progress: read from /proc now, while it still runs.
    /// `exe`: its executable as BPF saw it; `seen_ns`: when the event was read
    /// (CLOCK_BOOTTIME).
    pub(crate) fn discover(
        &mut self,
        key: ProcKey,
        (comm, exe, cgroup_id): (&[u8], ExeSeen, u64),
        (round, seen_ns): (u64, u64),
        counters: &Counters,
    ) {
        if let Some(k) = self.by_key.get_mut(&key) {
            k.last_seen = k.last_seen.max(round);
            return;
        }
        if self.read_left > 0 {
            bump(&counters.processes_read_early);
        }
        let id = self.insert(key, (comm, exe, cgroup_id), (round, seen_ns), counters);
        if let Some(k) = self
            .by_key
            .get(&key)
            .filter(|k| k.id == id && k.record.complete)
        {
            self.cgroups.learn(cgroup_id, &k.record.cgroup, counters);
        }
    }

    /// A known process ran code outside the mappings of its record (the BPF program's
    /// REMAP, at most ten a second per process): they are read again now, while round
    /// `round` is in progress, unless a read that changed nothing was lately (JIT code
    /// it has not mapped from a file, say), within the round's /proc budget.
    pub(crate) fn remap(&mut self, key: ProcKey, (round, now_ns): (u64, u64), counters: &Counters) {
        bump(&counters.remap_events);
        let Some(k) = self.by_key.get_mut(&key) else {
            bump(&counters.remap_events_skipped);
            return;
        };
        if k.ended.is_some() || k.deferred || !k.record.complete || now_ns < k.remap_after {
            bump(&counters.remap_events_skipped);
            return;
        }
        // Half the round's /proc budget stays for new processes, whatever REMAPs ask.
        let budget = self.read_left.saturating_sub(self.round_budget / 2);
        if budget == 0 {
            bump(&counters.remap_reads_no_budget);
            return;
        }
        if !self.remap_reads.allow() {
            bump(&counters.remap_reads_limited);
            return;
        }
        let (before, version) = (k.record.wire_bytes(), k.version);
        let (read, changed) = refresh(k, round, (&self.handles, &mut self.texts), counters, budget);
        // New files are what REMAP is for (a loader at work, a dlopen); a JIT's anonymous
        // code coming and going is taken but backs off like a read that found nothing.
        k.remap_wait = if k.version != version {
            REMAP_MIN_NS
        } else {
            (k.remap_wait.max(REMAP_MIN_NS / 2) * 2).min(REMAP_MAX_NS)
        };
        k.remap_after = now_ns.saturating_add(k.remap_wait);
        if changed {
            bump(&counters.remap_reads_changed);
            self.fresh.push((key, k.record.clone()));
        }
        self.read_left = self.read_left.saturating_sub(read);
        self.bytes = self.bytes.saturating_sub(before) + k.record.wire_bytes();
        self.shrink(counters);
    }

    /// A known process sampled in cgroup `id`, another than its last sample's.
    pub(crate) fn moved(&mut self, key: ProcKey, id: u64, counters: &Counters) {
        if self.by_key.get(&key).is_some_and(|k| k.ended.is_none()) {
            self.cgroups.moved((key.tgid, key.start_ns), id, counters);
        }
    }

    /// Takes the handles of the files that records read since the last call map: after
    /// a burst of new processes has been read, so that no read waits for another
    /// process's walks.
    pub(crate) fn take_handles(&mut self, counters: &Counters) {
        let t0 = std::time::Instant::now();
        self.handles.borrow_mut().take_queued(counters);
        add(
            &counters.binary_handle_ns,
            u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX),
        );
    }

    /// A process the BPF program saw exec or exit while round `round` was in progress.
    pub(crate) fn ended(&mut self, key: ProcKey, how: Ending, round: u64) {
        if let Some(k) = self.by_key.get_mut(&key) {
            k.ended = Some(round);
            k.last_seen = k.last_seen.max(round);
            tracing::debug!(pid = key.tgid, ?how, round, "process ended");
        }
    }

    /// Identifies the process of a sample, reading /proc the first time it is seen (or,
    /// once the round's read budget is spent, in a later round).
    /// `comm` is the BPF-seen thread comm, used when /proc cannot be read. `left_code`:
    /// the unwinder stopped at a return address outside the mappings it was given
    /// (code mapped since, or a wrong table); like a frame outside them, it has the
    /// mappings read again, with backoff.
    pub(crate) fn observe(
        &mut self,
        key: ProcKey,
        comm: &[u8],
        (user, left_code): (&[u64], bool),
        round: u64,
        counters: &Counters,
    ) -> u64 {
        let Some(k) = self.by_key.get_mut(&key) else {
            return self.insert(key, (comm, ExeSeen::default(), 0), (round, 0), counters);
        };
        k.last_seen = k.last_seen.max(round);
        // Once ended, /proc describes another program or nothing: the record stays.
        if k.ended.is_none() {
            if k.deferred && self.read_left > 0 {
                let (mut record, read) = read_record(
                    key,
                    (comm, ExeSeen::default(), None),
                    (&self.handles, &mut self.layouts),
                    counters,
                );
                record.first_sample_ns = k.record.first_sample_ns;
                self.texts.share(&mut record);
                self.read_left = self.read_left.saturating_sub(read);
                self.bytes = self.bytes.saturating_sub(k.record.wire_bytes()) + record.wire_bytes();
                k.record = Rc::new(record);
                k.version += 1;
                k.deferred = false;
                self.fresh.push((key, k.record.clone()));
            } else if k.record.complete
                && round >= k.next_refresh
                && (left_code || user.iter().any(|&a| !k.covers(a)))
            {
                let before = k.record.wire_bytes();
                let (read, changed) = refresh(
                    k,
                    round,
                    (&self.handles, &mut self.texts),
                    counters,
                    self.read_left,
                );
                if changed {
                    self.fresh.push((key, k.record.clone()));
                }
                self.read_left = self.read_left.saturating_sub(read);
                self.bytes = self.bytes.saturating_sub(before) + k.record.wire_bytes();
            }
        }
        let id = k.id;
        self.shrink(counters);
        id
    }

    fn insert(
        &mut self,
        key: ProcKey,
        (comm, exe, cgroup_id): (&[u8], ExeSeen, u64),
        (round, seen_ns): (u64, u64),
        counters: &Counters,
    ) -> u64 {
        self.next_id += 1;
        let id = self.next_id;
        let (mut record, deferred) = if self.read_left > 0 {
            let cgroup = self.cgroups.for_discovery(cgroup_id);
            if cgroup.is_some() {
                bump(&counters.cgroup_reads_saved);
            }
            let (record, read) = read_record(
                key,
                (comm, exe, cgroup.as_deref()),
                (&self.handles, &mut self.layouts),
                counters,
            );
            self.read_left = self.read_left.saturating_sub(read);
            (record, false)
        } else {
            bump(&counters.process_reads_deferred);
            tracing::warn!(
                pid = key.tgid,
                budget_bytes = self.round_budget,
                "this round's /proc read budget is spent; process read in a later round"
            );
            (placeholder(key.tgid, key.start_ns, comm), true)
        };
        record.first_sample_ns = seen_ns;
        self.texts.share(&mut record);
        self.bytes += record.wire_bytes();
        let known = Known {
            id,
            start_ns: key.start_ns,
            version: 1,
            record: Rc::new(record),
            last_seen: round,
            next_refresh: round + 1,
            backoff: 1,
            deferred,
            remap_after: 0,
            remap_wait: 0,
            ended: None,
            exe: ExeSeen { facts: None, ..exe },
        };
        if self.by_key.len() >= MAX_PROCESSES {
            self.evict_oldest(counters);
        }
        if !deferred {
            self.fresh.push((key, known.record.clone()));
        }
        self.by_key.insert(key, Box::new(known));
        self.shrink(counters);
        id
    }

    /// Forgets the least recently seen processes while the table is over its bytes.
    fn shrink(&mut self, counters: &Counters) {
        while self.bytes > self.max_bytes && self.by_key.len() > 1 {
            self.evict_oldest(counters);
            bump(&counters.processes_evicted_bytes);
        }
    }

    pub(crate) fn get(&self, key: ProcKey) -> Option<&Known> {
        self.by_key.get(&key).map(|k| &**k)
    }

    /// Forgets processes whose last samples have been sent: those that ended
    /// `ended_rounds` ago, and those not sampled for a while that have exited.
    /// Returns the ids forgotten, so subscribers can forget them too.
    pub(crate) fn sweep(&mut self, round: u64, counters: &Counters) -> Vec<u64> {
        let mut gone = Vec::new();
        let mut freed = 0;
        let unseen = &mut self.unseen;
        let dropped = &mut self.dropped;
        let keep = self.ended_rounds;
        self.by_key.retain(|key, k| {
            match k.ended {
                Some(at) if round >= at + keep => {}
                Some(_) => return true,
                None => {
                    if round.saturating_sub(k.last_seen) < IDLE_ROUNDS {
                        return true;
                    }
                    if k.record.complete && procfs::is_alive(key.tgid, k.start_ns) {
                        k.last_seen = round;
                        return true;
                    }
                    unseen.push(*key);
                }
            }
            gone.push(k.id);
            dropped.push(*key);
            freed += k.record.wire_bytes();
            false
        });
        self.bytes = self.bytes.saturating_sub(freed);
        shrink_after_storm(&mut self.by_key);
        self.texts.sweep();
        add(&counters.processes_forgotten, gone.len() as u64);
        // Counted when they were evicted.
        gone.append(&mut self.evicted);
        gone
    }

    /// Processes forgotten that the BPF program may still hold as announced (so that it
    /// announces them again if they are sampled again).
    pub(crate) fn take_unseen(&mut self) -> Vec<ProcKey> {
        std::mem::take(&mut self.unseen)
    }

    /// Records read from /proc since the last call (new, deferred or refreshed).
    pub(crate) fn take_fresh(&mut self) -> Vec<(ProcKey, Rc<ProcessRecord>)> {
        std::mem::take(&mut self.fresh)
    }

    /// Every process forgotten since the last call, whatever the reason.
    pub(crate) fn take_dropped(&mut self) -> Vec<ProcKey> {
        std::mem::take(&mut self.dropped)
    }

    fn evict_oldest(&mut self, counters: &Counters) {
        if let Some((&key, _)) = self.by_key.iter().min_by_key(|(_, k)| k.last_seen) {
            if let Some(k) = self.by_key.remove(&key) {
                self.bytes = self.bytes.saturating_sub(k.record.wire_bytes());
                self.dropped.push(key);
                self.evicted.push(k.id);
                if k.ended.is_none() {
                    self.unseen.push(key);
                }
            }
            bump(&counters.processes_forgotten);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.by_key.len()
    }
}

/// Reads the mappings of `k` again if the budget allows; returns the bytes read and
/// whether they changed. Libraries loaded since (dlopen) get handles too, so they are
/// brokered after exit.
fn refresh(
    k: &mut Known,
    round: u64,
    (handles, texts): (&RefCell<Handles>, &mut Texts),
    counters: &Counters,
    budget: usize,
) -> (usize, bool) {
    if budget == 0 {
        // Tried again next round, without backing off.
        return (0, false);
    }
    bump(&counters.mapping_refreshes);
    let (mut read, mut changed) = (0, false);
    match procfs::read_mappings(k.record.pid, k.start_ns) {
        // Exec keeps the start time: the executable BPF saw tells the program.
        Ok(((maps, _), n, _))
            if crate::facts::exe_mapping(&k.exe, &maps).is_some_and(|m| m.is_none()) =>
        {
            read = n;
            bump(&counters.mapping_reads_other_program);
            k.backoff = (k.backoff * 2).min(MAX_REFRESH_BACKOFF);
        }
        Ok(((maps, code), n, dir)) if maps != k.record.mappings || code != k.record.code => {
            read = n;
            handles.borrow_mut().queue(dir, &maps, counters);
            let mut rec = (*k.record).clone();
            // Only file mappings are sent: a new version for those alone.
            if maps != rec.mappings {
                k.version += 1;
            }
            rec.mappings = maps;
            rec.code = code;
            if rec.trim_to(procfs::MAX_RECORD_BYTES) {
                bump(&counters.process_records_trimmed);
            }
            texts.share(&mut rec);
            k.record = Rc::new(rec);
            k.backoff = 1;
            changed = true;
        }
        Ok((_, n, _)) => {
            read = n;
            k.backoff = (k.backoff * 2).min(MAX_REFRESH_BACKOFF);
        }
        Err(_) => k.backoff = (k.backoff * 2).min(MAX_REFRESH_BACKOFF),
    }
    k.next_refresh = round + k.backoff;
    (read, changed)
}

#[cfg(test)]
#[path = "processes_tests.rs"]
mod tests;

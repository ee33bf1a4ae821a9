//! Subscribers and their bounded queues. A round is published to every subscriber; a
//! subscriber's sender task pushes batches over its connection as flow control allows.
//! A full queue drops its oldest batch (counted) and carries that batch's process
//! records into the next one, so no record a later sample needs is lost.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;

use tokio::sync::Notify;

use crate::assemble::{Issued, RoundData};
use crate::broker::{BROKER_BURST, BROKER_RATE};
use crate::counters::{add, bump, Counters};
use crate::procfs::ProcessRecord;
use firn_logs::TokenBucket;

/// Process record bytes one batch carries at most (as estimated by
/// `ProcessRecord::wire_bytes`). With the samples (16,384 × 127 frames) and kernel
/// symbols this keeps a batch well under the enricher's 128 MiB reader limit. Records
/// past it wait for the next batch, oldest first.
pub(crate) const MAX_BATCH_RECORD_BYTES: usize = 32 << 20;

pub(crate) struct Outgoing {
    /// `None`: an announcement, records read between rounds (no samples).
    pub(crate) round: Option<Rc<RoundData>>,
    pub(crate) processes: Vec<Issued>,
    pub(crate) forgotten: Vec<u64>,
    /// Python code blobs of batches dropped before this one (each code object's names
    /// are copied once, so they must not be lost with their batch).
    pub(crate) python_code: Vec<Rc<[u8]>>,
    /// When it was queued (an announcement waits a moment for others to join it).
    pub(crate) queued_at: std::time::Instant,
}

/// How long an announcement alone in the queue waits for more records to join it: a
/// burst of new processes (a build, a fork storm) then costs one message, not one each,
/// for 5 ms more before their tables.
const ANNOUNCE_GATHER: std::time::Duration = std::time::Duration::from_millis(5);

/// A mapped file as the sampler names it: device (major, minor) and inode.
pub(crate) type FileId = (u32, u32, u64);

/// Files a subscriber is known to have heard of, at most; past it the set starts over
/// (counted), and processes are announced again until it fills.
const MAX_TOLD_FILES: usize = 1 << 16;
/// Files a subscriber loaded a Python interpreter record for, at most.
const MAX_INTERPRETER_FILES: usize = 1024;

pub(crate) struct Subscriber {
    pub(crate) id: u64,
    queue: RefCell<VecDeque<Outgoing>>,
    wake: Notify,
    /// Process id → the record (and its mapping version) sent to this subscriber: what
    /// its broker requests may refer to.
    sent: RefCell<HashMap<u64, (u32, Rc<ProcessRecord>)>>,
    pub(crate) dropped: Cell<u64>,
    /// The highest process id ever sent to this subscriber: a request above it names a
    /// process it was never told of (below it, one may since have been forgotten).
    pub(crate) max_sent: Cell<u64>,
    closed: Cell<bool>,
    /// Binds the broker channel to this subscription.
    pub(crate) broker_key: [u8; 16],
    pub(crate) channel: RefCell<Option<std::os::unix::net::UnixStream>>,
    pub(crate) next_ticket: Cell<u64>,
    pub(crate) rate: RefCell<TokenBucket>,
    /// Records over a batch's byte bound, to go into the next batch.
    deferred: RefCell<Vec<Issued>>,
    /// Files of the records sent to this subscriber (announced or batched): a new
    /// process that maps none but these is not announced. What the subscriber does with
    /// an announcement is build the tables of files new to it, and send the interpreter
    /// record of a Python process; a process of known files waits for its round's batch,
    /// which saves its wakeups and messages on both sides (a churn of one program).
    told: RefCell<HashSet<FileId>>,
    /// Files this subscriber loaded a Python interpreter record for: their new processes
    /// are announced, so that their records go out before the round ends.
    interpreters: RefCell<HashSet<FileId>>,
}

impl Subscriber {
    pub(crate) fn close(&self) {
        self.closed.set(true);
        self.queue.borrow_mut().clear();
        self.wake.notify_one();
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.get()
    }

    /// A Python interpreter record was loaded for a mapping of `file`.
    pub(crate) fn note_interpreter(&self, file: FileId) {
        let mut i = self.interpreters.borrow_mut();
        if i.len() >= MAX_INTERPRETER_FILES {
            // Only a delay: a new process of an interpreter forgotten here comes with
            // the round's batch, its record then built for its second round.
            i.clear();
        }
        i.insert(file);
    }

    /// Whether `record` brings this subscriber something to do before its round: a file
    /// it has not heard of, or one of a Python interpreter it has records for. "Heard
    /// of" is what was sent, not what the subscriber still holds: a table it dropped is
    /// built again at the round, not ahead of it.
    fn urgent(&self, record: &ProcessRecord) -> bool {
        let told = self.told.borrow();
        let interpreters = self.interpreters.borrow();
        record.mappings.iter().any(|m| {
            let f = file_of(m);
            !told.contains(&f) || interpreters.contains(&f)
        })
    }

    /// The files of records sent to this subscriber.
    fn tell(&self, sent: &[Issued], counters: &Counters) {
        let mut told = self.told.borrow_mut();
        for p in sent {
            for m in &p.record.mappings {
                if told.len() >= MAX_TOLD_FILES {
                    bump(&counters.told_files_flushed);
                    told.clear();
                }
                told.insert(file_of(m));
            }
        }
    }

    /// The record of `process_id` at `version`, if this subscriber was sent exactly that.
    pub(crate) fn record(&self, process_id: u64, version: u32) -> Option<Rc<ProcessRecord>> {
        match self.sent.borrow().get(&process_id) {
            Some((v, r)) if *v == version => Some(r.clone()),
            _ => None,
        }
    }

    /// Waits for the next batch or announcement; `None` once the subscriber is closed.
    pub(crate) async fn next(&self) -> Option<Outgoing> {
        loop {
            if self.closed.get() {
                return None;
            }
            let young = {
                let q = self.queue.borrow();
                match q.front() {
                    Some(o) if o.round.is_none() && q.len() == 1 => {
                        ANNOUNCE_GATHER.checked_sub(o.queued_at.elapsed())
                    }
                    _ => None,
                }
            };
            if let Some(wait) = young.filter(|w| !w.is_zero()) {
                tokio::time::sleep(wait).await;
                continue;
            }
            if let Some(b) = self.queue.borrow_mut().pop_front() {
                return Some(b);
            }
            self.wake.notified().await;
        }
    }
}

pub struct Hub {
    subs: RefCell<Vec<Rc<Subscriber>>>,
    next_id: Cell<u64>,
    queue_limit: usize,
    counters: Rc<Counters>,
    batch_record_bytes: usize,
}

impl Hub {
    pub fn new(queue_limit: usize, counters: Rc<Counters>) -> Self {
        Self {
            subs: RefCell::new(Vec::new()),
            next_id: Cell::new(0),
            queue_limit: queue_limit.max(1),
            counters,
            batch_record_bytes: MAX_BATCH_RECORD_BYTES,
        }
    }

    /// A hub whose batches carry at most `bytes` of process records (tests).
    #[cfg(test)]
    pub(crate) fn with_batch_record_bytes(mut self, bytes: usize) -> Self {
        self.batch_record_bytes = bytes;
        self
    }

    /// The records of `candidates` (oldest first) that fit in `max` bytes; the rest go
    /// to the subscriber's deferred list, counted. At least one record always goes, so
    /// a record alone over the bound still leaves.
    fn fit(&self, sub: &Subscriber, candidates: Vec<Issued>, max: usize) -> Vec<Issued> {
        let mut used = 0;
        let mut kept = Vec::with_capacity(candidates.len());
        let mut over = Vec::new();
        for p in candidates {
            let n = p.record.wire_bytes();
            if kept.is_empty() || used + n <= max {
                used += n;
                kept.push(p);
            } else {
                over.push(p);
            }
        }
        if !over.is_empty() {
            let c = &self.counters;
            add(&c.process_records_deferred, over.len() as u64);
            tracing::warn!(
                subscriber = sub.id,
                deferred = over.len(),
                max_bytes = max,
                "a batch's process record bytes are spent; the rest go in the next batch"
            );
            let mut d = sub.deferred.borrow_mut();
            carry(over, &mut d);
        }
        kept
    }

    pub(crate) fn add(&self, broker_key: [u8; 16]) -> Rc<Subscriber> {
        self.next_id.set(self.next_id.get() + 1);
        let sub = Rc::new(Subscriber {
            id: self.next_id.get(),
            queue: RefCell::new(VecDeque::new()),
            wake: Notify::new(),
            sent: RefCell::new(HashMap::new()),
            max_sent: Cell::new(0),
            dropped: Cell::new(0),
            closed: Cell::new(false),
            broker_key,
            channel: RefCell::new(None),
            next_ticket: Cell::new(0),
            rate: RefCell::new(TokenBucket::new(BROKER_RATE, BROKER_BURST)),
            deferred: RefCell::new(Vec::new()),
            told: RefCell::new(HashSet::new()),
            interpreters: RefCell::new(HashSet::new()),
        });
        self.subs.borrow_mut().push(sub.clone());
        sub
    }

    /// Attaches a broker channel to the open subscription holding `key`, once.
    pub(crate) fn attach_channel(
        &self,
        key: &[u8; 16],
        channel: std::os::unix::net::UnixStream,
    ) -> bool {
        let subs = self.subs.borrow();
        let Some(sub) = subs.iter().find(|s| !s.is_closed() && &s.broker_key == key) else {
            return false;
        };
        let mut slot = sub.channel.borrow_mut();
        if slot.is_some() {
            return false;
        }
        *slot = Some(channel);
        true
    }

    /// Queues `round` for every open subscriber, with the process records each lacks.
    pub(crate) fn publish(&self, round: Rc<RoundData>, forgotten: &[u64]) {
        let c = &self.counters;
        let forgotten_all = forgotten;
        self.subs.borrow_mut().retain(|s| !s.is_closed());
        for sub in self.subs.borrow().iter() {
            let mut sent = sub.sent.borrow_mut();
            let forgotten: Vec<u64> = forgotten
                .iter()
                .copied()
                .filter(|id| sent.remove(id).is_some())
                .collect();
            crate::processes::shrink_after_storm(&mut sent);
            let mut deferred = sub.deferred.take();
            deferred.retain(|p| !forgotten_all.contains(&p.id));
            carry(
                round
                    .processes
                    .iter()
                    .filter(|p| sent.get(&p.id).map(|s| s.0) != Some(p.version))
                    .cloned()
                    .collect(),
                &mut deferred,
            );
            let processes = self.fit(sub, deferred, self.batch_record_bytes);
            for p in &processes {
                sent.insert(p.id, (p.version, p.record.clone()));
                sub.max_sent.set(sub.max_sent.get().max(p.id));
            }
            sub.tell(&processes, c);
            let mut q = sub.queue.borrow_mut();
            q.push_back(Outgoing {
                round: Some(round.clone()),
                processes,
                forgotten,
                python_code: Vec::new(),
                queued_at: std::time::Instant::now(),
            });
            bump(&c.batches_queued);
            self.trim(sub, &mut q);
            sub.wake.notify_one();
        }
    }

    /// Queues the records read since the last call (new processes, between rounds) for
    /// every open subscriber that lacks them, ahead of the round's batch: the subscriber
    /// can send their tables while the round runs. Announcements waiting one behind
    /// another become one while within a batch's record bytes.
    pub(crate) fn announce(&self, fresh: &[Issued]) {
        if fresh.is_empty() {
            return;
        }
        let c = &self.counters;
        self.subs.borrow_mut().retain(|s| !s.is_closed());
        for sub in self.subs.borrow().iter() {
            let mut sent = sub.sent.borrow_mut();
            let unsent = fresh
                .iter()
                .filter(|p| sent.get(&p.id).map(|s| s.0) != Some(p.version));
            let (new, later): (Vec<Issued>, Vec<Issued>) =
                unsent.cloned().partition(|p| sub.urgent(&p.record));
            add(&c.processes_not_announced, later.len() as u64);
            if new.is_empty() {
                continue;
            }
            let mut q = sub.queue.borrow_mut();
            let bytes = |p: &[Issued]| p.iter().map(|p| p.record.wire_bytes()).sum::<usize>();
            let waiting = q
                .back()
                .filter(|o| o.round.is_none())
                .map(|o| bytes(&o.processes));
            // Merged into the announcement waiting last while within a batch's bound;
            // else a new one (records over the bound go to the next batch, as ever).
            let merge = waiting.is_some_and(|w| w + bytes(&new) <= self.batch_record_bytes);
            let processes = if merge {
                new
            } else {
                self.fit(sub, new, self.batch_record_bytes)
            };
            for p in &processes {
                sent.insert(p.id, (p.version, p.record.clone()));
                sub.max_sent.set(sub.max_sent.get().max(p.id));
            }
            sub.tell(&processes, c);
            add(&c.processes_announced, processes.len() as u64);
            match q.back_mut().filter(|o| merge && o.round.is_none()) {
                Some(back) => carry(processes, &mut back.processes),
                None => q.push_back(Outgoing {
                    round: None,
                    processes,
                    forgotten: Vec::new(),
                    python_code: Vec::new(),
                    queued_at: std::time::Instant::now(),
                }),
            }
            self.trim(sub, &mut q);
            sub.wake.notify_one();
        }
    }

    /// Drops the oldest batches while more than the queue limit wait. What a dropped
    /// item carries that a later one needs moves on: its records to the next item, its
    /// forgotten ids and Python code to the next batch. An announcement ahead of the
    /// batches is merged the same way, and not counted as a drop.
    fn trim(&self, sub: &Subscriber, q: &mut VecDeque<Outgoing>) {
        let c = &self.counters;
        while q.iter().filter(|o| o.round.is_some()).count() > self.queue_limit {
            let Some(old) = q.pop_front() else { break };
            if old.round.is_some() {
                bump(&sub.dropped);
                bump(&c.batches_dropped);
                tracing::warn!(
                    subscriber = sub.id,
                    dropped = sub.dropped.get(),
                    "subscriber's queue full (it reads too slowly); oldest batch dropped"
                );
            }
            if let Some(next) = q.front_mut() {
                let mut merged = old.processes;
                carry(std::mem::take(&mut next.processes), &mut merged);
                next.processes = self.fit(sub, merged, self.batch_record_bytes);
            }
            let Some(next) = q.iter_mut().find(|o| o.round.is_some()) else {
                break;
            };
            next.forgotten.extend(old.forgotten);
            // Within the batch's bound with the next round's own blobs; past it the
            // oldest go (counted; their frames stay unnamed).
            let own = next.round.as_ref().map_or(0, |r| r.python_code.len());
            let room = (firn_schema::limits::MAX_PYTHON_CODES as usize).saturating_sub(own);
            let mut code = old.python_code;
            if let Some(r) = &old.round {
                code.extend(r.python_code.iter().cloned());
            }
            code.append(&mut next.python_code);
            let excess = code.len().saturating_sub(room);
            add(&c.python_code_dropped, excess as u64);
            next.python_code = code.split_off(excess);
        }
    }
}

fn file_of(m: &crate::procfs::Mapping) -> FileId {
    (m.dev_major, m.dev_minor, m.inode)
}

/// Moves the records of `from` into `into` (appended, in order), newest version
/// winning where both hold a process.
fn carry(from: Vec<Issued>, into: &mut Vec<Issued>) {
    if from.is_empty() {
        return;
    }
    let mut at: HashMap<u64, usize> = into.iter().enumerate().map(|(i, p)| (p.id, i)).collect();
    for p in from {
        match at.get(&p.id) {
            Some(&i) if into[i].version >= p.version => {}
            Some(&i) => into[i] = p,
            None => {
                at.insert(p.id, into.len());
                into.push(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procfs::Mapping;

    fn issued(id: u64, path_bytes: usize) -> Issued {
        Issued {
            id,
            version: 1,
            record: Rc::new(ProcessRecord {
                pid: id as u32,
                mappings: vec![Mapping {
                    start: 0x1000,
                    end: 0x2000,
                    offset: 0,
                    dev_major: 8,
                    dev_minor: 1,
                    inode: id,
                    path: vec![b'p'; path_bytes].into(),
                    cut: false,
                }],
                complete: true,
                ..Default::default()
            }),
        }
    }

    fn round(n: u64, processes: Vec<Issued>) -> Rc<RoundData> {
        Rc::new(RoundData {
            round: n,
            start_time_ns: 0,
            end_time_ns: 1,
            samples: Vec::new(),
            kernel_symbols: Vec::new(),
            processes,
            python_code: Vec::new(),
            cgroups: Vec::new(),
        })
    }

    fn queued_ids(sub: &Subscriber) -> Vec<Vec<u64>> {
        sub.queue
            .borrow()
            .iter()
            .map(|o| o.processes.iter().map(|p| p.id).collect())
            .collect()
    }

    #[test]
    fn batches_keep_their_record_bound_and_defer_the_rest() {
        let c = Rc::new(Counters::default());
        let hub = Hub::new(8, c.clone()).with_batch_record_bytes(100_000);
        let sub = hub.add([0; 16]);
        // Ten records of ~30 KB: three fit in a batch.
        hub.publish(round(1, (1..=10).map(|i| issued(i, 30_000)).collect()), &[]);
        let bytes: usize = sub.queue.borrow()[0]
            .processes
            .iter()
            .map(|p| p.record.wire_bytes())
            .sum();
        assert!(bytes <= 100_000);
        assert_eq!(queued_ids(&sub), vec![vec![1, 2, 3]]);
        assert_eq!(c.process_records_deferred.get(), 7);
        // The next rounds carry the rest, oldest first, before new ones; a deferred
        // process forgotten meanwhile is never sent.
        hub.publish(round(2, vec![issued(11, 30_000)]), &[5]);
        hub.publish(round(3, Vec::new()), &[]);
        hub.publish(round(4, Vec::new()), &[]);
        assert_eq!(
            queued_ids(&sub),
            vec![vec![1, 2, 3], vec![4, 6, 7], vec![8, 9, 10], vec![11]]
        );
        // A record alone over the bound still goes.
        hub.publish(round(5, vec![issued(12, 200_000)]), &[]);
        assert_eq!(queued_ids(&sub)[4], vec![12]);
    }

    #[test]
    fn a_dropped_batch_hands_its_records_on_within_the_bound() {
        let c = Rc::new(Counters::default());
        let hub = Hub::new(1, c.clone()).with_batch_record_bytes(100_000);
        let sub = hub.add([0; 16]);
        hub.publish(round(1, (1..=3).map(|i| issued(i, 30_000)).collect()), &[]);
        hub.publish(round(2, (4..=6).map(|i| issued(i, 30_000)).collect()), &[]);
        // Batch 1 was dropped: its records lead batch 2, whose own wait for the next.
        assert_eq!(queued_ids(&sub), vec![vec![1, 2, 3]]);
        assert_eq!(c.batches_dropped.get(), 1);
        // Sent; then the next round brings the held-back records.
        sub.queue.borrow_mut().pop_front();
        hub.publish(round(3, Vec::new()), &[]);
        assert_eq!(queued_ids(&sub), vec![vec![4, 5, 6]]);
    }

    #[test]
    fn announcements_go_ahead_of_the_batch_and_are_not_sent_twice() {
        let c = Rc::new(Counters::default());
        let hub = Hub::new(1, c.clone());
        let sub = hub.add([0; 16]);
        hub.announce(&[issued(1, 10)]);
        hub.announce(&[issued(2, 10), issued(1, 10)]);
        // Two announcements waiting are one; a record already announced is not again.
        assert_eq!(queued_ids(&sub), vec![vec![1, 2]]);
        assert!(
            sub.record(2, 1).is_some(),
            "an announced record may be named"
        );
        hub.publish(round(1, vec![issued(1, 10), issued(3, 10)]), &[]);
        assert_eq!(queued_ids(&sub), vec![vec![1, 2], vec![3]]);
        // Over the queue limit the oldest batch goes; the announcement before it is
        // merged into what follows, not counted as a drop.
        hub.announce(&[issued(4, 10)]);
        hub.publish(round(2, Vec::new()), &[3]);
        let q = sub.queue.borrow();
        assert_eq!(q.len(), 2, "one announcement, one batch");
        assert!(q[0].round.is_none() && q[1].round.is_some());
        let mut ids: Vec<u64> = q[0].processes.iter().map(|p| p.id).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![1, 2, 3, 4]);
        assert_eq!(q[1].forgotten, vec![3]);
        assert_eq!(c.batches_dropped.get(), 1);
        assert_eq!(c.processes_announced.get(), 3);
    }

    /// `issued` with its one mapping of file `inode`.
    fn of_file(id: u64, inode: u64) -> Issued {
        let mut p = issued(id, 10);
        let r = Rc::get_mut(&mut p.record).expect("fresh record");
        r.mappings[0].inode = inode;
        p
    }

    #[test]
    fn only_processes_with_files_new_to_a_subscriber_are_announced() {
        let c = Rc::new(Counters::default());
        let hub = Hub::new(8, c.clone());
        let sub = hub.add([0; 16]);
        hub.announce(&[of_file(1, 100)]);
        // Another process of the same file: nothing to build, it waits for its batch.
        hub.announce(&[of_file(2, 100)]);
        assert_eq!(queued_ids(&sub), vec![vec![1]]);
        assert_eq!(c.processes_not_announced.get(), 1);
        hub.publish(round(1, vec![of_file(2, 100), of_file(3, 300)]), &[]);
        assert_eq!(queued_ids(&sub), vec![vec![1], vec![2, 3]]);
        // A file heard of in a batch counts as told too.
        hub.announce(&[of_file(4, 300)]);
        assert_eq!(queued_ids(&sub).len(), 2);
        // A Python interpreter's file: its processes are announced (their records go out
        // before the round ends).
        sub.note_interpreter((8, 1, 300));
        hub.announce(&[of_file(5, 300)]);
        assert_eq!(queued_ids(&sub)[2], vec![5]);
        // Another subscriber has heard of nothing yet.
        let other = hub.add([1; 16]);
        hub.announce(&[of_file(6, 100)]);
        assert_eq!(queued_ids(&other), vec![vec![6]]);
    }
}

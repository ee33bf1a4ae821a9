//! Subscribers and their bounded queues. A round is published to every subscriber; a
//! subscriber's sender task pushes batches over its connection as flow control allows.
//! A full queue drops its oldest batch (counted) and carries that batch's process
//! records into the next one, so no record a later sample needs is lost.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use tokio::sync::Notify;

use crate::broker::RateLimit;
use crate::counters::Counters;
use crate::procfs::ProcessRecord;
use crate::round::{Issued, RoundData};

pub struct Outgoing {
    pub round: Rc<RoundData>,
    pub processes: Vec<Issued>,
    pub forgotten: Vec<u64>,
}

pub struct Subscriber {
    pub id: u64,
    queue: RefCell<VecDeque<Outgoing>>,
    wake: Notify,
    /// Process id → the record (and its mapping version) sent to this subscriber: what
    /// its broker requests may refer to.
    sent: RefCell<HashMap<u64, (u32, Rc<ProcessRecord>)>>,
    pub dropped: Cell<u64>,
    /// The highest process id ever sent to this subscriber: a request above it names a
    /// process it was never told of (below it, one may since have been forgotten).
    pub max_sent: Cell<u64>,
    closed: Cell<bool>,
    /// Binds the broker channel to this subscription.
    pub broker_key: [u8; 16],
    pub channel: RefCell<Option<std::os::unix::net::UnixStream>>,
    pub next_ticket: Cell<u64>,
    pub rate: RefCell<RateLimit>,
}

impl Subscriber {
    pub fn close(&self) {
        self.closed.set(true);
        self.queue.borrow_mut().clear();
        self.wake.notify_one();
    }

    pub fn is_closed(&self) -> bool {
        self.closed.get()
    }

    /// The record of `process_id` at `version`, if this subscriber was sent exactly that.
    pub fn record(&self, process_id: u64, version: u32) -> Option<Rc<ProcessRecord>> {
        match self.sent.borrow().get(&process_id) {
            Some((v, r)) if *v == version => Some(r.clone()),
            _ => None,
        }
    }

    /// Waits for the next batch; `None` once the subscriber is closed.
    pub async fn next(&self) -> Option<Outgoing> {
        loop {
            if self.closed.get() {
                return None;
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
}

impl Hub {
    pub fn new(queue_limit: usize, counters: Rc<Counters>) -> Self {
        Self {
            subs: RefCell::new(Vec::new()),
            next_id: Cell::new(0),
            queue_limit: queue_limit.max(1),
            counters,
        }
    }

    pub fn add(&self, broker_key: [u8; 16]) -> Rc<Subscriber> {
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
            rate: RefCell::new(RateLimit::default()),
        });
        self.subs.borrow_mut().push(sub.clone());
        sub
    }

    pub fn len(&self) -> usize {
        self.subs.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.subs.borrow().is_empty()
    }

    /// Attaches a broker channel to the open subscription holding `key`, once.
    pub fn attach_channel(&self, key: &[u8; 16], channel: std::os::unix::net::UnixStream) -> bool {
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
    pub fn publish(&self, round: Rc<RoundData>, forgotten: &[u64]) {
        let c = &self.counters;
        self.subs.borrow_mut().retain(|s| !s.is_closed());
        for sub in self.subs.borrow().iter() {
            let mut sent = sub.sent.borrow_mut();
            let forgotten: Vec<u64> = forgotten
                .iter()
                .copied()
                .filter(|id| sent.remove(id).is_some())
                .collect();
            let processes: Vec<Issued> = round
                .processes
                .iter()
                .filter(|p| sent.get(&p.id).map(|s| s.0) != Some(p.version))
                .cloned()
                .collect();
            for p in &processes {
                sent.insert(p.id, (p.version, p.record.clone()));
                sub.max_sent.set(sub.max_sent.get().max(p.id));
            }
            let mut q = sub.queue.borrow_mut();
            q.push_back(Outgoing {
                round: round.clone(),
                processes,
                forgotten,
            });
            c.batches_queued.set(c.batches_queued.get() + 1);
            while q.len() > self.queue_limit {
                let Some(old) = q.pop_front() else { break };
                sub.dropped.set(sub.dropped.get() + 1);
                c.batches_dropped.set(c.batches_dropped.get() + 1);
                tracing::warn!(
                    subscriber = sub.id,
                    dropped = sub.dropped.get(),
                    "subscriber's queue full (it reads too slowly); oldest batch dropped"
                );
                if let Some(next) = q.front_mut() {
                    carry(old.processes, &mut next.processes);
                    next.forgotten.extend(old.forgotten);
                }
            }
            sub.wake.notify_one();
        }
    }
}

/// Moves records from a dropped batch into the one after it, newest version winning.
fn carry(from: Vec<Issued>, into: &mut Vec<Issued>) {
    for p in from {
        if !into.iter().any(|q| q.id == p.id && q.version >= p.version) {
            into.retain(|q| q.id != p.id);
            into.push(p);
        }
    }
}

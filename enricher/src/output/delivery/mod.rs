//! Delivery of one sink's requests: a bounded memory queue, a bounded on-disk spool
//! behind it, and one sender that delivers in order with capped, jittered backoff.
//!
//! Requests are delivered oldest first, one at a time, so the ids of delivered requests
//! only grow: the spool keeps the last one (`delivered`) and, after a restart, skips
//! spooled requests at or below it. A request whose acknowledgement was lost when the
//! enricher died is the one that can arrive twice (OTLP profiles carry a stable
//! `profile_id` a backend can deduplicate with).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

mod spool;

use crate::metrics::{Metrics, SinkMetrics};
use crate::settings::Settings;
use spool::Spool;

/// Why a request did not arrive.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    /// The backend is down, slow or overloaded: keep the request and try again later.
    #[error("{0} (will retry)")]
    Retry(String),
    /// The backend refused this request for what it holds: sending it again cannot
    /// help, so it is dropped and counted.
    #[error("{0} (rejected, not retried)")]
    Reject(String),
}

/// A request's id: the round's end time and number, zero-padded so that ids sort in
/// delivery order (the spool's delivered mark compares them).
pub(crate) fn request_id(end_ns: u64, round: u64) -> String {
    format!("{end_ns:020}-{round:08}")
}

/// One request: its id (see [`request_id`]) and its encoded bytes.
#[derive(Clone)]
pub(crate) struct Request {
    pub(crate) id: String,
    pub(crate) body: Arc<Vec<u8>>,
}

/// Sends one encoded request; the future ends when the backend answered.
pub(crate) trait Transport {
    fn send(&self, body: Arc<Vec<u8>>) -> Pin<Box<dyn Future<Output = Result<(), SendError>>>>;
}

#[derive(Debug, Clone)]
pub(crate) struct Limits {
    /// Bytes kept in memory before the oldest go to the spool.
    pub(crate) memory_bytes: u64,
    /// Bytes kept on disk; past it the oldest spooled request is dropped.
    pub(crate) spool_bytes: u64,
    /// Longest wait for one call's answer.
    pub(crate) call_timeout: Duration,
    /// First wait after a failure; it doubles up to `backoff_max`.
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
}

struct Queue {
    memory: VecDeque<Request>,
    memory_bytes: u64,
    /// None: the spool directory could not be opened (memory only, said at start).
    spool: Option<Spool>,
}

/// Where the oldest waiting request is.
enum Head {
    Memory(Request),
    Disk(String),
}

pub(crate) struct Delivery {
    name: &'static str,
    limits: Limits,
    queue: RefCell<Queue>,
    wake: Notify,
    /// A request is being sent (its answer not yet in).
    sending: std::cell::Cell<bool>,
    /// The last attempt failed.
    failing: std::cell::Cell<bool>,
    pub(crate) metrics: Arc<SinkMetrics>,
}

impl Delivery {
    /// A sink's queue with its spool under `dir`; requests spooled by an earlier run
    /// and not yet delivered are sent first.
    pub(crate) fn new(
        name: &'static str,
        dir: &Path,
        limits: Limits,
        metrics: Arc<SinkMetrics>,
    ) -> Rc<Self> {
        let spool = match Spool::open(dir, limits.spool_bytes) {
            Ok(s) => {
                if !s.entries.is_empty() {
                    tracing::info!(
                        sink = name,
                        requests = s.entries.len(),
                        bytes = s.bytes,
                        "requests spooled by an earlier run will be sent first"
                    );
                }
                Some(s)
            }
            Err(e) => {
                SinkMetrics::inc(&metrics.spool_errors);
                tracing::warn!(sink = name, error = %e, "no spool: requests wait in memory only while the backend is down");
                None
            }
        };
        let d = Rc::new(Self {
            name,
            limits,
            queue: RefCell::new(Queue {
                memory: VecDeque::new(),
                memory_bytes: 0,
                spool,
            }),
            wake: Notify::new(),
            sending: std::cell::Cell::new(false),
            failing: std::cell::Cell::new(false),
            metrics,
        });
        d.gauges();
        d
    }

    fn gauges(&self) {
        let q = self.queue.borrow();
        let m = &self.metrics;
        SinkMetrics::set(&m.queue_requests, q.memory.len() as u64);
        SinkMetrics::set(&m.queue_bytes, q.memory_bytes);
        SinkMetrics::set(
            &m.spool_requests,
            q.spool.as_ref().map_or(0, |s| s.entries.len() as u64),
        );
        SinkMetrics::set(&m.spool_bytes, q.spool.as_ref().map_or(0, |s| s.bytes));
    }

    /// Queues a request; past the memory bound the oldest move to the spool.
    pub(crate) fn push(&self, r: Request) {
        {
            let mut q = self.queue.borrow_mut();
            q.memory_bytes += r.body.len() as u64;
            q.memory.push_back(r);
            while q.memory_bytes > self.limits.memory_bytes {
                let Some(old) = q.memory.pop_front() else {
                    break;
                };
                q.memory_bytes -= old.body.len() as u64;
                self.spill(&mut q, &old);
            }
        }
        self.gauges();
        self.wake.notify_one();
    }

    /// Writes a request to the spool, or drops it (counted) when it cannot be.
    fn spill(&self, q: &mut Queue, r: &Request) {
        let m = &self.metrics;
        let Some(spool) = q.spool.as_mut() else {
            SinkMetrics::inc(&m.dropped);
            tracing::warn!(sink = self.name, id = %r.id, "memory queue full and no spool: oldest request dropped");
            return;
        };
        let (evicted, written) = spool.push(r);
        if evicted > 0 {
            SinkMetrics::add(&m.dropped, evicted as u64);
            tracing::warn!(
                sink = self.name,
                requests = evicted,
                "spool full (--upload-spool-size): oldest requests dropped"
            );
        }
        match written {
            Ok(()) => SinkMetrics::inc(&m.spooled),
            Err(e) => {
                SinkMetrics::inc(&m.spool_errors);
                SinkMetrics::inc(&m.dropped);
                tracing::warn!(sink = self.name, id = %r.id, error = %e, "request could not be spooled: dropped");
            }
        }
    }

    /// Whether a shutdown should wait for this sink: it is delivering (healthy, with
    /// requests waiting or one in flight).
    pub(crate) fn draining(&self) -> bool {
        let q = self.queue.borrow();
        let waiting =
            !q.memory.is_empty() || q.spool.as_ref().is_some_and(|s| !s.entries.is_empty());
        !self.failing.get() && (waiting || self.sending.get())
    }

    /// Moves every request waiting in memory to the spool (at shutdown, so that a
    /// restart sends them).
    pub(crate) fn flush_to_spool(&self) {
        {
            let mut q = self.queue.borrow_mut();
            while let Some(r) = q.memory.pop_front() {
                q.memory_bytes -= r.body.len() as u64;
                self.spill(&mut q, &r);
            }
        }
        self.gauges();
    }

    fn head(&self) -> Option<Head> {
        let q = self.queue.borrow();
        if let Some((id, _)) = q.spool.as_ref().and_then(|s| s.entries.front()) {
            return Some(Head::Disk(id.clone()));
        }
        q.memory.front().cloned().map(Head::Memory)
    }

    /// Removes a request wherever it is now (it may have moved to the spool, or been
    /// dropped for room, while it was being sent).
    fn remove(&self, id: &str) {
        let mut q = self.queue.borrow_mut();
        if q.memory.front().is_some_and(|r| r.id == id) {
            if let Some(r) = q.memory.pop_front() {
                q.memory_bytes -= r.body.len() as u64;
            }
        } else if let Some(s) = q.spool.as_mut() {
            s.remove(id);
        }
    }

    fn delivered(&self, id: &str) {
        self.remove(id);
        let mut q = self.queue.borrow_mut();
        if let Some(s) = q.spool.as_mut() {
            if let Err(e) = s.mark_delivered(id) {
                SinkMetrics::inc(&self.metrics.spool_errors);
                tracing::warn!(sink = self.name, error = %e, "writing the delivered mark (a restart may send this request again)");
            }
        }
    }

    /// The sender: runs for the life of the enricher.
    pub(crate) async fn run(self: Rc<Self>, transport: Rc<dyn Transport>) {
        let m = self.metrics.clone();
        let mut backoff = self.limits.backoff_min;
        let mut jitter = Jitter::seeded();
        let mut failing_since: Option<std::time::Instant> = None;
        loop {
            let Some(head) = self.head() else {
                self.wake.notified().await;
                continue;
            };
            let (id, body) = match head {
                Head::Memory(r) => (r.id, r.body),
                Head::Disk(id) => {
                    let read = self.queue.borrow().spool.as_ref().map(|s| s.read(&id));
                    match read {
                        Some(Ok(b)) => (id, Arc::new(b)),
                        other => {
                            if let Some(Err(e)) = other {
                                tracing::warn!(sink = self.name, error = %e, "spooled request unreadable: dropped");
                            }
                            SinkMetrics::inc(&m.spool_errors);
                            SinkMetrics::inc(&m.dropped);
                            self.remove(&id);
                            self.gauges();
                            continue;
                        }
                    }
                }
            };
            let len = body.len() as u64;
            self.sending.set(true);
            let sent = tokio::time::timeout(self.limits.call_timeout, transport.send(body)).await;
            self.sending.set(false);
            let outcome = match sent {
                Ok(r) => r,
                Err(_) => Err(SendError::Retry(format!(
                    "no answer within {:?} (--upload-timeout)",
                    self.limits.call_timeout
                ))),
            };
            match outcome {
                Ok(()) => {
                    self.delivered(&id);
                    SinkMetrics::inc(&m.requests_sent);
                    SinkMetrics::add(&m.bytes_sent, len);
                    SinkMetrics::set(&m.last_success_seconds, unix_seconds());
                    SinkMetrics::set(&m.failing, 0);
                    self.failing.set(false);
                    backoff = self.limits.backoff_min;
                    if let Some(t) = failing_since.take() {
                        tracing::info!(
                            sink = self.name,
                            after_seconds = t.elapsed().as_secs(),
                            "backend reachable again; delivering the queue"
                        );
                    }
                }
                Err(SendError::Reject(msg)) => {
                    self.remove(&id);
                    SinkMetrics::inc(&m.rejected);
                    tracing::warn!(sink = self.name, id = %id, error = %msg, "backend rejected a request; dropped");
                }
                Err(SendError::Retry(msg)) => {
                    SinkMetrics::inc(&m.retries);
                    SinkMetrics::set(&m.failing, 1);
                    self.failing.set(true);
                    if failing_since.is_none() {
                        failing_since = Some(std::time::Instant::now());
                        tracing::warn!(sink = self.name, error = %msg, "backend failing; requests wait (memory, then spool) and are retried with backoff");
                    } else {
                        tracing::debug!(sink = self.name, error = %msg, "retry failed");
                    }
                    tokio::time::sleep(jitter.around(backoff)).await;
                    backoff = (backoff * 2).min(self.limits.backoff_max);
                }
            }
            self.gauges();
        }
    }
}

impl Delivery {
    /// Starts the sink `name`'s delivery through `transport`, on the settings' limits,
    /// spooling under `<spool dir>/<name>`; its counters join `/metrics`.
    pub(crate) fn start(
        name: &'static str,
        s: &Settings,
        metrics: &Metrics,
        sink: Arc<SinkMetrics>,
        transport: Rc<dyn Transport>,
    ) -> Rc<Self> {
        if let Ok(mut all) = metrics.sinks.lock() {
            all.push(sink.clone());
        }
        let limits = Limits {
            memory_bytes: s.upload_memory,
            spool_bytes: s.upload_spool_size,
            call_timeout: s.upload_timeout,
            backoff_min: Duration::from_secs(1).min(s.upload_backoff_max),
            backoff_max: s.upload_backoff_max,
        };
        let dir = spool_dir(s, name);
        let d = Delivery::new(name, &dir, limits, sink);
        tokio::task::spawn_local(d.clone().run(transport));
        d
    }

    /// Queues the encoding of a round (none when there was nothing to send), counting
    /// the time the encoding took since `started`.
    pub(crate) fn push_round(
        &self,
        round: &crate::model::Round,
        body: Option<Vec<u8>>,
        started: std::time::Instant,
    ) {
        SinkMetrics::add(
            &self.metrics.encode_ns,
            u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX),
        );
        if let Some(body) = body {
            self.push(Request {
                id: request_id(round.end_ns, round.round),
                body: Arc::new(body),
            });
        }
    }

    /// At shutdown: a healthy backend gets up to `grace` to take what waits (a request
    /// cut off in flight could arrive twice after a restart); what is left goes to the
    /// spool for the next run.
    pub(crate) async fn shutdown(&self, grace: Duration) {
        let until = std::time::Instant::now() + grace;
        while self.draining() && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.flush_to_spool();
    }
}

/// The spool folder of sink `name`: `--upload-spool-dir`, else `.spool` under
/// `--output-dir`.
pub(crate) fn spool_dir(s: &Settings, name: &str) -> PathBuf {
    s.upload_spool_dir
        .clone()
        .unwrap_or_else(|| s.output_dir.join(".spool"))
        .join(name)
}

fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// ±25 % jitter so that many nodes do not retry in step (xorshift; no need for more).
struct Jitter(u64);

impl Jitter {
    fn seeded() -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Self(t | 1)
    }

    fn around(&mut self, d: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let f = 0.75 + (self.0 % 1000) as f64 / 2000.0;
        d.mul_f64(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn limits(memory: u64, spool: u64) -> Limits {
        Limits {
            memory_bytes: memory,
            spool_bytes: spool,
            call_timeout: Duration::from_secs(5),
            backoff_min: Duration::from_millis(10),
            backoff_max: Duration::from_millis(40),
        }
    }

    fn req(i: u64, size: usize) -> Request {
        Request {
            id: request_id(i * 1000, i),
            body: Arc::new(vec![i as u8; size]),
        }
    }

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("firn-spool-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// Fails the first `fail` calls with the given error, then records bodies.
    struct Fake {
        fail: Cell<u32>,
        reject: bool,
        got: Rc<RefCell<Vec<u8>>>,
    }

    impl Transport for Fake {
        fn send(&self, body: Arc<Vec<u8>>) -> Pin<Box<dyn Future<Output = Result<(), SendError>>>> {
            let n = self.fail.get();
            let got = self.got.clone();
            let reject = self.reject;
            if n > 0 {
                self.fail.set(n - 1);
            }
            Box::pin(async move {
                if n > 0 {
                    return Err(if reject {
                        SendError::Reject("bad".into())
                    } else {
                        SendError::Retry("down".into())
                    });
                }
                got.borrow_mut().push(body[0]);
                Ok(())
            })
        }
    }

    fn run_until(d: &Rc<Delivery>, fake: Fake, want: usize) -> Vec<u8> {
        let got = fake.got.clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        let d = d.clone();
        let seen = got.clone();
        local.block_on(&rt, async move {
            let task = tokio::task::spawn_local(d.run(Rc::new(fake)));
            for _ in 0..500 {
                if seen.borrow().len() >= want {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            task.abort();
        });
        let v = got.borrow().clone();
        v
    }

    #[test]
    fn memory_spills_to_spool_in_order_and_survives_a_restart() {
        let dir = tmp("order");
        let m = Arc::new(SinkMetrics::new("t"));
        let d = Delivery::new("t", &dir, limits(250, 10_000), m.clone());
        for i in 1..=5 {
            d.push(req(i, 100));
        }
        // Memory holds two; three went to disk.
        assert_eq!(
            m.spool_requests.load(std::sync::atomic::Ordering::Relaxed),
            3
        );
        d.flush_to_spool();
        drop(d);
        // A new run finds all five, delivers them in order after two failures.
        let d = Delivery::new("t", &dir, limits(250, 10_000), m.clone());
        let fake = Fake {
            fail: Cell::new(2),
            reject: false,
            got: Default::default(),
        };
        assert_eq!(run_until(&d, fake, 5), vec![1, 2, 3, 4, 5]);
        assert_eq!(m.retries.load(std::sync::atomic::Ordering::Relaxed), 2);
        // Nothing is sent twice after another restart.
        d.push(req(6, 100));
        d.flush_to_spool();
        drop(d);
        let d = Delivery::new("t", &dir, limits(250, 10_000), m.clone());
        let fake = Fake {
            fail: Cell::new(0),
            reject: false,
            got: Default::default(),
        };
        assert_eq!(run_until(&d, fake, 1), vec![6]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn oldest_dropped_past_the_spool_bound_and_rejects_not_retried() {
        let dir = tmp("bound");
        let m = Arc::new(SinkMetrics::new("t"));
        let d = Delivery::new("t", &dir, limits(0, 300), m.clone());
        for i in 1..=5 {
            d.push(req(i, 100));
        }
        assert_eq!(m.dropped.load(std::sync::atomic::Ordering::Relaxed), 2);
        let fake = Fake {
            fail: Cell::new(1),
            reject: true,
            got: Default::default(),
        };
        // 3 is rejected (not retried), 4 and 5 arrive.
        assert_eq!(run_until(&d, fake, 2), vec![4, 5]);
        assert_eq!(m.rejected.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(m.retries.load(std::sync::atomic::Ordering::Relaxed), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

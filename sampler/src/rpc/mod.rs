//! The Cap'n Proto server: one RPC system per accepted connection, requests validated
//! like a privilege-separation monitor (wrong version → error; malformed → the
//! connection is closed and counted). `guard` checks every incoming message and call
//! before it acts; `methods` serves the two interfaces (`interpreter`, its CPython records).

mod guard;
mod interpreter;
mod methods;

use std::cell::{Cell, RefCell};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use capnp::capability::FromServer;
use capnp::traits::HasTypeId;
use capnp_rpc::{rpc_twoparty_capnp::Side, twoparty, RpcSystem};
use firn_schema::firn_capnp::{batch_sink, sampler};
use futures::{AsyncReadExt as _, FutureExt};
use tokio::io::AsyncReadExt;
use tokio::sync::Notify;
use tokio_util::compat::{TokioAsyncReadCompatExt, TokioAsyncWriteCompatExt};

use crate::counters::{add, bump, Counters};
use crate::hub::{Hub, Subscriber};
use crate::wire::{self, BatchMeta};
use firn_logs::TokenBucket;

const STREAM_WINDOW_BYTES: usize = 16 * 1024;

/// Calls per connection (any method): sustained per second, and burst. Above the
/// broker's own limit, so a client that asks a little too fast is refused opens first
/// and only a flood is disconnected.
const CALL_RATE: f64 = 250.0;
const CALL_BURST: f64 = 2_500.0;
/// `info` answers are the largest (every counter); a status call, rarely needed.
const INFO_RATE: f64 = 5.0;
const INFO_BURST: f64 = 50.0;

/// What `info` reports and every batch is stamped with.
pub struct Identity {
    pub session_id: u64,
    pub node: String,
    pub kernel_release: String,
    pub frequency_hz: u32,
    pub round_seconds: u32,
    pub kept_capabilities: Vec<String>,
    /// --off-cpu's one-in-N at least, minimum wait in ns and switches a second per CPU
    /// taken at most (N 0: off).
    pub off_cpu: (u32, u64, u32),
}

pub struct Shared {
    pub hub: Hub,
    pub counters: Rc<Counters>,
    pub identity: Identity,
    pub connections: Cell<u32>,
    pub max_connections: u32,
    /// A connection whose writes have not progressed for this long is not reading what
    /// it asked for: closed, so its unread answers cannot pile up in the sampler's
    /// memory (`--write-stall-seconds`).
    pub write_stall_limit: Duration,
    /// Handles of recently mapped files, shared with the process table that takes them.
    pub handles: Rc<RefCell<crate::handles::Handles>>,
    /// The unwinder's maps, written from the tables subscribers send.
    pub unwind: Rc<RefCell<crate::unwind::Unwind>>,
}

/// Per-connection control: closing it ends the connection's RPC system.
pub(crate) struct Conn {
    kill: Notify,
    subscribed: Cell<bool>,
    /// The subscription's batch sender: it holds the subscriber's sink, so it must
    /// end with the connection, or a connection the sampler closed would keep its
    /// subscription (and its tables) alive, waiting on a push that never returns.
    sender: RefCell<Option<tokio::task::AbortHandle>>,
    flooded: Cell<bool>,
    calls: RefCell<TokenBucket>,
    info_calls: RefCell<TokenBucket>,
}

impl Default for Conn {
    fn default() -> Self {
        Self {
            kill: Notify::new(),
            subscribed: Cell::new(false),
            sender: RefCell::new(None),
            flooded: Cell::new(false),
            calls: RefCell::new(TokenBucket::new(CALL_RATE, CALL_BURST)),
            info_calls: RefCell::new(TokenBucket::new(INFO_RATE, INFO_BURST)),
        }
    }
}

/// Admits one call on `conn`, or counts a flood and closes the connection.
pub(crate) fn admit(conn: &Rc<Conn>, shared: &Shared, info: bool) -> Result<(), capnp::Error> {
    let ok = conn.calls.borrow_mut().allow() && (!info || conn.info_calls.borrow_mut().allow());
    if ok {
        return Ok(());
    }
    // Calls already in flight are refused too; the connection counts once.
    if !conn.flooded.replace(true) {
        bump(&shared.counters.request_floods);
        tracing::warn!("a client sent calls faster than allowed; closing its connection");
        conn.close_soon();
    }
    Err(capnp::Error::overloaded(
        "too many calls on this connection; closing it".into(),
    ))
}

impl Conn {
    /// Closes the connection shortly, so the error reply still reaches the peer.
    pub(crate) fn close_soon(self: &Rc<Self>) {
        let me = self.clone();
        tokio::task::spawn_local(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            me.kill.notify_one();
        });
    }
}

pub(crate) async fn send_loop(shared: Rc<Shared>, sub: Rc<Subscriber>, sink: batch_sink::Client) {
    let c = &shared.counters;
    while let Some(mut out) = sub.next().await {
        // A storm's records would make one message of megabytes, resident while it is
        // written: all but the last share go ahead, each in an announcement of its own.
        for ahead in wire::records_ahead(&mut out.processes, wire::MAX_MESSAGE_RECORD_BYTES) {
            let mut req = sink.announce_request();
            wire::fill_processes(req.get(), &ahead);
            add(&c.records_sent_ahead, ahead.len() as u64);
            drop(ahead);
            if !delivered(c, &sub, &c.announcements_sent, req.send().await) {
                return;
            }
        }
        let (sent, res) = match &out.round {
            Some(round) => {
                let counters = c.list();
                let meta = BatchMeta {
                    session_id: shared.identity.session_id,
                    frequency_hz: shared.identity.frequency_hz,
                    dropped_batches: sub.dropped.get(),
                    tables_evicted: c.unwind_tables_evicted.get(),
                    counters: &counters,
                    off_cpu: shared.identity.off_cpu.0 > 0,
                };
                let mut req = sink.push_request();
                wire::fill_batch(req.get().init_batch(), round, &out, &meta);
                drop(out);
                (&c.batches_sent, req.send().await)
            }
            None => {
                let mut req = sink.announce_request();
                wire::fill_processes(req.get(), &out.processes);
                drop(out);
                (&c.announcements_sent, req.send().await)
            }
        };
        if !delivered(c, &sub, sent, res) {
            return;
        }
    }
}

/// Counts a message's delivery; a failed one closes the subscriber (`false`).
fn delivered(
    c: &Counters,
    sub: &Subscriber,
    sent: &std::cell::Cell<u64>,
    res: Result<(), capnp::Error>,
) -> bool {
    match res {
        Ok(()) => {
            bump(sent);
            true
        }
        Err(e) => {
            bump(&c.send_errors);
            tracing::info!(subscriber = sub.id, error = %e, "subscriber gone");
            sub.close();
            false
        }
    }
}

/// Time a new connection has to send its first bytes.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handles one accepted, already authorised connection: a broker channel if it opens
/// with the broker magic, else a Cap'n Proto RPC connection.
pub async fn handle(mut stream: tokio::net::UnixStream, shared: Rc<Shared>) {
    let mut first = [0u8; 8];
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.read_exact(&mut first)).await {
        Ok(Ok(_)) => {}
        Ok(Err(_)) => return done(&shared),
        Err(_) => {
            bump(&shared.counters.handshake_timeouts);
            tracing::warn!(
                seconds = HANDSHAKE_TIMEOUT.as_secs(),
                "a client sent nothing in time; closed"
            );
            return done(&shared);
        }
    }
    if &first[..] == firn_schema::firn_capnp::BROKER_MAGIC {
        let mut key = [0u8; 16];
        let ok = matches!(
            tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.read_exact(&mut key)).await,
            Ok(Ok(_))
        );
        let attached = ok
            && stream
                .into_std()
                .is_ok_and(|std| shared.hub.attach_channel(&key, std));
        if attached {
            bump(&shared.counters.broker_channels);
        } else {
            bump(&shared.counters.broker_channels_refused);
            tracing::warn!("broker channel with an unknown or reused key; closed");
        }
        // The channel now lives with its subscription; it no longer counts as a
        // connection of its own.
        return done(&shared);
    }
    serve(stream, first, shared).await;
}

fn done(shared: &Shared) {
    shared
        .connections
        .set(shared.connections.get().saturating_sub(1));
}

/// Serves a Cap'n Proto connection whose first 8 bytes were already read.
async fn serve(stream: tokio::net::UnixStream, first: [u8; 8], shared: Rc<Shared>) {
    let (r, w) = stream.into_split();
    let reader = futures::io::Cursor::new(first.to_vec()).chain(r.compat());
    let stall = Rc::new(Stall::default());
    let writer = StallWatch {
        inner: w.compat_write(),
        stall: stall.clone(),
    };
    let mut network = twoparty::VatNetwork::new(
        reader,
        writer,
        Side::Server,
        firn_schema::sampler_reader_options(),
    );
    // Unacknowledged push bytes allowed per subscriber. Batches come once per round, so
    // a small window costs nothing; past it a stalled subscriber's batches wait in its
    // bounded queue, where the oldest are dropped and counted.
    network.set_window_size(STREAM_WINDOW_BYTES);
    let budget = Rc::new(guard::MessageBudget::new(shared.counters.clone()));
    let network = guard::GuardedNetwork {
        inner: network,
        budget: budget.clone(),
    };
    let conn = Rc::new(Conn::default());
    let server = methods::SamplerImpl {
        shared: shared.clone(),
        conn: conn.clone(),
    };
    let client: sampler::Client = capnp_rpc::new_client(guard::Guarded {
        inner: <sampler::Client as FromServer<_>>::from_server(Rc::new(server)),
        interface_id: <sampler::Client as HasTypeId>::TYPE_ID,
        methods: guard::SAMPLER_METHODS,
        conn: conn.clone(),
        shared: shared.clone(),
    });
    let rpc = RpcSystem::new(Box::new(network), Some(client.client));
    tokio::select! {
        res = rpc.map(|r| r) => {
            // A refusal by the message budget is counted under its own name.
            if let (Err(e), None) = (res, budget.refused()) {
                bump(&shared.counters.protocol_errors);
                tracing::warn!(error = %e, "connection closed: unreadable or over-limit message");
            }
        }
        _ = conn.kill.notified() => {}
        _ = write_stalled(stall, shared.write_stall_limit) => {
            bump(&shared.counters.stalled_connections);
            tracing::warn!(
                seconds = shared.write_stall_limit.as_secs(),
                "a client stopped reading its answers; closing its connection"
            );
        }
    }
    if let Some(sender) = conn.sender.take() {
        sender.abort();
    }
    done(&shared);
}

/// Since when a write has waited for the peer, and a wake-up for the watch when one
/// begins: at rest (nothing waiting) the watch sleeps without a timer.
#[derive(Default)]
struct Stall {
    since: Cell<Option<Instant>>,
    began: tokio::sync::Notify,
}

/// Resolves once a write has waited longer than `limit`.
async fn write_stalled(stall: Rc<Stall>, limit: Duration) {
    loop {
        let Some(since) = stall.since.get() else {
            // A permit left by a stall that ended meanwhile costs one more look.
            stall.began.notified().await;
            continue;
        };
        let left = limit.saturating_sub(since.elapsed());
        if left.is_zero() {
            return;
        }
        tokio::time::sleep(left).await;
    }
}

/// The connection's writer, noting since when a write has been waiting for the peer.
struct StallWatch<W> {
    inner: W,
    stall: Rc<Stall>,
}

impl<W> StallWatch<W> {
    fn note<T>(&self, p: &Poll<T>) {
        let s = &self.stall;
        match p {
            Poll::Pending if s.since.get().is_none() => {
                s.since.set(Some(Instant::now()));
                s.began.notify_one();
            }
            Poll::Pending => {}
            Poll::Ready(_) => s.since.set(None),
        }
    }
}

impl<W: futures::AsyncWrite + Unpin> futures::AsyncWrite for StallWatch<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let p = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.note(&p);
        p
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let p = Pin::new(&mut self.inner).poll_flush(cx);
        self.note(&p);
        p
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

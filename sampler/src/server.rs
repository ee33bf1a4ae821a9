//! The Cap'n Proto server: one RPC system per accepted connection, requests validated
//! like a privilege-separation monitor (wrong version → error; malformed → the
//! connection is closed and counted).

use std::cell::{Cell, RefCell};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use capnp::capability::{DispatchCallResult, FromServer, Params, Promise, Results};
use capnp::traits::HasTypeId;
use capnp_rpc::{rpc_twoparty_capnp::Side, twoparty, RpcSystem};
use firn_schema::firn_capnp::{batch_sink, sampler, subscription, Refusal, TableRefusal};
use firn_schema::PROTOCOL_VERSION;
use futures::{AsyncReadExt as _, FutureExt};
use tokio::io::AsyncReadExt;
use tokio::sync::Notify;
use tokio_util::compat::{TokioAsyncReadCompatExt, TokioAsyncWriteCompatExt};

use crate::counters::{bump, Counters};
use crate::encode::{self, BatchMeta};
use crate::hub::{Hub, Subscriber};
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

/// Unwind table chunks per subscription: sustained per second, and burst (a chunk is up
/// to 32,768 rows, so ~2 M rows a second: a busy node's binaries within seconds).
const TABLE_CHUNK_RATE: f64 = 64.0;
const TABLE_CHUNK_BURST: f64 = 256.0;

/// Per-connection control: closing it ends the connection's RPC system.
struct Conn {
    kill: Notify,
    subscribed: Cell<bool>,
    flooded: Cell<bool>,
    calls: RefCell<TokenBucket>,
    info_calls: RefCell<TokenBucket>,
}

impl Default for Conn {
    fn default() -> Self {
        Self {
            kill: Notify::new(),
            subscribed: Cell::new(false),
            flooded: Cell::new(false),
            calls: RefCell::new(TokenBucket::new(CALL_RATE, CALL_BURST)),
            info_calls: RefCell::new(TokenBucket::new(INFO_RATE, INFO_BURST)),
        }
    }
}

/// Admits one call on `conn`, or counts a flood and closes the connection.
fn admit(conn: &Rc<Conn>, shared: &Shared, info: bool) -> Result<(), capnp::Error> {
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
    fn close_soon(self: &Rc<Self>) {
        let me = self.clone();
        tokio::task::spawn_local(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            me.kill.notify_one();
        });
    }
}

struct SamplerImpl {
    shared: Rc<Shared>,
    conn: Rc<Conn>,
}

impl SamplerImpl {
    /// Whether the client speaks this protocol version. If not: counted, logged, and the
    /// connection closes once the answer is out.
    fn version_matches(&self, got: u32) -> bool {
        if got == PROTOCOL_VERSION {
            return true;
        }
        bump(&self.shared.counters.protocol_mismatches);
        tracing::warn!(
            client_version = got,
            sampler_version = PROTOCOL_VERSION,
            "client speaks another protocol version; closing its connection"
        );
        self.conn.close_soon();
        false
    }

    fn check_version(&self, got: u32) -> Result<(), capnp::Error> {
        if self.version_matches(got) {
            return Ok(());
        }
        Err(capnp::Error::failed(format!(
            "protocol version mismatch: firn-sampler speaks version {PROTOCOL_VERSION}, \
             the client sent {got}; run matching firn versions"
        )))
    }

    fn bad_request(&self, what: &str, e: capnp::Error) -> capnp::Error {
        bump(&self.shared.counters.bad_requests);
        tracing::warn!(request = what, error = %e, "malformed request; closing the connection");
        self.conn.close_soon();
        capnp::Error::failed(format!("malformed {what} request: {e}"))
    }
}

impl sampler::Server for SamplerImpl {
    fn info(
        self: Rc<Self>,
        params: sampler::InfoParams,
        mut results: sampler::InfoResults,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let r = (|| {
            admit(&self.conn, &self.shared, true)?;
            let version = params
                .get()
                .map_err(|e| self.bad_request("info", e))?
                .get_protocol_version();
            let mut info = results.get().init_info();
            info.set_protocol_version(PROTOCOL_VERSION);
            info.set_sampler_version(env!("CARGO_PKG_VERSION"));
            // Another version gets the typed answer (the two version fields) and nothing
            // else; `info`'s ordinal and these fields are the frozen part of the schema.
            if !self.version_matches(version) {
                return Ok(());
            }
            let id = &self.shared.identity;
            info.set_node(id.node.as_str());
            info.set_kernel_release(id.kernel_release.as_str());
            info.set_session_id(id.session_id);
            info.set_frequency_hz(id.frequency_hz);
            info.set_round_seconds(id.round_seconds);
            let mut caps = info
                .reborrow()
                .init_kept_capabilities(id.kept_capabilities.len() as u32);
            for (i, c) in id.kept_capabilities.iter().enumerate() {
                caps.set(i as u32, c.as_str());
            }
            let counters = self.shared.counters.list();
            encode::fill_counters(info.init_counters(counters.len() as u32), &counters);
            Ok(())
        })();
        std::future::ready(r)
    }

    fn subscribe(
        self: Rc<Self>,
        params: sampler::SubscribeParams,
        mut results: sampler::SubscribeResults,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let r = (|| {
            admit(&self.conn, &self.shared, false)?;
            let p = params.get().map_err(|e| self.bad_request("subscribe", e))?;
            self.check_version(p.get_protocol_version())?;
            if self.conn.subscribed.replace(true) {
                return Err(self.bad_request(
                    "subscribe",
                    capnp::Error::failed("one subscription per connection".into()),
                ));
            }
            let sink: batch_sink::Client =
                p.get_sink().map_err(|e| self.bad_request("subscribe", e))?;
            let mut key = [0u8; 16];
            // SAFETY: getrandom writes at most key.len() bytes into key.
            if unsafe { libc::getrandom(key.as_mut_ptr().cast(), key.len(), 0) } != 16 {
                return Err(capnp::Error::failed(
                    "no randomness for the broker key".into(),
                ));
            }
            let sub = self.shared.hub.add(key);
            bump(&self.shared.counters.subscriptions);
            tracing::info!(subscriber = sub.id, "subscribed");
            tokio::task::spawn_local(send_loop(self.shared.clone(), sub.clone(), sink));
            let mut r = results.get();
            r.set_broker_key(&key);
            let server = SubscriptionImpl {
                sub,
                shared: self.shared.clone(),
                conn: self.conn.clone(),
                chunks: RefCell::new(TokenBucket::new(TABLE_CHUNK_RATE, TABLE_CHUNK_BURST)),
            };
            r.set_subscription(capnp_rpc::new_client(Guarded {
                inner: <subscription::Client as FromServer<_>>::from_server(Rc::new(server)),
                interface_id: <subscription::Client as HasTypeId>::TYPE_ID,
                methods: SUBSCRIPTION_METHODS,
                conn: self.conn.clone(),
                shared: self.shared.clone(),
            }));
            Ok(())
        })();
        std::future::ready(r)
    }
}

struct SubscriptionImpl {
    sub: Rc<Subscriber>,
    shared: Rc<Shared>,
    conn: Rc<Conn>,
    chunks: RefCell<TokenBucket>,
}

impl SubscriptionImpl {
    fn open(&self, process_id: u64, index: u32, version: u32) -> Result<u64, Refusal> {
        if !self.sub.rate.borrow_mut().allow() {
            return Err(Refusal::RateLimited);
        }
        let record = self
            .sub
            .record(process_id, version)
            .ok_or(Refusal::UnknownProcess)?;
        let channel = self.sub.channel.borrow();
        let channel = channel.as_ref().ok_or(Refusal::NoBrokerChannel)?;
        let fd = crate::broker::open_mapping(
            &record,
            index as usize,
            &self.shared.handles.borrow(),
            &self.shared.counters,
        )?;
        let ticket = self.sub.next_ticket.get() + 1;
        self.sub.next_ticket.set(ticket);
        crate::broker::send_fd(channel, ticket, fd)?;
        Ok(ticket)
    }

    fn count(&self, r: Refusal) {
        let c = &self.shared.counters;
        bump(match r {
            Refusal::UnknownProcess | Refusal::UnknownMapping => &c.broker_refused_unknown,
            Refusal::ProcessGone => &c.broker_refused_gone,
            Refusal::Deleted => &c.broker_refused_deleted,
            Refusal::NotRegularFile => &c.broker_refused_not_regular,
            Refusal::IdentityMismatch => &c.broker_refused_identity,
            Refusal::OpenFailed => &c.broker_refused_open,
            Refusal::RateLimited => &c.broker_refused_rate,
            Refusal::NoBrokerChannel | Refusal::ChannelFull => &c.broker_refused_channel,
            Refusal::ObsoleteUnsupported => &c.broker_refused_open,
        });
    }
}

/// What became of a table chunk.
enum Chunk {
    Taken,
    Refused(TableRefusal),
    /// Malformed rows: refused and the connection closed.
    Malformed(crate::unwind::TableError),
}

impl SubscriptionImpl {
    /// Unreadable parameters: counted, and the connection closes.
    fn malformed(&self) {
        bump(&self.shared.counters.bad_requests);
        self.conn.close_soon();
    }

    /// A process id above any sent to this subscriber is a guess (another session's id,
    /// or a scan), not a race with a forgotten process: counted, and the connection
    /// closes.
    fn check_issued(&self, process_id: u64, method: &str) -> Result<(), capnp::Error> {
        if process_id <= self.sub.max_sent.get() {
            return Ok(());
        }
        bump(&self.shared.counters.broker_requests_never_issued);
        tracing::warn!(
            subscriber = self.sub.id,
            process_id,
            method,
            "request for a process never sent to this subscriber; closing"
        );
        self.conn.close_soon();
        Err(capnp::Error::failed(format!(
            "{method} for a process this subscription was never sent"
        )))
    }

    fn table_chunk(&self, p: &subscription::load_unwind_table_params::Reader<'_>) -> Chunk {
        use crate::unwind::{FileKey, TableError};
        let c = &self.shared.counters;
        let mut unwind = self.shared.unwind.borrow_mut();
        if !unwind.enabled() {
            bump(&c.unwind_tables_refused_other);
            return Chunk::Refused(TableRefusal::Disabled);
        }
        if !self.chunks.borrow_mut().allow() {
            bump(&c.unwind_tables_refused_other);
            return Chunk::Refused(TableRefusal::RateLimited);
        }
        let Some(record) = self
            .sub
            .record(p.get_process_id(), p.get_mappings_version())
        else {
            bump(&c.unwind_tables_refused_unknown);
            return Chunk::Refused(TableRefusal::UnknownProcess);
        };
        let Some(mapping) = record.mappings.get(p.get_mapping_index() as usize) else {
            bump(&c.unwind_tables_refused_unknown);
            return Chunk::Refused(TableRefusal::UnknownMapping);
        };
        let rows = match p.get_rows() {
            Ok(r) => r,
            Err(_) => return Chunk::Malformed(TableError::Ragged),
        };
        if rows.len()
            > firn_schema::limits::MAX_TABLE_CHUNK_ROWS as usize * crate::unwind::ROW_BYTES
        {
            return Chunk::Malformed(TableError::Ragged);
        }
        match unwind.take_chunk(
            self.sub.id,
            FileKey::of(mapping),
            p.get_first_row(),
            p.get_total_rows(),
            rows,
        ) {
            Ok(done) => {
                if done {
                    tracing::info!(
                        subscriber = self.sub.id,
                        path = %String::from_utf8_lossy(&mapping.path),
                        rows = p.get_total_rows(),
                        "unwind table loaded"
                    );
                }
                Chunk::Taken
            }
            Err(e) if e.is_malformed() => Chunk::Malformed(e),
            Err(e) => {
                let refusal = match e {
                    TableError::TooLarge { .. } | TableError::NoRoom { .. } => {
                        bump(&c.unwind_tables_refused_budget);
                        if matches!(e, TableError::TooLarge { .. }) {
                            TableRefusal::TooLarge
                        } else {
                            TableRefusal::NoRoom
                        }
                    }
                    TableError::NotOwner => {
                        bump(&c.unwind_tables_refused_other);
                        TableRefusal::NotOwner
                    }
                    _ => {
                        bump(&c.unwind_tables_refused_other);
                        TableRefusal::OutOfOrder
                    }
                };
                tracing::info!(
                    subscriber = self.sub.id,
                    path = %String::from_utf8_lossy(&mapping.path),
                    error = %e,
                    "unwind table refused"
                );
                Chunk::Refused(refusal)
            }
        }
    }
}

impl subscription::Server for SubscriptionImpl {
    fn load_unwind_table(
        self: Rc<Self>,
        params: subscription::LoadUnwindTableParams,
        mut results: subscription::LoadUnwindTableResults,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let r = (|| {
            admit(&self.conn, &self.shared, false)?;
            let p = params.get().inspect_err(|_| self.malformed())?;
            self.check_issued(p.get_process_id(), "loadUnwindTable")?;
            match self.table_chunk(&p) {
                Chunk::Taken => {
                    results.get().init_result().set_done(());
                    Ok(())
                }
                Chunk::Refused(r) => {
                    results.get().init_result().set_refused(r);
                    Ok(())
                }
                Chunk::Malformed(e) => {
                    bump(&self.shared.counters.unwind_tables_refused_malformed);
                    tracing::warn!(
                        subscriber = self.sub.id,
                        error = %e,
                        "malformed unwind table; closing the connection"
                    );
                    self.conn.close_soon();
                    Err(capnp::Error::failed(format!(
                        "malformed unwind table: {e}; closing"
                    )))
                }
            }
        })();
        std::future::ready(r)
    }

    fn open_mapping(
        self: Rc<Self>,
        params: subscription::OpenMappingParams,
        mut results: subscription::OpenMappingResults,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let r = (|| {
            admit(&self.conn, &self.shared, false)?;
            let p = params.get().inspect_err(|_| self.malformed())?;
            self.check_issued(p.get_process_id(), "openMapping")?;
            let outcome = self.open(
                p.get_process_id(),
                p.get_mapping_index(),
                p.get_mappings_version(),
            );
            let mut out = results.get().init_result();
            match outcome {
                Ok(ticket) => {
                    bump(&self.shared.counters.broker_fds_sent);
                    out.set_ticket(ticket);
                }
                Err(refusal) => {
                    self.count(refusal);
                    tracing::info!(
                        subscriber = self.sub.id,
                        process_id = p.get_process_id(),
                        mapping = p.get_mapping_index(),
                        reason = ?refusal,
                        "broker request refused"
                    );
                    out.set_refused(refusal);
                }
            }
            Ok(())
        })();
        std::future::ready(r)
    }
}

impl Drop for SubscriptionImpl {
    fn drop(&mut self) {
        tracing::info!(subscriber = self.sub.id, "unsubscribed");
        self.shared.unwind.borrow_mut().drop_owner(self.sub.id);
        self.sub.close();
    }
}

/// Methods of each interface in the schema (`@0`..): a call past them is a client
/// this sampler was not built for, or a probe.
const SAMPLER_METHODS: u16 = 2;
const SUBSCRIPTION_METHODS: u16 = 2;

/// A generated dispatcher behind a check: a call to an interface or method the sampler
/// does not have is counted and closes the connection. capnp-rpc alone would answer
/// "unimplemented" and keep serving whatever the client tries next.
struct Guarded<D> {
    inner: D,
    interface_id: u64,
    methods: u16,
    conn: Rc<Conn>,
    shared: Rc<Shared>,
}

struct GuardedDispatch<D>(Rc<Guarded<D>>);

impl<D> Clone for GuardedDispatch<D> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<D> std::ops::Deref for GuardedDispatch<D> {
    type Target = Guarded<D>;
    fn deref(&self) -> &Guarded<D> {
        &self.0
    }
}

impl<D: capnp::capability::Server + Clone> capnp::capability::Server for GuardedDispatch<D> {
    fn dispatch_call(
        self,
        interface_id: u64,
        method_id: u16,
        params: Params<capnp::any_pointer::Owned>,
        results: Results<capnp::any_pointer::Owned>,
    ) -> DispatchCallResult {
        let g = &self.0;
        if interface_id == g.interface_id && method_id < g.methods {
            return g
                .inner
                .clone()
                .dispatch_call(interface_id, method_id, params, results);
        }
        bump(&g.shared.counters.unknown_methods);
        tracing::warn!(
            interface_id = format_args!("{interface_id:#x}"),
            method_id,
            "call to a method this sampler does not have; closing the connection"
        );
        g.conn.close_soon();
        DispatchCallResult::new(
            Promise::err(capnp::Error::unimplemented(format!(
                "firn-sampler has no method {method_id} on interface {interface_id:#x}; \
                 closing the connection"
            ))),
            false,
        )
    }

    fn as_ptr(&self) -> usize {
        self.0.inner.as_ptr()
    }
}

impl FromServer<Guarded<sampler::ServerDispatch<SamplerImpl>>> for sampler::Client {
    type Dispatch = GuardedDispatch<sampler::ServerDispatch<SamplerImpl>>;
    fn from_server(s: Rc<Guarded<sampler::ServerDispatch<SamplerImpl>>>) -> Self::Dispatch {
        GuardedDispatch(s)
    }
}

impl FromServer<Guarded<subscription::ServerDispatch<SubscriptionImpl>>> for subscription::Client {
    type Dispatch = GuardedDispatch<subscription::ServerDispatch<SubscriptionImpl>>;
    fn from_server(
        s: Rc<Guarded<subscription::ServerDispatch<SubscriptionImpl>>>,
    ) -> Self::Dispatch {
        GuardedDispatch(s)
    }
}

async fn send_loop(shared: Rc<Shared>, sub: Rc<Subscriber>, sink: batch_sink::Client) {
    let c = &shared.counters;
    while let Some(out) = sub.next().await {
        let counters = c.list();
        let meta = BatchMeta {
            session_id: shared.identity.session_id,
            frequency_hz: shared.identity.frequency_hz,
            dropped_batches: sub.dropped.get(),
            counters: &counters,
        };
        let mut req = sink.push_request();
        encode::fill_batch(
            req.get().init_batch(),
            &out.round,
            &out.processes,
            &out.forgotten,
            &meta,
        );
        drop(out);
        match req.send().await {
            Ok(()) => bump(&c.batches_sent),
            Err(e) => {
                bump(&c.send_errors);
                tracing::info!(subscriber = sub.id, error = %e, "subscriber gone");
                sub.close();
                return;
            }
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
    let stalled_since = Rc::new(Cell::new(None));
    let writer = StallWatch {
        inner: w.compat_write(),
        since: stalled_since.clone(),
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
    let conn = Rc::new(Conn::default());
    let server = SamplerImpl {
        shared: shared.clone(),
        conn: conn.clone(),
    };
    let client: sampler::Client = capnp_rpc::new_client(Guarded {
        inner: <sampler::Client as FromServer<_>>::from_server(Rc::new(server)),
        interface_id: <sampler::Client as HasTypeId>::TYPE_ID,
        methods: SAMPLER_METHODS,
        conn: conn.clone(),
        shared: shared.clone(),
    });
    let rpc = RpcSystem::new(Box::new(network), Some(client.client));
    tokio::select! {
        res = rpc.map(|r| r) => {
            if let Err(e) = res {
                bump(&shared.counters.protocol_errors);
                tracing::warn!(error = %e, "connection closed: unreadable or over-limit message");
            }
        }
        _ = conn.kill.notified() => {}
        _ = write_stalled(stalled_since, shared.write_stall_limit) => {
            bump(&shared.counters.stalled_connections);
            tracing::warn!(
                seconds = shared.write_stall_limit.as_secs(),
                "a client stopped reading its answers; closing its connection"
            );
        }
    }
    done(&shared);
}

/// Resolves once `since` has said "stalled" for longer than `limit`.
async fn write_stalled(since: Rc<Cell<Option<Instant>>>, limit: Duration) {
    loop {
        tokio::time::sleep(Duration::from_millis(500).min(limit)).await;
        if since.get().is_some_and(|t| t.elapsed() >= limit) {
            return;
        }
    }
}

/// The connection's writer, noting since when a write has been waiting for the peer.
struct StallWatch<W> {
    inner: W,
    since: Rc<Cell<Option<Instant>>>,
}

impl<W> StallWatch<W> {
    fn note<T>(&self, p: &Poll<T>) {
        match p {
            Poll::Pending if self.since.get().is_none() => self.since.set(Some(Instant::now())),
            Poll::Pending => {}
            Poll::Ready(_) => self.since.set(None),
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

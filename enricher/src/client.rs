//! Connection to the sampler: connect with capped exponential backoff, check the
//! protocol version, subscribe, and hand decoded batches to the rest of the enricher.
//! A sampler restart only costs a reconnect.

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use capnp_rpc::{rpc_twoparty_capnp::Side, twoparty, RpcSystem};
use firn_schema::firn_capnp::{batch_sink, sampler};
use tokio::sync::mpsc;
use tokio_util::compat::{TokioAsyncReadCompatExt, TokioAsyncWriteCompatExt};

use crate::batch::{self, Batch};
use crate::broker::Broker;
use crate::metrics::Metrics;

const FIRST_BACKOFF: Duration = Duration::from_millis(200);
// Low: a connect to a local socket costs nothing, and a sampler back from a restart
// should see its enricher again within a round or two, however long it was gone.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientError {
    #[error("{detail} (this firn-enricher speaks protocol version {ours})")]
    Version { ours: u32, detail: String },
}

#[derive(Debug, Clone)]
pub(crate) struct SamplerInfo {
    pub(crate) session_id: u64,
    pub(crate) node: String,
    pub(crate) kernel_release: String,
    pub(crate) frequency_hz: u32,
    pub(crate) round_seconds: u32,
    pub(crate) kept_capabilities: Vec<String>,
    pub(crate) counters: Vec<(String, u64)>,
}

pub(crate) enum Event {
    /// A session started; `broker` is absent when its channel could not be opened.
    Connected(SamplerInfo, Option<Rc<Broker>>),
    Batch(Batch),
    /// Records of processes just seen, ahead of their round's batch, with the sampler
    /// session they belong to (they may come before `Connected`).
    Announce(u64, Vec<batch::Process>),
    Disconnected,
}

struct Sink {
    tx: mpsc::Sender<Event>,
    metrics: Arc<Metrics>,
    session_id: u64,
}

impl batch_sink::Server for Sink {
    fn push(
        self: Rc<Self>,
        params: batch_sink::PushParams,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let decoded = params
            .get()
            .and_then(|p| p.get_batch())
            .map_err(batch::DecodeError::from)
            .and_then(batch::decode);
        async move {
            match decoded {
                Ok(b) => {
                    Metrics::inc(&self.metrics.batches_received);
                    // Awaiting here is the flow control: a busy enricher slows the
                    // stream, and the sampler's bounded queue absorbs the rest.
                    let _ = self.tx.send(Event::Batch(b)).await;
                }
                Err(e) => {
                    Metrics::inc(&self.metrics.batches_rejected);
                    tracing::warn!(error = %e, "batch rejected");
                }
            }
            Ok(())
        }
    }

    fn announce(
        self: Rc<Self>,
        params: batch_sink::AnnounceParams,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let decoded = params
            .get()
            .map_err(batch::DecodeError::from)
            .and_then(batch::announced);
        async move {
            match decoded {
                Ok(p) => {
                    Metrics::inc(&self.metrics.announcements_received);
                    let _ = self.tx.send(Event::Announce(self.session_id, p)).await;
                }
                Err(e) => {
                    Metrics::inc(&self.metrics.announcements_rejected);
                    tracing::warn!(error = %e, "announcement rejected");
                }
            }
            Ok(())
        }
    }
}

/// Runs forever: connects, subscribes, forwards events, reconnects. Returns only on a
/// protocol version mismatch, which no retry can fix.
pub(crate) async fn run(
    socket: PathBuf,
    version: u32,
    tx: mpsc::Sender<Event>,
    metrics: Arc<Metrics>,
) -> ClientError {
    let mut backoff = FIRST_BACKOFF;
    let mut logged_down = false;
    loop {
        match tokio::net::UnixStream::connect(&socket).await {
            Ok(stream) => {
                Metrics::inc(&metrics.connects);
                logged_down = false;
                match session(stream, &socket, version, &tx, &metrics).await {
                    Ok(()) => backoff = FIRST_BACKOFF,
                    Err(SessionEnd::Fatal(e)) => return e,
                    Err(SessionEnd::Other(msg)) => {
                        tracing::warn!(error = %msg, "sampler connection ended");
                    }
                }
                Metrics::inc(&metrics.disconnects);
                let _ = tx.send(Event::Disconnected).await;
            }
            Err(e) => {
                Metrics::inc(&metrics.connect_failures);
                if !logged_down {
                    tracing::warn!(socket = %socket.display(), error = %e, "cannot reach the sampler; retrying with backoff");
                    logged_down = true;
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

enum SessionEnd {
    Fatal(ClientError),
    Other(String),
}

async fn session(
    stream: tokio::net::UnixStream,
    socket: &Path,
    version: u32,
    tx: &mpsc::Sender<Event>,
    metrics: &Arc<Metrics>,
) -> Result<(), SessionEnd> {
    let (r, w) = stream.into_split();
    let network = twoparty::VatNetwork::new(
        r.compat(),
        w.compat_write(),
        Side::Client,
        firn_schema::enricher_reader_options(),
    );
    let mut rpc = RpcSystem::new(Box::new(network), None);
    let client: sampler::Client = rpc.bootstrap(Side::Server);
    let done = tokio::task::spawn_local(rpc);

    let other = |e: capnp::Error| SessionEnd::Other(e.to_string());
    let mut req = client.info_request();
    req.get().set_protocol_version(version);
    let reply = req.send().promise.await.map_err(other)?;
    let info = reply.get().and_then(|r| r.get_info()).map_err(other)?;
    // The typed answer to another version: the sampler's own version, then it closes.
    if info.get_protocol_version() != version {
        return Err(SessionEnd::Fatal(ClientError::Version {
            ours: version,
            detail: format!(
                "protocol version mismatch: firn-sampler speaks version {}; run matching firn versions",
                info.get_protocol_version()
            ),
        }));
    }
    let text = |t: capnp::Result<capnp::text::Reader<'_>>| {
        t.ok().and_then(|t| t.to_string().ok()).unwrap_or_default()
    };
    let sampler_info = SamplerInfo {
        session_id: info.get_session_id(),
        node: text(info.get_node()),
        kernel_release: text(info.get_kernel_release()),
        frequency_hz: info.get_frequency_hz(),
        round_seconds: info.get_round_seconds(),
        kept_capabilities: info
            .get_kept_capabilities()
            .map(|l| l.iter().map(text).collect())
            .unwrap_or_default(),
        counters: info
            .get_counters()
            .map_err(batch::DecodeError::from)
            .and_then(batch::counters)
            .unwrap_or_default(),
    };
    tracing::info!(
        session = sampler_info.session_id,
        node = %sampler_info.node,
        frequency_hz = sampler_info.frequency_hz,
        round_seconds = sampler_info.round_seconds,
        "connected to the sampler"
    );
    let sink: batch_sink::Client = capnp_rpc::new_client(Sink {
        tx: tx.clone(),
        metrics: metrics.clone(),
        session_id: sampler_info.session_id,
    });
    let mut sub = client.subscribe_request();
    sub.get().set_protocol_version(version);
    sub.get().set_sink(sink);
    let subscribed = sub.send().promise.await.map_err(other)?;
    let results = subscribed.get().map_err(other)?;
    // Holding the subscription keeps it alive until the connection ends.
    let subscription = results.get_subscription().map_err(other)?;
    let key = results.get_broker_key().map_err(other)?;
    let broker = match Broker::connect(socket, subscription.clone(), key).await {
        Ok(b) => Some(Rc::new(b)),
        Err(e) => {
            tracing::warn!(error = %e, "no broker channel: user frames stay unsymbolized");
            None
        }
    };
    // Sent before any batch can be handled (batches wait in the channel meanwhile);
    // announcements may come first, and carry their session.
    let _ = tx.send(Event::Connected(sampler_info, broker)).await;
    let _subscription = subscription;
    match done.await {
        Ok(Ok(())) => Err(SessionEnd::Other("sampler closed the connection".into())),
        Ok(Err(e)) => Err(other(e)),
        Err(e) => Err(SessionEnd::Other(e.to_string())),
    }
}

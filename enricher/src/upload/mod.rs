//! Upload sinks: profiles sent to an OTLP profiles backend and to Parca, beside the local
//! directory. Each sink encodes a round into one request, queues it (memory, then a
//! bounded on-disk spool while the backend is down), and one sender task delivers the
//! queue in order with capped, jittered backoff. Parca also gets the binaries it cannot
//! symbolize (`debuginfo`).

pub mod debuginfo;
pub mod delivery;
pub mod grpc;
pub mod opensearch;
pub mod otlp;
pub mod parca;
pub mod parca_proto;

use std::fmt::Write;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::cli::Args;
use crate::encode::Encoded;
use crate::enrich::Round;
use crate::metrics::Metrics;
use crate::profile::Frame;
use crate::symbolize::Symbolizer;
use delivery::{Delivery, Limits, Request};

/// How OTLP requests travel (`--otlp-compression`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// gRPC gzip: a round's request shrinks several times (its dictionary is text).
    #[default]
    Gzip,
    None,
}

#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("--otlp-endpoint: {0}")]
    Otlp(grpc::GrpcError),
    #[error("--parca-address: {0}")]
    Parca(grpc::GrpcError),
    #[error("--parca-bearer-token-file: {0}")]
    Token(parca::ParcaError),
    #[error("{0}")]
    OpenSearch(#[from] opensearch::OpenSearchError),
}

/// The upload sinks that are on, fed once per round.
pub struct Uploads {
    otlp: Option<Rc<Delivery>>,
    parca: Option<Rc<Delivery>>,
    parca_token: Option<Rc<parca::Token>>,
    debuginfo: Option<Rc<debuginfo::Debuginfo>>,
    opensearch: Option<(
        Rc<Delivery>,
        opensearch::Format,
        Rc<opensearch::Credentials>,
    )>,
    metrics: Arc<Metrics>,
}

impl Uploads {
    /// Starts a sender per configured sink (inside the runtime: channels connect
    /// lazily, so a backend that is down at start only delays delivery).
    pub fn start(args: &Args, metrics: Arc<Metrics>) -> Result<Uploads, UploadError> {
        let limits = Limits {
            memory_bytes: args.upload_memory,
            spool_bytes: args.upload_spool_size,
            call_timeout: args.upload_timeout,
            backoff_min: std::time::Duration::from_secs(1).min(args.upload_backoff_max),
            backoff_max: args.upload_backoff_max,
        };
        let spool_root = args
            .upload_spool_dir
            .clone()
            .unwrap_or_else(|| args.output_dir.join(".spool"));
        let mut up = Uploads {
            otlp: None,
            parca: None,
            parca_token: None,
            debuginfo: None,
            opensearch: None,
            metrics: metrics.clone(),
        };
        let sink = |name: &'static str| {
            let m = Arc::new(SinkMetrics::new(name));
            if let Ok(mut all) = metrics.sinks.lock() {
                all.push(m.clone());
            }
            m
        };
        if let Some(url) = &args.otlp_endpoint {
            let channel = grpc::channel(url, args.otlp_ca_file.as_deref(), args.upload_timeout)
                .map_err(UploadError::Otlp)?;
            let headers = args
                .otlp_headers
                .iter()
                .map(|h| grpc::header(h))
                .collect::<Result<Vec<_>, _>>()
                .map_err(UploadError::Otlp)?;
            let m = sink("otlp");
            let d = Delivery::new("otlp", &spool_root.join("otlp"), limits.clone(), m.clone());
            let t = otlp::OtlpTransport {
                channel,
                headers: Rc::new(headers),
                metrics: m,
                gzip: args.otlp_compression == Compression::Gzip,
            };
            tokio::task::spawn_local(d.clone().run(Rc::new(t)));
            tracing::info!(endpoint = %url, spool = %spool_root.join("otlp").display(), "sending profiles to OTLP");
            up.otlp = Some(d);
        }
        if let Some(addr) = &args.parca_address {
            let url = match (addr.contains("://"), args.parca_insecure) {
                (true, _) => addr.clone(),
                (false, true) => format!("http://{addr}"),
                (false, false) => format!("https://{addr}"),
            };
            let channel = grpc::channel(&url, args.parca_ca_file.as_deref(), args.upload_timeout)
                .map_err(UploadError::Parca)?;
            let token = parca::Token::new(args.parca_bearer_token_file.clone())
                .map_err(UploadError::Token)?;
            let d = Delivery::new(
                "parca",
                &spool_root.join("parca"),
                limits.clone(),
                sink("parca"),
            );
            let t = parca::ParcaTransport {
                channel: channel.clone(),
                token: token.clone(),
            };
            tokio::task::spawn_local(d.clone().run(Rc::new(t)));
            if args.debuginfo_upload != debuginfo::Mode::Off {
                up.debuginfo = Some(debuginfo::Debuginfo::new(
                    channel,
                    token.clone(),
                    debuginfo::Settings {
                        mode: args.debuginfo_upload,
                        concurrency: args.debuginfo_upload_concurrency as usize,
                        rate: args.debuginfo_upload_rate,
                    },
                    metrics.clone(),
                ));
            }
            tracing::info!(address = %url, debuginfo = ?args.debuginfo_upload, spool = %spool_root.join("parca").display(), "sending profiles to Parca");
            up.parca = Some(d);
            up.parca_token = Some(token);
        }
        if let Some(url) = &args.opensearch_url {
            let client = opensearch::client(url, args.opensearch_ca_file.as_deref())?;
            let credentials = opensearch::Credentials::new(
                args.opensearch_username.clone(),
                args.opensearch_password_file.clone(),
            )?;
            let m = sink("opensearch");
            let dir = spool_root.join("opensearch");
            let d = Delivery::new("opensearch", &dir, limits, m.clone());
            let prefix = args.opensearch_index_prefix.clone();
            let t = opensearch::OpenSearchTransport::new(
                client,
                &prefix,
                credentials.clone(),
                m,
                metrics.clone(),
            );
            tokio::task::spawn_local(d.clone().run(Rc::new(t)));
            tracing::info!(url = %url, index_prefix = %prefix, spool = %dir.display(), "sending profiles to OpenSearch");
            let format = opensearch::Format {
                index_prefix: prefix,
                max_stacks: args.opensearch_max_stacks as usize,
                max_bytes: usize::try_from(args.opensearch_max_bytes).unwrap_or(usize::MAX),
                pprof_base: opensearch::pprof_base(
                    args.opensearch_pprof_base_url.as_deref(),
                    args.http_address,
                ),
            };
            up.opensearch = Some((d, format, credentials));
        }
        Ok(up)
    }

    pub fn any(&self) -> bool {
        self.otlp.is_some() || self.parca.is_some() || self.opensearch.is_some()
    }

    /// Encodes the round for each sink and queues it; offers Parca the binaries it
    /// may need. `encoded` are the round's pprof profiles (the local sink's).
    pub fn round(
        &self,
        round: &Round,
        groups: &crate::encode::Groups,
        stems: &[String],
        encoded: &[Encoded],
        symbolizer: &Symbolizer,
    ) {
        let id = request_id(round.end_ns, round.round);
        let timed = |d: &Rc<Delivery>, body: Option<Vec<u8>>, t: std::time::Instant| {
            SinkMetrics::add(&d.metrics.encode_ns, t.elapsed().as_nanos() as u64);
            if let Some(body) = body {
                d.push(Request {
                    id: id.clone(),
                    body: Arc::new(body),
                });
            }
        };
        if let Some(d) = &self.otlp {
            let t = std::time::Instant::now();
            timed(d, otlp::encode(round, groups), t);
        }
        if let Some(d) = &self.parca {
            let t = std::time::Instant::now();
            timed(d, parca::encode(encoded), t);
        }
        if let Some((d, format, _)) = &self.opensearch {
            let t = std::time::Instant::now();
            let body = opensearch::encode(round, groups, stems, format).map(|(body, enc)| {
                Metrics::add(
                    &self.metrics.opensearch_stacks_left_out,
                    enc.stacks_left_out as u64,
                );
                body
            });
            timed(d, body, t);
        }
        if let Some(di) = &self.debuginfo {
            self.offer_debuginfo(di, round, symbolizer);
        }
    }

    fn offer_debuginfo(
        &self,
        di: &Rc<debuginfo::Debuginfo>,
        round: &Round,
        symbolizer: &Symbolizer,
    ) {
        let all = di.mode() == debuginfo::Mode::All;
        let mut seen = std::collections::HashSet::new();
        // Frames share their mapping's Arc: a pointer check spares hashing the build id
        // string for every frame of every stack.
        let mut seen_mappings = std::collections::HashSet::new();
        for s in &round.stacks {
            for f in s.frames.iter() {
                let Frame::User {
                    mapping: Some(m),
                    lines,
                    ..
                } = f
                else {
                    continue;
                };
                if m.build_id.is_empty() || (lines.is_some() && !all) {
                    continue;
                }
                if !seen_mappings.insert(Arc::as_ptr(m)) {
                    continue;
                }
                if !seen.insert(m.build_id.clone()) || !di.wants(&m.build_id) {
                    continue;
                }
                let file =
                    crate::symbolize::unhex(&m.build_id).and_then(|b| symbolizer.binary_file(&b));
                match file {
                    Some(file) => di.offer(m.build_id.to_string(), file),
                    None => Metrics::inc(&self.metrics.debuginfo_skipped),
                }
            }
        }
    }

    /// SIGHUP: reads token and password files again.
    pub fn reload(&self) {
        if let Some((_, _, c)) = &self.opensearch {
            match c.reload() {
                Ok(()) => tracing::info!("OpenSearch credentials reloaded"),
                Err(e) => {
                    Metrics::inc(&self.metrics.upload_token_reload_errors);
                    tracing::warn!(error = %e, "OpenSearch password not reloaded; the previous one stays");
                }
            }
        }
        if let Some(t) = &self.parca_token {
            if let Err(e) = t.reload() {
                Metrics::inc(&self.metrics.upload_token_reload_errors);
                tracing::warn!(error = %e, "bearer token not reloaded; the previous one stays");
            }
        }
    }

    /// At shutdown: healthy sinks get up to `grace` to deliver what waits (a request
    /// cut off in flight could arrive twice after a restart); what is left goes to the
    /// spool for the next run.
    pub async fn shutdown(&self, grace: std::time::Duration) {
        let sinks: Vec<&Rc<Delivery>> = self.otlp.iter().chain(self.parca.iter()).collect();
        let until = std::time::Instant::now() + grace;
        while sinks.iter().any(|d| d.draining()) && std::time::Instant::now() < until {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        for d in sinks {
            d.flush_to_spool();
        }
    }
}

/// Why a request did not arrive.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The backend is down, slow or overloaded: keep the request and try again later.
    #[error("{0} (will retry)")]
    Retry(String),
    /// The backend refused this request for what it holds: sending it again cannot
    /// help, so it is dropped and counted.
    #[error("{0} (rejected, not retried)")]
    Reject(String),
}

macro_rules! sink_metrics {
    ($($name:ident: $kind:literal, $help:literal,)*) => {
        /// Delivery counters of one sink, rendered with a `sink` label on `/metrics`.
        #[derive(Default)]
        pub struct SinkMetrics {
            pub sink: &'static str,
            $(#[doc = $help] pub $name: AtomicU64,)*
        }

        impl SinkMetrics {
            pub fn new(sink: &'static str) -> Self {
                Self { sink, ..Default::default() }
            }

            /// Prometheus text for every sink; HELP and TYPE once per metric.
            pub fn render(all: &[std::sync::Arc<SinkMetrics>], out: &mut String) {
                if all.is_empty() {
                    return;
                }
                $(
                    let name = if $kind == "counter" {
                        format!("firn_enricher_upload_{}_total", stringify!($name))
                    } else {
                        format!("firn_enricher_upload_{}", stringify!($name))
                    };
                    let _ = writeln!(out, "# HELP {name} {}", $help);
                    let _ = writeln!(out, "# TYPE {name} {}", $kind);
                    for m in all {
                        let _ = writeln!(out, "{name}{{sink=\"{}\"}} {}", m.sink, m.$name.load(Ordering::Relaxed));
                    }
                )*
            }
        }
    };
}

sink_metrics! {
    requests_sent: "counter", "requests the backend accepted (one per round)",
    bytes_sent: "counter", "bytes of accepted requests",
    retries: "counter", "send attempts that failed and will be retried (backend down, slow, overloaded)",
    rejected: "counter", "requests the backend refused as invalid (dropped, not retried)",
    profiles_rejected: "counter", "profiles an OTLP backend reported as rejected in a partial success",
    dropped: "counter", "requests dropped unsent: the oldest past the spool bound, or unwritable to the spool",
    spooled: "counter", "requests written to the on-disk spool",
    spool_errors: "counter", "spool writes or reads that failed (disk full, I/O error)",
    encode_ns: "counter", "nanoseconds spent encoding rounds for this sink (in the round loop)",
    documents_sent: "counter", "documents OpenSearch accepted (its _bulk answer, item by item)",
    documents_rejected: "counter", "documents OpenSearch refused for what they hold (mapping errors; dropped, not retried)",
    documents_retried: "counter", "documents OpenSearch asked to send again (429, 5xx items)",
    queue_requests: "gauge", "requests waiting in memory",
    queue_bytes: "gauge", "bytes waiting in memory",
    spool_requests: "gauge", "requests waiting in the on-disk spool",
    spool_bytes: "gauge", "bytes waiting in the on-disk spool",
    last_success_seconds: "gauge", "Unix time of the last accepted request (0: none yet)",
    failing: "gauge", "1 while the backend is failing (requests wait and are retried)",
}

impl SinkMetrics {
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub fn set(c: &AtomicU64, n: u64) {
        c.store(n, Ordering::Relaxed);
    }
}

/// Prometheus label names: `[a-zA-Z_][a-zA-Z0-9_]*`; anything else becomes `_`.
pub fn prometheus_name(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.is_empty() || out.as_bytes()[0].is_ascii_digit() {
        out.insert(0, '_');
    }
    out
}

/// A request's id: the round's end time and number, zero-padded so that ids sort in
/// delivery order (the spool's delivered mark compares them).
pub fn request_id(end_ns: u64, round: u64) -> String {
    format!("{end_ns:020}-{round:08}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ids() {
        assert_eq!(prometheus_name("container_id"), "container_id");
        assert_eq!(
            prometheus_name("app.kubernetes.io/name"),
            "app_kubernetes_io_name"
        );
        assert_eq!(prometheus_name("1x"), "_1x");
        assert_eq!(prometheus_name(""), "_");
        assert!(request_id(9, 2) < request_id(10, 1));
        let mut out = String::new();
        let m = std::sync::Arc::new(SinkMetrics::new("otlp"));
        SinkMetrics::inc(&m.retries);
        SinkMetrics::render(&[m], &mut out);
        assert!(out.contains("firn_enricher_upload_retries_total{sink=\"otlp\"} 1"));
        assert!(out.contains("# TYPE firn_enricher_upload_spool_bytes gauge"));
    }
}

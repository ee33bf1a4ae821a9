//! OpenSearch sink: each round as one `_bulk` request (NDJSON) of documents, into daily
//! indices `<prefix>-YYYY.MM.DD` whose index template (explicit mappings) is installed
//! when absent.
//!
//! - A **profile** document per profile: the round's time span, every label as a
//!   keyword, samples, CPU nanoseconds, the top functions, a link to the pprof.
//! - A **stack** document per distinct stack per profile: the frames leaf first, its
//!   samples and CPU, the profile's labels. At most `--opensearch-max-stacks` a round
//!   (the heaviest); the rest count in their profile documents only.
//!
//! Document ids are derived from the round, the labels and the frames, so a request
//! sent twice (a retry after a lost answer, a restart) overwrites the same documents
//! instead of adding to them. Items refused in a `_bulk` answer are retried when the
//! refusal is temporary (429, 5xx) and counted and dropped otherwise (mapping errors).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use serde_json::{json, Map, Value};

use super::delivery::Transport;
use super::{SendError, SinkMetrics};
use crate::encode::Groups;
use crate::enrich::Round;
use crate::metrics::Metrics;
use crate::profile::frame_names;

#[derive(Debug, thiserror::Error)]
pub enum OpenSearchError {
    #[error("--opensearch-url {url}: {message}")]
    Url { url: String, message: String },
    #[error("--opensearch-ca-file {path}: {message}")]
    CaFile { path: PathBuf, message: String },
    #[error("--opensearch-password-file {path}: {source}")]
    Password {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "--opensearch-password-file {path} (or FIRN_OPENSEARCH_PASSWORD) is empty or not \
         one line of text"
    )]
    PasswordInvalid { path: PathBuf },
    #[error(
        "a password was given (file or FIRN_OPENSEARCH_PASSWORD) but no --opensearch-username"
    )]
    NoUsername,
}

/// Functions listed in a profile document, by samples at the leaf.
const TOP_FUNCTIONS: usize = 10;
/// Frames kept per stack document (the leaf end; deeper callers are cut).
const MAX_FRAMES: usize = 128;

/// What the documents are built with.
pub struct Format {
    pub index_prefix: String,
    pub max_stacks: usize,
    /// Bytes of a round's request past which no more stack documents are added.
    pub max_bytes: usize,
    /// `http://host:port` of the enricher's HTTP server, for pprof links.
    pub pprof_base: String,
}

/// The daily index of a round (UTC, by its end).
pub fn index_name(prefix: &str, end_ns: u64) -> String {
    let s = crate::sinks::local::utc_stamp(end_ns);
    format!("{prefix}-{}.{}.{}", &s[0..4], &s[4..6], &s[6..8])
}

fn hex_id(parts: &[&[u8]]) -> String {
    let mut ctx = md5::Context::new();
    for p in parts {
        ctx.consume(p);
        ctx.consume([0]);
    }
    format!("{:x}", ctx.compute())
}

fn millis(ns: u64) -> u64 {
    ns / 1_000_000
}

/// The labels as a JSON object of strings.
fn labels_object(labels: &[(String, String)]) -> Value {
    Value::Object(
        labels
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect::<Map<_, _>>(),
    )
}

/// What a round's encoding left out, for the counters.
#[derive(Default, Debug, PartialEq, Eq)]
pub struct Encoding {
    pub profiles: usize,
    pub stacks: usize,
    /// Distinct stacks past `max_stacks` or `max_bytes`, counted in their profiles only.
    pub stacks_left_out: usize,
}

/// The round as `_bulk` NDJSON. `stems` are the groups' pprof file stems (the local
/// sink's names). None: no samples.
pub fn encode(
    round: &Round,
    groups: &Groups,
    stems: &[String],
    f: &Format,
) -> Option<(Vec<u8>, Encoding)> {
    if groups.is_empty() {
        return None;
    }
    let index = index_name(&f.index_prefix, round.end_ns);
    let period_ns = 1_000_000_000 / u64::from(round.frequency_hz.max(1));
    let round_dir = crate::sinks::local::round_dir(round);
    let round_key = super::request_id(round.end_ns, round.round);
    let mut out = Vec::new();
    let mut enc = Encoding::default();
    // (samples, profile index, frames leaf first) of every distinct stack.
    let mut all_stacks: Vec<(u64, usize, Vec<Arc<str>>)> = Vec::new();
    let mut profile_ids = Vec::with_capacity(groups.len());
    let mut names = Vec::new();
    for (g, (labels, idx)) in groups.iter().enumerate() {
        let mut label_key = Vec::new();
        for (k, v) in labels.iter() {
            label_key.extend_from_slice(k.as_bytes());
            label_key.push(0);
            label_key.extend_from_slice(v.as_bytes());
            label_key.push(0);
        }
        let profile_id = hex_id(&[round_key.as_bytes(), &label_key]);
        let mut stacks: HashMap<Vec<Arc<str>>, u64> = HashMap::new();
        let mut leaf: HashMap<Arc<str>, u64> = HashMap::new();
        let mut samples = 0u64;
        for &i in idx {
            let s = &round.stacks[i];
            names.clear();
            for fr in s.frames.iter().rev() {
                frame_names(fr, &mut names);
            }
            names.reverse();
            names.truncate(MAX_FRAMES);
            samples = samples.saturating_add(s.count);
            if let Some(l) = names.first() {
                *leaf.entry(l.clone()).or_insert(0) += s.count;
            }
            *stacks.entry(names.clone()).or_insert(0) += s.count;
        }
        let mut top: Vec<(Arc<str>, u64)> = leaf.into_iter().collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        top.truncate(TOP_FUNCTIONS);
        let stem = stems.get(g).map_or("set", String::as_str);
        let file = format!("{round_dir}/{stem}.pb.gz");
        let mut doc = json!({
            "doc_type": "profile",
            "@timestamp": millis(round.end_ns),
            "start": millis(round.start_ns),
            "end": millis(round.end_ns),
            "duration_ms": millis(round.end_ns.saturating_sub(round.start_ns)),
            "round": round.round,
            "session_id": round.session_id,
            "profile_id": profile_id,
            "labels": labels_object(labels),
            "samples": samples,
            "cpu_ns": samples.saturating_mul(period_ns),
            "frequency_hz": round.frequency_hz,
            "distinct_stacks": stacks.len(),
            "top_functions": top.iter().map(|(n, c)| json!({"function": n.as_ref(), "samples": c})).collect::<Vec<_>>(),
            "pprof_file": file,
            "pprof_url": format!("{}/rounds/{file}", f.pprof_base),
        });
        add_labels_top(&mut doc, labels);
        push_pair(&mut out, &index, &profile_id, &doc);
        enc.profiles += 1;
        profile_ids.push((profile_id, labels.clone()));
        for (frames, count) in stacks {
            all_stacks.push((count, g, frames));
        }
    }
    all_stacks.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.2.cmp(&b.2)));
    let distinct = all_stacks.len();
    all_stacks.truncate(f.max_stacks);
    let mut key = Vec::new();
    let mut pair = Vec::new();
    for (count, g, frames) in all_stacks {
        let (profile_id, labels) = &profile_ids[g];
        key.clear();
        for fr in &frames {
            key.extend_from_slice(fr.as_bytes());
            key.push(0);
        }
        let id = hex_id(&[profile_id.as_bytes(), &key]);
        let mut doc = json!({
            "doc_type": "stack",
            "@timestamp": millis(round.end_ns),
            "start": millis(round.start_ns),
            "end": millis(round.end_ns),
            "round": round.round,
            "profile_id": profile_id,
            "labels": labels_object(labels),
            "frames": frames.iter().map(|s| s.as_ref()).collect::<Vec<_>>(),
            "leaf": frames.first().map_or("", |s| s.as_ref()),
            "depth": frames.len(),
            "samples": count,
            "cpu_ns": count.saturating_mul(period_ns),
        });
        add_labels_top(&mut doc, labels);
        pair.clear();
        push_pair(&mut pair, &index, &id, &doc);
        if out.len() + pair.len() > f.max_bytes {
            // Heaviest first: what is left out is the lightest.
            break;
        }
        out.extend_from_slice(&pair);
        enc.stacks += 1;
    }
    enc.stacks_left_out = distinct - enc.stacks;
    Some((out, enc))
}

/// The labels Dashboards charts split by most, also at the top level (`comm`,
/// `executable`, …), so that a visualization needs no nested field names.
fn add_labels_top(doc: &mut Value, labels: &[(String, String)]) {
    for (k, v) in labels {
        if TOP_LEVEL_LABELS.contains(&k.as_str()) {
            doc[k.as_str()] = Value::String(v.clone());
        }
    }
}

const TOP_LEVEL_LABELS: &[&str] = &[
    "node",
    "comm",
    "executable",
    "pid",
    "container_id",
    "systemd_unit",
    "namespace",
    "pod",
    "container",
];

fn push_pair(out: &mut Vec<u8>, index: &str, id: &str, doc: &Value) {
    let action = json!({"index": {"_index": index, "_id": id}});
    // Serializing a Value cannot fail; a line of JSON has no newline inside.
    let _ = serde_json::to_writer(&mut *out, &action);
    out.push(b'\n');
    let _ = serde_json::to_writer(&mut *out, doc);
    out.push(b'\n');
}

/// The index template: explicit mappings for every field the documents carry; labels
/// are keywords whatever their names (a dynamic template, not dynamic mapping's
/// guesses), and anything else is refused (`dynamic: strict`).
pub fn template(prefix: &str) -> Value {
    let kw = json!({"type": "keyword", "ignore_above": 1024});
    let date = json!({"type": "date", "format": "epoch_millis"});
    let long = json!({"type": "long"});
    let mut props = json!({
        "doc_type": kw, "@timestamp": date, "start": date, "end": date,
        "duration_ms": long, "round": long, "session_id": long, "profile_id": kw,
        "labels": {"type": "object", "dynamic": true},
        "samples": long, "cpu_ns": long, "frequency_hz": long, "distinct_stacks": long,
        "top_functions": {"properties": {"function": kw, "samples": long}},
        "pprof_file": kw, "pprof_url": kw,
        "frames": kw, "leaf": kw, "depth": long,
    });
    for l in TOP_LEVEL_LABELS {
        props[*l] = kw.clone();
    }
    json!({
        "index_patterns": [format!("{prefix}-*")],
        "priority": 100,
        "_meta": {"created_by": "firn-enricher", "version": env!("CARGO_PKG_VERSION")},
        "template": {
            "settings": {"number_of_shards": 1, "refresh_interval": "10s"},
            "mappings": {
                "dynamic": "strict",
                "dynamic_templates": [{
                    "labels_as_keywords": {
                        "path_match": "labels.*",
                        "mapping": {"type": "keyword", "ignore_above": 1024}
                    }
                }],
                "properties": props
            }
        }
    })
}

/// Basic-auth credentials: the user from its flag, the password from a file (read at
/// start and on SIGHUP) or the environment. Never logged.
pub struct Credentials {
    username: Option<String>,
    password_file: Option<PathBuf>,
    header: RefCell<Option<HeaderValue>>,
    /// Bumped on every successful reload, so that a refusal of old credentials does not
    /// stop new ones from being tried.
    generation: Cell<u64>,
}

impl Credentials {
    pub fn new(
        username: Option<String>,
        password_file: Option<PathBuf>,
    ) -> Result<Rc<Self>, OpenSearchError> {
        let c = Rc::new(Self {
            username,
            password_file,
            header: RefCell::new(None),
            generation: Cell::new(0),
        });
        c.reload()?;
        Ok(c)
    }

    /// Reads the password again; on error the previous credentials stay.
    pub fn reload(&self) -> Result<(), OpenSearchError> {
        let password = match &self.password_file {
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|source| OpenSearchError::Password {
                        path: path.clone(),
                        source,
                    })?;
                let p = text.trim_end_matches(['\n', '\r']).to_string();
                if p.is_empty() || p.contains('\n') {
                    return Err(OpenSearchError::PasswordInvalid { path: path.clone() });
                }
                Some(p)
            }
            None => std::env::var("FIRN_OPENSEARCH_PASSWORD").ok(),
        };
        let header = match (&self.username, password) {
            (Some(u), p) => {
                use base64::Engine;
                let token = base64::engine::general_purpose::STANDARD
                    .encode(format!("{u}:{}", p.unwrap_or_default()));
                let mut v = HeaderValue::from_str(&format!("Basic {token}")).map_err(|_| {
                    OpenSearchError::PasswordInvalid {
                        path: self.password_file.clone().unwrap_or_default(),
                    }
                })?;
                v.set_sensitive(true);
                Some(v)
            }
            (None, Some(_)) => return Err(OpenSearchError::NoUsername),
            (None, None) => None,
        };
        *self.header.borrow_mut() = header;
        self.generation.set(self.generation.get() + 1);
        Ok(())
    }
}

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The client for `url` (http:// or https://, with the system's roots or `ca_file`).
pub fn client(url: &str, ca_file: Option<&Path>) -> Result<(HttpsClient, String), OpenSearchError> {
    let bad = |m: &str| OpenSearchError::Url {
        url: url.to_string(),
        message: m.to_string(),
    };
    let uri: hyper::Uri = url
        .parse()
        .map_err(|e: hyper::http::uri::InvalidUri| bad(&e.to_string()))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => return Err(bad("give a URL starting with http:// or https://")),
    }
    if uri.host().is_none() {
        return Err(bad("no host"));
    }
    if uri.query().is_some() {
        return Err(bad("no query string, please: firn adds the paths it needs"));
    }
    let builder = hyper_rustls::HttpsConnectorBuilder::new();
    let plain = uri.scheme_str() == Some("http");
    let tls = |roots: rustls::RootCertStore| {
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map(|b| b.with_root_certificates(roots).with_no_client_auth())
    };
    let builder = match ca_file {
        // Plain HTTP: no roots to load (the system's set costs memory and start-up).
        None if plain => builder
            .with_tls_config(tls(rustls::RootCertStore::empty()).map_err(|e| bad(&e.to_string()))?),
        Some(path) => {
            use rustls_pki_types::pem::PemObject;
            let ca = |message: String| OpenSearchError::CaFile {
                path: path.to_path_buf(),
                message,
            };
            let mut roots = rustls::RootCertStore::empty();
            let certs = rustls_pki_types::CertificateDer::pem_file_iter(path)
                .map_err(|e| ca(e.to_string()))?;
            for c in certs {
                roots
                    .add(c.map_err(|e| ca(e.to_string()))?)
                    .map_err(|e| ca(e.to_string()))?;
            }
            if roots.is_empty() {
                return Err(ca("no certificate in the file".into()));
            }
            builder.with_tls_config(tls(roots).map_err(|e| ca(e.to_string()))?)
        }
        None => builder
            .with_provider_and_native_roots(rustls::crypto::ring::default_provider())
            .map_err(|e| bad(&format!("the system's CA roots: {e}")))?,
    };
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(Duration::from_secs(5)));
    http.set_keepalive(Some(Duration::from_secs(60)));
    let connector = builder.https_or_http().enable_http1().wrap_connector(http);
    let client = Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
    Ok((client, url.trim_end_matches('/').to_string()))
}

pub struct OpenSearchTransport {
    client: HttpsClient,
    /// The URL without a trailing slash.
    base: String,
    /// The index prefix, which names the template too.
    prefix: String,
    template: Bytes,
    credentials: Rc<Credentials>,
    metrics: Arc<SinkMetrics>,
    global: Arc<Metrics>,
    template_ok: Cell<bool>,
    /// The credentials generation OpenSearch refused (401/403): nothing is sent with it
    /// again, so a wrong password is not tried in a loop.
    refused_generation: Cell<Option<u64>>,
}

/// One `_bulk` answer, read item by item.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BulkOutcome {
    /// Request line pairs (action, document) to send again (429, 5xx).
    pub retry: Vec<usize>,
    pub rejected: usize,
    pub accepted: usize,
    /// The first refusal's type and reason, for the log.
    pub first_error: Option<String>,
}

/// Reads a `_bulk` answer for `pairs` documents.
pub fn read_bulk_answer(body: &[u8], pairs: usize) -> Result<BulkOutcome, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("unreadable _bulk answer: {e}"))?;
    let items = v["items"]
        .as_array()
        .ok_or_else(|| "a _bulk answer without items".to_string())?;
    if items.len() != pairs {
        return Err(format!(
            "a _bulk answer with {} items for {pairs} documents",
            items.len()
        ));
    }
    let mut o = BulkOutcome::default();
    for (i, item) in items.iter().enumerate() {
        let r = item
            .as_object()
            .and_then(|m| m.values().next())
            .cloned()
            .unwrap_or(Value::Null);
        let status = r["status"].as_u64().unwrap_or(0);
        match status {
            200..=299 => o.accepted += 1,
            429 | 500..=599 => o.retry.push(i),
            _ => {
                o.rejected += 1;
                if o.first_error.is_none() {
                    o.first_error = Some(format!(
                        "{status} {}: {}",
                        r["error"]["type"].as_str().unwrap_or("?"),
                        r["error"]["reason"].as_str().unwrap_or("?")
                    ));
                }
            }
        }
    }
    Ok(o)
}

/// The request's lines as (action, document) pairs.
fn pairs(body: &[u8]) -> Vec<&[u8]> {
    body.split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect()
}

impl OpenSearchTransport {
    /// `base` as [`client`] returns it.
    pub fn new(
        (client, base): (HttpsClient, String),
        prefix: &str,
        credentials: Rc<Credentials>,
        metrics: Arc<SinkMetrics>,
        global: Arc<Metrics>,
    ) -> Rc<Self> {
        Rc::new(Self {
            client,
            base,
            prefix: prefix.to_string(),
            template: Bytes::from(template(prefix).to_string()),
            credentials,
            metrics,
            global,
            template_ok: Cell::new(false),
            refused_generation: Cell::new(None),
        })
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        content_type: &str,
        body: Bytes,
    ) -> Result<(StatusCode, Bytes), SendError> {
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header(CONTENT_TYPE, content_type)
            .header(
                hyper::header::USER_AGENT,
                concat!("firn-enricher/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(h) = self.credentials.header.borrow().as_ref() {
            req = req.header(AUTHORIZATION, h.clone());
        }
        let req = req
            .body(Full::new(body))
            .map_err(|e| SendError::Reject(format!("building the request: {e}")))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| SendError::Retry(format!("OpenSearch unreachable: {e}")))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| SendError::Retry(format!("reading OpenSearch's answer: {e}")))?
            .to_bytes();
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            self.refused_generation
                .set(Some(self.credentials.generation.get()));
            Metrics::inc(&self.global.opensearch_auth_failures);
            tracing::error!(
                status = status.as_u16(),
                "OpenSearch refused firn's credentials: check --opensearch-username and \
                 --opensearch-password-file (or FIRN_OPENSEARCH_PASSWORD), then send SIGHUP; \
                 until then rounds wait in the queue and spool and nothing is sent"
            );
            return Err(SendError::Retry(format!(
                "credentials refused ({status}); waiting for SIGHUP"
            )));
        }
        Ok((status, body))
    }

    /// Classifies a non-2xx answer: 429 and 5xx are temporary, other 4xx are not.
    fn failed(what: &str, status: StatusCode, body: &[u8]) -> SendError {
        let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
        let msg = format!("{what}: {status}: {text}");
        if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
            SendError::Retry(msg)
        } else {
            SendError::Reject(msg)
        }
    }

    /// Installs the index template unless OpenSearch has one of that name.
    async fn ensure_template(&self) -> Result<(), SendError> {
        let path = format!("/_index_template/{}", self.prefix);
        let (status, body) = self
            .call(Method::GET, &path, "application/json", Bytes::new())
            .await?;
        if status.is_success() {
            self.template_ok.set(true);
            return Ok(());
        }
        if status != StatusCode::NOT_FOUND {
            return Err(Self::failed("looking up the index template", status, &body));
        }
        let (status, body) = self
            .call(
                Method::PUT,
                &path,
                "application/json",
                self.template.clone(),
            )
            .await?;
        if !status.is_success() {
            // A refused template is a firn bug or a cluster policy: say it, and keep the
            // documents (they would be mapped by guesswork without it).
            let e = Self::failed("installing the index template", status, &body);
            return Err(SendError::Retry(e.to_string()));
        }
        Metrics::inc(&self.global.opensearch_template_installs);
        tracing::info!(template = %self.prefix, "OpenSearch index template installed");
        self.template_ok.set(true);
        Ok(())
    }

    async fn bulk(&self, body: Arc<Vec<u8>>) -> Result<(), SendError> {
        if let Some(g) = self.refused_generation.get() {
            if g == self.credentials.generation.get() {
                return Err(SendError::Retry(
                    "credentials refused earlier; waiting for SIGHUP".into(),
                ));
            }
            self.refused_generation.set(None);
        }
        if !self.template_ok.get() {
            self.ensure_template().await?;
        }
        let lines = pairs(&body);
        let mut pending: Vec<usize> = (0..lines.len() / 2).collect();
        let mut wait = Duration::from_secs(1);
        let mut payload = Bytes::from(body.as_ref().clone());
        loop {
            let (status, answer) = self
                .call(Method::POST, "/_bulk", "application/x-ndjson", payload)
                .await?;
            if !status.is_success() {
                return Err(Self::failed("_bulk", status, &answer));
            }
            let o = read_bulk_answer(&answer, pending.len()).map_err(SendError::Retry)?;
            SinkMetrics::add(&self.metrics.documents_sent, o.accepted as u64);
            if o.rejected > 0 {
                SinkMetrics::add(&self.metrics.documents_rejected, o.rejected as u64);
                tracing::warn!(
                    documents = o.rejected,
                    first = o.first_error.as_deref().unwrap_or(""),
                    "OpenSearch refused documents (not retried)"
                );
            }
            if o.retry.is_empty() {
                return Ok(());
            }
            SinkMetrics::add(&self.metrics.documents_retried, o.retry.len() as u64);
            pending = o.retry.iter().map(|&i| pending[i]).collect();
            let mut again = Vec::new();
            for &p in &pending {
                for l in &lines[2 * p..2 * p + 2] {
                    again.extend_from_slice(l);
                    again.push(b'\n');
                }
            }
            payload = Bytes::from(again);
            tracing::debug!(
                documents = pending.len(),
                "OpenSearch asked to retry documents"
            );
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(30));
        }
    }
}

impl Transport for Rc<OpenSearchTransport> {
    fn send(&self, body: Arc<Vec<u8>>) -> Pin<Box<dyn Future<Output = Result<(), SendError>>>> {
        let me = self.clone();
        Box::pin(async move { me.bulk(body).await })
    }
}

/// The pprof links' base: `--opensearch-pprof-base-url`, else the HTTP address.
pub fn pprof_base(explicit: Option<&str>, http: std::net::SocketAddr) -> String {
    match explicit {
        Some(b) => b.trim_end_matches('/').to_string(),
        None => format!("http://{http}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_answers_are_read_item_by_item() {
        let a = br#"{"took":3,"errors":true,"items":[
            {"index":{"_id":"a","status":201}},
            {"index":{"_id":"b","status":429,"error":{"type":"es_rejected_execution_exception","reason":"queue full"}}},
            {"index":{"_id":"c","status":400,"error":{"type":"mapper_parsing_exception","reason":"bad"}}},
            {"index":{"_id":"d","status":503}}]}"#;
        let o = read_bulk_answer(a, 4).unwrap();
        assert_eq!(o.accepted, 1);
        assert_eq!(o.retry, vec![1, 3]);
        assert_eq!(o.rejected, 1);
        assert!(o.first_error.unwrap().contains("mapper_parsing_exception"));
        assert!(read_bulk_answer(a, 3).is_err(), "item count must match");
        assert!(read_bulk_answer(b"<html>", 1).is_err());
    }

    fn stack(fns: &[&str], count: u64) -> crate::profile::StackSample {
        use crate::profile::Frame;
        let frames: Vec<Frame> = fns
            .iter()
            .map(|f| Frame::User {
                mapping: None,
                address: 1,
                lines: Some(Arc::from(vec![crate::symbolize::Line {
                    function: Arc::from(*f),
                    file: Arc::from(""),
                    line: 0,
                }])),
            })
            .collect();
        crate::profile::StackSample {
            process_id: 1,
            labels: Arc::new(vec![
                ("comm".into(), "w".into()),
                ("pid".into(), "7".into()),
            ]),
            frames: Arc::from(frames),
            count,
        }
    }

    /// Documents: one profile, one per distinct stack (leaf first), heaviest first, and
    /// the stack and byte bounds leave out the lightest, counted.
    #[test]
    fn documents_and_their_bounds() {
        let round = Round {
            session_id: 1,
            round: 3,
            start_ns: 1_796_100_600_000_000_000,
            end_ns: 1_796_100_610_000_000_000,
            frequency_hz: 100,
            stacks: vec![
                stack(&["leaf", "mid", "main"], 5),
                stack(&["leaf", "mid", "main"], 2),
                stack(&["other", "main"], 1),
                stack(&["third", "main"], 3),
            ],
        };
        let groups = crate::encode::groups(&round, crate::encode::ProfileBy::Process);
        let stems = crate::encode::file_stems(&groups);
        let mut f = Format {
            index_prefix: "p".into(),
            max_stacks: 10,
            max_bytes: 1 << 20,
            pprof_base: "http://h:1".into(),
        };
        let (body, enc) = encode(&round, &groups, &stems, &f).unwrap();
        assert_eq!((enc.profiles, enc.stacks, enc.stacks_left_out), (1, 3, 0));
        let lines: Vec<Value> = pairs(&body)
            .iter()
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        assert_eq!(lines[0]["index"]["_index"], "p-2026.12.01");
        let p = &lines[1];
        assert_eq!(
            (p["samples"].as_u64(), p["cpu_ns"].as_u64()),
            (Some(11), Some(110_000_000))
        );
        assert_eq!(p["top_functions"][0]["function"], "leaf");
        assert_eq!(
            p["pprof_url"],
            "http://h:1/rounds/20261201T045000Z-r000003/pid-7.pb.gz"
        );
        assert_eq!(lines[3]["frames"], json!(["leaf", "mid", "main"]));
        assert_eq!(lines[3]["samples"], 7);
        assert_eq!(lines[5]["leaf"], "third");
        // The same round encodes to the same ids: a resend overwrites.
        let (again, _) = encode(&round, &groups, &stems, &f).unwrap();
        assert_eq!(again, body);
        f.max_stacks = 2;
        let (_, enc) = encode(&round, &groups, &stems, &f).unwrap();
        assert_eq!((enc.stacks, enc.stacks_left_out), (2, 1));
        f.max_stacks = 10;
        f.max_bytes = body.len() - 10;
        let (small, enc) = encode(&round, &groups, &stems, &f).unwrap();
        assert_eq!((enc.stacks, enc.stacks_left_out), (2, 1));
        assert!(small.len() <= f.max_bytes);
    }

    #[test]
    fn daily_index_names() {
        // 2026-12-01T04:50:00Z
        assert_eq!(
            index_name("firn-profiles", 1_796_100_600_000_000_000),
            "firn-profiles-2026.12.01"
        );
    }

    #[test]
    fn template_maps_every_field_the_documents_carry() {
        let t = template("p");
        let props = t["template"]["mappings"]["properties"].as_object().unwrap();
        for f in [
            "doc_type",
            "@timestamp",
            "labels",
            "samples",
            "cpu_ns",
            "frames",
            "leaf",
            "top_functions",
            "pprof_url",
            "comm",
            "container_id",
        ] {
            assert!(props.contains_key(f), "{f} unmapped");
        }
        assert_eq!(t["template"]["mappings"]["dynamic"], "strict");
        assert_eq!(t["index_patterns"][0], "p-*");
    }
}

//! OpenSearch sink: each round as one `_bulk` request (NDJSON) of documents, into daily
//! indices `<prefix>-YYYY.MM.DD` whose index template (explicit mappings) is installed
//! when absent, and upgraded with its indices when it is firn's own of an older mapping.
//!
//! - A **profile** document per profile: the round's time span, every label as a
//!   keyword, samples, CPU nanoseconds, the top functions, a link to the pprof; when the
//!   sampler measured off-CPU time, `off_cpu_ns` and the top functions by it.
//! - A **stack** document per distinct stack per profile: the frames leaf first, its
//!   samples and CPU (and `off_cpu_ns`), the profile's labels. At most
//!   `--opensearch-max-stacks` a round, the heaviest on-CPU and off-CPU stacks in
//!   turns; the rest count in their profile documents only.
//!
//! Document ids are derived from the round, the labels and the frames, so a request
//! sent twice (a retry after a lost answer, a restart) overwrites the same documents
//! instead of adding to them. Items refused in a `_bulk` answer are retried when the
//! refusal is temporary (429, 5xx) and counted and dropped otherwise (mapping errors).

use std::cell::{Cell, RefCell};
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
use serde_json::Value;

mod documents;
mod template;

use super::delivery::{Delivery, SendError, Transport};
use super::{OutputError, Published, Sink};
use crate::metrics::{Metrics, SinkMetrics};
use crate::settings::Settings;
use documents::template;
pub use documents::{encode, Format};

#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenSearchError {
    #[error("--opensearch-url {url}: {message}")]
    Url { url: String, message: String },
    #[error("--opensearch-ca-file {path}: {message}")]
    CaFile { path: PathBuf, message: String },
    #[error("--opensearch-password-file: {0}")]
    Password(#[from] crate::credentials::CredentialError),
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

/// Starts the OpenSearch sink when `--opensearch-url` is given.
pub(super) fn start(
    s: &Settings,
    metrics: &Arc<Metrics>,
) -> Result<Option<Box<dyn Sink>>, OutputError> {
    let Some(url) = &s.opensearch_url else {
        return Ok(None);
    };
    let client = client(url, s.opensearch_ca_file.as_deref())?;
    let credentials = Credentials::new(
        s.opensearch_username.clone(),
        s.opensearch_password_file.clone(),
    )?;
    let sink = Arc::new(SinkMetrics::new("opensearch"));
    let prefix = s.opensearch_index_prefix.clone();
    // A `_bulk` answer is about the size of its request's action lines.
    let max_answer = (16usize << 20).max(2 * usize::try_from(s.opensearch_max_bytes).unwrap_or(0));
    let transport = OpenSearchTransport::new(
        client,
        max_answer,
        &prefix,
        credentials.clone(),
        sink.clone(),
        metrics.clone(),
    );
    let delivery = Delivery::start("opensearch", s, metrics, sink, Rc::new(transport));
    tracing::info!(url = %url, index_prefix = %prefix, spool = %super::delivery::spool_dir(s, "opensearch").display(), "sending profiles to OpenSearch");
    let format = Format {
        index_prefix: prefix,
        max_stacks: s.opensearch_max_stacks as usize,
        max_bytes: usize::try_from(s.opensearch_max_bytes).unwrap_or(usize::MAX),
        pprof_base: pprof_base(s.opensearch_pprof_base_url.as_deref(), s.http_address),
    };
    Ok(Some(Box::new(OpenSearchSink {
        delivery,
        format,
        credentials,
        metrics: metrics.clone(),
    })))
}

struct OpenSearchSink {
    delivery: Rc<Delivery>,
    format: Format,
    credentials: Rc<Credentials>,
    metrics: Arc<Metrics>,
}

impl Sink for OpenSearchSink {
    fn round(&mut self, p: &Published<'_>) {
        let t0 = std::time::Instant::now();
        let body = encode(p.round, p.groups, p.layout, &self.format).map(|(body, enc)| {
            Metrics::add(
                &self.metrics.opensearch_stacks_left_out,
                enc.stacks_left_out as u64,
            );
            body
        });
        self.delivery.push_round(p.round, body, t0);
    }

    fn reload(&mut self) {
        match self.credentials.reload() {
            Ok(()) => tracing::info!("OpenSearch credentials reloaded"),
            Err(e) => {
                Metrics::inc(&self.metrics.upload_token_reload_errors);
                tracing::warn!(error = %e, "OpenSearch password not reloaded; the previous one stays");
            }
        }
    }

    fn shutdown(&mut self, grace: Duration) -> super::Done<'_> {
        Box::pin(self.delivery.shutdown(grace))
    }
}

/// Basic-auth credentials: the user from its flag, the password from a file (read at
/// start and on SIGHUP) or the environment. Never logged.
struct Credentials {
    username: Option<String>,
    password_file: Option<PathBuf>,
    header: RefCell<Option<HeaderValue>>,
    /// Bumped on every successful reload, so that a refusal of old credentials does not
    /// stop new ones from being tried.
    generation: Cell<u64>,
}

impl Credentials {
    fn new(
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
    fn reload(&self) -> Result<(), OpenSearchError> {
        let password = match &self.password_file {
            Some(path) => {
                let p = crate::credentials::read("the OpenSearch password file", path)?;
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
fn client(url: &str, ca_file: Option<&Path>) -> Result<(HttpsClient, String), OpenSearchError> {
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

struct OpenSearchTransport {
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
    /// Bytes of one answer at most.
    max_answer: usize,
    /// The credentials generation OpenSearch refused (401/403): nothing is sent with it
    /// again, so a wrong password is not tried in a loop.
    refused_generation: Cell<Option<u64>>,
}

/// One `_bulk` answer, read item by item.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct BulkOutcome {
    /// Request line pairs (action, document) to send again (429, 5xx).
    pub(crate) retry: Vec<usize>,
    pub(crate) rejected: usize,
    pub(crate) accepted: usize,
    /// The first refusal's type and reason, for the log.
    pub(crate) first_error: Option<String>,
}

/// Reads a `_bulk` answer for `pairs` documents.
pub(crate) fn read_bulk_answer(body: &[u8], pairs: usize) -> Result<BulkOutcome, String> {
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
    fn new(
        (client, base): (HttpsClient, String),
        max_answer: usize,
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
            max_answer,
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
        let body = http_body_util::Limited::new(resp.into_body(), self.max_answer)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    SinkMetrics::inc(&self.metrics.answers_too_large);
                    SendError::Retry(format!(
                        "OpenSearch's answer is over {} bytes: refused unread",
                        self.max_answer
                    ))
                } else {
                    SendError::Retry(format!("reading OpenSearch's answer: {e}"))
                }
            })?
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
fn pprof_base(explicit: Option<&str>, http: std::net::SocketAddr) -> String {
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
}

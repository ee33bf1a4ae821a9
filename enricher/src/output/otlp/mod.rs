//! OTLP profiles (`opentelemetry.proto.collector.profiles.v1development`, proto v1.10):
//! one `Export` request per round, every profile of the round sharing one dictionary.
//!
//! Each firn profile (a label set) is one `ResourceProfiles` whose resource attributes
//! follow the OpenTelemetry semantic conventions, with two profiles: `samples/count`
//! and `cpu/nanoseconds` (a v1.10 profile holds one sample type). Symbolized frames
//! carry function, file and line, inline frames as extra lines of one location (the
//! caller last, as in pprof); unsymbolized frames keep their address and their
//! mapping's GNU build id (`process.executable.build_id.gnu`) for the backend.

mod encode;

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;

use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceResponse;
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};
use tonic::transport::Channel;

use super::delivery::{Delivery, SendError, Transport};
use super::{grpc, OutputError, Published, Sink};
use crate::credentials::SecretFile;
use crate::metrics::{Metrics, SinkMetrics};
use crate::settings::{Compression, Settings};
pub use encode::encode;

/// Starts the OTLP sink when `--otlp-endpoint` is given.
pub(super) fn start(
    s: &Settings,
    metrics: &Arc<Metrics>,
) -> Result<Option<Box<dyn Sink>>, OutputError> {
    let Some(url) = &s.otlp_endpoint else {
        return Ok(None);
    };
    let channel = grpc::channel(url, s.otlp_ca_file.as_deref(), s.upload_timeout)
        .map_err(OutputError::Otlp)?;
    let headers = Rc::new(Headers::new(
        &s.otlp_headers,
        s.otlp_headers_file.as_deref(),
    )?);
    let sink = Arc::new(SinkMetrics::new("otlp"));
    let transport = OtlpTransport {
        channel,
        headers: headers.clone(),
        metrics: sink.clone(),
        gzip: s.otlp_compression == Compression::Gzip,
    };
    let delivery = Delivery::start("otlp", s, metrics, sink, Rc::new(transport));
    tracing::info!(endpoint = %url, spool = %super::delivery::spool_dir(s, "otlp").display(), "sending profiles to OTLP");
    Ok(Some(Box::new(OtlpSink {
        delivery,
        headers,
        metrics: metrics.clone(),
    })))
}

struct OtlpSink {
    delivery: Rc<Delivery>,
    headers: Rc<Headers>,
    metrics: Arc<Metrics>,
}

impl Sink for OtlpSink {
    fn round(&mut self, p: &Published<'_>) {
        let t0 = std::time::Instant::now();
        self.delivery
            .push_round(p.round, encode(p.round, p.groups), t0);
    }

    fn reload(&mut self) {
        if let Err(e) = self.headers.reload() {
            Metrics::inc(&self.metrics.upload_token_reload_errors);
            tracing::warn!(error = %e, "OTLP headers file not reloaded; the previous headers stay");
        }
    }

    fn shutdown(&mut self, grace: std::time::Duration) -> super::Done<'_> {
        Box::pin(self.delivery.shutdown(grace))
    }
}

type Pair = (AsciiMetadataKey, AsciiMetadataValue);

/// The headers of every request: those of `--otlp-header`, then the file's (read again
/// on SIGHUP; a file that no longer parses leaves the previous headers).
struct Headers {
    fixed: Vec<Pair>,
    file: Option<Rc<SecretFile>>,
    from_file: std::cell::RefCell<Vec<Pair>>,
}

impl Headers {
    fn new(flags: &[String], file: Option<&std::path::Path>) -> Result<Self, OutputError> {
        let fixed = flags
            .iter()
            .map(|h| grpc::header(h))
            .collect::<Result<Vec<_>, _>>()
            .map_err(OutputError::Otlp)?;
        for (k, _) in &fixed {
            if looks_secret(k.as_str()) {
                tracing::warn!(
                    header = k.as_str(),
                    "an OTLP header that looks like a credential is on the command line, \
                     which every local user can read: use --otlp-headers-file"
                );
            }
        }
        let file = file
            .map(|p| SecretFile::open("the OTLP headers file", p))
            .transpose()?;
        let h = Self {
            fixed,
            file,
            from_file: Default::default(),
        };
        h.parse_file()?;
        Ok(h)
    }

    fn parse_file(&self) -> Result<(), OutputError> {
        let Some(f) = &self.file else { return Ok(()) };
        let pairs = f
            .get()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(grpc::header)
            .collect::<Result<Vec<_>, _>>()
            .map_err(OutputError::Otlp)?;
        *self.from_file.borrow_mut() = pairs;
        Ok(())
    }

    fn reload(&self) -> Result<(), OutputError> {
        if let Some(f) = &self.file {
            f.reload()?;
        }
        self.parse_file()
    }

    fn all(&self) -> Vec<Pair> {
        let mut all = self.fixed.clone();
        all.extend(self.from_file.borrow().iter().cloned());
        all
    }
}

/// Header names that usually carry a credential.
fn looks_secret(name: &str) -> bool {
    [
        "authorization",
        "token",
        "key",
        "secret",
        "password",
        "auth",
    ]
    .iter()
    .any(|w| name.contains(w))
}

const EXPORT: &str = "/opentelemetry.proto.collector.profiles.v1development.ProfilesService/Export";
/// Sends encoded requests to an OTLP gRPC endpoint.
struct OtlpTransport {
    channel: Channel,
    headers: Rc<Headers>,
    metrics: Arc<SinkMetrics>,
    /// Requests go gzip-compressed (`--otlp-compression`).
    gzip: bool,
}

impl Transport for OtlpTransport {
    fn send(&self, body: Arc<Vec<u8>>) -> Pin<Box<dyn Future<Output = Result<(), SendError>>>> {
        let channel = self.channel.clone();
        let headers = self.headers.all();
        let metrics = self.metrics.clone();
        let gzip = self.gzip;
        Box::pin(async move {
            let r: ExportProfilesServiceResponse =
                grpc::unary(channel, EXPORT, body, &headers, gzip)
                    .await
                    .map_err(|s| {
                        grpc::count_too_large(&s, &metrics);
                        grpc::classify(&s)
                    })?;
            if let Some(p) = r.partial_success {
                if p.rejected_profiles > 0 || !p.error_message.is_empty() {
                    SinkMetrics::add(
                        &metrics.profiles_rejected,
                        p.rejected_profiles.max(0) as u64,
                    );
                    tracing::warn!(
                        sink = "otlp",
                        rejected_profiles = p.rejected_profiles,
                        message = %p.error_message,
                        "the OTLP backend accepted the request in part"
                    );
                }
            }
            Ok(())
        })
    }
}

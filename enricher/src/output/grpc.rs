//! gRPC plumbing shared by the sinks: channels (plain or TLS), unary calls whose request
//! is already-encoded bytes (what the spool holds), and which failures are retried.

use std::marker::PhantomData;
use std::path::Path;
use std::time::Duration;

use bytes::BufMut;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};

use super::delivery::SendError;

#[derive(Debug, thiserror::Error)]
pub(crate) enum GrpcError {
    #[error("invalid endpoint {url:?}: {message}")]
    Endpoint { url: String, message: String },
    #[error("reading CA file {path}: {source}")]
    CaFile {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("invalid header {0:?}: give KEY=VALUE with a valid header name and value")]
    Header(String),
}

/// A lazily connected channel: a backend down at start is a retried send, not a failed
/// start. `url` is `http://host:port` (plain) or `https://host:port` (TLS with the
/// system's roots, or `ca_file`'s).
pub(crate) fn channel(
    url: &str,
    ca_file: Option<&Path>,
    timeout: Duration,
) -> Result<Channel, GrpcError> {
    let bad = |m: String| GrpcError::Endpoint {
        url: url.to_string(),
        message: m,
    };
    let tls = if url.starts_with("https://") {
        true
    } else if url.starts_with("http://") {
        false
    } else {
        return Err(bad("give a URL starting with http:// or https://".into()));
    };
    let mut ep = Endpoint::from_shared(url.to_string())
        .map_err(|e| bad(e.to_string()))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(timeout)
        .tcp_keepalive(Some(Duration::from_secs(60)))
        // A backend's headers are small; a hostile one's must not grow the enricher.
        .http2_max_header_list_size(64 << 10)
        .user_agent(concat!("firn-enricher/", env!("CARGO_PKG_VERSION")))
        .map_err(|e| bad(e.to_string()))?;
    if tls {
        let mut cfg = ClientTlsConfig::new();
        cfg = match ca_file {
            Some(p) => {
                let pem = std::fs::read(p).map_err(|source| GrpcError::CaFile {
                    path: p.to_path_buf(),
                    source,
                })?;
                cfg.ca_certificate(tonic::transport::Certificate::from_pem(pem))
            }
            None => cfg.with_native_roots(),
        };
        ep = ep.tls_config(cfg).map_err(|e| bad(e.to_string()))?;
    }
    Ok(ep.connect_lazy())
}

/// `KEY=VALUE` into a metadata pair.
pub(crate) fn header(
    kv: &str,
) -> Result<
    (
        tonic::metadata::AsciiMetadataKey,
        tonic::metadata::AsciiMetadataValue,
    ),
    GrpcError,
> {
    let (k, v) = kv
        .split_once('=')
        .ok_or_else(|| GrpcError::Header(redact(kv)))?;
    let key = k
        .trim()
        .to_ascii_lowercase()
        .parse()
        .map_err(|_| GrpcError::Header(redact(kv)))?;
    let mut value: tonic::metadata::AsciiMetadataValue = v
        .trim()
        .parse()
        .map_err(|_| GrpcError::Header(redact(kv)))?;
    // Kept out of Debug output (values are often credentials).
    value.set_sensitive(true);
    Ok((key, value))
}

/// A header as it may be logged: its name only.
fn redact(kv: &str) -> String {
    match kv.split_once('=') {
        Some((k, _)) => format!("{k}=…"),
        None => "…".into(),
    }
}

/// Which failures are worth retrying: the backend is down, slow, overloaded, or refuses
/// our credentials (fixable by a SIGHUP with a new token; the requests wait meanwhile).
/// What it refuses for the request's content (INVALID_ARGUMENT and the like) would fail
/// again.
pub(crate) fn classify(s: &Status) -> SendError {
    let msg = format!("{:?}: {}", s.code(), s.message());
    match s.code() {
        Code::Unavailable
        | Code::ResourceExhausted
        | Code::DeadlineExceeded
        | Code::Aborted
        | Code::Cancelled
        | Code::Unknown
        | Code::Internal
        | Code::Unauthenticated
        | Code::PermissionDenied => SendError::Retry(msg),
        _ => SendError::Reject(msg),
    }
}

/// Encodes requests that are already bytes; decodes the answer as `R`.
pub(crate) struct RawCodec<R>(PhantomData<R>);

impl<R> Default for RawCodec<R> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

pub(crate) struct RawEncoder;

impl Encoder for RawEncoder {
    type Item = std::sync::Arc<Vec<u8>>;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

pub(crate) struct ProstDecoder<R>(PhantomData<R>);

impl<R: prost14::Message + Default> Decoder for ProstDecoder<R> {
    type Item = R;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<R>, Status> {
        R::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(format!("decoding the answer: {e}")))
    }
}

impl<R: prost14::Message + Default + Send + 'static> Codec for RawCodec<R> {
    type Encode = std::sync::Arc<Vec<u8>>;
    type Decode = R;
    type Encoder = RawEncoder;
    type Decoder = ProstDecoder<R>;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> ProstDecoder<R> {
        ProstDecoder(PhantomData)
    }
}

/// One unary call of `path` with an encoded request and the given metadata; `gzip`
/// compresses the request on the wire.
pub(crate) async fn unary<R: prost14::Message + Default + Send + 'static>(
    channel: Channel,
    path: &'static str,
    body: std::sync::Arc<Vec<u8>>,
    headers: &[(
        tonic::metadata::AsciiMetadataKey,
        tonic::metadata::AsciiMetadataValue,
    )],
    gzip: bool,
) -> Result<R, Status> {
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_ANSWER_BYTES);
    if gzip {
        grpc = grpc.send_compressed(tonic::codec::CompressionEncoding::Gzip);
    }
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("connecting: {e}")))?;
    let mut req = tonic::Request::new(body);
    for (k, v) in headers {
        req.metadata_mut().insert(k.clone(), v.clone());
    }
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    grpc.unary(req, path, RawCodec::<R>::default())
        .await
        .map(|r| r.into_inner())
        .map_err(|s| {
            // tonic refuses an answer over the bound as OUT_OF_RANGE, which would read
            // as the request's fault; it is the backend's (or whoever sits on the way),
            // so it is retried like an overloaded backend.
            if s.code() == Code::OutOfRange && s.message().contains("too large") {
                Status::resource_exhausted(format!("{TOO_LARGE}: {}", s.message()))
            } else {
                s
            }
        })
}

/// Bytes of one gRPC answer at most: the backends answer a few bytes (an id, a partial
/// success); more is refused unread.
pub(crate) const MAX_ANSWER_BYTES: usize = 1 << 20;
const TOO_LARGE: &str = "the backend's answer is over the byte bound";

/// Counts an answer refused for its size (once per failed call).
pub(crate) fn count_too_large(s: &Status, m: &crate::metrics::SinkMetrics) {
    if s.message().starts_with(TOO_LARGE) {
        crate::metrics::SinkMetrics::inc(&m.answers_too_large);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_codes() {
        let (k, v) = header("Authorization=Bearer abc").unwrap();
        assert_eq!(k.as_str(), "authorization");
        assert_eq!(v.to_str().unwrap(), "Bearer abc");
        let e = header("novalue").unwrap_err().to_string();
        assert!(!e.contains("novalue"), "{e}");
        let e = header("x y=secret").unwrap_err().to_string();
        assert!(!e.contains("secret"), "{e}");
        assert!(matches!(
            classify(&Status::unavailable("x")),
            SendError::Retry(_)
        ));
        assert!(matches!(
            classify(&Status::resource_exhausted("x")),
            SendError::Retry(_)
        ));
        assert!(matches!(
            classify(&Status::invalid_argument("x")),
            SendError::Reject(_)
        ));
        assert!(channel("ftp://x", None, Duration::from_secs(1)).is_err());
    }
}

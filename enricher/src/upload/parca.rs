//! Parca: `parca.profilestore.v1alpha1.ProfileStoreService/WriteRaw`, one request per
//! round with one series per firn profile, each holding that profile's gzip pprof (the
//! bytes the local sink writes).
//!
//! Labels: `__name__` = `parca_agent`, so that with firn's sample types Parca shows
//! `parca_agent:samples:count:cpu:nanoseconds:delta` beside its own agent's profiles,
//! and firn's labels with their names made valid Prometheus names (the first of two
//! that collide wins). `normalized` is false: locations hold the process's virtual
//! addresses and mappings their start, limit and file offset, which the server
//! normalizes. `executable_info` is not sent (it must cover every mapping, and the
//! kernel's mapping has no ELF header to describe).

use std::cell::RefCell;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;

use prost14::Message;
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};
use tonic::transport::Channel;

use super::delivery::Transport;
use super::parca_proto::{
    Label, LabelSet, RawProfileSeries, RawSample, WriteRawRequest, WriteRawResponse,
};
use super::{grpc, prometheus_name, SendError};
use crate::encode::Encoded;

const WRITE_RAW: &str = "/parca.profilestore.v1alpha1.ProfileStoreService/WriteRaw";
pub const NAME: &str = "parca_agent";

#[derive(Debug, thiserror::Error)]
pub enum ParcaError {
    #[error("reading the bearer token file {path}: {source}")]
    Token {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the bearer token in {path} is empty or not a valid header value")]
    TokenInvalid { path: PathBuf },
}

/// Parca's labels of one firn profile: `__name__` first, then firn's, valid and unique.
pub fn labels(firn: &crate::profile::LabelSet) -> Vec<Label> {
    let mut out = vec![Label {
        name: "__name__".into(),
        value: NAME.into(),
    }];
    for (k, v) in firn {
        let name = prometheus_name(k);
        if name.starts_with("__") || v.is_empty() || out.iter().any(|l| l.name == name) {
            continue;
        }
        out.push(Label {
            name,
            value: v.clone(),
        });
    }
    out
}

/// The round's profiles as one encoded `WriteRawRequest` (None: no profiles).
pub fn encode(profiles: &[Encoded]) -> Option<Vec<u8>> {
    if profiles.is_empty() {
        return None;
    }
    let series = profiles
        .iter()
        .map(|p| RawProfileSeries {
            labels: Some(LabelSet {
                labels: labels(&p.labels),
            }),
            samples: vec![RawSample {
                raw_profile: p.gz.to_vec(),
                executable_info: Vec::new(),
            }],
        })
        .collect();
    Some(
        WriteRawRequest {
            tenant: String::new(),
            series,
            normalized: false,
        }
        .encode_to_vec(),
    )
}

/// The bearer token, read from its file at start and on SIGHUP; never logged.
#[derive(Default)]
pub struct Token {
    path: Option<PathBuf>,
    value: RefCell<Option<AsciiMetadataValue>>,
}

impl Token {
    pub fn new(path: Option<PathBuf>) -> Result<Rc<Self>, ParcaError> {
        let t = Rc::new(Self {
            path,
            value: RefCell::new(None),
        });
        t.reload()?;
        Ok(t)
    }

    /// Reads the file again; on error the previous token stays.
    pub fn reload(&self) -> Result<(), ParcaError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let text = std::fs::read_to_string(path).map_err(|source| ParcaError::Token {
            path: path.clone(),
            source,
        })?;
        let text = text.trim();
        let mut v: AsciiMetadataValue = format!("Bearer {text}")
            .parse()
            .map_err(|_| ParcaError::TokenInvalid { path: path.clone() })?;
        if text.is_empty() {
            return Err(ParcaError::TokenInvalid { path: path.clone() });
        }
        v.set_sensitive(true);
        *self.value.borrow_mut() = Some(v);
        Ok(())
    }

    pub fn headers(&self) -> Vec<(AsciiMetadataKey, AsciiMetadataValue)> {
        self.value
            .borrow()
            .as_ref()
            .map(|v| vec![(AsciiMetadataKey::from_static("authorization"), v.clone())])
            .unwrap_or_default()
    }
}

pub struct ParcaTransport {
    pub channel: Channel,
    pub token: Rc<Token>,
}

impl Transport for ParcaTransport {
    fn send(&self, body: Arc<Vec<u8>>) -> Pin<Box<dyn Future<Output = Result<(), SendError>>>> {
        let channel = self.channel.clone();
        let headers = self.token.headers();
        Box::pin(async move {
            // The profiles inside are gzip already.
            grpc::unary::<WriteRawResponse>(channel, WRITE_RAW, body, &headers, false)
                .await
                .map(|_| ())
                .map_err(|s| grpc::classify(&s))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_valid_and_unique() {
        let firn = vec![
            ("__meta_x".to_string(), "a".to_string()),
            ("container-id".to_string(), "c1".to_string()),
            ("container_id".to_string(), "c2".to_string()),
            ("pid".to_string(), "7".to_string()),
            ("systemd_unit".to_string(), String::new()),
        ];
        let l = labels(&firn);
        let names: Vec<&str> = l.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["__name__", "container_id", "pid"]);
        assert_eq!(l[1].value, "c1");
        let enc = Encoded {
            group: 0,
            labels: Arc::new(firn),
            samples: 1,
            gz: Arc::new(vec![1, 2, 3]),
        };
        let bytes = encode(&[enc]).unwrap();
        let req = WriteRawRequest::decode(bytes.as_slice()).unwrap();
        assert!(!req.normalized);
        assert_eq!(req.series[0].samples[0].raw_profile, vec![1, 2, 3]);
    }

    #[test]
    fn token_file() {
        let p = std::env::temp_dir().join(format!("firn-token-{}", std::process::id()));
        std::fs::write(&p, "s3cret\n").unwrap();
        let t = Token::new(Some(p.clone())).unwrap();
        let h = t.headers();
        assert_eq!(h[0].1.to_str().unwrap(), "Bearer s3cret");
        assert!(!format!("{:?}", h[0].1).contains("s3cret"));
        std::fs::write(&p, "").unwrap();
        assert!(t.reload().is_err());
        assert_eq!(t.headers()[0].1.to_str().unwrap(), "Bearer s3cret");
        let _ = std::fs::remove_file(&p);
    }
}

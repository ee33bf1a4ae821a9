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
//!
//! Off-CPU time (the sampler's `--off-cpu`) goes as Parca Agent sends it: sample type
//! `wallclock`/`nanoseconds`, period type `samples`/`count`, which Parca shows as
//! `parca_agent:wallclock:nanoseconds:samples:count:delta` (its Off-CPU profile).
//! Parca's normalizer names every sample type of a pprof with the pprof's one period
//! type, so the local files' three-type pprof would become a meaningless
//! `off_cpu:nanoseconds:cpu:nanoseconds`: a round with off-CPU time sends each series
//! an on-CPU pprof and, when the profile waited at all, a wallclock pprof, as two
//! `RawSample`s of the one series. One series, not two with equal labels: the series
//! is the label set, and each raw profile brings its own profile type.

mod debuginfo;
mod proto;

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;

use prost14::Message;
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue};
use tonic::transport::Channel;

use super::delivery::{Delivery, SendError, Transport};
use super::group::{self, Encoded, Groups};
use super::{grpc, OutputError, Published, Sink};
use crate::credentials::{CredentialError, SecretFile};
use crate::metrics::{Metrics, SinkMetrics};
use crate::model::{Frame, Round};
use crate::pprof::SampleTypes;
use crate::settings::{DebuginfoMode, Settings};
use proto::{Label, LabelSet, RawProfileSeries, RawSample, WriteRawRequest, WriteRawResponse};

const WRITE_RAW: &str = "/parca.profilestore.v1alpha1.ProfileStoreService/WriteRaw";
pub(crate) const NAME: &str = "parca_agent";

/// Starts the Parca sink when `--parca-address` is given.
pub(super) fn start(
    s: &Settings,
    metrics: &Arc<Metrics>,
) -> Result<Option<Box<dyn Sink>>, OutputError> {
    let Some(addr) = &s.parca_address else {
        return Ok(None);
    };
    let url = match (addr.contains("://"), s.parca_insecure) {
        (true, _) => addr.clone(),
        (false, true) => format!("http://{addr}"),
        (false, false) => format!("https://{addr}"),
    };
    let channel = grpc::channel(&url, s.parca_ca_file.as_deref(), s.upload_timeout)
        .map_err(OutputError::Parca)?;
    let token = Token::new(s.parca_bearer_token_file.as_deref())?;
    let sink = Arc::new(SinkMetrics::new("parca"));
    let transport = ParcaTransport {
        channel: channel.clone(),
        token: token.clone(),
        metrics: sink.clone(),
    };
    let delivery = Delivery::start("parca", s, metrics, sink, Rc::new(transport));
    let debuginfo = (s.debuginfo_upload != DebuginfoMode::Off).then(|| {
        debuginfo::Debuginfo::new(
            channel,
            token.clone(),
            debuginfo::Settings {
                mode: s.debuginfo_upload,
                concurrency: s.debuginfo_upload_concurrency as usize,
                rate: s.debuginfo_upload_rate,
            },
            metrics.clone(),
        )
    });
    tracing::info!(address = %url, debuginfo = ?s.debuginfo_upload, spool = %super::delivery::spool_dir(s, "parca").display(), "sending profiles to Parca");
    Ok(Some(Box::new(ParcaSink {
        delivery,
        token,
        debuginfo,
        metrics: metrics.clone(),
    })))
}

struct ParcaSink {
    delivery: Rc<Delivery>,
    token: Rc<Token>,
    debuginfo: Option<Rc<debuginfo::Debuginfo>>,
    metrics: Arc<Metrics>,
}

impl Sink for ParcaSink {
    fn round(&mut self, p: &Published<'_>) {
        let t0 = std::time::Instant::now();
        self.delivery
            .push_round(p.round, encode(p.round, p.groups, p.profiles), t0);
        if let Some(di) = &self.debuginfo {
            offer_debuginfo(di, p, &self.metrics);
        }
    }

    fn reload(&mut self) {
        if let Err(e) = self.token.reload() {
            Metrics::inc(&self.metrics.upload_token_reload_errors);
            tracing::warn!(error = %e, "bearer token not reloaded; the previous one stays");
        }
    }

    fn shutdown(&mut self, grace: std::time::Duration) -> super::Done<'_> {
        Box::pin(self.delivery.shutdown(grace))
    }
}

/// Offers Parca the binaries of the round it may need: those whose frames firn could
/// not name (all with a build id, with `--debuginfo-upload all`).
fn offer_debuginfo(di: &Rc<debuginfo::Debuginfo>, p: &Published<'_>, metrics: &Metrics) {
    let all = di.mode() == DebuginfoMode::All;
    let mut seen = std::collections::HashSet::new();
    // Frames share their mapping's Arc: a pointer check spares hashing the build id
    // string for every frame of every stack.
    let mut seen_mappings = std::collections::HashSet::new();
    for s in &p.round.stacks {
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
            let file = unhex(&m.build_id).and_then(|b| p.binaries.file_of(&b));
            match file {
                Some(file) => di.offer(m.build_id.to_string(), file),
                None => Metrics::inc(&metrics.debuginfo_skipped),
            }
        }
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Prometheus label names: `[a-zA-Z_][a-zA-Z0-9_]*`; anything else becomes `_`.
fn prometheus_name(name: &str) -> String {
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

/// Parca's labels of one firn profile: `__name__` first, then firn's, valid and unique.
pub(crate) fn labels(firn: &crate::model::LabelSet) -> Vec<Label> {
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
pub fn encode(round: &Round, groups: &Groups, profiles: &[Encoded]) -> Option<Vec<u8>> {
    if profiles.is_empty() {
        return None;
    }
    let raw = |gz: &[u8]| RawSample {
        raw_profile: gz.to_vec(),
        executable_info: Vec::new(),
    };
    let series = profiles
        .iter()
        .map(|p| {
            let samples = match (round.off_cpu, groups.get(p.group)) {
                (true, Some(g)) => {
                    let waited = g.stacks.iter().any(|&i| round.stacks[i].off_cpu_ns > 0);
                    let kinds: &[SampleTypes] = match waited {
                        true => &[SampleTypes::OnCpu, SampleTypes::OffCpuWallclock],
                        false => &[SampleTypes::OnCpu],
                    };
                    kinds
                        .iter()
                        .filter_map(|&t| group::encode(round, p.group, &g.labels, &g.stacks, t))
                        .map(|e| raw(&e.gz))
                        .collect()
                }
                // Without off-CPU time the local file's bytes are Parca's pprof.
                _ => vec![raw(&p.gz)],
            };
            RawProfileSeries {
                labels: Some(LabelSet {
                    labels: labels(&p.labels),
                }),
                samples,
            }
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
pub(crate) struct Token {
    file: Option<Rc<SecretFile>>,
    value: RefCell<Option<AsciiMetadataValue>>,
}

impl Token {
    pub(crate) fn new(path: Option<&std::path::Path>) -> Result<Rc<Self>, CredentialError> {
        let file = path
            .map(|p| SecretFile::open("the bearer token file", p))
            .transpose()?;
        let t = Rc::new(Self {
            file,
            value: RefCell::new(None),
        });
        t.set()?;
        Ok(t)
    }

    /// Reads the file again; on error the previous token stays.
    pub(crate) fn reload(&self) -> Result<(), CredentialError> {
        if let Some(f) = &self.file {
            f.reload()?;
        }
        self.set()
    }

    fn set(&self) -> Result<(), CredentialError> {
        let Some(f) = &self.file else {
            return Ok(());
        };
        let text = f.get();
        let invalid = || CredentialError::Format {
            what: f.what(),
            path: f.path().to_path_buf(),
            message: "the token is empty or not a valid header value".into(),
        };
        if text.trim().is_empty() {
            return Err(invalid());
        }
        let mut v: AsciiMetadataValue = format!("Bearer {}", text.trim())
            .parse()
            .map_err(|_| invalid())?;
        v.set_sensitive(true);
        *self.value.borrow_mut() = Some(v);
        Ok(())
    }

    pub(crate) fn headers(&self) -> Vec<(AsciiMetadataKey, AsciiMetadataValue)> {
        self.value
            .borrow()
            .as_ref()
            .map(|v| vec![(AsciiMetadataKey::from_static("authorization"), v.clone())])
            .unwrap_or_default()
    }
}

struct ParcaTransport {
    channel: Channel,
    token: Rc<Token>,
    metrics: Arc<SinkMetrics>,
}

impl Transport for ParcaTransport {
    fn send(&self, body: Arc<Vec<u8>>) -> Pin<Box<dyn Future<Output = Result<(), SendError>>>> {
        let channel = self.channel.clone();
        let headers = self.token.headers();
        let metrics = self.metrics.clone();
        Box::pin(async move {
            // The profiles inside are gzip already.
            grpc::unary::<WriteRawResponse>(channel, WRITE_RAW, body, &headers, false)
                .await
                .map(|_| ())
                .map_err(|s| {
                    grpc::count_too_large(&s, &metrics);
                    grpc::classify(&s)
                })
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
        let round = round(false, Vec::new());
        let bytes = encode(&round, &Vec::new(), &[enc]).unwrap();
        let req = WriteRawRequest::decode(bytes.as_slice()).unwrap();
        assert!(!req.normalized);
        assert_eq!(req.series[0].samples[0].raw_profile, vec![1, 2, 3]);
    }

    fn round(off_cpu: bool, stacks: Vec<crate::model::StackSample>) -> Round {
        Round {
            session_id: 1,
            round: 1,
            start_ns: 0,
            end_ns: 1_000_000_000,
            frequency_hz: 100,
            off_cpu,
            stacks,
        }
    }

    fn stack(pid: &str, count: u64, off_cpu_ns: u64) -> crate::model::StackSample {
        crate::model::StackSample {
            process_id: pid.parse().unwrap(),
            labels: Arc::new(vec![("pid".into(), pid.into())]),
            frames: Arc::from(vec![Frame::Kernel(Arc::from("schedule"))]),
            count,
            off_cpu_ns,
        }
    }

    /// (sample types, period type, period, values) of a raw gzip pprof.
    fn read(gz: &[u8]) -> (Vec<String>, String, i64, Vec<Vec<i64>>) {
        use std::io::Read;
        let mut raw = Vec::new();
        flate2::read::GzDecoder::new(gz)
            .read_to_end(&mut raw)
            .unwrap();
        let p = <pprof::protos::Profile as prost::Message>::decode(raw.as_slice()).unwrap();
        let s = |i: i64| p.string_table[i as usize].clone();
        let vt = |t: &pprof::protos::ValueType| format!("{}/{}", s(t.ty), s(t.unit));
        (
            p.sample_type.iter().map(vt).collect(),
            p.period_type.as_ref().map(vt).unwrap_or_default(),
            p.period,
            p.sample.iter().map(|x| x.value.clone()).collect(),
        )
    }

    /// With off-CPU time a series carries an on-CPU pprof and, when its profile waited,
    /// a wallclock one (Parca Agent's off-CPU type); without it, the local file's bytes.
    #[test]
    fn off_cpu_time_is_a_wallclock_pprof_of_its_own() {
        let r = round(
            true,
            vec![stack("1", 3, 0), stack("1", 0, 7_000), stack("2", 2, 0)],
        );
        let groups = group::groups(&r, crate::settings::ProfileBy::Process);
        let profiles = group::per_label_set(&r, &groups);
        let req =
            WriteRawRequest::decode(encode(&r, &groups, &profiles).unwrap().as_slice()).unwrap();
        let of = |pid: &str| {
            req.series
                .iter()
                .find(|s| {
                    s.labels
                        .as_ref()
                        .unwrap()
                        .labels
                        .iter()
                        .any(|l| l.value == pid)
                })
                .unwrap()
        };
        let one = &of("1").samples;
        assert_eq!(one.len(), 2);
        let cpu = read(&one[0].raw_profile);
        assert_eq!(cpu.0, ["samples/count", "cpu/nanoseconds"]);
        assert_eq!((cpu.1.as_str(), cpu.2), ("cpu/nanoseconds", 10_000_000));
        assert_eq!(cpu.3, vec![vec![3, 30_000_000]]);
        let wall = read(&one[1].raw_profile);
        assert_eq!(wall.0, ["wallclock/nanoseconds"]);
        assert_eq!((wall.1.as_str(), wall.2), ("samples/count", 1));
        assert_eq!(wall.3, vec![vec![7_000]]);
        assert_eq!(of("2").samples.len(), 1, "a profile that never waited");
        // Without off-CPU time: the local sink's bytes, one raw sample a series.
        let r = round(false, vec![stack("1", 3, 0)]);
        let groups = group::groups(&r, crate::settings::ProfileBy::Process);
        let profiles = group::per_label_set(&r, &groups);
        let req =
            WriteRawRequest::decode(encode(&r, &groups, &profiles).unwrap().as_slice()).unwrap();
        assert_eq!(req.series[0].samples.len(), 1);
        assert_eq!(req.series[0].samples[0].raw_profile, *profiles[0].gz);
    }

    #[test]
    fn token_file() {
        use std::os::unix::fs::PermissionsExt;
        let p = std::env::temp_dir().join(format!("firn-token-{}", std::process::id()));
        std::fs::write(&p, "s3cret\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let t = Token::new(Some(&p)).unwrap();
        let h = t.headers();
        assert_eq!(h[0].1.to_str().unwrap(), "Bearer s3cret");
        assert!(!format!("{:?}", h[0].1).contains("s3cret"));
        std::fs::write(&p, "").unwrap();
        assert!(t.reload().is_err());
        assert_eq!(t.headers()[0].1.to_str().unwrap(), "Bearer s3cret");
        let _ = std::fs::remove_file(&p);
    }
}

//! A subscriber for the tests that play a lying enricher (`firn-lying-tables`,
//! `firn-lying-python`): it connects, subscribes, and keeps what the batches say about
//! one victim process.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use capnp_rpc::{rpc_twoparty_capnp::Side, twoparty, RpcSystem};
use firn_schema::firn_capnp::{batch_sink, sampler, subscription};
use tokio_util::compat::{TokioAsyncReadCompatExt, TokioAsyncWriteCompatExt};

/// A mapping of the victim's record: start, end, file offset, path.
pub type VictimMapping = (u64, u64, u64, String);

/// What the batches told about the victim.
#[derive(Default)]
pub struct Seen {
    /// (process id, mappings version, its mappings).
    pub record: Option<(u64, u32, Vec<VictimMapping>)>,
    pub frames: Vec<u64>,
    pub ends: BTreeMap<String, u64>,
    pub samples: u64,
    pub counters: BTreeMap<String, u64>,
    /// Every Python code blob of every batch (any process's).
    pub python_code: Vec<Vec<u8>>,
}

struct Sink {
    pid: u32,
    seen: Rc<RefCell<Seen>>,
}

impl Sink {
    fn records(
        &self,
        seen: &mut Seen,
        procs: capnp::Result<
            capnp::struct_list::Reader<'_, firn_schema::firn_capnp::process::Owned>,
        >,
    ) {
        for p in procs.into_iter().flatten() {
            if p.get_pid() != self.pid {
                continue;
            }
            let maps = p
                .get_mappings()
                .into_iter()
                .flatten()
                .map(|m| {
                    let path = m
                        .get_path()
                        .map(|p| String::from_utf8_lossy(p).into_owned());
                    (
                        m.get_start(),
                        m.get_end(),
                        m.get_file_offset(),
                        path.unwrap_or_default(),
                    )
                })
                .collect();
            seen.record = Some((p.get_process_id(), p.get_mappings_version(), maps));
        }
    }
}

impl batch_sink::Server for Sink {
    fn push(
        self: Rc<Self>,
        params: batch_sink::PushParams,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let mut seen = self.seen.borrow_mut();
        if let Ok(b) = params.get().and_then(|p| p.get_batch()) {
            self.records(&mut seen, b.get_processes());
            for s in b.get_samples().into_iter().flatten() {
                if s.get_pid() != self.pid {
                    continue;
                }
                seen.samples += s.get_count();
                seen.frames
                    .extend(s.get_user_frames().into_iter().flatten());
                let end = format!("{:?}", s.get_user_stack_end().ok());
                *seen.ends.entry(end).or_default() += s.get_count();
            }
            for c in b.get_counters().into_iter().flatten() {
                if let Ok(name) = c.get_name().map(|n| n.to_string().unwrap_or_default()) {
                    seen.counters.insert(name, c.get_value());
                }
            }
            for blob in b.get_python_code().into_iter().flatten().flatten() {
                seen.python_code.push(blob.to_vec());
            }
        }
        std::future::ready(Ok(()))
    }

    fn announce(
        self: Rc<Self>,
        params: batch_sink::AnnounceParams,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        if let Ok(p) = params.get() {
            self.records(&mut self.seen.borrow_mut(), p.get_processes());
        }
        std::future::ready(Ok(()))
    }
}

pub struct Session {
    pub client: sampler::Client,
    pub ended: tokio::sync::oneshot::Receiver<()>,
}

/// Connects to the sampler (call within a tokio LocalSet).
pub async fn connect(sock: &str) -> Session {
    let stream = tokio::net::UnixStream::connect(sock)
        .await
        .expect("connect");
    let (r, w) = stream.into_split();
    let network = twoparty::VatNetwork::new(
        futures::io::BufReader::new(r.compat()),
        w.compat_write(),
        Side::Client,
        Default::default(),
    );
    let mut rpc = RpcSystem::new(Box::new(network), None);
    let client: sampler::Client = rpc.bootstrap(Side::Server);
    let (tx, ended) = tokio::sync::oneshot::channel::<()>();
    tokio::task::spawn_local(async move {
        let _ = rpc.await;
        let _ = tx.send(());
    });
    Session { client, ended }
}

/// Subscribes; the batches' news of process `pid` go into `seen`.
pub async fn subscribe(s: &Session, pid: u32, seen: &Rc<RefCell<Seen>>) -> subscription::Client {
    let sink: batch_sink::Client = capnp_rpc::new_client(Sink {
        pid,
        seen: seen.clone(),
    });
    let mut req = s.client.subscribe_request();
    req.get()
        .set_protocol_version(firn_schema::PROTOCOL_VERSION);
    req.get().set_sink(sink);
    let res = req.send().promise.await.expect("subscribe");
    res.get()
        .and_then(|r| r.get_subscription())
        .expect("subscription")
}

/// Waits (up to 30 s) for the victim's record.
pub async fn victim_record(seen: &Rc<RefCell<Seen>>) -> Option<(u64, u32, Vec<VictimMapping>)> {
    let t0 = Instant::now();
    while seen.borrow().record.is_none() && t0.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    seen.borrow().record.clone()
}

/// Runs `f` on a single-threaded runtime with a LocalSet (capnp-rpc is !Send).
pub fn run_local<F: std::future::Future<Output = String>>(f: F) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, f)
}

/// The executable ranges of `pid` (files, anonymous code, the vDSO), as root reads them.
pub fn code_ranges(pid: u32) -> Vec<(u64, u64)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("victim maps");
    maps.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let range = it.next()?;
            let perms = it.next()?;
            if perms.as_bytes().get(2) != Some(&b'x') {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .collect()
}

//! The enricher's lifecycle: settings, the event loop, the sampler connection, then one
//! round after another through [`Enricher`] into the [`Outputs`], until SIGTERM.

use std::process::ExitCode;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::broker::Broker;
use crate::client::{self, Event};
use crate::enrich::Enricher;
use crate::labels::{Labeler, System};
use crate::metrics::Metrics;
use crate::output::{http, Outputs};
use crate::settings::file::Labeling;
use crate::settings::{self, Settings};
use crate::{confine, heap, summary, symbolize};

impl crate::output::BinaryFiles for symbolize::Symbolizer {
    fn file_of(&self, build_id: &[u8]) -> Option<std::fs::File> {
        self.binary_file(build_id)
    }
}

/// `firn-enricher`'s main.
pub fn main() -> ExitCode {
    let (settings, labeling) = match settings::file::settings(std::env::args_os().collect()) {
        Ok(s) => s,
        Err(settings::file::SettingsError::Args(e)) => e.exit(),
        Err(e) => {
            eprintln!("firn-enricher: {e}");
            return ExitCode::from(2);
        }
    };
    if settings.healthcheck {
        return healthcheck(settings.http_address);
    }
    // What the enricher writes (profiles, the spool, the token) is not for other users.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o027));
    if let Err(e) = firn_logs::init(&settings.log) {
        eprintln!("firn-enricher: {e}");
        return ExitCode::from(2);
    }
    // A panic the symbolizer contains is one log line, not a backtrace on stderr.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if symbolize::panic_is_contained() {
            tracing::info!(panic = %info, "contained panic in the symbolizer");
        } else {
            default_hook(info);
        }
    }));
    if nix::unistd::geteuid().is_root() && !settings.allow_root {
        tracing::error!(
            "firn-enricher refuses to run as root: it parses untrusted input (binaries, \
             container metadata, server replies) and needs no privilege. Run it as an \
             unprivileged user allowed by the sampler's --allow-uid, or pass --allow-root"
        );
        return ExitCode::from(2);
    }
    raise_fd_limit();
    heap::configure();
    let confinement = match confine(&settings) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "starting the event loop");
            return ExitCode::FAILURE;
        }
    };
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, run(settings, labeling, confinement))
}

/// Test-only entry (the confined probe of tests/src/bin): confines the calling process
/// exactly as `firn-enricher` with `args` would confine itself.
pub fn confine_as_enricher(args: Vec<std::ffi::OsString>) -> Result<(), String> {
    let (settings, _) = settings::file::settings(args).map_err(|e| e.to_string())?;
    confine(&settings)
        .map(|_| ())
        .map_err(|code| format!("confinement failed ({code:?})"))
}

/// Confines the process (confine.rs) while it is one thread: before the event loop.
/// The HTTP token is made first, since its file may lie outside the writable folders.
fn confine(s: &Settings) -> Result<confine::Report, ExitCode> {
    if s.unconfined {
        tracing::warn!(
            "--unconfined: the enricher runs without its Landlock and seccomp confinement"
        );
        return Ok(confine::Report {
            landlock_abi: 0,
            missing: vec!["--unconfined"],
        });
    }
    if !s.dump && s.http_auth == settings::HttpAuth::Token {
        if let Err(e) = http::ensure_token(s) {
            tracing::error!("{e}");
            return Err(ExitCode::from(2));
        }
    }
    if let Some(dir) = s.unwind_cache() {
        // Made before the confinement, which allows writes only beneath folders that exist.
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::error!(path = %dir.display(), error = %e, "creating the unwind table cache's folder (--unwind-cache-size 0 turns it off)");
            return Err(ExitCode::from(2));
        }
    }
    if s.http_self_profile && !s.dump {
        // The self-profiler writes a temporary file: keep it in a folder of ours, not
        // in /tmp, which stays closed to writes.
        let tmp = s.output_dir.join(".tmp");
        if let Err(e) = std::fs::create_dir_all(&tmp) {
            tracing::error!(path = %tmp.display(), error = %e, "creating the self-profile's temporary folder");
            return Err(ExitCode::from(2));
        }
        // SAFETY: the process is one thread here (confine::apply checks it next), so
        // nothing reads the environment meanwhile.
        unsafe { std::env::set_var("TMPDIR", &tmp) };
    }
    confine::apply(&confine::Plan::from_settings(s)).map_err(|e| {
        tracing::error!(
            "{e} (--unconfined runs without confinement, for a kernel or setup it breaks)"
        );
        ExitCode::from(2)
    })
}

/// Each cached binary holds an fd or two: take the hard limit as the soft one.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

/// What turns batches into outputs: absent with `--dump`.
struct Pipeline {
    enricher: Enricher,
    outputs: Outputs,
    heap: heap::Trimmer,
}

/// What the event loop keeps of the sampler session.
struct Session {
    broker: Option<Rc<Broker>>,
    /// The sampler counts drops per subscription, cumulatively; this is the last count.
    dropped: u64,
    /// (device, inode) of the output directory the confinement allows writes beneath.
    confined_dir: Option<(u64, u64)>,
}

impl Pipeline {
    /// One round: enriched, handed to the outputs. `Err` with the exit code when the
    /// enricher must stop (its output directory was replaced).
    async fn round(
        &mut self,
        batch: crate::batch::Batch,
        session: &mut Session,
        s: &Settings,
        metrics: &Metrics,
    ) -> Result<(), ExitCode> {
        let lost = batch.dropped_batches.saturating_sub(session.dropped);
        Metrics::add(&metrics.batches_dropped_upstream, lost);
        if lost > 0 {
            tracing::warn!(
                batches = lost,
                "the sampler dropped batches for this enricher (it fell behind)"
            );
        }
        session.dropped = batch.dropped_batches;
        if let Ok(mut c) = metrics.sampler.lock() {
            *c = batch.counters.clone();
        }
        let end_ns = batch.end_time_ns;
        let round = self.enricher.handle(batch, session.broker.as_deref()).await;
        let errors = metrics.sink_errors.load(Ordering::Relaxed);
        self.outputs.round(round, &self.enricher.symbolizer);
        if metrics.sink_errors.load(Ordering::Relaxed) > errors
            && session
                .confined_dir
                .is_some_and(|id| dir_identity(&s.output_dir).is_some_and(|now| now != id))
        {
            tracing::error!(
                output_dir = %s.output_dir.display(),
                "the output directory was removed and made again: the confinement \
                 allows writes only beneath the one the enricher started with; \
                 exiting with 75 so that the supervisor restarts it"
            );
            return Err(ExitCode::from(75));
        }
        let lag = firn_schema::now_ns().saturating_sub(end_ns);
        metrics
            .round_lag_ms
            .store(lag / 1_000_000, Ordering::Relaxed);
        // A round's transient memory (the batch, unwind tables being built, the encoded
        // profiles) is free now: give its pages back rather than let the heap keep its
        // high-water mark until the next burst.
        self.enricher.take_table_bytes();
        self.heap.trim(metrics);
        Ok(())
    }
}

async fn run(s: Settings, labeling: Labeling, confinement: confine::Report) -> ExitCode {
    let metrics = Arc::new(Metrics::default());
    metrics
        .landlock_abi
        .store(confinement.landlock_abi, Ordering::Relaxed);
    Metrics::add(
        &metrics.confinement_missing,
        confinement.missing.len() as u64,
    );
    let (tx, mut rx) = mpsc::channel(4);
    let mut client = tokio::task::spawn_local(client::run(
        s.socket.clone(),
        s.protocol_version,
        tx,
        metrics.clone(),
    ));
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut hup) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) {
        (Ok(t), Ok(h)) => (t, h),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "signal handlers");
            return ExitCode::FAILURE;
        }
    };
    let http = http::Shared::new(metrics.clone(), s.output_dir.clone(), s.http_self_profile);
    let mut pipeline = if s.dump {
        None
    } else {
        match start(&s, labeling, &metrics, &http).await {
            Ok(p) => Some(p),
            Err(code) => return code,
        }
    };
    let mut session = Session {
        broker: None,
        dropped: 0,
        // The confinement allows writes beneath the output directory it started with;
        // one removed and made again is another directory, out of reach until a restart.
        confined_dir: (!s.unconfined)
            .then(|| dir_identity(&s.output_dir))
            .flatten(),
    };
    let mut exit = ExitCode::SUCCESS;
    let mut dump = summary::Dump::default();
    loop {
        // Armed only with a broker to send tables through (else it would spin).
        let early = pipeline
            .as_mut()
            .filter(|_| session.broker.is_some())
            .and_then(|p| p.enricher.early_wait());
        let ev = tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => ev,
                // The client only ends on a fatal error; report it below.
                None => return fatal(client.await),
            },
            res = &mut client => return fatal(res),
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            _ = hup.recv() => {
                reload(&s, pipeline.as_mut(), &metrics);
                continue;
            }
            // A large file's table, built off the loop: sent, and the queue goes on.
            built = async {
                match pipeline.as_mut() {
                    Some(p) => p.enricher.built_aside().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Some(p) = pipeline.as_mut() {
                    p.enricher.finish_aside(built, session.broker.as_deref()).await;
                    p.heap.after_tables(p.enricher.take_table_bytes(), &metrics);
                }
                continue;
            }
            // Tables of announced processes left for want of budget: on with them.
            _ = tokio::time::sleep(early.unwrap_or_default()), if early.is_some() => {
                if let (Some(p), Some(b)) = (pipeline.as_mut(), session.broker.as_deref()) {
                    p.enricher.early_work(b).await;
                    p.heap.after_tables(p.enricher.take_table_bytes(), &metrics);
                }
                continue;
            }
        };
        let Some(p) = pipeline.as_mut() else {
            dump.print(ev);
            continue;
        };
        match ev {
            Event::Connected(info, b) => {
                p.enricher.set_session(info.session_id);
                p.enricher.labeler.set_node(&info.node);
                http.set_round_seconds(info.round_seconds);
                session.broker = b;
                session.dropped = 0;
            }
            Event::Disconnected => session.broker = None,
            Event::Announce(session_id, records) => {
                p.enricher.set_session(session_id);
                p.enricher
                    .announced(records, session.broker.as_deref())
                    .await;
                p.heap.after_tables(p.enricher.take_table_bytes(), &metrics);
            }
            Event::Batch(batch) => {
                if let Err(code) = p.round(batch, &mut session, &s, &metrics).await {
                    exit = code;
                    break;
                }
            }
        }
    }
    tracing::info!("stopping");
    if let Some(p) = pipeline.as_mut() {
        p.outputs.shutdown(std::time::Duration::from_secs(5)).await;
    }
    exit
}

/// (device, inode) of a directory.
fn dir_identity(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// The HTTP server, the enricher and every output.
async fn start(
    s: &Settings,
    labeling: Labeling,
    metrics: &Arc<Metrics>,
    http: &Arc<http::Shared>,
) -> Result<Pipeline, ExitCode> {
    let access = http::Access::new(s, metrics.clone()).map_err(|e| {
        tracing::error!("{e}");
        ExitCode::from(2)
    })?;
    match tokio::net::TcpListener::bind(s.http_address).await {
        Ok(listener) => {
            let app = http::router(http.clone(), access.clone());
            tokio::spawn(http::serve(
                listener,
                app,
                s.http_max_connections as usize,
                metrics.clone(),
            ));
        }
        Err(e) => {
            tracing::error!(address = %s.http_address, error = %e, "cannot serve HTTP (use --http-address)");
            return Err(ExitCode::FAILURE);
        }
    }
    let token_file = http::token_path(s);
    tracing::info!(
        output_dir = %s.output_dir.display(),
        http = %http::view_url(s.http_address, None),
        token = %if access.token().is_some() { token_file.display().to_string() } else { "none (--http-auth none)".into() },
        "writing profiles; the web view opens with ?token=<the token in that file>"
    );
    let limits = symbolize::Limits {
        binaries: s.symbol_cache as usize,
        budget_bytes: s.symbol_budget,
        frames: s.symbol_frames as usize,
    };
    let symbolizer = symbolize::Symbolizer::new(limits, metrics.clone());
    let mut labeler = Labeler::new(
        labeling.rules,
        labeling.external,
        System::detect(s.node.as_deref().unwrap_or_default()),
    );
    if s.kubernetes || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        start_kubernetes(s, &mut labeler, metrics).await;
    }
    let mut enricher = Enricher::new(symbolizer, labeler, metrics.clone());
    if let Some(dir) = s.unwind_cache() {
        match crate::unwind::cache::Cache::open(&dir, s.unwind_cache_size, s.min_free) {
            Ok(c) => {
                tracing::info!(path = %dir.display(), tables = c.len(), bytes = c.bytes(), "unwind table cache opened");
                metrics
                    .unwind_cache_bytes
                    .store(c.bytes(), Ordering::Relaxed);
                metrics
                    .unwind_cache_entries
                    .store(c.len() as u64, Ordering::Relaxed);
                enricher.table_cache = Some(c);
            }
            Err(e) => {
                tracing::warn!(error = %e, "no unwind table cache: tables are built from CFI at every start")
            }
        }
    }
    if s.unwind_min_samples > 1 {
        tracing::warn!(
            "--unwind-min-samples is no longer used: tables are sent from a process's first \
             sample, within a budget of work per second"
        );
    }
    let outputs = Outputs::start(s, metrics, http).map_err(|e| {
        tracing::error!("{e}");
        ExitCode::from(2)
    })?;
    Ok(Pipeline {
        enricher,
        outputs,
        heap: heap::Trimmer::default(),
    })
}

/// `--healthcheck`: 0 when /healthz of the local server answers 200.
fn healthcheck(address: std::net::SocketAddr) -> ExitCode {
    use std::io::{Read, Write};
    let target = if address.ip().is_unspecified() {
        std::net::SocketAddr::from(([127, 0, 0, 1], address.port()))
    } else {
        address
    };
    let ask = || -> std::io::Result<bool> {
        let t = std::time::Duration::from_secs(5);
        let mut s = std::net::TcpStream::connect_timeout(&target, t)?;
        s.set_read_timeout(Some(t))?;
        write!(
            s,
            "GET /healthz HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n"
        )?;
        let mut head = [0u8; 12];
        s.read_exact(&mut head)?;
        Ok(head.starts_with(b"HTTP/1.1 200"))
    };
    match ask() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("firn-enricher --healthcheck: {target}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn fatal(res: Result<client::ClientError, tokio::task::JoinError>) -> ExitCode {
    match res {
        Ok(e) => tracing::error!("{e}"),
        Err(e) => tracing::error!(error = %e, "the sampler client stopped"),
    }
    ExitCode::from(3)
}

/// SIGHUP: reads the config file again (relabeling and external labels change at once;
/// an invalid file changes nothing and says why) and every output's credentials.
fn reload(s: &Settings, pipeline: Option<&mut Pipeline>, metrics: &Metrics) {
    let Some(p) = pipeline else { return };
    p.outputs.reload();
    let Some(path) = &s.config else {
        tracing::info!("SIGHUP: no --config file to reload");
        return;
    };
    match settings::file::load(path) {
        Ok(parsed) => {
            p.enricher
                .labeler
                .reconfigure(parsed.labeling.rules, parsed.labeling.external);
            Metrics::inc(&metrics.config_reloads);
            tracing::info!(
                path = %path.display(),
                "config reloaded: relabeling and external labels apply from the next round; \
                 other settings need a restart"
            );
        }
        Err(e) => {
            Metrics::inc(&metrics.config_reload_errors);
            tracing::warn!(error = %e, "config reload refused; the previous config stays in force");
        }
    }
}

/// Built without Kubernetes support: say so, profile on.
#[cfg(not(feature = "kubernetes"))]
async fn start_kubernetes(_: &Settings, _: &mut Labeler, _: &Arc<Metrics>) {
    tracing::error!(
        "this firn-enricher was built without the kubernetes feature; Kubernetes metadata is off"
    );
}

/// Starts the pod watch of this node; profiling goes on without it if it cannot start.
#[cfg(feature = "kubernetes")]
async fn start_kubernetes(s: &Settings, labeler: &mut Labeler, metrics: &Arc<Metrics>) {
    use crate::labels::kubernetes;
    let node = match &s.node {
        Some(n) => n.clone(),
        None => nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default(),
    };
    match kubernetes::client(s.kubeconfig.as_deref()).await {
        Ok(client) => {
            let index = kubernetes::SharedIndex::default();
            labeler.set_pods(index.clone(), metrics.clone());
            tokio::spawn(kubernetes::watch(
                client,
                node.clone(),
                index,
                metrics.clone(),
            ));
            tracing::info!(node = %node, "watching this node's pods for Kubernetes labels");
        }
        Err(e) => tracing::error!(error = %e, "Kubernetes metadata is off"),
    }
}

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
use crate::{summary, symbolize};

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
    local.block_on(&rt, run(settings, labeling))
}

/// Each cached binary holds an fd: take the hard limit as the soft one.
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
}

async fn run(s: Settings, labeling: Labeling) -> ExitCode {
    let metrics = Arc::new(Metrics::default());
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
    let http = http::Shared::new(metrics.clone(), s.output_dir.clone());
    let mut pipeline = if s.dump {
        None
    } else {
        match start(&s, labeling, &metrics, &http).await {
            Ok(p) => Some(p),
            Err(code) => return code,
        }
    };
    let mut broker: Option<Rc<Broker>> = None;
    // The sampler counts drops per subscription, cumulatively; this is the last count.
    let mut session_dropped = 0u64;
    loop {
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
        };
        let Some(p) = pipeline.as_mut() else {
            summary::print(&ev);
            continue;
        };
        match ev {
            Event::Connected(info, b) => {
                p.enricher.labeler.set_node(&info.node);
                http.set_round_seconds(info.round_seconds);
                broker = b;
                session_dropped = 0;
            }
            Event::Disconnected => broker = None,
            Event::Batch(batch) => {
                let lost = batch.dropped_batches.saturating_sub(session_dropped);
                Metrics::add(&metrics.batches_dropped_upstream, lost);
                if lost > 0 {
                    tracing::warn!(
                        batches = lost,
                        "the sampler dropped batches for this enricher (it fell behind)"
                    );
                }
                session_dropped = batch.dropped_batches;
                if let Ok(mut c) = metrics.sampler.lock() {
                    *c = batch.counters.clone();
                }
                let end_ns = batch.end_time_ns;
                let round = p.enricher.handle(batch, broker.as_deref()).await;
                p.outputs.round(round, &p.enricher.symbolizer);
                let lag = firn_schema::now_ns().saturating_sub(end_ns);
                metrics
                    .round_lag_ms
                    .store(lag / 1_000_000, Ordering::Relaxed);
                // A round's transient memory (the batch, unwind tables being built, the
                // encoded profiles) is free now: give its pages back rather than let the
                // heap keep its high-water mark until the next burst.
                // SAFETY: malloc_trim has no preconditions.
                unsafe { libc::malloc_trim(0) };
            }
        }
    }
    tracing::info!("stopping");
    if let Some(p) = pipeline.as_mut() {
        p.outputs.shutdown(std::time::Duration::from_secs(5)).await;
    }
    ExitCode::SUCCESS
}

/// The HTTP server, the enricher and every output.
async fn start(
    s: &Settings,
    labeling: Labeling,
    metrics: &Arc<Metrics>,
    http: &Arc<http::Shared>,
) -> Result<Pipeline, ExitCode> {
    match tokio::net::TcpListener::bind(s.http_address).await {
        Ok(listener) => {
            let app = http::router(http.clone());
            tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!(error = %e, "HTTP server stopped");
                }
            });
        }
        Err(e) => {
            tracing::error!(address = %s.http_address, error = %e, "cannot serve HTTP (use --http-address)");
            return Err(ExitCode::FAILURE);
        }
    }
    tracing::info!(
        output_dir = %s.output_dir.display(),
        http = %format!("http://{}/", s.http_address),
        "writing profiles"
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
    enricher.unwind_min_samples = s.unwind_min_samples;
    let outputs = Outputs::start(s, metrics, http).map_err(|e| {
        tracing::error!("{e}");
        ExitCode::from(2)
    })?;
    Ok(Pipeline { enricher, outputs })
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

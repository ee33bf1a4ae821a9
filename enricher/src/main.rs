//! firn-enricher: subscribes to the sampler, symbolizes, encodes pprof, writes the
//! local sink and serves HTTP. Unprivileged by design.

use firn_enricher::labels::{Labeler, System};
use firn_enricher::{cli, client, config, http, summary, symbolize};

use std::process::ExitCode;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::mpsc;

use firn_enricher::broker::Broker;
use firn_enricher::client::Event;
use firn_enricher::enrich::{Enricher, Round};
use firn_enricher::metrics::Metrics;
use firn_enricher::sinks::local::{Item, LocalSink, Settings};
use firn_enricher::upload::Uploads;

fn main() -> ExitCode {
    let matches = <cli::Args as clap::CommandFactory>::command().get_matches();
    let mut args = match <cli::Args as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(a) => a,
        Err(e) => e.exit(),
    };
    let labeling = match args.config.clone() {
        Some(path) => match config::load(&path) {
            Ok((file, labeling)) => {
                config::apply(&mut args, &matches, &file);
                labeling
            }
            Err(e) => {
                eprintln!("firn-enricher: invalid config: {e}");
                return ExitCode::from(2);
            }
        },
        None => match config::labeling(&config::FileConfig::default()) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("firn-enricher: built-in relabel set: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    if let Err(e) = firn_logs::init(&args.log) {
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
    if nix::unistd::geteuid().is_root() && !args.allow_root {
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
    local.block_on(&rt, run(args, labeling))
}

/// Each cached binary holds an fd: take the hard limit as the soft one.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

async fn run(args: cli::Args, labeling: config::Labeling) -> ExitCode {
    let metrics = Arc::new(Metrics::default());
    let (tx, mut rx) = mpsc::channel(4);
    let mut client = tokio::task::spawn_local(client::run(
        args.socket.clone(),
        args.protocol_version,
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
    let http = http::Shared::new(metrics.clone());
    let _ = http.output_dir.set(args.output_dir.clone());
    let mut pipeline = if args.dump {
        None
    } else {
        match tokio::net::TcpListener::bind(args.http_address).await {
            Ok(listener) => {
                let app = http::router(http.clone());
                tokio::spawn(async move {
                    if let Err(e) = axum::serve(listener, app).await {
                        tracing::error!(error = %e, "HTTP server stopped");
                    }
                });
            }
            Err(e) => {
                tracing::error!(address = %args.http_address, error = %e, "cannot serve HTTP (use --http-address)");
                return ExitCode::FAILURE;
            }
        }
        let sink = LocalSink::new(
            Settings {
                dir: args.output_dir.clone(),
                max_bytes: args.retention_size,
                max_age: args.retention_age,
                min_free_bytes: args.min_free,
            },
            metrics.clone(),
        );
        tracing::info!(
            output_dir = %args.output_dir.display(),
            http = %format!("http://{}/", args.http_address),
            "writing profiles"
        );
        let limits = symbolize::Limits {
            binaries: args.symbol_cache as usize,
            budget_bytes: args.symbol_budget,
            frames: args.symbol_frames as usize,
        };
        let symbolizer = symbolize::Symbolizer::new(limits, metrics.clone());
        let mut labeler = Labeler::new(
            labeling.rules,
            labeling.external,
            System::detect(args.node.as_deref().unwrap_or_default()),
        );
        if args.kubernetes || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            start_kubernetes(&args, &mut labeler, &metrics).await;
        }
        let mut enricher = Enricher::new(symbolizer, labeler, metrics.clone());
        enricher.unwind_min_samples = args.unwind_min_samples;
        let uploads = match Uploads::start(&args, metrics.clone()) {
            Ok(u) => u,
            Err(e) => {
                tracing::error!("{e}");
                return ExitCode::from(2);
            }
        };
        Some((enricher, sink, uploads))
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
                reload(&args, pipeline.as_mut().map(|p| &mut p.0), &metrics);
                if let Some(p) = &pipeline {
                    p.2.reload();
                }
                continue;
            }
        };
        let Some((enricher, sink, uploads)) = pipeline.as_mut() else {
            summary::print(&ev);
            continue;
        };
        match ev {
            Event::Connected(info, b) => {
                enricher.labeler.set_node(&info.node);
                if let Ok(mut g) = http.inner.lock() {
                    g.round_seconds = info.round_seconds;
                }
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
                if let Ok(mut s) = metrics.sampler.lock() {
                    *s = batch.counters.clone();
                }
                let round = enricher.handle(batch, broker.as_deref()).await;
                let out = Out {
                    sink,
                    http: &http,
                    uploads,
                    symbolizer: &enricher.symbolizer,
                };
                write(round, args.profile_by, out, &metrics);
                // A round's transient memory (the batch, unwind tables being built, the
                // encoded profiles) is free now: give its pages back rather than let the
                // heap keep its high-water mark until the next burst.
                // SAFETY: malloc_trim has no preconditions.
                unsafe { libc::malloc_trim(0) };
            }
        }
    }
    tracing::info!("stopping");
    if let Some(p) = &pipeline {
        p.2.shutdown(std::time::Duration::from_secs(5)).await;
    }
    ExitCode::SUCCESS
}

/// Where a round's profiles go.
struct Out<'a> {
    sink: &'a mut LocalSink,
    http: &'a http::Shared,
    uploads: &'a Uploads,
    symbolizer: &'a symbolize::Symbolizer,
}

/// One pprof per label set (per process for now), to disk, to the HTTP view and to the
/// upload sinks.
fn write(round: Round, by: firn_enricher::encode::ProfileBy, out: Out<'_>, metrics: &Metrics) {
    let Out {
        sink,
        http,
        uploads,
        symbolizer,
    } = out;
    let groups = firn_enricher::encode::groups(&round, by);
    let stems = firn_enricher::encode::file_stems(&groups);
    let encoded = firn_enricher::encode::per_label_set(&round, &groups);
    uploads.round(&round, &groups, &stems, &encoded, symbolizer);
    let mut items = Vec::with_capacity(encoded.len());
    let mut latest = Vec::with_capacity(encoded.len());
    for e in encoded {
        let stem = &stems[e.group];
        let name = format!("{stem}.pb.gz");
        let id = format!("r{}-{stem}", round.round);
        latest.push(http::Latest {
            id,
            labels: e.labels.clone(),
            samples: e.samples,
            round: round.round,
            gz: e.gz.clone(),
        });
        items.push(Item {
            labels: e.labels,
            samples: e.samples,
            gz: e.gz,
            name,
        });
    }
    sink.write_round(&round, &items);
    let lag = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        .saturating_sub(round.end_ns);
    metrics
        .round_lag_ms
        .store(lag / 1_000_000, Ordering::Relaxed);
    http.publish(Arc::new(round), latest);
}

fn fatal(res: Result<client::ClientError, tokio::task::JoinError>) -> ExitCode {
    match res {
        Ok(e) => tracing::error!("{e}"),
        Err(e) => tracing::error!(error = %e, "the sampler client stopped"),
    }
    ExitCode::from(3)
}

/// SIGHUP: reads the config file again. Relabeling and external labels change at once;
/// an invalid file changes nothing and says why.
fn reload(args: &cli::Args, enricher: Option<&mut Enricher>, metrics: &Metrics) {
    let Some(path) = &args.config else {
        tracing::info!("SIGHUP: no --config file to reload");
        return;
    };
    match config::load(path) {
        Ok((_, labeling)) => {
            if let Some(e) = enricher {
                e.labeler.reconfigure(labeling.rules, labeling.external);
            }
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
async fn start_kubernetes(_: &cli::Args, _: &mut Labeler, _: &Arc<Metrics>) {
    tracing::error!(
        "this firn-enricher was built without the kubernetes feature; Kubernetes metadata is off"
    );
}

/// Starts the pod watch of this node; profiling goes on without it if it cannot start.
#[cfg(feature = "kubernetes")]
async fn start_kubernetes(args: &cli::Args, labeler: &mut Labeler, metrics: &Arc<Metrics>) {
    use firn_enricher::labels::kubernetes;
    let node = match &args.node {
        Some(n) => n.clone(),
        None => nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default(),
    };
    match kubernetes::client(args.kubeconfig.as_deref()).await {
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

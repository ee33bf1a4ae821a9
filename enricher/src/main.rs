//! firn-enricher: subscribes to the sampler, symbolizes, encodes pprof, writes the
//! local sink and serves HTTP. Unprivileged by design.

use firn_enricher::{cli, client, http, summary, symbolize};

use std::process::ExitCode;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use clap::Parser;
use tokio::sync::mpsc;

use firn_enricher::broker::Broker;
use firn_enricher::client::Event;
use firn_enricher::enrich::{Enricher, Round};
use firn_enricher::metrics::Metrics;
use firn_enricher::sinks::local::{Item, LocalSink, Settings};

fn main() -> ExitCode {
    let args = cli::Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
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
    local.block_on(&rt, run(args))
}

/// Each cached binary holds an fd: take the hard limit as the soft one.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

async fn run(args: cli::Args) -> ExitCode {
    let metrics = Arc::new(Metrics::default());
    let (tx, mut rx) = mpsc::channel(4);
    let mut client = tokio::task::spawn_local(client::run(
        args.socket.clone(),
        args.protocol_version,
        tx,
        metrics.clone(),
    ));
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "SIGTERM handler");
            return ExitCode::FAILURE;
        }
    };
    let http = http::Shared::new(metrics.clone());
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
        let symbolizer = symbolize::Symbolizer::new(args.symbol_cache as usize, metrics.clone());
        Some((
            Enricher::new(
                symbolizer,
                metrics.clone(),
                args.node.clone().unwrap_or_default(),
            ),
            sink,
        ))
    };
    let mut printer = summary::Printer::new(true, 5);
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
        };
        let Some((enricher, sink)) = pipeline.as_mut() else {
            printer.event(&ev);
            continue;
        };
        match ev {
            Event::Connected(info, b) => {
                enricher.set_node(&info.node);
                if let Ok(mut g) = http.inner.lock() {
                    g.round_seconds = info.round_seconds;
                }
                broker = b;
                session_dropped = 0;
            }
            Event::Disconnected => broker = None,
            Event::Batch(batch) => {
                Metrics::add(
                    &metrics.batches_dropped_upstream,
                    batch.dropped_batches.saturating_sub(session_dropped),
                );
                session_dropped = batch.dropped_batches;
                if let Ok(mut s) = metrics.sampler.lock() {
                    *s = batch.counters.clone();
                }
                let round = enricher.handle(batch, broker.as_deref()).await;
                write(round, sink, &http, &metrics);
            }
        }
    }
    tracing::info!("stopping");
    ExitCode::SUCCESS
}

/// One pprof per label set (per process for now), to disk and to the HTTP view.
fn write(round: Round, sink: &mut LocalSink, http: &http::Shared, metrics: &Metrics) {
    let encoded = firn_enricher::encode::per_label_set(&round);
    let mut items = Vec::with_capacity(encoded.len());
    let mut latest = Vec::with_capacity(encoded.len());
    for e in encoded {
        let pid = e
            .labels
            .iter()
            .find(|(k, _)| k == "pid")
            .map_or("0", |(_, v)| v.as_str());
        let name = format!("pid-{pid}.pb.gz");
        let id = format!("r{}-pid-{pid}", round.round);
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
    sink.write_round(round.round, round.start_ns, &items);
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

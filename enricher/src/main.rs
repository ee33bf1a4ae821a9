//! firn-enricher: the unprivileged half. For now it subscribes to the sampler and
//! prints what it receives: a per-round summary, or every batch as JSON (`--dump`).

mod batch;
mod client;
mod summary;

use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;

use clap::Parser;
use tokio::sync::mpsc;

/// firn's unprivileged half: connects to firn-sampler's Unix socket, subscribes, and
/// turns the stream of raw stacks and process records into readable output.
#[derive(Debug, Parser)]
#[command(name = "firn-enricher", version, about, long_about)]
struct Args {
    /// The sampler's socket.
    #[arg(long, env = "FIRN_SOCKET", default_value = "/run/firn/sampler.sock")]
    socket: PathBuf,

    /// Print every batch as one JSON line on stdout instead of a per-round summary.
    #[arg(long)]
    dump: bool,

    /// Kernel symbols listed in the per-round summary.
    #[arg(long, default_value_t = 5)]
    top: usize,

    /// Allow running as uid 0. The enricher parses untrusted input (binaries, metadata,
    /// server replies) and needs no privilege, so root is refused by default.
    #[arg(long)]
    allow_root: bool,

    /// Protocol version to announce (tests of the mismatch path only).
    #[arg(long, hide = true, default_value_t = firn_schema::PROTOCOL_VERSION)]
    protocol_version: u32,

    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "FIRN_LOG", default_value = "info")]
    log: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
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

async fn run(args: Args) -> ExitCode {
    let (tx, mut rx) = mpsc::channel(4);
    let counters = Rc::new(client::ClientCounters::default());
    let mut client = tokio::task::spawn_local(client::run(
        args.socket.clone(),
        args.protocol_version,
        tx,
        counters,
    ));
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "SIGTERM handler");
            return ExitCode::FAILURE;
        }
    };
    let mut out = summary::Printer::new(args.dump, args.top);
    loop {
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => out.event(&ev),
                // The client only ends on a fatal error; report it below.
                None => return fatal(client.await),
            },
            res = &mut client => return fatal(res),
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    ExitCode::SUCCESS
}

fn fatal(res: Result<client::ClientError, tokio::task::JoinError>) -> ExitCode {
    match res {
        Ok(e) => tracing::error!("{e}"),
        Err(e) => tracing::error!(error = %e, "the sampler client stopped"),
    }
    ExitCode::from(3)
}

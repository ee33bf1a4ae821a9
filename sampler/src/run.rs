//! The steady state's event loop: accept clients, and time the rounds (flip, grace
//! period, drain, publish) until a signal or a CPU that can no longer be sampled.

use std::os::fd::RawFd;
use std::rc::Rc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;

use tokio::signal::unix::Signal;

use crate::attach::Sampling;
use crate::counters::bump;
use crate::drain;
use crate::kallsyms::Kallsyms;
use crate::listen::{self, Allow, Peer};
use crate::rounds::{CpuHotplug, Rounds};
use crate::rpc::{self, Shared};

/// Accepts clients for ever: each allowed peer gets a connection task, up to the limit.
pub(crate) async fn accept_loop(
    listener: tokio::net::UnixListener,
    shared: Rc<Shared>,
    allow: Allow,
) {
    let c = shared.counters.clone();
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        match listen::check_peer(&stream, &allow) {
            Peer::Allowed { uid, pid } => {
                if shared.connections.get() >= shared.max_connections {
                    bump(&c.connections_refused_limit);
                    tracing::warn!(
                        uid,
                        pid,
                        limit = shared.max_connections,
                        "too many connections; refused"
                    );
                    continue;
                }
                bump(&c.connections_accepted);
                shared.connections.set(shared.connections.get() + 1);
                tracing::info!(uid, pid, "client connected");
                tokio::task::spawn_local(rpc::handle(stream, shared.clone()));
            }
            Peer::Refused { uid, gid, pid } => {
                bump(&c.connections_refused_peer);
                tracing::warn!(
                    uid,
                    gid,
                    pid,
                    "peer not allowed (see --allow-uid/--allow-gid); disconnected"
                );
            }
            Peer::Unknown(e) => {
                bump(&c.connections_peer_unknown);
                tracing::warn!(error = %e, "cannot read peer credentials; disconnected");
            }
        }
    }
}

/// Reads the process events waiting in the ring buffer and acts on them: the records
/// read are announced to subscribers at once.
fn take_events(sampling: &mut Sampling, rounds: &mut Rounds, shared: &Shared) {
    let c = &shared.counters;
    let (events, malformed) = sampling.events.take();
    if malformed > 0 {
        crate::counters::add(&c.events_malformed, malformed);
        tracing::warn!(
            malformed,
            "process events of an unexpected size or kind ignored"
        );
    }
    rounds.on_events(&events, c);
    let fresh = rounds.sync_mappings(sampling, c);
    shared.hub.announce(&fresh);
}

/// Runs rounds every `period` until SIGTERM or SIGINT (`Ok`) or a CPU hotplug that a
/// confined sampler cannot follow (`Err`).
pub(crate) async fn run_rounds(
    period: Duration,
    shared: Rc<Shared>,
    sampling: &mut Sampling,
    kallsyms: &Kallsyms,
    mut rounds: Rounds,
    events_ready: AsyncFd<RawFd>,
    (mut sigterm, mut sigint): (Signal, Signal),
) -> Result<(), CpuHotplug> {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = sigterm.recv() => { tracing::info!("SIGTERM: stopping"); break; }
            _ = sigint.recv() => { tracing::info!("SIGINT: stopping"); break; }
            ready = events_ready.readable() => {
                if let Ok(mut guard) = ready {
                    guard.clear_ready();
                }
                take_events(sampling, &mut rounds, &shared);
                continue;
            }
        }
        // Events written before the flip belong to processes whose first samples are in
        // the retired set: read them before it is assembled.
        take_events(sampling, &mut rounds, &shared);
        let retired = rounds.flip(sampling, firn_schema::now_ns());
        tokio::time::sleep(drain::GRACE).await;
        let online = crate::cpus::online_cpus().ok();
        let done = rounds.finish(
            sampling,
            retired,
            online.as_deref(),
            kallsyms,
            &shared.counters,
        )?;
        if let Some(round) = done {
            shared.hub.publish(Rc::new(round.data), &round.forgotten);
        }
    }
    Ok(())
}

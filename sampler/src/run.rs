//! The steady state's event loop: accept clients, and time the rounds (flip, grace
//! period, drain, publish) until a signal or a CPU that can no longer be sampled.

use std::os::fd::{OwnedFd, RawFd};
use std::rc::Rc;
use std::time::Duration;

use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
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

/// The round clock: a periodic timerfd, set once at setup. A tokio timer a round away
/// sits in a high level of tokio's timer wheel, and the event loop wakes at each level's
/// slot boundary on the way down (at 10 s rounds: twice more a round, up to 4 s and
/// 64 ms before the tick); the kernel's timer wakes it once. A round that runs past the
/// next tick is followed by one at once (shorter than a period), then the ticks keep
/// their phase.
pub(crate) struct RoundTimer {
    fd: AsyncFd<OwnedFd>,
}

impl RoundTimer {
    /// A timer that fires every `period`, first `period` from now. Made before
    /// confinement (`timerfd_create` and `timerfd_settime` are setup-only); registered
    /// with the event loop, so called within the runtime.
    pub(crate) fn start(period: Duration) -> std::io::Result<Self> {
        let timer = TimerFd::new(
            ClockId::CLOCK_MONOTONIC,
            TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
        )?;
        let every = TimeSpec::from_duration(period);
        timer.set(
            Expiration::IntervalDelayed(every, every),
            TimerSetTimeFlags::empty(),
        )?;
        let fd = OwnedFd::from(timer);
        // SAFETY: the fd moves into the AsyncFd, which owns it (open, the same timer)
        // for its whole life.
        let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(Self { fd })
    }

    /// Waits for the next tick; returns the ticks since the last read (more than one:
    /// a round ran past its successor's tick).
    async fn tick(&self) -> std::io::Result<u64> {
        loop {
            let mut guard = self.fd.readable().await?;
            let mut buf = [0u8; 8];
            match guard.try_io(|fd| Ok(nix::unistd::read(fd.get_ref(), &mut buf)?)) {
                Ok(Ok(8)) => {
                    // The read took every tick so far: waiting again needs no read
                    // that finds none (a tick after it is reported by the next poll).
                    guard.clear_ready();
                    return Ok(u64::from_ne_bytes(buf));
                }
                Ok(Ok(n)) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("a timerfd read of {n} bytes"),
                    ))
                }
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }
}

/// Runs rounds on `timer`'s ticks until SIGTERM or SIGINT (`Ok`) or a CPU hotplug that a
/// confined sampler cannot follow (`Err`).
pub(crate) async fn run_rounds(
    timer: RoundTimer,
    shared: Rc<Shared>,
    sampling: &mut Sampling,
    kallsyms: &Kallsyms,
    mut rounds: Rounds,
    events_ready: AsyncFd<RawFd>,
    (mut sigterm, mut sigint): (Signal, Signal),
) -> Result<(), CpuHotplug> {
    let c = shared.counters.clone();
    loop {
        tokio::select! {
            ticked = timer.tick() => match ticked {
                Ok(ticks) => crate::counters::add(&c.round_ticks_missed, ticks.saturating_sub(1)),
                Err(error) => {
                    // Not seen in practice; the round still runs, a second later, so that
                    // a timer that keeps failing cannot spin the loop (it makes rounds a
                    // second apart instead, whatever --round says).
                    bump(&c.round_timer_errors);
                    tracing::warn!(%error, "reading the round timer failed");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            },
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
        let online = sampling.online_now();
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

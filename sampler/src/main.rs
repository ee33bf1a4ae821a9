//! firn-sampler: setup while privileged, then drop, confine, and run rounds.

#[cfg(feature = "forbidden-probe")]
use firn_sampler::probe;
use firn_sampler::{attach, cli, drain, drop, hub, listen, preflight, round, server};
use std::cell::Cell;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};

use firn_sampler::attach::Sampling;
use firn_sampler::counters::Counters;
use firn_sampler::kallsyms::Kallsyms;
use firn_sampler::listen::{Allow, Peer};
use firn_sampler::processes::ProcessTable;
use firn_sampler::server::{Identity, Shared};

fn main() -> ExitCode {
    let args = cli::Args::parse();
    if args.print_seccomp {
        print!("{}", drop::table());
        return ExitCode::SUCCESS;
    }
    if let Err(e) = firn_logs::init(&args.log) {
        eprintln!("firn-sampler: {e}");
        return ExitCode::from(2);
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A random session id below 2^47, so that no integer on the wire looks like a kernel
/// address.
fn session_id() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    (u64::from_ne_bytes(b) >> 17).max(1)
}

fn run(args: cli::Args) -> anyhow::Result<()> {
    preflight::check()?;

    let listening = match listen::from_systemd()? {
        Some(listener) => {
            tracing::info!("using the socket passed by systemd");
            listen::Listening { listener }
        }
        None => listen::create(&args.socket, args.socket_group.as_deref())?,
    };
    listening.listener.set_nonblocking(true)?;
    let allow = listen::resolve_allow(&args.allow_uid, &args.allow_gid)?;
    let run_as = args.user.as_deref().map(drop::resolve_user).transpose()?;

    // Opened while CAP_SYSLOG is held: the kernel decides visibility at open time.
    let kallsyms = match std::fs::File::open("/proc/kallsyms").map(Kallsyms::read) {
        Ok(Ok(k)) => k,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "kernel frames will be [unknown]");
            Kallsyms::empty()
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot open /proc/kallsyms; kernel frames will be [unknown]");
            Kallsyms::empty()
        }
    };
    if kallsyms.is_empty() {
        tracing::warn!(
            "/proc/kallsyms shows no addresses (kptr_restrict?); kernel frames will be [unknown]"
        );
    }

    let mut sampling = attach::load_and_attach(args.frequency)?;
    {
        use libbpf_rs::MapCore;
        drain::check_key_size(sampling.skel.maps.counts_0.key_size())?;
    }
    tracing::info!(
        links = sampling.links(),
        cpus = ?sampling.cpus(),
        frequency_hz = args.frequency,
        round_seconds = args.round,
        kernel_symbols = kallsyms.len(),
        "sampling started"
    );

    let uname = nix::sys::utsname::uname().context("uname")?;
    let identity = Identity {
        session_id: session_id(),
        node: uname.nodename().to_string_lossy().into_owned(),
        kernel_release: uname.release().to_string_lossy().into_owned(),
        frequency_hz: args.frequency,
        round_seconds: args.round,
        kept_capabilities: drop::KEPT.iter().map(ToString::to_string).collect(),
    };

    // Everything that needs a syscall the filter forbids happens before confinement:
    // the runtime's epoll instance, the signal pipe, the listener registration.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the event loop")?;
    let (listener, sigterm, sigint) = {
        let _guard = rt.enter();
        (
            tokio::net::UnixListener::from_std(listening.listener)
                .context("registering the listening socket")?,
            signal(SignalKind::terminate()).context("SIGTERM handler")?,
            signal(SignalKind::interrupt()).context("SIGINT handler")?,
        )
    };

    // Setup freed several MiB (kallsyms text, libbpf's parse of the kernel BTF); hand
    // them back so the steady state starts small.
    // SAFETY: malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
    drop::drop_capabilities(run_as).context("dropping capabilities")?;
    let filter = drop::build_filter()?;
    drop::confine(&filter).context("installing the seccomp filter")?;
    tracing::info!(
        kept_capabilities = ?identity.kept_capabilities,
        "privileges dropped; seccomp filter installed"
    );
    #[cfg(feature = "forbidden-probe")]
    probe::run();

    let counters = Rc::new(Counters::default());
    let shared = Rc::new(Shared {
        hub: hub::Hub::new(args.queue_batches as usize, counters.clone()),
        counters,
        identity,
        connections: Cell::new(0),
        max_connections: args.max_connections,
        write_stall_limit: Duration::from_secs(args.write_stall_seconds),
    });
    let local = tokio::task::LocalSet::new();
    let ended = local.block_on(
        &rt,
        run_loop(
            &args,
            listener,
            shared,
            allow,
            &mut sampling,
            &kallsyms,
            (sigterm, sigint),
        ),
    );
    drop(sampling);
    ended?;
    tracing::info!("stopped; BPF program detached");
    Ok(())
}

async fn accept_loop(listener: tokio::net::UnixListener, shared: Rc<Shared>, allow: Allow) {
    let c = shared.counters.clone();
    let bump = |x: &Cell<u64>| x.set(x.get() + 1);
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
                tokio::task::spawn_local(server::handle(stream, shared.clone()));
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

fn set_active(sampling: &mut Sampling, set: u32) {
    if let Some(bss) = sampling.skel.maps.bss_data.as_deref_mut() {
        // SAFETY: the .bss map is mmapped for the skeleton's lifetime; the program
        // reads the field with a plain load, so a volatile store is all it takes.
        unsafe { std::ptr::write_volatile(&mut bss.active_set, set) };
    }
}

/// The run loop ended because a CPU can no longer be sampled.
#[derive(Debug, thiserror::Error)]
#[error(
    "CPU {0} is online but not sampled (it went offline and came back, or came online \
     after setup); a confined sampler cannot attach to it, so it exits for its \
     supervisor to restart it (systemd: Restart=on-failure)"
)]
pub struct CpuHotplug(u32);

fn read_bpf_counters(sampling: &Sampling, c: &Counters) {
    use firn_sampler_bpf::counter as k;
    let m = &sampling.skel.maps.counters;
    for (slot, cell, name) in [
        (k::SAMPLES, &c.bpf_samples, ""),
        (k::IDLE, &c.bpf_idle_samples, ""),
        (
            k::USER_STACK_FULL,
            &c.bpf_user_stack_lost,
            "bpf_user_stack_lost",
        ),
        (
            k::KERN_STACK_FULL,
            &c.bpf_kernel_stack_lost,
            "bpf_kernel_stack_lost",
        ),
        (
            k::USER_STACK_ERR,
            &c.bpf_user_stack_errors,
            "bpf_user_stack_errors",
        ),
        (
            k::KERN_STACK_ERR,
            &c.bpf_kernel_stack_errors,
            "bpf_kernel_stack_errors",
        ),
        (
            k::COUNTS_FULL,
            &c.bpf_counts_map_full,
            "bpf_counts_map_full",
        ),
    ] {
        if let Some(v) = drain::percpu_sum(m, slot) {
            let before = cell.replace(v);
            if !name.is_empty() && v > before {
                tracing::warn!(
                    counter = name,
                    lost = v - before,
                    "samples or stacks lost in the BPF program this round"
                );
            }
        }
    }
}

async fn run_loop(
    args: &cli::Args,
    listener: tokio::net::UnixListener,
    shared: Rc<Shared>,
    allow: Allow,
    sampling: &mut Sampling,
    kallsyms: &Kallsyms,
    (mut sigterm, mut sigint): (tokio::signal::unix::Signal, tokio::signal::unix::Signal),
) -> Result<(), CpuHotplug> {
    tokio::task::spawn_local(accept_loop(listener, shared.clone(), allow));
    let period = Duration::from_secs(u64::from(args.round));
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut table = ProcessTable::default();
    let mut active = 0u32;
    let mut round_no = 0u64;
    let mut round_start = now_ns();
    let c = &shared.counters;
    let mut gone: Vec<u32> = Vec::new();
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = sigterm.recv() => { tracing::info!("SIGTERM: stopping"); break; }
            _ = sigint.recv() => { tracing::info!("SIGINT: stopping"); break; }
        }
        let drained_set = active;
        active ^= 1;
        set_active(sampling, active);
        let round_end = now_ns();
        tokio::time::sleep(drain::GRACE).await;
        round_no += 1;
        let maps = &sampling.skel.maps;
        let (counts, stacks) = if drained_set == 0 {
            (drain::fd_of(&maps.counts_0), drain::fd_of(&maps.stacks_0))
        } else {
            (drain::fd_of(&maps.counts_1), drain::fd_of(&maps.stacks_1))
        };
        let drained = match drain::drain(counts, stacks) {
            Ok(d) => d,
            Err(e) => {
                c.drain_errors.set(c.drain_errors.get() + 1);
                tracing::warn!(round = round_no, error = %e, "draining the maps failed");
                round_start = round_end;
                continue;
            }
        };
        c.stack_lookup_failures
            .set(c.stack_lookup_failures.get() + drained.stack_lookup_failures);
        if drained.stack_lookup_failures > 0 {
            tracing::warn!(
                round = round_no,
                stacks = drained.stack_lookup_failures,
                "stacks missing from the stack map; their samples are sent without them"
            );
        }
        read_bpf_counters(sampling, c);
        if let Ok(online) = attach::online_cpus() {
            for &cpu in sampling.cpus() {
                if !online.contains(&cpu) && !gone.contains(&cpu) {
                    tracing::warn!(cpu, "CPU went offline; sampling goes on on the others");
                    gone.push(cpu);
                }
            }
            if let Some(cpu) = attach::unsampled_cpu(sampling.cpus(), &online, &gone) {
                c.cpus_unsampled.set(c.cpus_unsampled.get() + 1);
                // Logged once, by main, as the reason for exiting.
                return Err(CpuHotplug(cpu));
            }
        }
        table.begin_round();
        let data = round::assemble(
            drained,
            kallsyms,
            &mut table,
            round_no,
            (round_start, round_end),
            c,
        );
        let forgotten = table.sweep(round_no, c);
        c.rounds.set(c.rounds.get() + 1);
        tracing::debug!(
            round = round_no,
            samples = data.samples.len(),
            processes = data.processes.len(),
            known_processes = table.len(),
            subscribers = shared.hub.len(),
            "round done"
        );
        shared.hub.publish(Rc::new(data), &forgotten);
        round_start = round_end;
    }
    Ok(())
}

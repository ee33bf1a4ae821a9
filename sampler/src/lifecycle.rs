//! firn-sampler's lifecycle: setup while privileged, then drop, confine, and run rounds.

#[cfg(feature = "forbidden-probe")]
use crate::probe;
use crate::{attach, cli, drain, drop, handles, hub, listen, preflight, run, trim};
use std::cell::Cell;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};

use crate::counters::Counters;
use crate::kallsyms::Kallsyms;
use crate::processes::ProcessTable;
use crate::rounds::Rounds;
use crate::rpc::{Identity, Shared};

/// `firn-sampler`'s main.
pub fn main() -> ExitCode {
    let args = cli::Args::parse();
    if args.print_seccomp {
        print!("{}", drop::table());
        return ExitCode::SUCCESS;
    }
    if args.print_seccomp_profile {
        print!("{}", drop::container_profile());
        return ExitCode::SUCCESS;
    }
    if let Some(path) = &args.install_seccomp_profile {
        return match install_profile(path) {
            Ok(()) => {
                println!(
                    "firn-sampler: seccomp profile written to {}",
                    path.display()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!(
                    "firn-sampler: writing the seccomp profile to {}: {e}",
                    path.display()
                );
                ExitCode::FAILURE
            }
        };
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

/// Writes the container profile beside `path` and renames it into place, so that a
/// runtime never reads half a file. Run as root into a node directory: the temporary
/// file is created new, never through a link left at its name.
fn install_profile(path: &std::path::Path) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("json.tmp");
    // A leftover (or a link planted there) goes; removing a link leaves its target.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    f.write_all(drop::container_profile().as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
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
    trim::fix_heap_threshold();
    preflight::check(args.user.is_some())?;

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

    let kallsyms = read_kallsyms();

    let counters = Rc::new(Counters::default());
    let off_cpu = args.off_cpu.then_some(attach::OffCpu {
        min_ns: args.off_cpu_min_us * 1000,
        every: args.off_cpu_every,
        rate: args.off_cpu_rate,
    });
    let mut sampling = attach::load_and_attach(
        (args.frequency, args.round, args.events_buffer_kib),
        args.sample_log_slots,
        crate::unwind::Limits {
            pool_rows: args.unwind_rows,
            table_rows: args.unwind_table_rows,
        },
        off_cpu,
        counters.clone(),
    )?;
    let handles = binary_handles(args.binary_handles as usize);
    {
        use libbpf_rs::MapCore;
        drain::check_layout(
            sampling.skel.maps.counts_0.key_size(),
            sampling.skel.maps.kstacks_0.value_size(),
        )?;
    }
    tracing::info!(
        links = sampling.links(),
        cpus = ?sampling.cpus(),
        frequency_hz = args.frequency,
        round_seconds = args.round,
        kernel_symbols = kallsyms.len(),
        kernel_symbol_bytes = kallsyms.bytes(),
        off_cpu = args.off_cpu,
        "sampling started"
    );

    let identity = identity(&args)?;

    // Everything that needs a syscall the filter forbids happens before confinement:
    // the runtime's epoll instance, the signal pipe, the listener registration.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the event loop")?;
    let (listener, sigterm, sigint, events_ready, timer) = {
        let _guard = rt.enter();
        (
            tokio::net::UnixListener::from_std(listening.listener)
                .context("registering the listening socket")?,
            signal(SignalKind::terminate()).context("SIGTERM handler")?,
            signal(SignalKind::interrupt()).context("SIGINT handler")?,
            // SAFETY: the epoll fd belongs to the ring buffer in `sampling`, which is
            // dropped only after the event loop (and this AsyncFd) has ended.
            unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(
                    sampling.events.fd(),
                    tokio::io::Interest::READABLE,
                )
            }
            .map_err(|e| anyhow::anyhow!("registering the process event ring buffer: {e}"))?,
            run::RoundTimer::start(Duration::from_secs(u64::from(args.round)))
                .context("the round timer")?,
        )
    };

    drop_privileges(run_as, &identity)?;
    #[cfg(feature = "forbidden-probe")]
    probe::run();

    let shared = Rc::new(Shared {
        hub: hub::Hub::new(args.queue_batches as usize, counters.clone()),
        counters,
        identity,
        connections: Cell::new(0),
        max_connections: args.max_connections,
        write_stall_limit: Duration::from_secs(args.write_stall_seconds),
        handles: handles.clone(),
        unwind: sampling.unwind.clone(),
    });
    let rounds = Rounds::new(
        ProcessTable::default()
            .with_handles(handles)
            .with_round_seconds(args.round),
        firn_schema::now_ns(),
    );
    let local = tokio::task::LocalSet::new();
    let ended = local.block_on(&rt, async {
        tokio::task::spawn_local(run::accept_loop(listener, shared.clone(), allow));
        run::run_rounds(
            timer,
            shared,
            &mut sampling,
            &kallsyms,
            rounds,
            events_ready,
            (sigterm, sigint),
        )
        .await
    });
    drop(sampling);
    ended?;
    tracing::info!("stopped; BPF program detached");
    Ok(())
}

/// The kernel's symbols, opened while CAP_SYSLOG is held (the kernel decides visibility
/// at open time); empty, with a warning, when they cannot be had.
fn read_kallsyms() -> Kallsyms {
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
    kallsyms
}

/// The binary handles, their number raised to fit RLIMIT_NOFILE while setrlimit is
/// still allowed (each handle is one fd).
fn binary_handles(wanted: usize) -> Rc<std::cell::RefCell<handles::Handles>> {
    let max_handles = handles::fit_to_fd_limit(wanted);
    if max_handles < wanted {
        tracing::warn!(
            wanted,
            kept = max_handles,
            "RLIMIT_NOFILE leaves room for fewer binary handles; binaries of exited \
             processes may not be brokered"
        );
    }
    Rc::new(std::cell::RefCell::new(handles::Handles::new(max_handles)))
}

fn identity(args: &cli::Args) -> anyhow::Result<Identity> {
    let uname = nix::sys::utsname::uname().context("uname")?;
    Ok(Identity {
        session_id: session_id(),
        node: uname.nodename().to_string_lossy().into_owned(),
        kernel_release: uname.release().to_string_lossy().into_owned(),
        frequency_hz: args.frequency,
        round_seconds: args.round,
        kept_capabilities: drop::KEPT.iter().map(ToString::to_string).collect(),
        off_cpu: if args.off_cpu {
            (
                args.off_cpu_every,
                args.off_cpu_min_us * 1000,
                args.off_cpu_rate,
            )
        } else {
            (0, 0, 0)
        },
    })
}

/// Capabilities dropped (to `run_as` if given), setup's pages out of the RSS, then the
/// seccomp filter: after this, only the filter's syscalls remain.
fn drop_privileges(run_as: Option<(u32, u32)>, identity: &Identity) -> anyhow::Result<()> {
    // Setup freed several MiB (kallsyms text, libbpf's parse of the kernel BTF); hand
    // them back so the steady state starts small.
    // SAFETY: malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
    drop::drop_capabilities(run_as).context("dropping capabilities")?;
    let filter = drop::build_filter()?;
    // Setup's code and read-only data leave the RSS (madvise is not in the filter).
    match trim::drop_setup_pages() {
        Ok(kib) => tracing::info!(dropped_kib = kib, "setup pages dropped from RSS"),
        Err(e) => tracing::warn!(error = %e, "setup pages kept"),
    }
    drop::confine(&filter).context("installing the seccomp filter")?;
    tracing::info!(
        kept_capabilities = ?identity.kept_capabilities,
        "privileges dropped; seccomp filter installed"
    );
    Ok(())
}

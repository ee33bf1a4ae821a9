//! Command-line flags of `firn-sampler`.

use std::path::PathBuf;

use clap::Parser;

/// The switches a second per CPU whose stacks --off-cpu takes at most, by default: each
/// costs a few µs of stack walk in the switching thread (BENCHMARKS.md, "Off-CPU").
pub(crate) const DEFAULT_OFF_CPU_RATE: u32 = 250;

/// firn's privileged half. Loads the eBPF sampler on every CPU, then drops its
/// capabilities, confines itself with seccomp and streams raw stacks and process
/// records to subscribed enrichers over a Unix socket (Cap'n Proto RPC).
///
/// Run it as root (or with CAP_BPF, CAP_PERFMON, CAP_SYSLOG, CAP_SYS_PTRACE, CAP_SETPCAP).
/// Under systemd socket activation (LISTEN_FDS/LISTEN_PID) it serves the passed socket
/// and `--socket` is ignored.
#[derive(Debug, Parser)]
#[command(name = "firn-sampler", version, about, long_about)]
pub(crate) struct Args {
    /// Sampling frequency per CPU, in Hz (1–10000).
    #[arg(long, default_value_t = 19, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub(crate) frequency: u32,

    /// Length of one round in seconds (1–600): one batch per round to every subscriber.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=600))]
    pub(crate) round: u32,

    /// Path of the Unix socket to create (mode 0660). Its directory must exist and the
    /// path must be free (a stale socket with no listener is replaced).
    #[arg(long, default_value = "/run/firn/sampler.sock")]
    pub(crate) socket: PathBuf,

    /// Group that owns the created socket (name or numeric gid); default: root's group.
    #[arg(long)]
    pub(crate) socket_group: Option<String>,

    /// Users allowed to connect, by name or uid (repeatable or comma-separated).
    /// uid 0 is always allowed.
    #[arg(long, value_delimiter = ',')]
    pub(crate) allow_uid: Vec<String>,

    /// Groups allowed to connect, by name or gid: a peer whose primary or supplementary
    /// groups (as of its connect) include one is allowed.
    #[arg(long, value_delimiter = ',')]
    pub(crate) allow_gid: Vec<String>,

    /// Batches kept per subscriber before the oldest is dropped (1–64).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) queue_batches: u32,

    /// Simultaneous client connections (1–256); more are refused and counted.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub(crate) max_connections: u32,

    /// Seconds a client may leave its answers unread (once the socket buffer is full)
    /// before its connection is closed and counted.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(crate) write_stall_seconds: u64,

    /// Size of the ring buffer of process events, in KiB (a power of two, 4–65536). The
    /// BPF program announces each process's first sample (and the exec and exit of
    /// announced ones) there, 104 bytes each, so that the sampler reads /proc while the
    /// process still runs. When it is full, events are lost (counted as
    /// bpf_events_lost) and the process is announced by its next sample instead.
    /// Default: sized by the node, 64–256 KiB: half a second of the most events the
    /// sampling rate (--frequency, --off-cpu-rate) can make on the online CPUs.
    #[arg(long, value_parser = events_kib)]
    pub(crate) events_buffer_kib: Option<u32>,

    /// Slots of the sample log a CPU has per round (0–65536; 64 bytes each, rounded up to
    /// whole pages, twice: one run per map set). The BPF program puts each sample in the
    /// next slot, which costs far less than counting it in a hash map; the sampler adds
    /// them up at the round's end. A round with more samples on a CPU counts the rest in
    /// the counts map (bpf_sample_log_full): slower, nothing lost. The whole log stays
    /// within 8 MiB (fewer slots on a node with many CPUs). 0: no log. Default: a round's
    /// samples at --frequency, and a quarter more.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=65_536))]
    pub(crate) sample_log_slots: Option<u32>,

    /// Handles of recently mapped files kept so that binaries of exited processes can
    /// still be brokered (0–65536; each is one file descriptor; fewer if RLIMIT_NOFILE's
    /// hard limit is lower). 0: only binaries of live processes are brokered.
    #[arg(long, default_value_t = crate::handles::MAX_HANDLES as u32, value_parser = clap::value_parser!(u32).range(0..=65_536))]
    pub(crate) binary_handles: u32,

    /// Rows of the unwind table pool shared by all binaries (0–67108864; 8 bytes each,
    /// kernel memory allocated at start: 2 Mi rows are 16 MiB). The enricher builds a
    /// table per binary from its CFI so that code without frame pointers unwinds whole;
    /// each table takes its rows and a page directory of at most an eighth as many
    /// entries. Tables of binaries no known process maps are evicted to make room. When the pool
    /// is full of tables in use, further tables are refused (unwind_tables_refused_budget;
    /// the log line names this flag) and those binaries are unwound by frame pointers.
    /// 0: no tables, frame pointers only.
    #[arg(long, default_value_t = crate::unwind::DEFAULT_POOL_ROWS, value_parser = clap::value_parser!(u32).range(0..=(64 << 20)))]
    pub(crate) unwind_rows: u32,

    /// Rows one binary's table may have (1–16777215); a larger table is refused and
    /// counted, and that binary is unwound by frame pointers.
    #[arg(long, default_value_t = crate::unwind::DEFAULT_TABLE_ROWS, value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::unwind::MAX_TABLE_ROWS)))]
    pub(crate) unwind_table_rows: u32,

    /// Also time where threads wait off CPU (blocked on a lock, a pipe, a socket, disk,
    /// asleep; preemption is not a wait) and count it under their stacks, kernel and
    /// user, as a second profile type (`off_cpu`, nanoseconds). Hooks the scheduler's
    /// sched_switch tracepoint, attached during setup.
    #[arg(long)]
    pub(crate) off_cpu: bool,

    /// With --off-cpu: waits shorter than this (µs, 0–1000000) are skipped and counted
    /// (`bpf_off_cpu_short`); the totals then hold only the longer waits.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub(crate) off_cpu_min_us: u64,

    /// With --off-cpu: take the stacks of one voluntary switch in N at least (1–4096,
    /// drawn at random) and count its wait N times, so totals stay unbiased while a
    /// storm of switches costs a walk per N of them. The stacks are taken when a thread
    /// leaves its CPU, before the wait's length is known (see the README).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) off_cpu_every: u32,

    /// With --off-cpu: take at most about this many switches a second on each CPU
    /// (0, or 10–1000000; 0: no bound but --off-cpu-every). Each CPU raises its N every
    /// 100 ms from its switch rate, so a quiet node takes every wait and a storm of
    /// switches costs about this many stack walks a second per CPU, its waits weighted.
    #[arg(long, default_value_t = DEFAULT_OFF_CPU_RATE, value_parser = parse_off_cpu_rate)]
    pub(crate) off_cpu_rate: u32,

    /// After setup, run as this user (name or uid) instead of root, keeping only
    /// CAP_SYS_PTRACE: root-owned files (e.g. /etc/shadow) then become unreadable to a
    /// compromised sampler. Binaries only root may reach (e.g. under a 0700 /root) can then
    /// not be brokered. Its primary group is taken too; supplementary groups are dropped.
    #[arg(long)]
    pub(crate) user: Option<String>,

    /// Print the seccomp allow-list of the steady state (a Markdown table) and exit.
    #[arg(long)]
    pub(crate) print_seccomp: bool,

    /// Print the OCI seccomp profile for the sampler's container (setup and steady
    /// state, by name; JSON for podman, CRI-O, containerd and the kubelet) and exit.
    #[arg(long)]
    pub(crate) print_seccomp_profile: bool,

    /// Write that profile to PATH (creating its directory) and exit: the Kubernetes
    /// init step that puts it where the kubelet reads Localhost profiles.
    #[arg(long, value_name = "PATH")]
    pub(crate) install_seccomp_profile: Option<PathBuf>,

    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `firn_sampler=debug`.
    #[arg(long, env = "FIRN_LOG", default_value = "info")]
    pub(crate) log: String,
}

fn events_kib(s: &str) -> Result<u32, String> {
    let n: u32 = s.parse().map_err(|e| format!("{e}"))?;
    if !(4..=65_536).contains(&n) || !n.is_power_of_two() {
        return Err(format!(
            "{n} is not a power of two between 4 and 65536 (the kernel's ring buffer size \
             must be a power-of-two multiple of the page size)"
        ));
    }
    Ok(n)
}

/// `--off-cpu-rate`: 0, or a rate a 100 ms window can hold one of (10 a second and up).
fn parse_off_cpu_rate(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(0) => Ok(0),
        Ok(n @ 10..=1_000_000) => Ok(n),
        Ok(_) => Err("0 (no bound) or 10–1000000 switches a second per CPU".into()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_off_cpu_rate_a_window_cannot_hold_is_refused() {
        assert_eq!(super::parse_off_cpu_rate("0"), Ok(0));
        assert_eq!(super::parse_off_cpu_rate("10"), Ok(10));
        assert!(super::parse_off_cpu_rate("9").is_err());
        assert!(super::parse_off_cpu_rate("1000001").is_err());
        assert!(super::parse_off_cpu_rate("x").is_err());
    }
}

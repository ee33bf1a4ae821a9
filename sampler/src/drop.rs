//! Giving up privileges after setup: capabilities on every thread, no_new_privs, then a
//! seccomp allow-list (DESIGN.md rules 4 and 5). Order matters: the bounding set and the
//! securebits need CAP_SETPCAP, which goes last.

use std::collections::{BTreeMap, HashSet};

use caps::{CapSet, Capability};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

/// The one capability kept in the steady state: reading /proc/<pid>/maps and opening
/// /proc/<pid>/root/... of processes of other users (ptrace read access checks).
/// Seccomp denies every ptrace-family syscall, so it cannot be used to trace.
pub(crate) const KEPT: &[Capability] = &[Capability::CAP_SYS_PTRACE];

#[derive(Debug, thiserror::Error)]
pub(crate) enum DropError {
    #[error("the sampler has {0} threads before dropping privileges; it must have one")]
    Threads(usize),
    #[error("dropping {cap} from the {set:?} set: {source}")]
    Caps {
        cap: String,
        set: CapSet,
        source: caps::errors::CapsError,
    },
    #[error("prctl({what}): {source}")]
    Prctl {
        what: &'static str,
        source: nix::errno::Errno,
    },
    #[error("building the seccomp filter: {0}")]
    Filter(#[from] seccompiler::BackendError),
    #[error("installing the seccomp filter: {0}")]
    Install(#[from] seccompiler::Error),
    #[error("seccomp filters for this architecture are not written")]
    Arch,
    #[error("unknown user {0} (in --user)")]
    UnknownUser(String),
    #[error("switching to uid {uid} gid {gid}: {source}")]
    SwitchUser {
        uid: u32,
        gid: u32,
        source: nix::errno::Errno,
    },
}

/// The uid and primary gid of `--user` (a name or a number; a number needs no passwd
/// entry and then keeps gid = uid).
pub(crate) fn resolve_user(user: &str) -> Result<(u32, u32), DropError> {
    if let Ok(uid) = user.parse::<u32>() {
        return Ok(
            match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
                Ok(Some(u)) => (uid, u.gid.as_raw()),
                _ => (uid, uid),
            },
        );
    }
    match nix::unistd::User::from_name(user) {
        Ok(Some(u)) => Ok((u.uid.as_raw(), u.gid.as_raw())),
        _ => Err(DropError::UnknownUser(user.to_string())),
    }
}

fn caps_err(
    cap: Option<Capability>,
    set: CapSet,
) -> impl FnOnce(caps::errors::CapsError) -> DropError {
    move |source| DropError::Caps {
        cap: cap.map_or_else(|| "all".to_string(), |c| c.to_string()),
        set,
        source,
    }
}

/// Drops every capability but [`KEPT`] from all sets, locks the securebits so that uid 0
/// regains nothing, optionally switches to `run_as` (uid, gid) keeping [`KEPT`], and sets
/// no_new_privs.
pub(crate) fn drop_capabilities(run_as: Option<(u32, u32)>) -> Result<(), DropError> {
    let threads = std::fs::read_dir("/proc/self/task").map_or(1, |d| d.count());
    if threads != 1 {
        // Capabilities are per thread: a thread started earlier would keep them.
        return Err(DropError::Threads(threads));
    }
    let keep: HashSet<Capability> = KEPT.iter().copied().collect();
    for cap in caps::all() {
        if !keep.contains(&cap) {
            caps::drop(None, CapSet::Bounding, cap)
                .map_err(caps_err(Some(cap), CapSet::Bounding))?;
        }
    }
    // SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, SECBIT_KEEP_CAPS off, SECBIT_NO_CAP_AMBIENT_RAISE,
    // each with its lock bit: uid 0 gets no capabilities back through exec or setuid, and
    // a switch away from uid 0 below keeps the sets as they are (no fix-up).
    const SECBITS: libc::c_ulong = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80;
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_SECUREBITS, SECBITS, 0, 0, 0) } != 0 {
        return Err(DropError::Prctl {
            what: "PR_SET_SECUREBITS",
            source: nix::errno::Errno::last(),
        });
    }
    if let Some((uid, gid)) = run_as {
        switch_user(uid, gid)?;
    }
    caps::clear(None, CapSet::Ambient).map_err(caps_err(None, CapSet::Ambient))?;
    caps::clear(None, CapSet::Inheritable).map_err(caps_err(None, CapSet::Inheritable))?;
    caps::set(None, CapSet::Effective, &keep).map_err(caps_err(None, CapSet::Effective))?;
    caps::set(None, CapSet::Permitted, &keep).map_err(caps_err(None, CapSet::Permitted))?;
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(DropError::Prctl {
            what: "PR_SET_NO_NEW_PRIVS",
            source: nix::errno::Errno::last(),
        });
    }
    Ok(())
}

/// All of uid and gid (real, effective, saved, filesystem) become `uid`/`gid`, with no
/// supplementary groups. CAP_SETUID/CAP_SETGID are still effective here (they leave the
/// bounding set above, which does not touch the effective set); SECBIT_NO_SETUID_FIXUP
/// keeps every set as it is, so CAP_SYS_PTRACE survives. The kernel marks the process
/// non-dumpable, so processes of that uid cannot ptrace it.
fn switch_user(uid: u32, gid: u32) -> Result<(), DropError> {
    let err = |source| DropError::SwitchUser { uid, gid, source };
    nix::unistd::setgroups(&[]).map_err(err)?;
    let g = nix::unistd::Gid::from_raw(gid);
    nix::unistd::setresgid(g, g, g).map_err(err)?;
    let u = nix::unistd::Uid::from_raw(uid);
    nix::unistd::setresuid(u, u, u).map_err(err)?;
    Ok(())
}

/// What the filter checks of an allowed syscall's arguments.
#[derive(Debug, Clone, Copy)]
pub enum Check {
    /// Any arguments.
    Any,
    /// Argument `arg` (a 32-bit value) is one of `values`.
    OneOf {
        arg: u8,
        values: &'static [(u64, &'static str)],
    },
    /// Argument `arg` has none of the bits of `mask`.
    NoBits {
        arg: u8,
        mask: u64,
        what: &'static str,
    },
    /// Argument `arg` (all 64 bits) is 0.
    Zero { arg: u8, what: &'static str },
}

/// One entry of the allow-list.
#[derive(Debug, Clone, Copy)]
pub struct Allowed {
    pub name: &'static str,
    pub nr: i64,
    pub check: Check,
    pub why: &'static str,
}

// bpf(2) commands (linux/bpf.h, enum bpf_cmd).
const BPF_MAP_LOOKUP_ELEM: u64 = 1;
const BPF_MAP_UPDATE_ELEM: u64 = 2;
const BPF_MAP_DELETE_ELEM: u64 = 3;
const BPF_MAP_LOOKUP_AND_DELETE_ELEM: u64 = 21;
const BPF_MAP_LOOKUP_BATCH: u64 = 24;
const BPF_MAP_LOOKUP_AND_DELETE_BATCH: u64 = 25;
/// linux/perf_event.h: `_IO('$', 1)`.
const PERF_EVENT_IOC_DISABLE: u64 = 0x2401;

/// Flags that make `openat` write or create. O_TMPFILE includes O_DIRECTORY's bit; only
/// its own bit means "create".
const OPEN_WRITE_FLAGS: u64 = (libc::O_WRONLY
    | libc::O_RDWR
    | libc::O_CREAT
    | libc::O_TRUNC
    | libc::O_APPEND
    | (libc::O_TMPFILE & !libc::O_DIRECTORY)) as u64;

/// `allow!(SYS_read, Check::Any, "why")`: the entry for `libc::SYS_read`.
macro_rules! allow {
    ($sys:ident, $check:expr, $why:expr) => {
        Allowed {
            name: stringify!($sys),
            nr: libc::$sys,
            check: $check,
            why: $why,
        }
    };
}

impl Allowed {
    /// The syscall's name without the `SYS_` prefix.
    pub fn syscall(&self) -> &'static str {
        syscall_name(self.name)
    }

    /// The restriction in words, as the README's table shows it.
    pub(crate) fn restriction(&self) -> String {
        match self.check {
            Check::Any => "–".to_string(),
            Check::OneOf { values, .. } => values
                .iter()
                .map(|(_, n)| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", "),
            Check::NoBits { what, .. } | Check::Zero { what, .. } => what.to_string(),
        }
    }
}

const IO: &str = "I/O on fds already held: sockets, /proc files, the round timer, stderr";
const PROC: &str = "reading process facts under /proc, resolving broker paths (glibc's fstat is newfstatat; std's File metadata is statx)";
const SERVER: &str = "the Unix socket server: accept clients, read their credentials (SO_PEERCRED, SO_PEERGROUPS), exchange messages";
const RUNTIME: &str =
    "tokio's current-thread event loop (timers are epoll timeouts; the clock is the vDSO)";
const MEMORY: &str = "memory allocation (glibc's main arena: brk, large blocks by mmap)";

/// Allowed syscalls a busy steady state may not call in a short run, each with the path
/// that needs it; every other entry of [`ALLOWED`] is seen in one
/// (`allowed_syscalls_are_used` in tests/tests/sampler.rs).
pub const RARE: &[(&str, &str)] = &[
    ("mremap", "glibc realloc past its mmap threshold"),
    ("brk", "the heap growing past what setup left"),
    ("mmap", "an allocation larger than glibc's mmap threshold"),
    ("futex", "tokio's notify, std's contended once-cells"),
    ("getrandom", "a hash map's random keys"),
    ("rt_sigreturn", "return from the SIGTERM/SIGINT handler"),
    (
        "sigaltstack",
        "Rust's main-thread signal stack, released at exit",
    ),
    ("shutdown", "closing a client connection"),
    ("sendmsg", "the broker passing an fd (SCM_RIGHTS)"),
    ("ioctl", "detaching the perf events at exit"),
    ("exit_group", "exit"),
    ("readlinkat", "a process read the stat-checked way"),
];

/// The steady-state allow-list, one table per architecture (they differ in the epoll
/// wait call). Any other syscall fails with EPERM.
macro_rules! allow_list {
    ($epoll_wait:ident) => {
        &[
            allow!(SYS_read, Check::Any, IO),
            allow!(
                SYS_pread64,
                Check::Zero {
                    arg: 3,
                    what: "offset 0",
                },
                "reading the online CPU list each round again from the start, through the fd kept open since setup (no path walk, open and close per round)"
            ),
            allow!(SYS_write, Check::Any, IO),
            allow!(SYS_close, Check::Any, IO),
            allow!(SYS_newfstatat, Check::Any, PROC),
            allow!(SYS_statx, Check::Any, PROC),
            allow!(SYS_readlinkat, Check::Any, PROC),
            allow!(
                SYS_openat,
                Check::NoBits {
                    arg: 2,
                    mask: OPEN_WRITE_FLAGS,
                    what: "flags without `O_WRONLY`, `O_RDWR`, `O_CREAT`, `O_TRUNC`, `O_APPEND`, `O_TMPFILE`",
                },
                "read-only opens of /proc files; brokered binaries reopened read-only through /proc/self/fd"
            ),
            allow!(
                SYS_bpf,
                Check::OneOf {
                    arg: 0,
                    values: &[
                        (BPF_MAP_LOOKUP_ELEM, "BPF_MAP_LOOKUP_ELEM"),
                        (BPF_MAP_UPDATE_ELEM, "BPF_MAP_UPDATE_ELEM"),
                        (BPF_MAP_DELETE_ELEM, "BPF_MAP_DELETE_ELEM"),
                        (
                            BPF_MAP_LOOKUP_AND_DELETE_ELEM,
                            "BPF_MAP_LOOKUP_AND_DELETE_ELEM"
                        ),
                        (BPF_MAP_LOOKUP_BATCH, "BPF_MAP_LOOKUP_BATCH"),
                        (
                            BPF_MAP_LOOKUP_AND_DELETE_BATCH,
                            "BPF_MAP_LOOKUP_AND_DELETE_BATCH"
                        ),
                    ],
                },
                "map commands on the fds it holds, its own maps (it cannot get another: no CAP_BPF, no CAP_SYS_ADMIN, no map creation, no program load; seccomp cannot see the fd inside bpf_attr): drain counts by batch and stacks by lookup (and delete); read all counters by one batch; forget announced processes; write tables and process mappings (update); checked unwind rows are copied in through an `mmap` window, not written by command"
            ),
            allow!(SYS_accept4, Check::Any, SERVER),
            allow!(SYS_getsockopt, Check::Any, SERVER),
            allow!(SYS_recvfrom, Check::Any, SERVER),
            allow!(SYS_sendto, Check::Any, SERVER),
            allow!(SYS_sendmsg, Check::Any, "passing brokered fds (SCM_RIGHTS)"),
            allow!(SYS_shutdown, Check::Any, SERVER),
            allow!(
                SYS_ioctl,
                Check::OneOf {
                    arg: 1,
                    values: &[(PERF_EVENT_IOC_DISABLE, "PERF_EVENT_IOC_DISABLE")],
                },
                "detaching the perf events at exit"
            ),
            allow!($epoll_wait, Check::Any, RUNTIME),
            allow!(SYS_epoll_ctl, Check::Any, RUNTIME),
            allow!(SYS_futex, Check::Any, RUNTIME),
            allow!(SYS_getrandom, Check::Any, "random hash keys"),
            allow!(SYS_brk, Check::Any, MEMORY),
            allow!(
                SYS_mmap,
                Check::NoBits {
                    arg: 2,
                    mask: libc::PROT_EXEC as u64,
                    what: "no `PROT_EXEC`",
                },
                "memory allocation, the windows unwind rows are copied in through, and the sample log (mapped once when small, else its drained half each round); never executable memory"
            ),
            allow!(SYS_munmap, Check::Any, MEMORY),
            allow!(SYS_mremap, Check::Any, MEMORY),
            allow!(SYS_rt_sigreturn, Check::Any, "SIGTERM/SIGINT handling"),
            allow!(SYS_sigaltstack, Check::Any, "Rust's signal stack, released at exit"),
            allow!(SYS_exit_group, Check::Any, "exit"),
        ]
    };
}

#[cfg(target_arch = "x86_64")]
pub const ALLOWED: &[Allowed] = allow_list!(SYS_epoll_wait);
#[cfg(target_arch = "aarch64")]
pub const ALLOWED: &[Allowed] = allow_list!(SYS_epoll_pwait);

/// A syscall the sampler makes before it confines itself: the runtime's exec, the
/// dynamic loader, setup, the drop. Only a container runtime's profile needs these
/// ([`container_profile`]); the sampler's own filter never allows them.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub name: &'static str,
    pub nr: i64,
    pub why: &'static str,
}

/// `setup!(SYS_bpf, "why")`: the entry for `libc::SYS_bpf` (which must exist here).
macro_rules! setup {
    ($sys:ident, $why:expr) => {
        Setup {
            name: stringify!($sys),
            nr: libc::$sys,
            why: $why,
        }
    };
}

impl Setup {
    /// The syscall's name without the `SYS_` prefix.
    pub fn syscall(&self) -> &'static str {
        syscall_name(self.name)
    }
}

/// `SYS_read` → `read`.
fn syscall_name(constant: &'static str) -> &'static str {
    constant.trim_start_matches("SYS_")
}

const LOADER: &str = "the runtime's exec and the dynamic loader mapping libc, libelf, zlib";
const START: &str = "glibc and Rust's std starting the process (TLS, signal stack, stdio checks)";
const LIBBPF: &str = "loading the BPF program (libbpf: maps, BTF, program, links)";
const CAPS: &str = "reading and dropping capabilities, securebits, no_new_privs";
const SOCKET: &str = "the listening Unix socket, born with its mode and group";

/// Every syscall of the sampler's life before its own filter is installed that
/// [`ALLOWED`] does not already hold by name (setup's other `bpf` commands, `ioctl`s
/// and executable mappings fall under those names). `allowed_syscalls_are_used` in
/// tests/tests/hardening.rs checks an strace of a real start against it.
macro_rules! setup_list {
    ($($arch_only:expr),*) => {
        &[
            setup!(SYS_execve, LOADER),
            setup!(SYS_mprotect, LOADER),
            setup!(SYS_faccessat2, "libbpf probing optional files"),
            setup!(SYS_set_tid_address, START),
            setup!(SYS_set_robust_list, START),
            setup!(SYS_rseq, START),
            setup!(SYS_sched_getaffinity, START),
            setup!(SYS_rt_sigaction, "installing the SIGTERM/SIGINT handlers"),
            setup!(
                SYS_prlimit64,
                "raising RLIMIT_NOFILE's soft limit for binary handles"
            ),
            setup!(SYS_lseek, "reading /proc/kallsyms and the BPF object"),
            setup!(SYS_sysinfo, "glibc's qsort (libbpf sorting relocations)"),
            setup!(SYS_getdents64, "listing /proc/self/task and the online CPUs"),
            setup!(SYS_uname, "the kernel release check"),
            setup!(SYS_getuid, "naming the user in errors"),
            setup!(SYS_geteuid, "naming the user in errors"),
            setup!(SYS_getegid, "the socket's group"),
            setup!(SYS_gettid, START),
            setup!(SYS_getpid, "LISTEN_PID (systemd socket activation)"),
            setup!(SYS_fcntl, "descriptor flags"),
            setup!(SYS_dup3, LIBBPF),
            setup!(SYS_memfd_create, LIBBPF),
            setup!(
                SYS_perf_event_open,
                "a cpu-clock perf event on every online CPU"
            ),
            setup!(SYS_socket, SOCKET),
            setup!(SYS_bind, SOCKET),
            setup!(SYS_listen, SOCKET),
            setup!(SYS_umask, SOCKET),
            setup!(SYS_fchownat, SOCKET),
            setup!(SYS_unlinkat, "replacing a stale socket"),
            setup!(
                SYS_connect,
                "glibc asking nscd for --user, --allow-uid and --socket-group names"
            ),
            setup!(SYS_epoll_create1, "the event loop"),
            setup!(SYS_eventfd2, "the event loop"),
            setup!(SYS_timerfd_create, "the round timer"),
            setup!(SYS_timerfd_settime, "the round timer, set once to fire every round"),
            setup!(SYS_socketpair, "tokio's signal pipe"),
            setup!(SYS_madvise, "dropping setup-only pages from RSS"),
            setup!(SYS_capget, CAPS),
            setup!(SYS_capset, CAPS),
            setup!(SYS_prctl, CAPS),
            setup!(SYS_setgroups, "--user: no supplementary groups"),
            setup!(SYS_setresgid, "--user; the socket's group"),
            setup!(SYS_setresuid, "--user"),
            setup!(SYS_seccomp, "installing the sampler's own filter"),
            setup!(
                SYS_fstatfs,
                "the container runtime (runc), between loading a container profile and exec: checking that /proc/self/fd is procfs"
            ),
            $($arch_only),*
        ]
    };
}

#[cfg(target_arch = "x86_64")]
pub const SETUP: &[Setup] = setup_list!(
    setup!(SYS_access, LOADER),
    setup!(SYS_arch_prctl, LOADER),
    setup!(SYS_poll, START)
);
#[cfg(target_arch = "aarch64")]
pub const SETUP: &[Setup] = setup_list!(setup!(SYS_ppoll, START));

/// An OCI seccomp profile (the JSON of Docker, podman, CRI-O, containerd and the
/// kubelet's `Localhost` profiles) for the sampler's container: [`SETUP`] and
/// [`ALLOWED`] by name, anything else refused. It cannot narrow by argument, since setup
/// needs the general forms (any `bpf` command, executable mappings for the loader); the
/// sampler's own filter narrows to [`ALLOWED`] with its checks as soon as setup ends.
/// Refusals return ENOSYS, which glibc and Rust's std take as "not implemented here"
/// and fall back from (e.g. a newer glibc's first `clone3`).
pub(crate) fn container_profile() -> String {
    let arch = match std::env::consts::ARCH {
        "aarch64" => "SCMP_ARCH_AARCH64",
        _ => "SCMP_ARCH_X86_64",
    };
    let names = |list: Vec<&str>| {
        let mut l = list;
        l.sort_unstable();
        l.dedup();
        l.iter()
            .map(|n| format!("\"{n}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let steady = names(ALLOWED.iter().map(Allowed::syscall).collect());
    let setup = names(
        SETUP
            .iter()
            .map(Setup::syscall)
            .filter(|n| !ALLOWED.iter().any(|a| a.syscall() == *n))
            .collect(),
    );
    format!(
        "{{\n  \"defaultAction\": \"SCMP_ACT_ERRNO\",\n  \"defaultErrnoRet\": {enosys},\n  \
         \"architectures\": [\"{arch}\"],\n  \"syscalls\": [\n    {{\n      \
         \"comment\": \"firn-sampler's steady state; its own filter narrows these by argument after setup (firn-sampler --print-seccomp)\",\n      \
         \"names\": [{steady}],\n      \"action\": \"SCMP_ACT_ALLOW\"\n    }},\n    {{\n      \
         \"comment\": \"firn-sampler's start and setup only (sampler/src/drop.rs, SETUP); refused by its own filter afterwards\",\n      \
         \"names\": [{setup}],\n      \"action\": \"SCMP_ACT_ALLOW\"\n    }}\n  ]\n}}\n",
        enosys = libc::ENOSYS,
    )
}

/// The allow-list as the README's table shows it (`firn-sampler --print-seccomp`).
pub(crate) fn table() -> String {
    let mut out = String::from("| syscall | restriction | why |\n|---|---|---|\n");
    for a in ALLOWED {
        out.push_str(&format!(
            "| `{}` | {} | {} |\n",
            a.syscall(),
            a.restriction(),
            a.why
        ));
    }
    out
}

fn cond(arg: u8, len: Len, op: Op, value: u64) -> Result<SeccompCondition, DropError> {
    Ok(SeccompCondition::new(arg, len, op, value)?)
}

/// Builds the filter from [`ALLOWED`]. Anything else fails with EPERM (chosen over
/// killing so that an unforeseen library path shows up as an error in the logs, not a
/// silent death).
pub(crate) fn build_filter() -> Result<BpfProgram, DropError> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => TargetArch::x86_64,
        "aarch64" => TargetArch::aarch64,
        _ => return Err(DropError::Arch),
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for a in ALLOWED {
        let r = match a.check {
            Check::Any => vec![],
            Check::OneOf { arg, values } => values
                .iter()
                .map(|&(v, _)| {
                    SeccompRule::new(vec![cond(arg, Len::Dword, Op::Eq, v)?]).map_err(Into::into)
                })
                .collect::<Result<Vec<_>, DropError>>()?,
            Check::NoBits { arg, mask, .. } => vec![SeccompRule::new(vec![cond(
                arg,
                Len::Dword,
                Op::MaskedEq(mask),
                0,
            )?])?],
            Check::Zero { arg, .. } => {
                vec![SeccompRule::new(vec![cond(arg, Len::Qword, Op::Eq, 0)?])?]
            }
        };
        rules.insert(a.nr, r);
    }
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        arch,
    )?;
    Ok(filter.try_into()?)
}

/// Installs `filter` on every thread of the process (TSYNC).
pub(crate) fn confine(filter: &BpfProgram) -> Result<(), DropError> {
    seccompiler::apply_filter_all_threads(filter)?;
    Ok(())
}

#[cfg(test)]
#[path = "drop_tests.rs"]
mod tests;

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
pub const KEPT: &[Capability] = &[Capability::CAP_SYS_PTRACE];

#[derive(Debug, thiserror::Error)]
pub enum DropError {
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
/// regains nothing, and sets no_new_privs.
pub fn drop_capabilities() -> Result<(), DropError> {
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
    // each with its lock bit: uid 0 gets no capabilities back through exec or setuid.
    const SECBITS: libc::c_ulong = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80;
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_SECUREBITS, SECBITS, 0, 0, 0) } != 0 {
        return Err(DropError::Prctl {
            what: "PR_SET_SECUREBITS",
            source: nix::errno::Errno::last(),
        });
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

/// Context the filter needs: the one directory fd `unlinkat` may use (to remove the
/// socket file the sampler created), if any.
pub struct FilterContext {
    pub socket_dir_fd: Option<i32>,
}

/// bpf() commands the steady state uses: reading and emptying maps on held fds.
const BPF_CMDS: &[(u64, &str)] = &[
    (1, "BPF_MAP_LOOKUP_ELEM: read stacks and per-CPU counters"),
    (
        3,
        "BPF_MAP_DELETE_ELEM: empty the stack map of the drained set",
    ),
    (4, "BPF_MAP_GET_NEXT_KEY: walk a map"),
    (
        25,
        "BPF_MAP_LOOKUP_AND_DELETE_BATCH: drain the counts map of the drained set",
    ),
];

/// ioctl requests allowed: detaching perf links at exit and non-blocking fd setup.
const IOCTLS: &[u64] = &[
    0x2401, // PERF_EVENT_IOC_DISABLE
    0x5421, // FIONBIO
    0x5451, // FIOCLEX
];

fn cond(arg: u8, len: Len, op: Op, value: u64) -> Result<SeccompCondition, DropError> {
    Ok(SeccompCondition::new(arg, len, op, value)?)
}

/// Builds the allow-list. Anything else fails with EPERM (chosen over killing so that an
/// unforeseen library path shows up as an error in the logs, not a silent death).
pub fn build_filter(ctx: &FilterContext) -> Result<BpfProgram, DropError> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => TargetArch::x86_64,
        "aarch64" => TargetArch::aarch64,
        _ => return Err(DropError::Arch),
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for &nr in UNCONDITIONAL {
        rules.insert(nr, vec![]);
    }
    // bpf(cmd, ...): only the map commands above.
    let bpf = BPF_CMDS
        .iter()
        .map(|&(cmd, _)| {
            SeccompRule::new(vec![cond(0, Len::Dword, Op::Eq, cmd)?]).map_err(Into::into)
        })
        .collect::<Result<Vec<_>, DropError>>()?;
    rules.insert(libc::SYS_bpf, bpf);
    // openat(dirfd, path, flags, mode): read-only, never creating.
    const WRITE_FLAGS: u64 = (libc::O_WRONLY
        | libc::O_RDWR
        | libc::O_CREAT
        | libc::O_TRUNC
        | libc::O_APPEND
        // O_TMPFILE includes O_DIRECTORY's bit; only its own bit means "create".
        | (libc::O_TMPFILE & !libc::O_DIRECTORY)) as u64;
    rules.insert(
        libc::SYS_openat,
        vec![SeccompRule::new(vec![cond(
            2,
            Len::Dword,
            Op::MaskedEq(WRITE_FLAGS),
            0,
        )?])?],
    );
    // mmap/mprotect: never executable memory.
    let no_exec = |arg| -> Result<Vec<SeccompRule>, DropError> {
        Ok(vec![SeccompRule::new(vec![cond(
            arg,
            Len::Dword,
            Op::MaskedEq(libc::PROT_EXEC as u64),
            0,
        )?])?])
    };
    rules.insert(libc::SYS_mmap, no_exec(2)?);
    rules.insert(libc::SYS_mprotect, no_exec(2)?);
    let ioctls = IOCTLS
        .iter()
        .map(|&req| SeccompRule::new(vec![cond(1, Len::Dword, Op::Eq, req)?]).map_err(Into::into))
        .collect::<Result<Vec<_>, DropError>>()?;
    rules.insert(libc::SYS_ioctl, ioctls);
    // fcntl: F_GETFD/F_SETFD/F_GETFL/F_SETFL/F_DUPFD_CLOEXEC only.
    let fcntls = [1u64, 2, 3, 4, 1030]
        .iter()
        .map(|&c| SeccompRule::new(vec![cond(1, Len::Dword, Op::Eq, c)?]).map_err(Into::into))
        .collect::<Result<Vec<_>, DropError>>()?;
    rules.insert(libc::SYS_fcntl, fcntls);
    if let Some(fd) = ctx.socket_dir_fd {
        rules.insert(
            libc::SYS_unlinkat,
            vec![SeccompRule::new(vec![cond(
                0,
                Len::Dword,
                Op::Eq,
                fd as u64,
            )?])?],
        );
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
pub fn confine(filter: &BpfProgram) -> Result<(), DropError> {
    seccompiler::apply_filter_all_threads(filter)?;
    Ok(())
}

/// Syscalls allowed with any arguments. Each line says why the steady state needs it.
#[cfg(target_arch = "x86_64")]
const UNCONDITIONAL: &[i64] = &[
    // I/O on fds the sampler already holds: sockets, /proc files, stderr.
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_pread64,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_lseek,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_readlinkat,
    libc::SYS_getdents64,
    // Unix socket server: accept clients, check their credentials, exchange messages.
    libc::SYS_accept4,
    libc::SYS_getsockopt,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    // tokio's event loop and timers.
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_epoll_ctl,
    libc::SYS_futex,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_sched_yield,
    libc::SYS_getrandom,
    // memory allocation (mmap/mprotect are filtered above).
    libc::SYS_brk,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    // signals (SIGTERM/SIGINT handling) and exit.
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_exit,
    libc::SYS_exit_group,
];

#[cfg(target_arch = "aarch64")]
const UNCONDITIONAL: &[i64] = &[
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_pread64,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_lseek,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_readlinkat,
    libc::SYS_getdents64,
    libc::SYS_accept4,
    libc::SYS_getsockopt,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_shutdown,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_epoll_ctl,
    libc::SYS_futex,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_sched_yield,
    libc::SYS_getrandom,
    libc::SYS_brk,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_madvise,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_exit,
    libc::SYS_exit_group,
];

//! The seccomp half: a deny-list (the enricher runs a large, changing set of libraries,
//! so an allow-list would break on their next release) of what it never does. Every
//! denied call fails with EPERM; x32 numbers are refused as a whole, since a deny-list
//! names only x86-64's.

use std::collections::BTreeMap;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op,
    SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

/// Calls refused outright, and why the enricher has no use for them.
const DENIED: &[(i64, &str)] = &[
    (libc::SYS_ptrace, "tracing another process"),
    (
        libc::SYS_process_vm_readv,
        "reading another process's memory",
    ),
    (
        libc::SYS_process_vm_writev,
        "writing another process's memory",
    ),
    (libc::SYS_pidfd_getfd, "taking another process's files"),
    (libc::SYS_kcmp, "comparing other processes' resources"),
    (libc::SYS_execve, "running programs"),
    (libc::SYS_execveat, "running programs"),
    (libc::SYS_mount, "mounts"),
    (libc::SYS_umount2, "mounts"),
    (libc::SYS_pivot_root, "mounts"),
    (libc::SYS_chroot, "mounts"),
    (libc::SYS_open_tree, "mounts"),
    (libc::SYS_move_mount, "mounts"),
    (libc::SYS_fsopen, "mounts"),
    (libc::SYS_fsconfig, "mounts"),
    (libc::SYS_fsmount, "mounts"),
    (libc::SYS_fspick, "mounts"),
    (libc::SYS_mount_setattr, "mounts"),
    (libc::SYS_unshare, "new namespaces"),
    (libc::SYS_setns, "other namespaces"),
    (
        libc::SYS_open_by_handle_at,
        "opening files by handle, past path checks",
    ),
    (libc::SYS_name_to_handle_at, "file handles"),
    (libc::SYS_userfaultfd, "kernel-exploit staple"),
    (libc::SYS_bpf, "BPF is the sampler's"),
    (libc::SYS_perf_event_open, "sampling is the sampler's"),
    (libc::SYS_keyctl, "kernel keyrings"),
    (libc::SYS_add_key, "kernel keyrings"),
    (libc::SYS_request_key, "kernel keyrings"),
    (
        libc::SYS_io_uring_setup,
        "io_uring (its operations pass no seccomp filter)",
    ),
    (libc::SYS_io_uring_enter, "io_uring"),
    (libc::SYS_io_uring_register, "io_uring"),
    (libc::SYS_init_module, "kernel modules"),
    (libc::SYS_finit_module, "kernel modules"),
    (libc::SYS_delete_module, "kernel modules"),
    (libc::SYS_kexec_load, "kexec"),
    (libc::SYS_kexec_file_load, "kexec"),
    (libc::SYS_reboot, "reboot"),
    (libc::SYS_swapon, "swap"),
    (libc::SYS_swapoff, "swap"),
    (libc::SYS_acct, "process accounting"),
    (libc::SYS_syslog, "the kernel log"),
    (libc::SYS_personality, "execution domains"),
    (libc::SYS_uselib, "legacy library loading"),
    (libc::SYS_quotactl, "quotas"),
    (libc::SYS_settimeofday, "the clock"),
    (libc::SYS_clock_settime, "the clock"),
    (libc::SYS_clock_adjtime, "the clock"),
    (libc::SYS_adjtimex, "the clock"),
    (libc::SYS_iopl, "port I/O"),
    (libc::SYS_ioperm, "port I/O"),
];

/// clone() flags that make namespaces (clone3 hides its flags from seccomp: it gets
/// ENOSYS, and the C library falls back to clone, checked here).
const NAMESPACE_FLAGS: &[u64] = &[
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWCGROUP as u64,
];

const X32_BIT: u32 = 0x4000_0000;

fn program() -> Result<BpfProgram, String> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => TargetArch::x86_64,
        "aarch64" => TargetArch::aarch64,
        other => return Err(format!("no filter is written for {other}")),
    };
    let e = |e: seccompiler::BackendError| e.to_string();
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|&(nr, _)| (nr, vec![])).collect();
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|&f| {
            SeccompRule::new(vec![SeccompCondition::new(
                0,
                Len::Qword,
                Op::MaskedEq(f),
                f,
            )
            .map_err(e)?])
            .map_err(e)
        })
        .collect::<Result<Vec<_>, String>>()?;
    rules.insert(libc::SYS_clone, clone_rules);
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(e)?;
    let body: BpfProgram = filter.try_into().map_err(e)?;
    // Ahead of seccompiler's program (which checks the architecture first): clone3 gets
    // ENOSYS, and on x86-64 every x32 number EPERM. Its jumps are relative, so a prefix
    // leaves them intact.
    let mut prog = vec![
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0),
        jump(libc::BPF_JEQ, libc::SYS_clone3 as u32, 0, 1),
        stmt(
            libc::BPF_RET | libc::BPF_K,
            libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32,
        ),
    ];
    if arch == TargetArch::x86_64 {
        prog.extend([
            jump(libc::BPF_JGE, X32_BIT, 0, 1),
            stmt(
                libc::BPF_RET | libc::BPF_K,
                libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
            ),
        ]);
    }
    prog.extend(body);
    Ok(prog)
}

fn stmt(code: u32, k: u32) -> sock_filter {
    sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(op: u32, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter {
        code: (libc::BPF_JMP | op | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    }
}

/// Installs the filter on every thread (there is one).
pub(super) fn install() -> Result<(), String> {
    let prog = program()?;
    seccompiler::apply_filter_all_threads(&prog).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_filter_builds() {
        let p = super::program().unwrap();
        assert!(p.len() > super::DENIED.len());
    }
}

//! Checks before setup, so that a missing privilege or kernel feature is named clearly
//! instead of surfacing as an errno from deep inside libbpf.

use caps::{CapSet, Capability};

#[derive(Debug, thiserror::Error)]
pub(crate) enum PreflightError {
    #[error(
        "firn-sampler is missing {missing} (running as uid {uid}). Run it as root, or grant \
         these capabilities; it drops all but CAP_SYS_PTRACE right after setup"
    )]
    MissingCaps { missing: String, uid: u32 },
    #[error(
        "this kernel has no BTF (/sys/kernel/btf/vmlinux is missing); firn's CO-RE BPF \
         program needs a kernel built with CONFIG_DEBUG_INFO_BTF=y"
    )]
    NoBtf,
    #[error(
        "kernel {release} is older than 5.17; firn's BPF program needs bpf_loop (5.17, the \
         bounded unwinding loop), bpf_task_pt_regs (5.15, user registers of a sample taken \
         in the kernel), ring buffers (5.8) and hash maps written from a perf event \
         without preallocation (bpf_mem_alloc, 6.1 for best results)"
    )]
    OldKernel { release: String },
    #[error("reading capabilities: {0}")]
    Caps(#[from] caps::errors::CapsError),
}

/// `switch_user`: whether `--user` was given (it then needs CAP_SETUID and CAP_SETGID).
pub(crate) fn check(switch_user: bool) -> Result<(), PreflightError> {
    let eff = caps::read(None, CapSet::Effective)?;
    let mut missing = Vec::new();
    let admin = eff.contains(&Capability::CAP_SYS_ADMIN);
    for (cap, why) in [
        (Capability::CAP_BPF, "load the program"),
        (Capability::CAP_PERFMON, "open perf events on every CPU"),
    ] {
        if !eff.contains(&cap) && !admin {
            missing.push(format!("{cap} (to {why})"));
        }
    }
    for (cap, why) in [
        (
            Capability::CAP_SYS_PTRACE,
            "read other users' /proc/<pid>/maps",
        ),
        (
            Capability::CAP_SETPCAP,
            "drop capabilities from the bounding set",
        ),
    ] {
        if !eff.contains(&cap) {
            missing.push(format!("{cap} (to {why})"));
        }
    }
    if switch_user {
        for cap in [Capability::CAP_SETUID, Capability::CAP_SETGID] {
            if !eff.contains(&cap) {
                missing.push(format!("{cap} (to switch to --user)"));
            }
        }
    }
    if !missing.is_empty() {
        return Err(PreflightError::MissingCaps {
            missing: missing.join(", "),
            uid: nix::unistd::geteuid().as_raw(),
        });
    }
    if !eff.contains(&Capability::CAP_SYSLOG) {
        tracing::warn!(
            "no CAP_SYSLOG: /proc/kallsyms hides addresses, kernel frames will be [unknown]"
        );
    }
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Err(PreflightError::NoBtf);
    }
    let release = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    if kernel_version(&release).is_some_and(|v| v < (5, 17)) {
        return Err(PreflightError::OldKernel { release });
    }
    Ok(())
}

/// (major, minor) of a kernel release string such as `6.18.44-fc-v657`.
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_versions() {
        use super::kernel_version as v;
        assert_eq!(v("6.18.44-fc-v657"), Some((6, 18)));
        assert_eq!(v("5.15.0-91-generic"), Some((5, 15)));
        assert_eq!(v("4.19.0"), Some((4, 19)));
        assert!(v("4.19.0") < Some((5, 17)));
        assert_eq!(v("garbage"), None);
    }
}

//! The enricher's own confinement. It parses hostile input (binaries' ELF and DWARF,
//! cgroup text, backend answers), so it is locked as if it were already taken over:
//!
//! - **Landlock** ([`landlock`]): writes only beneath its output and spool directories,
//!   no execution, TCP connect only to the ports of its configured backends (and DNS),
//!   TCP bind only to its HTTP port, no signal or abstract-socket reach outside itself.
//!   A Landlock domain also refuses ptrace access to every process outside it, so
//!   `/proc/PID/{environ,root,mem,maps,fd}` of other processes are closed even to one
//!   of the enricher's own uid (the pod's hostPID case). Reads are left to the file
//!   modes: the symbolizer reopens brokered binaries as `/proc/self/fd/N`, which
//!   Landlock judges by the file's real place, in any mount namespace.
//! - **seccomp** ([`seccomp`]): a deny-list of what it never does (ptrace, other
//!   processes' memory, mounts, exec, namespaces, kernel keys, BPF, modules, io_uring).
//!
//! Both are taken in `main` before the event loop exists: Landlock (before ABI 8) binds
//! only the calling thread and those it starts later, so the process must still be one
//! thread. What the kernel lacks is logged and counted, never fatal.

mod landlock;
mod seccomp;

use std::collections::BTreeSet;
use std::path::PathBuf;

use crate::settings::Settings;

#[derive(Debug, thiserror::Error)]
pub(crate) enum ConfineError {
    #[error(
        "the enricher has {0} threads before confining itself; it must have one (a \
         thread started earlier would stay unconfined)"
    )]
    Threads(usize),
    #[error("creating {path} (to allow writes beneath it): {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("Landlock: {0}")]
    Landlock(#[from] ::landlock::RulesetError),
    #[error("Landlock rule for {path}: {message}")]
    Path { path: PathBuf, message: String },
    #[error("seccomp filter: {0}")]
    Seccomp(String),
}

/// What the settings need: the rest is refused.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Directories beneath which files may be created, written, renamed and removed.
    pub(crate) writable: Vec<PathBuf>,
    /// TCP ports `connect` may reach (any address).
    pub(crate) connect: BTreeSet<u16>,
    /// TCP ports `bind` may take.
    pub(crate) bind: BTreeSet<u16>,
    /// Warnings for the start-up log (a kubeconfig that wants an exec plugin, refused
    /// here).
    pub(crate) notes: Vec<String>,
}

/// The DNS port: resolvers fall back to TCP for long answers.
const DNS: u16 = 53;

impl Plan {
    pub(crate) fn from_settings(s: &Settings) -> Plan {
        let mut p = Plan::default();
        if !s.dump {
            p.writable.push(s.output_dir.clone());
            if let Some(d) = &s.upload_spool_dir {
                p.writable.push(d.clone());
            }
            if let Some(d) = s.unwind_cache().filter(|d| !d.starts_with(&s.output_dir)) {
                p.writable.push(d);
            }
            p.bind.insert(s.http_address.port());
        }
        let uploads = [
            s.otlp_endpoint.clone(),
            s.parca_address
                .as_ref()
                .map(|a| match (a.contains("://"), s.parca_insecure) {
                    (true, _) => a.clone(),
                    (false, true) => format!("http://{a}"),
                    (false, false) => format!("https://{a}"),
                }),
            s.opensearch_url.clone(),
        ];
        let mut any_remote = false;
        for url in uploads.iter().flatten() {
            if let Some(port) = port_of(url) {
                p.connect.insert(port);
                any_remote = true;
            }
        }
        #[cfg(feature = "kubernetes")]
        if s.kubernetes || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            let api = crate::labels::kubernetes::api_ports(s.kubeconfig.as_deref());
            any_remote |= !api.ports.is_empty();
            p.connect.extend(api.ports);
            p.notes.extend(api.notes);
        }
        if any_remote {
            p.connect.insert(DNS);
        }
        p
    }
}

/// The port an endpoint URL names, or its scheme's (http 80, https 443).
pub(crate) fn port_of(url: &str) -> Option<u16> {
    let uri: axum::http::Uri = url.parse().ok()?;
    uri.port_u16().or(match uri.scheme_str() {
        Some("https") => Some(443),
        Some("http") => Some(80),
        _ => None,
    })
}

/// What was enforced, for the start-up log and `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct Report {
    /// The Landlock ABI in force (0: none).
    pub(crate) landlock_abi: u64,
    /// Protections the kernel could not give, in words.
    pub(crate) missing: Vec<&'static str>,
}

/// Confines the process. Call while it is one thread.
pub(crate) fn apply(plan: &Plan) -> Result<Report, ConfineError> {
    let threads = threads();
    if threads != 1 {
        return Err(ConfineError::Threads(threads));
    }
    for d in &plan.writable {
        std::fs::create_dir_all(d).map_err(|source| ConfineError::Dir {
            path: d.clone(),
            source,
        })?;
    }
    let mut report = landlock::restrict(plan)?;
    seccomp::install().map_err(ConfineError::Seccomp)?;
    for note in &plan.notes {
        tracing::warn!(note = %note, "confinement");
    }
    if report.missing.is_empty() {
        tracing::info!(
            landlock_abi = report.landlock_abi,
            writable = ?plan.writable,
            tcp_connect = ?plan.connect,
            tcp_bind = ?plan.bind,
            "confined: Landlock (writes, exec, TCP, signals, other processes' /proc) and seccomp"
        );
    } else {
        report.missing.sort_unstable();
        tracing::warn!(
            landlock_abi = report.landlock_abi,
            missing = ?report.missing,
            "confined in part: this kernel lacks some of what the enricher asks of Landlock"
        );
    }
    Ok(report)
}

/// Threads of this process, from /proc/self/status.
fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_of_endpoints() {
        assert_eq!(port_of("http://otel:4317"), Some(4317));
        assert_eq!(port_of("https://opensearch.example/base"), Some(443));
        assert_eq!(port_of("http://[::1]:9200"), Some(9200));
        assert_eq!(port_of("otel:4317"), Some(4317), "an authority alone");
        assert_eq!(port_of("otel"), None);
    }
}

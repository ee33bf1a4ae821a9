//! podman for the container tests (`pod.rs`, `python_container.rs`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Whether podman, buildah and runc run here; with CI=true they must (tests/run.sh
/// installs them).
pub fn podman_usable() -> bool {
    let usable = ["podman", "buildah", "runc"].iter().all(|p| {
        Command::new(p)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if !usable {
        assert!(
            !crate::bpf_required(),
            "podman, buildah and runc are required (tests/run.sh installs them)"
        );
        eprintln!("skipped: no podman/buildah/runc");
    }
    usable
}

/// A containers.conf for this machine in `dir`: runc, not crun (hybrid cgroups); no
/// default ulimits (the machine's bounding set lacks CAP_SYS_RESOURCE); cgroupfs, since
/// systemd is not PID 1 here.
pub fn containers_conf(dir: &Path) -> PathBuf {
    let conf = dir.join("containers.conf");
    std::fs::write(
        &conf,
        "[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = \"runc\"\n\
         cgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n",
    )
    .expect("write containers.conf");
    conf
}

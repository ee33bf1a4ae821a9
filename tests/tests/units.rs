//! The shipped systemd units, checked by systemd-analyze (not by us).

use std::process::Command;

use firn_tests::*;

#[test]
fn systemd_units_verify() {
    let dir = TempDir::new("units");
    let bins = repo_root().join("target/release");
    for unit in [
        "firn-sampler.socket",
        "firn-sampler.service",
        "firn-enricher.service",
    ] {
        let text = std::fs::read_to_string(repo_root().join("systemd").join(unit)).unwrap();
        if unit == "firn-sampler.service" {
            // It would drop CAP_SYSLOG from the bounding set: kernel frames [unknown].
            assert!(
                !text.contains("ProtectKernelLogs=yes"),
                "{unit} must keep CAP_SYSLOG for /proc/kallsyms"
            );
        }
        // Point ExecStart at the freshly built binaries: verify checks that they exist.
        let text = text.replace("/usr/local/bin/", &format!("{}/", bins.display()));
        std::fs::write(dir.path().join(unit), text).unwrap();
    }
    if nix::unistd::geteuid().is_root() {
        test_user("firn");
    }
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .args(
            [
                "firn-sampler.socket",
                "firn-sampler.service",
                "firn-enricher.service",
            ]
            .map(|u| dir.path().join(u)),
        )
        .output()
        .expect("systemd-analyze (package systemd)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "systemd-analyze verify failed: {err}");
    assert!(
        err.trim().is_empty(),
        "systemd-analyze verify warned: {err}"
    );
}

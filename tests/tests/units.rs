//! The shipped systemd units, checked by systemd-analyze (not by us).

use std::process::Command;
use std::time::Duration;

use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);

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
        // The units' users: verify may look them up.
        test_user("firn");
        test_user("firn-sampler");
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

/// The last value of `key=` in a unit file.
fn unit_value(text: &str, key: &str) -> Option<String> {
    text.lines()
        .rev()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .map(|v| v.trim().to_string())
}

/// `CAP_BPF CAP_PERFMON` as setpriv's `-all,+bpf,+perfmon`.
fn setpriv_caps(unit_caps: &str) -> String {
    let mut out = String::from("-all");
    for c in unit_caps.split_whitespace() {
        out.push_str(",+");
        out.push_str(&c.trim_start_matches("CAP_").to_ascii_lowercase());
    }
    out
}

/// The sampler under the shipped unit's identity and privileges (User=, Group=,
/// AmbientCapabilities=, CapabilityBoundingSet=, NoNewPrivileges=), applied by setpriv as
/// systemd applies them (systemd is not PID 1 on these machines, so the unit itself
/// cannot be started): setup succeeds without root, kernel frames are named (CAP_SYSLOG
/// reached /proc/kallsyms at open), and the steady state keeps CAP_SYS_PTRACE alone.
#[test]
fn sampler_under_the_units_privileges_names_kernel_frames() {
    if !can_run_bpf() {
        return;
    }
    let text = std::fs::read_to_string(repo_root().join("systemd/firn-sampler.service")).unwrap();
    let user = unit_value(&text, "User").expect("the sampler's unit sets User=");
    assert_ne!(user, "root");
    let ambient = unit_value(&text, "AmbientCapabilities").expect("AmbientCapabilities=");
    let bounding = unit_value(&text, "CapabilityBoundingSet").expect("CapabilityBoundingSet=");
    assert_eq!(unit_value(&text, "NoNewPrivileges").as_deref(), Some("yes"));
    let (uid, gid) = test_user(&user);
    let dir = TempDir::new("unitcaps");
    std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap();
    let socket = dir.path().join("s.sock");
    let (reuid, regid) = (format!("--reuid={uid}"), format!("--regid={gid}"));
    let inh = format!("--inh-caps={}", setpriv_caps(&ambient));
    let amb = format!("--ambient-caps={}", setpriv_caps(&ambient));
    let bnd = format!("--bounding-set={}", setpriv_caps(&bounding));
    let wrapper = [
        "setpriv",
        &reuid,
        &regid,
        "--clear-groups",
        &inh,
        &amb,
        &bnd,
        "--no-new-privs",
    ];
    let mut sampler = start_sampler_under(
        &wrapper,
        &bin("firn-sampler"),
        &socket,
        &["--frequency", "99", "--round", "1"],
    );
    let pid = sampler.pid();
    assert_eq!(status_field(pid, "CapEff").unwrap(), "0000000000080000");
    assert_eq!(status_field(pid, "CapBnd").unwrap(), "0000000000080000");
    assert_eq!(status_field(pid, "NoNewPrivs").unwrap(), "1");
    assert_eq!(status_field(pid, "Seccomp").unwrap(), "2");
    let uids = status_field(pid, "Uid").unwrap();
    assert!(
        uids.split_whitespace().all(|u| u == uid.to_string()),
        "Uid: {uids}"
    );
    let dump = start_dump(&socket, None, &[]);
    assert!(dump.wait_for("\"connected\"", 10 * SECS).is_some());
    let mut w = start_workload(&workload("syscalls"), &["3"]);
    let wpid = u64::from(w.pid());
    w.wait_exit(15 * SECS).expect("workload ends");
    std::thread::sleep(3 * SECS);
    let mut names = std::collections::HashSet::new();
    for b in batches(&dump) {
        let syms = b["kernel_symbols"].as_array().cloned().unwrap_or_default();
        for s in b["samples"].as_array().into_iter().flatten() {
            if s["pid"].as_u64() != Some(wpid) {
                continue;
            }
            for f in s["kernel_frames"].as_array().into_iter().flatten() {
                let i = f.as_u64().unwrap_or(u64::MAX) as usize;
                if let Some(n) = syms.get(i).and_then(Value::as_str) {
                    names.insert(n.to_string());
                }
            }
        }
    }
    assert!(
        names.iter().any(|n| n.starts_with("__x64_sys_")
            || n.starts_with("entry_SYSCALL_64")
            || n == "do_syscall_64"),
        "kernel frames are not named under the unit's privileges: {names:?}"
    );
    sampler.stop();
}

/// `systemd-analyze security --offline=yes` scores (systemd's own judgement of the
/// units' sandboxing): the sampler ≤ 2.5, the enricher ≤ 1.5.
#[test]
fn systemd_security_scores() {
    for (unit, most) in [
        ("firn-sampler.service", 2.5),
        ("firn-enricher.service", 1.5),
    ] {
        let out = Command::new("systemd-analyze")
            .args(["security", "--offline=yes", "--no-pager"])
            .arg(repo_root().join("systemd").join(unit))
            .output()
            .expect("systemd-analyze (package systemd)");
        let text = String::from_utf8_lossy(&out.stdout);
        let score: f64 = text
            .lines()
            .find_map(|l| {
                let rest = l.split("Overall exposure level for ").nth(1)?;
                rest.split_whitespace().nth(1)?.parse().ok()
            })
            .unwrap_or_else(|| panic!("no overall score for {unit}: {text}"));
        eprintln!("{unit}: exposure {score}");
        assert!(score <= most, "{unit} scores {score}, above {most}");
    }
}

/// packaging/install.sh puts binaries, units and docs where the units expect them, says
/// what it did, and uninstall.sh takes them away again (under FIRN_ROOT: users and
/// systemctl are left alone, as on a package build).
#[test]
fn install_and_uninstall_under_a_root() {
    let dir = TempDir::new("install");
    let run = |script: &str| {
        let out = Command::new(repo_root().join("packaging").join(script))
            .env("FIRN_ROOT", dir.path())
            .env("FIRN_BIN_DIR", repo_root().join("target/release"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{script}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let said = run("install.sh");
    let placed = [
        "usr/local/bin/firn-sampler",
        "usr/local/bin/firn-enricher",
        "etc/systemd/system/firn-sampler.socket",
        "etc/systemd/system/firn-sampler.service",
        "etc/systemd/system/firn-enricher.service",
        "usr/local/share/doc/firn/README.md",
    ];
    for p in placed {
        assert!(dir.path().join(p).exists(), "{p} not installed: {said}");
        let shown = format!("/{}", p.trim_end_matches("README.md"));
        assert!(
            said.contains(&shown),
            "install.sh did not say {shown}: {said}"
        );
    }
    let unit = std::fs::read_to_string(dir.path().join("etc/systemd/system/firn-sampler.service"))
        .unwrap();
    assert!(unit.contains("ExecStart=/usr/local/bin/firn-sampler"));
    run("uninstall.sh");
    for p in placed {
        assert!(!dir.path().join(p).exists(), "{p} left by uninstall.sh");
    }
}

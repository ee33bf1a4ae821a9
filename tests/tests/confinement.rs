//! The enricher's own confinement (security review, round two: "the enricher confines
//! itself too"), tried from inside: `firn-confined-probe` confines itself with the
//! enricher's code and settings, then reaches for another process of the same uid
//! (what hostPID gives a pod), host files, TCP ports it was not given, exec and writes
//! outside its folders. A control run without the confinement shows each attempt is
//! one the kernel would otherwise allow. The running enricher is checked too.

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use firn_tests::*;

/// The probe's answers: attempt → "ALLOWED" or the errno.
fn probe(user: (u32, u32), args: &[String], confined: bool) -> Value {
    let out = Command::new("setpriv")
        .args([
            &format!("--reuid={}", user.0),
            &format!("--regid={}", user.1),
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(bin("firn-confined-probe"))
        .args(args)
        .env("FIRN_PROBE_UNCONFINED", if confined { "0" } else { "1" })
        .output()
        .expect("run firn-confined-probe");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "probe failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// What each attempt must end with under the confinement (and, in the control run,
/// the ones the kernel allows without it).
const REFUSED: &[&str] = &[
    "proc_environ",
    "proc_root",
    "proc_maps",
    "proc_mem",
    "proc_fd",
    "etc_shadow",
    "other_home",
    "tcp_unconfigured",
    "tcp_bind_other",
    "exec",
    "write_outside",
    "signal_victim",
    "ptrace",
    "process_vm_readv",
    "unshare_user",
    "mount",
    "io_uring_setup",
    "x32_getpid",
    "bpf",
];
/// Allowed without the confinement: the attempts that prove something.
const ALLOWED_UNCONFINED: &[&str] = &[
    "proc_environ",
    "proc_root",
    "proc_maps",
    "proc_fd",
    "tcp_unconfigured",
    "tcp_bind_other",
    "exec",
    "write_outside",
    "signal_victim",
];

#[test]
fn the_confined_enricher_reaches_nothing_it_was_not_given() {
    if !can_run_bpf() {
        return;
    }
    let dir = TempDir::new("confine");
    let user = test_user("firn-test");
    let out = dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::os::unix::fs::chown(&out, Some(user.0), Some(user.1)).unwrap();
    // Another user's home, closed to others as Debian makes it.
    let other = test_user("firn-other");
    let home = dir.path().join("home-other");
    std::fs::create_dir_all(&home).unwrap();
    let secret = home.join("notes");
    std::fs::write(&secret, "other's secret").unwrap();
    std::os::unix::fs::chown(&home, Some(other.0), Some(other.1)).unwrap();
    std::os::unix::fs::chown(&secret, Some(other.0), Some(other.1)).unwrap();
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
    // A process of the enricher's own uid, with a secret in its environment.
    let mut victim = Command::new("setpriv");
    victim
        .args([
            &format!("--reuid={}", user.0),
            &format!("--regid={}", user.1),
            "--clear-groups",
            "sleep",
            "120",
        ])
        .env("FIRN_VICTIM_SECRET", "hunter2");
    let victim = Proc::spawn("victim", victim);
    // Two listening ports: one the settings name (an OTLP endpoint), one they do not.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let open = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = |l: &TcpListener| l.local_addr().unwrap().port().to_string();
    let mut args = strs(&[&victim.pid().to_string(), secret.to_str().unwrap()]);
    args.extend([port(&closed), port(&open), "--".into()]);
    args.extend(strs(&[
        "--socket",
        "/run/firn-test-none.sock",
        "--output-dir",
        out.to_str().unwrap(),
        "--http-address",
        "127.0.0.1:7999",
        "--otlp-endpoint",
        &format!("http://127.0.0.1:{}", port(&open)),
    ]));
    std::thread::sleep(Duration::from_millis(200));

    let control = probe(user, &args, false);
    eprintln!("unconfined: {control}");
    for k in ALLOWED_UNCONFINED {
        assert_eq!(
            control[k], "ALLOWED",
            "{k} is refused even without the confinement: {control}"
        );
    }
    let r = probe(user, &args, true);
    eprintln!("confined: {r}");
    for k in REFUSED {
        assert_ne!(r[k], "ALLOWED", "{k} allowed under the confinement: {r}");
        assert!(r[k].is_string(), "{k} not tried: {r}");
    }
    // What it was given still works: its own /proc, its folder, its backend's port.
    for k in ["proc_self_status", "write_inside", "tcp_configured"] {
        assert_eq!(r[k], "ALLOWED", "{k}: {r}");
    }
    // Landlock's refusals are EACCES; seccomp's EPERM.
    for k in [
        "proc_environ",
        "proc_root",
        "tcp_unconfigured",
        "write_outside",
    ] {
        assert_eq!(r[k], "EACCES", "{k}: {r}");
    }
    for k in [
        "ptrace",
        "process_vm_readv",
        "mount",
        "unshare_user",
        "x32_getpid",
    ] {
        assert_eq!(r[k], "EPERM", "{k}: {r}");
    }
    drop(victim);
}

/// The enricher as the tests run it: one seccomp filter, no_new_privs, the Landlock
/// ABI and nothing missing in its metrics.
#[test]
fn the_running_enricher_is_confined() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start("confined-run", &["--round", "2"]);
    let pid = f.enricher.as_ref().unwrap().pid();
    assert_eq!(status_field(pid, "NoNewPrivs").as_deref(), Some("1"));
    assert_eq!(status_field(pid, "Seccomp").as_deref(), Some("2"));
    assert_eq!(
        status_field(pid, "CapEff").as_deref(),
        Some("0000000000000000")
    );
    assert!(
        f.enricher
            .as_ref()
            .unwrap()
            .wait_for("confined:", Duration::from_secs(5))
            .is_some(),
        "no confinement line at start"
    );
    assert!(wait_until(Duration::from_secs(20), || f.get("/healthz").0 == 200));
    let abi = f.metric("firn_enricher_landlock_abi").unwrap_or(0.0);
    assert!(abi >= 6.0, "Landlock ABI {abi}");
    assert_eq!(
        f.metric("firn_enricher_confinement_missing_total"),
        Some(0.0)
    );
}

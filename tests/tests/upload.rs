//! End-to-end tests of the upload sinks (issue: upload). The real sampler and enricher
//! send to receivers whose readers no one here wrote: an OTLP profiles server on the
//! OpenTelemetry project's Python bindings, and a Parca stand-in decoding with Parca's
//! published client types (`@parca/client`); see `tests/receivers/`. What arrives is
//! compared with what the local sink wrote for the same rounds.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use firn_tests::*;

const FAST: &[&str] = &["--frequency", "99", "--round", "2"];
const TOKEN: &str = "tok-5f1c9e";

fn frames_of(profiles: &[Value]) -> HashSet<String> {
    profiles
        .iter()
        .flat_map(|p| p["stacks"].as_array().unwrap().iter())
        .flat_map(|s| s["frames"].as_array().unwrap().iter())
        .filter_map(|f| f.as_str().map(str::to_string))
        .collect()
}

fn sha256(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// `busy` built without a symbol table (and at -O1, so that its build id differs from
/// `busy`'s): its frames cannot be named here, so the enricher offers it to Parca.
fn stripped_busy() -> PathBuf {
    let out = repo_root().join("target/workloads/busy-stripped");
    // The first test of a fresh checkout makes the folder.
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let ok = Command::new("clang")
        .args([
            "-O1",
            "-s",
            "-fno-omit-frame-pointer",
            "-mno-omit-leaf-frame-pointer",
            "-o",
        ])
        .arg(&out)
        .arg(repo_root().join("tests/workloads/busy.c"))
        .status()
        .expect("clang");
    assert!(ok.success());
    out
}

fn upload_metric(f: &Firn, name: &str, sink: &str) -> f64 {
    f.metric(&format!("firn_enricher_upload_{name}{{sink=\"{sink}\"}}"))
        .unwrap_or(-1.0)
}

/// Off-CPU time (the sampler's --off-cpu): OTLP's `off_cpu` profiles and Parca's
/// `wallclock` raw samples hold per round what the local pprof files do, as `go tool
/// pprof -sample_index=off_cpu` reads them, and name where the workload waited.
fn off_cpu_arrived(f: &Firn, pid: u32, otlp_out: &Path, parca_out: &Path) {
    // A round that began after the workload ended: its rounds are all written.
    assert!(wait_round_after(&f.out, now_ns(), Duration::from_secs(20)));
    let arrived = wait_until(Duration::from_secs(30), || {
        let otlp = otlp_rounds(otlp_out, pid, "off_cpu");
        let parca = parca_rounds(parca_out, pid);
        let local = pid_rounds(&f.out, pid);
        !local.is_empty()
            && local
                .keys()
                .all(|k| otlp.contains_key(k) && parca.contains_key(k))
    });
    assert!(arrived, "off-CPU rounds of {pid} missing upstream");
    let local = pid_off_cpu_rounds(&f.out, pid);
    let otlp = otlp_rounds(otlp_out, pid, "off_cpu");
    let parca = parca_off_cpu_rounds(parca_out, pid);
    for t in local.keys().chain(otlp.keys()).chain(parca.keys()) {
        let want = local.get(t).copied().unwrap_or(0);
        assert_eq!(
            otlp.get(t).copied().unwrap_or(0),
            want,
            "OTLP off_cpu, round {t}"
        );
        assert_eq!(
            parca.get(t).copied().unwrap_or(0),
            want,
            "Parca wallclock, round {t}"
        );
    }
    let total: u64 = local.values().sum();
    assert!(
        total > 2_000_000_000,
        "{total} ns off CPU in 5 s of waiting"
    );
    let off = otlp_profiles(otlp_out, pid, "off_cpu");
    for p in &off {
        assert_eq!(
            (p["unit"].as_str(), p["period_type"].as_str()),
            (Some("nanoseconds"), Some(""))
        );
    }
    let wall = parca_samples(parca_out, pid, &["wallclock/nanoseconds"]);
    for s in &wall {
        assert_eq!(
            (s["period_type"].as_str(), s["period"].as_u64()),
            (Some("samples/count"), Some(1))
        );
    }
    let parca_names: HashSet<String> = wall
        .iter()
        .flat_map(|s| s["stacks"].as_array().unwrap().iter())
        .flat_map(|st| st["frames"].as_array().unwrap().iter())
        .filter_map(|n| n.as_str().map(str::to_string))
        .collect();
    let otlp_names = frames_of(&off);
    // The kernel's reason: `pipe_read` (`anon_pipe_read` in recent kernels).
    for want in ["wait_pipe", "pipe_read"] {
        let has = |names: &HashSet<String>| names.iter().any(|n| n.contains(want));
        assert!(has(&otlp_names), "{want} not in OTLP's off_cpu stacks");
        assert!(has(&parca_names), "{want} not in Parca's wallclock stacks");
    }
    eprintln!(
        "off-CPU: {:.3} s over {} rounds in the local files, OTLP and Parca alike",
        total as f64 / 1e9,
        local.len()
    );
}

#[test]
fn otlp_and_parca_receive_what_the_local_sink_wrote() {
    if !can_run_bpf() {
        return;
    }
    let rx = TempDir::new("upl-rx");
    let (op, pp) = (free_port(), free_port());
    let otlp_out = rx.path().join("otlp.jsonl");
    let parca_out = rx.path().join("parca.jsonl");
    let _otlp = start_otlp_receiver(op, &otlp_out, &[]);
    let _parca = start_parca_receiver(pp, &parca_out, &["--token", TOKEN]);
    let mut f = Firn::start_with("upl", &[FAST, &["--off-cpu"]].concat(), |dir| {
        let token = secret_file(dir, "token", &format!("{TOKEN}\n"));
        let mut a = strs(&["--otlp-endpoint"]);
        a.push(format!("http://127.0.0.1:{op}"));
        a.extend(strs(&[
            "--otlp-header",
            "x-firn-test=yes",
            "--parca-address",
        ]));
        a.push(format!("127.0.0.1:{pp}"));
        a.extend(strs(&["--parca-insecure", "--parca-bearer-token-file"]));
        a.push(token.display().to_string());
        a
    });
    let stripped = stripped_busy();
    let waits = compile_plain("gcc", "offcpu.c", "offcpu-gcc", &["-O2", "-g", "-pthread"]);
    let mut w1 = start_workload(&workload("busy"), &["5"]);
    let mut w2 = start_workload(&stripped, &["5"]);
    let mut w3 = start_workload(&waits, &["5"]);
    let (pid, spid, wpid) = (w1.pid(), w2.pid(), w3.pid());
    w1.wait_exit(Duration::from_secs(30)).expect("busy ends");
    w2.wait_exit(Duration::from_secs(30))
        .expect("stripped busy ends");
    w3.wait_exit(Duration::from_secs(30)).expect("offcpu ends");
    assert!(f.wait_profiles(pid, 2, Duration::from_secs(15)).len() >= 2);
    // Every local round of the workload arrives at both receivers.
    let caught_up = wait_until(Duration::from_secs(30), || {
        let local = pid_rounds(&f.out, pid);
        let otlp: HashSet<u64> = otlp_profiles(&otlp_out, pid, "samples")
            .iter()
            .map(|p| p["time_unix_nano"].as_u64().unwrap())
            .collect();
        let parca = parca_rounds(&parca_out, pid);
        local
            .keys()
            .all(|k| otlp.contains(k) && parca.contains_key(k))
    });
    let lines = f.enricher.as_ref().unwrap().lines();
    assert!(
        caught_up,
        "rounds missing upstream: local {:?}, OTLP {:?}, Parca {:?}, requests {:?}; enricher log:\n{lines:#?}",
        pid_rounds(&f.out, pid),
        otlp_profiles(&otlp_out, pid, "samples")
            .iter()
            .map(|p| (p["time_unix_nano"].clone(), p["total"].clone()))
            .collect::<Vec<_>>(),
        parca_rounds(&parca_out, pid),
        received_kind(&otlp_out, "request"),
    );

    // OTLP: every index resolved, the header sent, values equal to the local sink's.
    for r in received_kind(&otlp_out, "request") {
        assert_eq!(r["errors"], serde_json::json!([]), "{r}");
        assert_eq!(r["headers"]["x-firn-test"], "yes");
    }
    let local = pid_rounds(&f.out, pid);
    let samples = otlp_profiles(&otlp_out, pid, "samples");
    let cpu = otlp_profiles(&otlp_out, pid, "cpu");
    let period = 1_000_000_000u64 / 99;
    // Summed per round as the local sink's index is: a sample that lands between the
    // workload's fork and its exec makes a second process under the same pid.
    let mut by_round: HashMap<u64, (u64, u64)> = HashMap::new();
    for p in &samples {
        let t = p["time_unix_nano"].as_u64().unwrap();
        by_round.entry(t).or_default().0 += p["total"].as_u64().unwrap_or(0);
        assert_eq!(p["unit"], "count");
        assert_eq!(p["period_type"], "cpu");
        assert_eq!(p["period"].as_u64(), Some(period));
        assert!(
            cpu.iter()
                .any(|c| c["time_unix_nano"] == p["time_unix_nano"]),
            "a cpu profile beside each samples profile"
        );
    }
    for c in &cpu {
        assert_eq!(c["unit"], "nanoseconds");
        let t = c["time_unix_nano"].as_u64().unwrap();
        by_round.entry(t).or_default().1 += c["total"].as_u64().unwrap_or(0);
    }
    for (t, (n, ns)) in &by_round {
        assert_eq!(Some(*n), local.get(t).copied(), "round {t}");
        assert_eq!(*ns, local[t] * period, "round {t}");
    }
    // A sample between the fork and the exec is the test binary's process (same pid).
    let busy = |p: &&Value| p["resource"]["process.executable.name"] == "busy";
    let res = &samples.iter().find(busy).expect("busy's profile")["resource"];
    assert_eq!(res["service.name"], "busy");
    assert!(
        res["host.name"].as_str().is_some_and(|h| !h.is_empty()),
        "{res}"
    );
    let names = frames_of(&samples);
    for want in ["hot_leaf", "middle", "outer", "main"] {
        assert!(
            names.contains(want),
            "{want} missing from OTLP frames: {names:?}"
        );
    }

    // Parca: the stand-in's checks passed, labels and values as the local sink's.
    for w in received_kind(&parca_out, "writeraw") {
        assert_eq!(w["errors"], serde_json::json!([]), "{w}");
        assert_eq!(w["normalized"], false);
    }
    let parca = parca_rounds(&parca_out, pid);
    for (t, n) in &local {
        assert_eq!(parca.get(t), Some(n), "Parca round {t}");
    }
    let series: Vec<Value> = received_kind(&parca_out, "writeraw")
        .into_iter()
        .flat_map(|w| w["series"].as_array().unwrap().clone())
        .filter(|s| s["labels"]["pid"].as_str() == Some(pid.to_string().as_str()))
        .collect();
    assert_eq!(series[0]["labels"]["__name__"], "parca_agent");
    assert_eq!(
        series[0]["samples"][0]["types"],
        serde_json::json!(["samples/count", "cpu/nanoseconds"])
    );
    let names: HashSet<String> = series
        .iter()
        .flat_map(|s| s["samples"][0]["stacks"].as_array().unwrap().clone())
        .flat_map(|st| st["frames"].as_array().unwrap().clone())
        .filter_map(|n| n.as_str().map(str::to_string))
        .collect();
    assert!(names.contains("hot_leaf"), "{names:?}");
    off_cpu_arrived(&f, wpid, &otlp_out, &parca_out);

    // Debuginfo: the stripped binary, whose frames stayed addresses, was uploaded whole;
    // the named one was not.
    let want = sha256(&stripped);
    let named = sha256(&workload("busy"));
    let got = wait_until(Duration::from_secs(20), || {
        received_kind(&parca_out, "finished").iter().any(|fin| {
            received_kind(&parca_out, "upload")
                .iter()
                .any(|u| u["sha256"] == want.as_str() && u["build_id"] == fin["build_id"])
        })
    });
    assert!(
        got,
        "stripped binary not uploaded: {:#?}",
        received(&parca_out)
    );
    for u in received_kind(&parca_out, "upload") {
        assert_eq!(u["errors"], serde_json::json!([]), "{u}");
        assert_ne!(
            u["sha256"],
            named.as_str(),
            "a binary firn could name was uploaded"
        );
    }
    let stripped_profiles = otlp_profiles(&otlp_out, spid, "samples");
    assert!(
        stripped_profiles
            .iter()
            .flat_map(|p| p["stacks"].as_array().unwrap().iter())
            .any(|s| !s["unnamed_build_ids"].as_array().unwrap().is_empty()),
        "the stripped binary's unnamed frames carry no build id in OTLP"
    );

    // Counters, and the token nowhere in logs or metrics.
    assert!(upload_metric(&f, "requests_sent_total", "otlp") >= 2.0);
    assert!(upload_metric(&f, "requests_sent_total", "parca") >= 2.0);
    assert_eq!(upload_metric(&f, "rejected_total", "otlp"), 0.0);
    assert_eq!(upload_metric(&f, "rejected_total", "parca"), 0.0);
    assert!(
        f.metric("firn_enricher_debuginfo_uploaded_total")
            .unwrap_or(0.0)
            >= 1.0
    );
    let (_, metrics) = f.get("/metrics");
    assert!(!String::from_utf8_lossy(&metrics).contains(TOKEN));
    let e = f.enricher.as_mut().unwrap();
    e.signal(nix::sys::signal::Signal::SIGTERM);
    e.wait_exit(Duration::from_secs(15))
        .expect("enricher stops");
    assert!(!e.lines().iter().any(|l| l.contains(TOKEN)), "token logged");
}

/// OTLP: down at start, killed mid-stream, slow (10 s for a call), and the enricher
/// restarted meanwhile: every round the local sink wrote arrives, and none arrives
/// again after the restart. Parca: UNAVAILABLE and RESOURCE_EXHAUSTED are retried,
/// INVALID_ARGUMENT is not, and is counted.
#[test]
fn outages_restarts_and_refusals_lose_nothing() {
    if !can_run_bpf() {
        return;
    }
    let rx = TempDir::new("upl-fault-rx");
    let (op, pp) = (free_port(), free_port());
    let otlp_out = rx.path().join("otlp.jsonl");
    let parca_out = rx.path().join("parca.jsonl");
    let _parca = start_parca_receiver(
        pp,
        &parca_out,
        &[
            "--fail",
            "UNAVAILABLE:2,RESOURCE_EXHAUSTED:1,INVALID_ARGUMENT:1",
        ],
    );
    let args: Vec<String> = {
        let mut a = strs(&["--otlp-endpoint"]);
        a.push(format!("http://127.0.0.1:{op}"));
        a.push("--parca-address".into());
        a.push(format!("127.0.0.1:{pp}"));
        a.extend(strs(&[
            "--parca-insecure",
            "--upload-backoff-max",
            "2s",
            "--debuginfo-upload",
            "off",
        ]));
        a
    };
    let mut f = Firn::start_with("upl-fault", FAST, |_| args.clone());
    let mut w = start_workload(&workload("busy"), &["40"]);
    let pid = w.pid();
    let all_arrived = |f: &Firn| {
        let otlp: HashSet<u64> = otlp_profiles(&otlp_out, pid, "samples")
            .iter()
            .map(|p| p["time_unix_nano"].as_u64().unwrap())
            .collect();
        let local = pid_rounds(&f.out, pid);
        !local.is_empty() && local.keys().all(|k| otlp.contains(k))
    };
    // Down at start: rounds wait.
    std::thread::sleep(Duration::from_secs(6));
    assert!(upload_metric(&f, "retries_total", "otlp") >= 1.0);
    assert_eq!(upload_metric(&f, "failing", "otlp"), 1.0);
    let mut rx1 = start_otlp_receiver(op, &otlp_out, &[]);
    assert!(
        wait_until(Duration::from_secs(30), || all_arrived(&f)),
        "backlog not delivered"
    );
    // Killed mid-stream, then back slow: the first call takes 10 s.
    rx1.child.kill().ok();
    rx1.wait_exit(Duration::from_secs(5));
    std::thread::sleep(Duration::from_secs(4));
    let _rx2 = start_otlp_receiver(op, &otlp_out, &["--delay", "10", "--delay-calls", "1"]);
    assert!(
        wait_until(Duration::from_secs(45), || all_arrived(&f)),
        "not delivered after the slow call"
    );
    // Parca meanwhile: two UNAVAILABLE and one RESOURCE_EXHAUSTED retried, then the
    // INVALID_ARGUMENT request dropped and counted, never sent again.
    assert!(
        wait_until(Duration::from_secs(20), || upload_metric(
            &f,
            "rejected_total",
            "parca"
        ) == 1.0),
        "INVALID_ARGUMENT not counted: {:#?}",
        received(&parca_out)
    );
    assert!(upload_metric(&f, "retries_total", "parca") >= 3.0);
    // A restart of the enricher: what it had not sent waits in the spool.
    let e = f.enricher.as_mut().unwrap();
    e.signal(nix::sys::signal::Signal::SIGTERM);
    e.wait_exit(Duration::from_secs(20))
        .expect("enricher stops");
    let restarted = now_secs();
    f.start_enricher(&args.iter().map(String::as_str).collect::<Vec<_>>());
    w.wait_exit(Duration::from_secs(60)).expect("busy ends");
    assert!(
        wait_until(Duration::from_secs(30), || all_arrived(&f)),
        "not delivered after the restart"
    );

    // Nothing lost; nothing received after the restart that had arrived before it.
    let profiles = received_kind(&otlp_out, "profile");
    let before: HashSet<&str> = profiles
        .iter()
        .filter(|p| p["t"].as_f64().unwrap() < restarted)
        .map(|p| p["profile_id"].as_str().unwrap())
        .collect();
    let again: Vec<&Value> = profiles
        .iter()
        .filter(|p| p["t"].as_f64().unwrap() >= restarted)
        .filter(|p| before.contains(p["profile_id"].as_str().unwrap()))
        .collect();
    assert!(
        again.is_empty(),
        "sent twice across the restart: {again:#?}"
    );
    for r in received_kind(&otlp_out, "request") {
        assert_eq!(r["errors"], serde_json::json!([]), "{r}");
    }

    // Parca: the four failures only; every round but the refused one arrived.
    let failed = received_kind(&parca_out, "failed");
    assert_eq!(failed.len(), 4, "{failed:#?}");
    // OTLP having the last round says nothing of Parca's queue: wait for it too.
    let parca_missing = || {
        let local = pid_rounds(&f.out, pid);
        let parca = parca_rounds(&parca_out, pid);
        let mut missing: Vec<u64> = local
            .into_keys()
            .filter(|k| !parca.contains_key(k))
            .collect();
        missing.sort_unstable();
        missing
    };
    wait_until(Duration::from_secs(30), || parca_missing().len() <= 1);
    let missing = parca_missing();
    assert!(
        missing.len() <= 1,
        "Parca lost more than the refused round: {missing:?}"
    );
}

fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Unmounts the test's tmpfs however the test ends.
struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// A spool on a full disk: requests that cannot be written are dropped and counted, the
/// enricher and the local sink carry on, and what was spooled is delivered later.
#[test]
fn a_full_spool_disk_is_counted_and_survived() {
    if !can_run_bpf() {
        return;
    }
    let rx = TempDir::new("upl-disk-rx");
    let op = free_port();
    let otlp_out = rx.path().join("otlp.jsonl");
    let spool = rx.path().join("spool");
    std::fs::create_dir_all(&spool).unwrap();
    let (uid, gid) = test_user("firn-test");
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o"])
        .arg(format!("size=48k,mode=0700,uid={uid},gid={gid}"))
        .arg("tmpfs")
        .arg(&spool)
        .status()
        .expect("mount");
    assert!(ok.success(), "mounting a small tmpfs");
    let _mount = Mount(spool.clone());
    let spool_arg = spool.display().to_string();
    let mut f = Firn::start_with("upl-disk", FAST, |_| {
        let mut a = strs(&["--otlp-endpoint"]);
        a.push(format!("http://127.0.0.1:{op}"));
        a.extend(strs(&[
            "--upload-memory",
            "0",
            "--upload-backoff-max",
            "2s",
            "--upload-spool-dir",
        ]));
        a.push(spool_arg.clone());
        a
    });
    let mut w = start_workload(&workload("busy"), &["25"]);
    let full = wait_until(Duration::from_secs(40), || {
        upload_metric(&f, "spool_errors_total", "otlp") >= 1.0
    });
    assert!(
        full,
        "the spool never filled: {:#?}",
        f.enricher.as_ref().unwrap().lines()
    );
    let dropped = upload_metric(&f, "dropped_total", "otlp");
    assert!(dropped >= 1.0);
    let spooled = upload_metric(&f, "spool_requests", "otlp");
    assert!(spooled >= 1.0, "nothing fitted the spool");
    assert!(f.enricher.as_mut().unwrap().running());
    let _rx = start_otlp_receiver(op, &otlp_out, &[]);
    let drained = wait_until(Duration::from_secs(40), || {
        upload_metric(&f, "spool_requests", "otlp") == 0.0
            && upload_metric(&f, "requests_sent_total", "otlp") >= spooled
    });
    assert!(drained, "spooled requests not delivered");
    w.wait_exit(Duration::from_secs(40)).expect("busy ends");
    assert!(
        !pid_rounds(&f.out, w.pid()).is_empty(),
        "the local sink stopped"
    );
    assert!(!received_kind(&otlp_out, "profile").is_empty());
    let t0 = Instant::now();
    let e = f.enricher.as_mut().unwrap();
    e.signal(nix::sys::signal::Signal::SIGTERM);
    e.wait_exit(Duration::from_secs(20))
        .expect("enricher stops");
    assert!(t0.elapsed() < Duration::from_secs(15));
}

/// OTLP over TLS: a certificate the test makes, trusted through --otlp-ca-file. The same
/// endpoint with the system's roots is refused (retried and counted, nothing sent).
#[test]
fn otlp_over_tls_trusts_the_given_ca_only() {
    if !can_run_bpf() {
        return;
    }
    let rx = TempDir::new("upl-tls-rx");
    let (ca, cert, key) = test_certificates(rx.path());
    let op = free_port();
    let otlp_out = rx.path().join("otlp.jsonl");
    let _otlp = start_otlp_receiver(
        op,
        &otlp_out,
        &[
            "--tls-cert",
            &cert.display().to_string(),
            "--tls-key",
            &key.display().to_string(),
        ],
    );
    let url = format!("https://localhost:{op}");
    let pem = std::fs::read_to_string(&ca).unwrap();
    let mut f = Firn::start_with("upl-tls", FAST, |dir| {
        let ca = readable_file(dir, "ca.pem", &pem);
        let mut a = strs(&["--otlp-endpoint", &url, "--otlp-ca-file"]);
        a.push(ca.display().to_string());
        a
    });
    let mut w = start_workload(&workload("busy"), &["3"]);
    let pid = w.pid();
    w.wait_exit(Duration::from_secs(20)).expect("busy ends");
    assert!(
        wait_until(Duration::from_secs(20), || !otlp_profiles(
            &otlp_out, pid, "samples"
        )
        .is_empty()),
        "nothing arrived over TLS: {:#?}",
        f.enricher.as_ref().unwrap().lines()
    );
    // The system's roots do not know this certificate: sends fail and are retried.
    let e = f.enricher.as_mut().unwrap();
    e.signal(nix::sys::signal::Signal::SIGTERM);
    e.wait_exit(Duration::from_secs(20))
        .expect("enricher stops");
    f.start_enricher(&["--otlp-endpoint", &url, "--upload-backoff-max", "2s"]);
    assert!(
        wait_until(Duration::from_secs(20), || upload_metric(
            &f,
            "retries_total",
            "otlp"
        ) >= 1.0),
        "an untrusted certificate was accepted"
    );
    assert_eq!(upload_metric(&f, "requests_sent_total", "otlp"), 0.0);
}

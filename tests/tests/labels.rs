//! Labels end to end (issue: labels): cgroup-derived labels of real processes in real
//! cgroups, relabeling in the running enricher, and the config file.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);
const FAST: &[&str] = &["--frequency", "99", "--round", "2"];

fn labels_of(f: &Firn, pid: u32) -> Value {
    index_entries(&f.out)
        .into_iter()
        // The shell that moved itself into the cgroup and exec'd busy is a process of
        // its own (read before it moved); busy's profile is the one that counts.
        .find(|(_, l)| {
            l["pid"].as_str() == Some(pid.to_string().as_str()) && l["executable"] == "busy"
        })
        .map(|(_, l)| l)
        .unwrap_or(Value::Null)
}

#[test]
fn container_and_systemd_labels_from_real_cgroups() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start("cg", FAST);
    let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    let pod = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod11111111_2222_3333_4444_555555555555.slice";
    let c = Cgroup::create(&format!("{pod}/cri-containerd-{id}.scope"));
    let pid = busy_in(&c, 4);
    let s = Cgroup::create("system.slice/firn-test-a\\x2db.service");
    let spid = busy_in(&s, 4);
    f.wait_profiles(spid, 2, 15 * SECS);
    let l = labels_of(&f, pid);
    assert_eq!(l["container_id"], id, "{l}");
    assert!(l.get("systemd_unit").is_none(), "{l}");
    let l = labels_of(&f, spid);
    assert_eq!(l["systemd_unit"], "firn-test-a\\x2db.service", "{l}");
    assert!(l.get("container_id").is_none(), "{l}");
    assert_eq!(l["executable"], "busy");
    assert_eq!(l["comm"], "busy");
}

#[test]
fn relabel_drop_removes_profiles_and_counts() {
    if !can_run_bpf() {
        return;
    }
    let mut f = Firn::start("drop", FAST);
    f.enricher.take().map(|mut e| e.stop());
    let cfg = f.dir.path().join("firn.yaml");
    std::fs::write(
        &cfg,
        "relabel_configs:\n\
         - {source_labels: [__meta_process_executable_name], regex: busy, action: drop}\n\
         - {source_labels: [__meta_process_pid], target_label: pid}\n\
         - {source_labels: [__meta_process_comm], target_label: comm}\n\
         external_labels: {cluster: test}\n",
    )
    .unwrap();
    f.start_enricher(&["--config", cfg.to_str().unwrap()]);
    let mut w = start_workload(&workload("busy"), &["4"]);
    let pid = w.pid();
    w.wait_exit(20 * SECS).unwrap();
    std::thread::sleep(5 * SECS);
    // busy's own samples are all dropped. The child may have been sampled between fork and
    // exec (more likely on a loaded machine): that program is the test binary, not busy,
    // so its few samples are kept under the spawning thread's comm.
    let kept: Vec<Value> = index_records(&f.out)
        .into_iter()
        .map(|(_, e)| e)
        .filter(|e| e["labels"]["pid"].as_str() == Some(pid.to_string().as_str()))
        .collect();
    let samples: u64 = kept.iter().filter_map(|e| e["samples"].as_u64()).sum();
    assert!(
        kept.iter().all(|e| e["labels"]["comm"] != "busy") && samples <= 10,
        "a dropped process still has profiles: {kept:?}"
    );
    assert!(
        f.metric("firn_enricher_processes_dropped_by_relabel_total")
            .unwrap()
            >= 1.0
    );
    assert!(
        f.metric("firn_enricher_samples_dropped_by_relabel_total")
            .unwrap()
            >= 1.0
    );
    // Others are kept, with the external label and without the meta labels.
    let any = index_entries(&f.out);
    let (_, l) = any.first().expect("other processes profiled");
    assert_eq!(l["cluster"], "test");
    assert!(
        l.as_object().unwrap().keys().all(|k| !k.starts_with("__")),
        "{l}"
    );
}

fn enricher_with_config(cfg: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(bin("firn-enricher"))
        .args([
            "--allow-root",
            "--socket",
            "/nonexistent/s.sock",
            "--config",
        ])
        .arg(cfg)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn config_errors_name_key_and_line() {
    if !bin("firn-enricher").exists() {
        panic!("build the release binaries first");
    }
    let dir = TempDir::new("cfg");
    let cases = [
        ("output_dir: /tmp/x\noutput_dirr: /tmp/y\n", &["output_dirr", "line 2"][..]),
        ("symbol_cache: lots\n", &["symbol_cache", "line 1"][..]),
        (
            "relabel_configs:\n  - source_labels: [a]\n    regex: '(unclosed'\n    target_label: b\n",
            &["invalid regex", "(unclosed", "line 3"][..],
        ),
        ("retention_size: 12 parsecs\n", &["retention_size", "line 1"][..]),
    ];
    for (text, want) in cases {
        let cfg = dir.path().join("bad.yaml");
        std::fs::write(&cfg, text).unwrap();
        let out = enricher_with_config(&cfg, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}: {err}");
        for w in want {
            assert!(err.contains(w), "{text}: error lacks {w:?}: {err}");
        }
    }
}

#[test]
fn flags_win_and_sighup_keeps_a_good_config() {
    let dir = TempDir::new("hup");
    let cfg = dir.path().join("firn.yaml");
    let from_file = dir.path().join("from-file");
    let from_flag = dir.path().join("from-flag");
    std::fs::write(
        &cfg,
        format!(
            "output_dir: {}\nhttp_address: 127.0.0.1:17650\n",
            from_file.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(bin("firn-enricher"));
    cmd.args([
        "--allow-root",
        "--socket",
        "/nonexistent/s.sock",
        "--config",
    ])
    .arg(&cfg)
    .arg("--output-dir")
    .arg(&from_flag);
    let p = Proc::spawn("enricher", cmd);
    let line = p.wait_for("writing profiles", 10 * SECS).expect("started");
    assert!(
        line.contains(from_flag.to_str().unwrap()),
        "the flag did not win: {line}"
    );
    assert!(
        line.contains("17650"),
        "the file's http_address was not used: {line}"
    );
    // A bad file on SIGHUP: refused, the old config stays.
    std::fs::write(&cfg, "relabel_configs: [{action: explode}]\n").unwrap();
    p.signal(nix::sys::signal::Signal::SIGHUP);
    assert!(p.wait_for("config reload refused", 10 * SECS).is_some());
    assert_eq!(
        http_get("127.0.0.1:17650", "/healthz").0,
        200,
        "enricher died on a bad reload"
    );
    // A good file: taken.
    std::fs::write(&cfg, "external_labels: {cluster: b}\n").unwrap();
    p.signal(nix::sys::signal::Signal::SIGHUP);
    assert!(p.wait_for("config reloaded", 10 * SECS).is_some());
    let token = std::fs::read_to_string(from_flag.join(".http-token")).unwrap_or_default();
    let (_, m) = http_get_with(
        "127.0.0.1:17650",
        "/metrics",
        &[format!("Authorization: Bearer {}", token.trim())],
    );
    let m = String::from_utf8_lossy(&m);
    assert!(
        m.contains("firn_enricher_config_reload_errors_total 1"),
        "{m}"
    );
    assert!(m.contains("firn_enricher_config_reloads_total 1"), "{m}");
}

#[test]
fn profile_by_container_merges_processes() {
    if !can_run_bpf() {
        return;
    }
    let mut f = Firn::start("byc", FAST);
    f.enricher.take().map(|mut e| e.stop());
    f.start_enricher(&["--profile-by", "container"]);
    let id = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";
    let c = Cgroup::create(&format!("system.slice/docker-{id}.scope"));
    // Two processes of the same container, one after the other.
    busy_in(&c, 3);
    busy_in(&c, 3);
    std::thread::sleep(5 * SECS);
    let entries: Vec<Value> = index_entries(&f.out)
        .into_iter()
        .map(|(_, l)| l)
        .filter(|l| l["container_id"].as_str() == Some(id))
        .collect();
    assert!(!entries.is_empty(), "no profile for the container");
    for l in &entries {
        assert!(
            l.get("pid").is_none() && l.get("comm").is_none(),
            "process labels in a container profile: {l}"
        );
        assert_eq!(l["systemd_unit"], format!("docker-{id}.scope"));
    }
    // One profile per round for the container, never one per process.
    let mut rounds = std::collections::HashMap::new();
    for (file, l) in index_entries(&f.out) {
        if l["container_id"].as_str() == Some(id) {
            *rounds
                .entry(file.parent().unwrap().to_path_buf())
                .or_insert(0) += 1;
        }
    }
    assert!(rounds.values().all(|&n| n == 1), "{rounds:?}");
}

/// CPU seconds (user + system) `pid` has used.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = after
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // utime and stime are fields 14 and 15: 12 and 13 after the comm.
    (f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)) as f64 / 100.0
}

#[test]
fn labels_follow_a_process_into_another_cgroup_and_hopping_is_bounded() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start("cgmove", FAST);
    let mut busy = start_workload(&workload("busy"), &["12"]);
    let pid = busy.pid();
    std::thread::sleep(4 * SECS);
    let unit = "firn-test-moved.service";
    let moved = Cgroup::create(&format!("system.slice/{unit}"));
    let at = now_ns();
    std::fs::write(moved.procs(), pid.to_string()).expect("move the workload");
    busy.wait_exit(30 * SECS).expect("workload ends");
    f.wait_profiles(pid, 5, 30 * SECS);
    std::thread::sleep(3 * SECS);
    let entries: Vec<Value> = index_records(&f.out)
        .into_iter()
        .filter(|(_, r)| r["labels"]["pid"].as_str() == Some(pid.to_string().as_str()))
        .map(|(_, r)| r)
        .collect();
    let unit_of = |r: &Value| r["labels"]["systemd_unit"].as_str().map(str::to_string);
    let round_ns = 2_000_000_000;
    // Rounds wholly before the move: the old cgroup; wholly after: the new one alone.
    let before: Vec<&Value> = entries
        .iter()
        .filter(|r| r["start_ns"].as_u64().unwrap_or(0) + round_ns <= at)
        .collect();
    let after: Vec<&Value> = entries
        .iter()
        .filter(|r| r["start_ns"].as_u64().unwrap_or(0) > at)
        .collect();
    assert!(!before.is_empty() && after.len() >= 3, "{entries:#?}");
    assert!(
        before.iter().all(|r| unit_of(r).as_deref() != Some(unit)),
        "{before:#?}"
    );
    assert!(
        after.iter().all(|r| unit_of(r).as_deref() == Some(unit)),
        "{after:#?}"
    );
    assert!(f.metric("firn_sampler_cgroup_moves").unwrap_or(0.0) >= 1.0);
    drop(moved);

    // A process hopping between two cgroups a thousand times a second: reads within
    // their rate bound (a read that finds the process already moved on is refused by
    // the cgroup filesystem's inode and done again), the sampler's CPU and memory
    // bounded.
    let a = Cgroup::create("system.slice/firn-test-hop-a.service");
    let b = Cgroup::create("system.slice/firn-test-hop-b.service");
    let mut busy = start_workload(&workload("busy"), &["12"]);
    let pid = busy.pid().to_string();
    let spid = f.sampler.pid();
    let (cpu0, reads0) = (
        cpu_secs(spid),
        f.metric("firn_sampler_cgroup_reads").unwrap_or(0.0),
    );
    let t0 = Instant::now();
    let mut hops = 0u64;
    while t0.elapsed() < 10 * SECS {
        let to = if hops.is_multiple_of(2) { &a } else { &b };
        if std::fs::write(to.procs(), &pid).is_ok() {
            hops += 1;
        }
        std::thread::sleep(Duration::from_micros(900));
    }
    let secs = t0.elapsed().as_secs_f64();
    let cpu = (cpu_secs(spid) - cpu0) / secs * 1000.0;
    busy.wait_exit(30 * SECS).expect("workload ends");
    std::thread::sleep(3 * SECS);
    let reads = f.metric("firn_sampler_cgroup_reads").unwrap_or(0.0) - reads0;
    let moves = f.metric("firn_sampler_cgroup_moves").unwrap_or(0.0);
    let hwm = status_kib(spid, "VmHWM").unwrap_or(0);
    eprintln!(
        "{hops} hops in {secs:.1} s: sampler {cpu:.2} ms/s, {reads} cgroup reads, \
         {moves} moves seen, VmHWM {hwm} KiB"
    );
    assert!(hops as f64 / secs >= 500.0, "the hopper was too slow");
    assert!(
        reads <= 50.0 * (secs + 6.0) + 100.0,
        "{reads} reads: over the rate bound"
    );
    assert!(moves >= 100.0, "BPF saw few moves: {moves}");
    assert!(cpu < 20.0, "sampler at {cpu:.2} ms/s while hopping");
    assert!(hwm <= 24 * 1024, "sampler peak RSS {hwm} KiB");
    drop((a, b));
}

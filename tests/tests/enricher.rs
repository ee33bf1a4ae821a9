//! End-to-end tests of firn-enricher with the real sampler (issue: enricher). The
//! enricher runs as an unprivileged test user; profiles are read back with
//! `go tool pprof`, which no one here wrote.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);
const FAST: &[&str] = &["--frequency", "99", "--round", "2"];

fn run_workload(path: &std::path::Path, args: &[&str], secs: u64) -> u32 {
    let mut w = start_workload(path, args);
    let pid = w.pid();
    w.wait_exit(Duration::from_secs(secs + 20))
        .expect("workload ends");
    pid
}

#[test]
fn workload_traces_http_and_privileges() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start("enr", FAST);
    let e = f.enricher.as_ref().unwrap();
    // Unprivileged: non-zero uid, no capability.
    let uid = status_field(e.pid(), "Uid").unwrap();
    let eff = status_field(e.pid(), "CapEff").unwrap();
    // setpriv execs the enricher in place, so the pid is the enricher's.
    assert!(!uid.starts_with("0\t"), "enricher runs as root: {uid}");
    assert_eq!(eff, "0000000000000000");

    let pid = run_workload(&workload("busy"), &["6"], 6);
    let files = f.wait_profiles(pid, 3, 15 * SECS);
    let tr = traces(&files);
    let total: u64 = tr.iter().map(|t| t.0).sum();
    let leaf: u64 = tr
        .iter()
        .filter(|t| t.1.first().is_some_and(|f| f == "hot_leaf"))
        .map(|t| t.0)
        .sum();
    assert!(total > 0);
    assert!(
        leaf * 100 >= total * 80,
        "hot_leaf has {leaf} of {total} samples:\n{tr:#?}"
    );
    let chain = ["hot_leaf", "middle", "outer", "main"];
    assert!(
        tr.iter().any(|t| t.1.len() >= 4 && t.1[..4] == chain),
        "no trace hot_leaf <- middle <- outer <- main:\n{tr:#?}"
    );

    // HTTP: metrics, health, the latest profiles, the whole-host profile, self-profile.
    let (code, body) = f.get("/metrics");
    assert_eq!(code, 200);
    let text = String::from_utf8_lossy(&body);
    for m in [
        "firn_enricher_batches_received_total",
        "firn_enricher_samples_received_total",
        "firn_enricher_frames_symbolized_total",
        "firn_enricher_broker_refusals_total",
        "firn_enricher_sink_errors_total",
        "firn_enricher_round_lag_seconds",
        "firn_sampler_batches_dropped",
    ] {
        assert!(text.contains(m), "/metrics lacks {m}");
    }
    assert_eq!(f.get("/healthz").0, 200);
    let (code, body) = f.get("/profiles");
    assert_eq!(code, 200);
    let list: Value = serde_json::from_slice(&body).unwrap();
    let first = list
        .as_array()
        .and_then(|l| l.first())
        .expect("a profile listed");
    let url = first["url"].as_str().unwrap().to_string();
    let (code, gz) = f.get(&url);
    assert_eq!(code, 200);
    let one = f.dir.path().join("one.pb.gz");
    std::fs::write(&one, gz).unwrap();
    go_pprof(&["-top"], &[one]);
    let (code, gz) = f.get(&format!("/pprof/cpu?seconds=60&pid={pid}"));
    assert_eq!(code, 200);
    let host = f.dir.path().join("host.pb.gz");
    std::fs::write(&host, gz).unwrap();
    let top = go_pprof(&["-top"], std::slice::from_ref(&host));
    assert!(
        top.contains("hot_leaf"),
        "/pprof/cpu lacks the workload:\n{top}"
    );
    assert_eq!(f.get("/pprof/cpu?seconds=0").0, 400);
    // As the README says to use it: pprof fetches the URL itself and asks /symbolz to
    // name what firn left as addresses (a 404 there made it exit 1).
    let url = f.url("/pprof/cpu?seconds=60");
    let top = go_pprof(&["-top", &url], &[]);
    assert!(top.contains("hot_leaf"), "{top}");
    let (code, body) = f.get("/symbolz");
    assert_eq!((code, body.as_slice()), (200, &b"num_symbols: 0\n"[..]));
    // The enricher's own profile is off unless --http-self-profile (tests/tests/http.rs).
    assert_eq!(f.get("/debug/pprof/profile?seconds=1").0, 404);
}

#[test]
fn go_and_cpp_inline_frames() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start("lang", FAST);
    let go = go_workload("gospin");
    let cpp = compile("inline.cpp", "inline", &[]);
    let mut g = start_workload(&go, &["5"]);
    let mut c = start_workload(&cpp, &["5"]);
    let (gpid, cpid) = (g.pid(), c.pid());
    g.wait_exit(30 * SECS).unwrap();
    c.wait_exit(30 * SECS).unwrap();
    let gt = traces(&f.wait_profiles(gpid, 2, 15 * SECS));
    assert!(
        gt.iter().any(|t| t.1.iter().any(|f| f == "main.spinLeaf")),
        "Go functions missing:\n{gt:#?}"
    );
    assert!(gt.iter().all(|t| t.1.iter().all(|f| !f.is_empty())));
    let files = f.wait_profiles(cpid, 2, 15 * SECS);
    let ct = traces(&files);
    assert!(
        ct.iter().any(|t| t.1.len() >= 2
            && t.1[0] == "firn::mix (inline)"
            && t.1[1].starts_with("firn::Spinner")),
        "inlined C++ frame missing:\n{ct:#?}"
    );
    // The inlined function's own source line, from DWARF.
    let lines = go_pprof(&["-traces", "-lines"], &files);
    assert!(
        lines
            .lines()
            .any(|l| l.contains("firn::mix") && l.contains("inline.cpp:")),
        "no file:line for the inline frame:\n{lines}"
    );
}

#[test]
fn library_loaded_after_start() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start("dlopen", FAST);
    let lib = compile("plug.c", "libfirnplug.so", &["-shared", "-fPIC"]);
    let exe = compile("dlopen.c", "dlopen", &["-ldl"]);
    let lib_s = lib.to_string_lossy().to_string();
    let pid = run_workload(&exe, &[&lib_s, "3", "5"], 8);
    let tr = traces(&f.wait_profiles(pid, 3, 15 * SECS));
    assert!(
        tr.iter()
            .any(|t| t.1.first().is_some_and(|f| f == "plug_leaf")),
        "the dlopened library was not symbolized:\n{tr:#?}"
    );
}

/// Runs `script` in a new mount namespace (`unshare -m`), printing the workload's pid.
fn ns_pid(p: &Proc) -> u32 {
    let line = p
        .wait_for("ready", 20 * SECS)
        .expect("workload in the namespace started");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn binary_only_inside_a_mount_namespace() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start("mntns", FAST);
    let busy = workload("busy");
    let hidden = f.dir.path().join("hidden");
    std::fs::create_dir_all(&hidden).unwrap();
    let h = hidden.display();
    // The binary lives on a tmpfs mounted only in the namespace: the host never sees it.
    let mut ns = in_mount_ns(&format!(
        "mount -t tmpfs none {h} && cp {} {h}/ns-busy && exec {h}/ns-busy 6",
        busy.display()
    ));
    let pid = ns_pid(&ns);
    assert!(!hidden.join("ns-busy").exists());
    ns.wait_exit(30 * SECS).unwrap();
    let tr = traces(&f.wait_profiles(pid, 3, 15 * SECS));
    assert!(
        tr.iter()
            .any(|t| t.1.first().is_some_and(|f| f == "hot_leaf")),
        "binary in the namespace not symbolized through the broker:\n{tr:#?}"
    );
}

#[test]
fn broker_resolves_inside_the_root_and_checks_identity() {
    if !can_run_bpf() {
        return;
    }
    // The enricher starts only after the namespace was rearranged, so its broker
    // requests see the paths the sampler recorded before.
    // Handles off: handles taken before the rearranging would serve the files the
    // processes really mapped; the path walk's checks are what is tested here.
    let mut f = Firn::start("safety", &[FAST, WALK_ONLY].concat());
    f.enricher.take().map(|mut e| e.stop());
    let busy = workload("busy");
    let t = f.dir.path().join("t");
    // On the host, below the namespace's tmpfs: a different copy of the binary.
    std::fs::create_dir_all(t.join("elsewhere")).unwrap();
    std::fs::copy(&busy, t.join("elsewhere/ns-busy")).unwrap();
    let t = t.display();
    let b = busy.display();
    // Each binary's path is then covered by a bind mount: the path the process maps
    // (and /proc/<pid>/maps keeps showing) leads to something else. d1's cover holds an
    // absolute symlink to a path only the host has; d3's cover holds another copy (other
    // inode) under the same name.
    let mut ns = in_mount_ns(&format!(
        "mount -t tmpfs none {t} && mkdir {t}/d1 {t}/d3 {t}/cover1 {t}/cover3 && \
         cp {b} {t}/d1/ns-busy && cp {b} {t}/d3/ns-busy && \
         ({t}/d1/ns-busy 14 &) && ({t}/d3/ns-busy 14 &) && sleep 4 && \
         ln -s {t}/elsewhere/ns-busy {t}/cover1/ns-busy && cp {b} {t}/cover3/ns-busy && \
         mount --bind {t}/cover1 {t}/d1 && mount --bind {t}/cover3 {t}/d3 && \
         echo rearranged && sleep 12"
    ));
    let line = ns
        .wait_for("rearranged", 30 * SECS)
        .expect("namespace rearranged");
    let pids: Vec<u32> = ns
        .lines()
        .iter()
        .filter(|l| l.starts_with("ready"))
        .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(pids.len(), 2, "{line}");
    f.start_enricher(&[]);
    ns.wait_exit(30 * SECS).unwrap();
    std::thread::sleep(3 * SECS);
    // Through the absolute symlink: the sampler resolved it inside the namespace's root,
    // where it leads nowhere (refused as gone), not to the host's copy (which would
    // have been an identity mismatch). The covered file: identity mismatch.
    let (_, body) = f.get("/metrics");
    let m = String::from_utf8_lossy(&body).to_string();
    let val = |k: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("firn_sampler_{k} ")))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert!(
        val("broker_refused_deleted") >= 1,
        "symlinked path was not refused:\n{m}"
    );
    assert!(
        val("broker_refused_identity") >= 1,
        "replaced file was not refused:\n{m}"
    );
    for pid in pids {
        let files = f.profiles_of(pid);
        if files.is_empty() {
            continue;
        }
        let tr = traces(&files);
        assert!(
            tr.iter().all(|t| !t.1.iter().any(|f| f == "hot_leaf")),
            "pid {pid} got names from a file it does not map:\n{tr:#?}"
        );
    }
}

#[test]
fn stripped_binary_keeps_addresses() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start("strip", FAST);
    // A build id of its own: the enricher rightly takes symbols from any copy with the
    // same build id (the same code), so a plain copy of `busy` got names whenever an
    // unstripped `busy` ran meanwhile (another test's leftover, a benchmark).
    let busy = compile(
        "busy.c",
        "busy-own-build-id",
        &[
            "-pthread",
            "-Wl,--build-id=0xf1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4",
        ],
    );
    let stripped = f.dir.path().join("busy-stripped");
    let st = Command::new("llvm-strip")
        .arg("-o")
        .arg(&stripped)
        .arg(&busy)
        .status()
        .or_else(|_| {
            Command::new("strip")
                .arg("-o")
                .arg(&stripped)
                .arg(&busy)
                .status()
        })
        .expect("strip");
    assert!(st.success());
    let pid = run_workload(&stripped, &["5"], 5);
    let files = f.wait_profiles(pid, 2, 15 * SECS);
    let tr = traces(&files);
    for t in &tr {
        for fr in &t.1 {
            assert!(
                !["hot_leaf", "middle", "outer"].contains(&fr.as_str()),
                "a stripped binary got a name: {fr}"
            );
        }
    }
    let raw = go_pprof(&["-raw"], &files);
    let build_id = Command::new("readelf")
        .args(["-n"])
        .arg(&busy)
        .output()
        .unwrap();
    let notes = String::from_utf8_lossy(&build_id.stdout);
    let id = notes
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: "))
        .expect("busy has a build id")
        .trim()
        .to_string();
    assert!(raw.contains(&id), "mapping lacks the build id {id}:\n{raw}");
    assert!(
        raw.contains("busy-stripped"),
        "mapping lacks the file name:\n{raw}"
    );
}

#[test]
fn sampler_and_enricher_restarts() {
    if !can_run_bpf() {
        return;
    }
    let mut f = Firn::start("restart", FAST);
    let mut w = start_workload(&workload("busy"), &["40"]);
    let pid = w.pid();
    f.wait_profiles(pid, 2, 15 * SECS);
    // Sampler killed mid-round, restarted: the same enricher resumes within two rounds.
    std::thread::sleep(Duration::from_millis(700));
    f.sampler.signal(nix::sys::signal::Signal::SIGKILL);
    f.sampler.wait_exit(5 * SECS);
    let before = f.profiles_of(pid).len();
    let enricher_pid = f.enricher.as_ref().unwrap().pid();
    f.restart_sampler();
    let after = f.wait_profiles(pid, before + 2, 12 * SECS);
    assert!(
        after.len() >= before + 2,
        "no profiles within two rounds of the restart"
    );
    assert_eq!(f.enricher.as_ref().unwrap().pid(), enricher_pid);
    assert!(
        f.enricher
            .as_mut()
            .unwrap()
            .child
            .try_wait()
            .unwrap()
            .is_none(),
        "enricher died"
    );
    let tr = traces(&after[before..]);
    assert!(tr
        .iter()
        .any(|t| t.1.first().is_some_and(|f| f == "hot_leaf")));
    // Enricher killed, restarted: the sampler kept serving.
    let e = f.enricher.as_mut().unwrap();
    e.signal(nix::sys::signal::Signal::SIGKILL);
    e.wait_exit(5 * SECS);
    std::thread::sleep(3 * SECS);
    assert!(
        f.sampler.child.try_wait().unwrap().is_none(),
        "sampler died with its client"
    );
    let before = f.profiles_of(pid).len();
    f.start_enricher(&[]);
    let after = f.wait_profiles(pid, before + 2, 12 * SECS);
    assert!(after.len() >= before + 2);
    w.stop();
}

#[test]
fn full_disk_pauses_and_resumes() {
    if !can_run_bpf() {
        return;
    }
    let mut f = Firn::start("disk", FAST);
    f.enricher.take().map(|mut e| e.stop());
    // A small tmpfs as the output directory.
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m,mode=0777", "none"])
        .arg(&f.out)
        .status()
        .unwrap();
    assert!(st.success(), "mount tmpfs");
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _guard = Unmount(f.out.clone());
    f.start_enricher(&["--min-free", "256KiB"]);
    let _w = start_workload(&workload("busy"), &["30"]);
    std::thread::sleep(5 * SECS);
    assert!(
        f.metric("firn_enricher_rounds_written_total")
            .unwrap_or(0.0)
            >= 1.0
    );
    // Fill the disk. The unwind table cache gives its files up when the profiles' free
    // space runs low (with a build beside the test it holds hundreds of KiB of the
    // compiler's libraries), so what that frees by the next round is taken too.
    let fill = |name: &str| {
        let _ = Command::new("dd")
            .args(["if=/dev/zero", "bs=4k", "count=1024"])
            .arg(format!("of={}", f.out.join(name).display()))
            .stderr(std::process::Stdio::null())
            .status();
    };
    fill("filler");
    std::thread::sleep(3 * SECS);
    fill("filler-2");
    std::thread::sleep(6 * SECS);
    let full = f
        .metric("firn_enricher_sink_disk_full_total")
        .unwrap_or(0.0)
        + f.metric("firn_enricher_sink_errors_total").unwrap_or(0.0);
    assert!(full >= 1.0, "no full-disk rounds counted");
    let e = f.enricher.as_mut().unwrap();
    assert!(
        e.child.try_wait().unwrap().is_none(),
        "enricher died on a full disk"
    );
    let written = f.metric("firn_enricher_rounds_written_total").unwrap();
    for name in ["filler", "filler-2"] {
        std::fs::remove_file(f.out.join(name)).unwrap();
    }
    std::thread::sleep(6 * SECS);
    assert!(
        f.metric("firn_enricher_rounds_written_total").unwrap() > written,
        "writing did not resume after space was freed"
    );
    // Nothing partial: no temp folders, every file a complete gzip.
    for entry in std::fs::read_dir(&f.out).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        assert!(!name.starts_with(".tmp-"), "partial round left: {name}");
    }
    for (file, _) in index_entries(&f.out) {
        let st = Command::new("gzip").arg("-t").arg(&file).status().unwrap();
        assert!(st.success(), "truncated file {}", file.display());
    }
}

//! End-to-end test of the local web view (issue: web view): the real sampler and
//! enricher, a real headless Chromium (Debian's, through chromedriver and selenium:
//! `tests/web/view_check.py`), and `go tool pprof` reading what the page offers. The
//! sampler measures off-CPU time too, so the page's off-CPU switch is checked on a
//! program that waits beside the busy one.

use std::process::Command;
use std::time::Duration;

use firn_tests::*;

#[test]
fn the_page_shows_the_machine_narrows_to_a_process_and_downloads_pprof() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start("view", &["--frequency", "99", "--round", "2", "--off-cpu"]);
    // Two programs, so that the machine view has more than one to choose from, and one
    // that waits (on a pipe, a mutex, asleep) for the off-CPU switch.
    let waits = compile_plain("gcc", "offcpu.c", "offcpu-gcc", &["-O2", "-g", "-pthread"]);
    let mut busy = start_workload(&workload("busy"), &["8"]);
    let mut other = start_workload(&workload("chain"), &["8"]);
    let mut waiting = start_workload(&waits, &["8"]);
    let pid = busy.pid();
    assert!(f.wait_profiles(pid, 3, Duration::from_secs(20)).len() >= 3);
    let shots = repo_root().join("target/view-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let pprof = f.dir.path().join("download.pb.gz");
    let out = Command::new(repo_root().join("target/test-venv/bin/python"))
        .arg(repo_root().join("tests/web/view_check.py"))
        .args([
            "--url",
            &format!("http://{}", f.http),
            "--token",
            &f.token(),
            "--pid",
            &pid.to_string(),
        ])
        .args(["--offcpu-pid", &waiting.pid().to_string()])
        .args(["--function", "hot_leaf", "--shots"])
        .arg(&shots)
        .arg("--pprof-out")
        .arg(&pprof)
        .output()
        .expect("run tests/web/view_check.py (tests/setup-tools.sh installs it)");
    busy.wait_exit(Duration::from_secs(30));
    other.wait_exit(Duration::from_secs(30));
    waiting.wait_exit(Duration::from_secs(30));
    assert!(
        out.status.success(),
        "the browser check failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("view: {}", String::from_utf8_lossy(&out.stdout).trim());
    // The downloaded pprof is the process's, and go tool pprof reads it.
    let top = go_pprof(&["-top", "-symbolize=none"], &[pprof]);
    assert!(top.contains("hot_leaf"), "{top}");
    // pprof fetching the whole machine itself exits 0 (it asks /symbolz, answered).
    let url = f.url("/pprof/cpu?seconds=60");
    let top = go_pprof(&["-top"], &[url.into()]);
    assert!(top.contains("hot_leaf"), "{top}");
}

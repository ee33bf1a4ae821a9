//! Python frames of a CPython in a podman container: its own pid and mount namespaces,
//! its files at the overlay's inodes. Read back with `go tool pprof -traces -lines`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use firn_tests::pyframes::*;
use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);
const FAST: &[&str] = &["--frequency", "99", "--round", "1"];

/// podman with this test's containers.conf (as tests/tests/pod.rs runs it).
fn podman(conf: &Path, program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .env("CONTAINERS_CONF", conf)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e} (apt-get install podman buildah runc)"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// An image of Debian's python3.11, its standard library, the libraries both load, and
/// the workload at /app: files the host has at other inodes (the overlay's).
fn python_image(conf: &Path, tag: &str) {
    let dir = TempDir::new("pyimg");
    let root = dir.path();
    let copy = |from: &Path| {
        let to = root.join(from.strip_prefix("/").unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        let ok = Command::new("cp")
            .arg("-a")
            .arg(from)
            .arg(&to)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "cp {}", from.display());
    };
    let python = Path::new("/usr/bin/python3.11");
    copy(python);
    copy(Path::new("/usr/lib/python3.11"));
    let mut objects = vec![python.to_path_buf()];
    for e in std::fs::read_dir("/usr/lib/python3.11/lib-dynload")
        .unwrap()
        .flatten()
    {
        objects.push(e.path());
    }
    let mut libs = std::collections::BTreeSet::new();
    for o in &objects {
        let ldd = Command::new("ldd").arg(o).output().unwrap();
        for line in String::from_utf8_lossy(&ldd.stdout).lines() {
            if let Some(lib) = line.split_whitespace().find(|w| w.starts_with('/')) {
                libs.insert(PathBuf::from(lib));
            }
        }
    }
    // Each at the path the loader asks for, as a file (the image has no /lib link).
    for lib in &libs {
        let to = root.join(lib.strip_prefix("/").unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(lib, &to).unwrap();
    }
    std::fs::create_dir_all(root.join("app")).unwrap();
    std::fs::copy(script(), root.join("app/pychain.py")).unwrap();
    let ctr = podman(conf, "buildah", &["from", "scratch"]);
    podman(
        conf,
        "buildah",
        &["copy", "--quiet", &ctr, &root.display().to_string(), "/"],
    );
    podman(conf, "buildah", &["commit", "--quiet", "--rm", &ctr, tag]);
}

#[test]
fn python_frames_in_a_podman_container() {
    if !can_run_bpf() {
        return;
    }
    if !firn_tests::containers::podman_usable() {
        return;
    }
    let dir = TempDir::new("pycontainer");
    let conf = firn_tests::containers::containers_conf(dir.path());
    let image = "localhost/firn-test-python:test";
    python_image(&conf, image);
    let name = format!("firn-py-{}", std::process::id());
    let f = Firn::start("pycontainer", FAST);
    let id = podman(
        &conf,
        "podman",
        &[
            "run",
            "-d",
            "--name",
            &name,
            "--network",
            "none",
            image,
            "/usr/bin/python3.11",
            "/app/pychain.py",
            "120",
        ],
    );
    let pid: u32 = podman(
        &conf,
        "podman",
        &["inspect", "--format", "{{.State.Pid}}", &id],
    )
    .parse()
    .expect("container pid");
    let result = std::panic::catch_unwind(|| {
        wait_interpreter(&f, pid);
        std::thread::sleep(3 * SECS);
        let since = now_ns();
        std::thread::sleep(8 * SECS);
        let files: Vec<PathBuf> = index_records(&f.out)
            .into_iter()
            .filter(|(_, r)| {
                r["labels"]["pid"].as_str() == Some(pid.to_string().as_str())
                    && r["start_ns"].as_u64().is_some_and(|s| s >= since)
            })
            .map(|(p, _)| p)
            .collect();
        let t = line_traces(&files);
        let chain = ["leaf", "K.method", "gen", "outer", "<module>"];
        let in_chain = |fr: &[Fr]| {
            fr.iter()
                .any(|x| x.python() && chain.contains(&x.func.as_str()))
        };
        let (whole, n) = share(&t, in_chain, |fr| python_chain(fr, &chain));
        eprintln!(
            "CPython 3.11 in a container: chain whole in {:.1} % of {n}",
            whole * 100.0
        );
        // The container's own path of the script: its mount namespace's files.
        let in_app = t
            .iter()
            .any(|(_, fr)| fr.iter().any(|x| x.file == "/app/pychain.py"));
        assert!(
            n >= 50 && whole >= 0.95 && in_app,
            "container: {whole:.3} of {n}: {:#?}",
            worst(&t, in_chain, |fr| python_chain(fr, &chain))
        );
        // Overlay files: maps must name the inode BPF saw as the executable, or every
        // container process would be read twice (the facts path, then the stat path).
        let facts = f
            .metric("firn_sampler_processes_read_from_facts")
            .unwrap_or(0.0);
        let mismatched = f
            .metric("firn_sampler_process_facts_mismatched")
            .unwrap_or(-1.0);
        eprintln!("read from the NEW event's facts: {facts}; mismatched {mismatched}");
        assert!(
            facts > 0.0 && (0.0..=facts / 10.0).contains(&mismatched),
            "facts {facts}, mismatched {mismatched}"
        );
    });
    let _ = Command::new("podman")
        .args(["rm", "-f", "-t", "2", &name])
        .env("CONTAINERS_CONF", &conf)
        .output();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

//! The two-container pod under a real container runtime: podman with runc (crun refuses
//! this machine's hybrid cgroup mode), from the image packaging/image.sh builds. The
//! containers get the settings of packaging/kubernetes/firn.yaml, read from the manifest
//! itself: user, capabilities, no_new_privs, read-only root, memory limit, the Localhost
//! seccomp profile as the manifest's init step installs it, the shared socket volume,
//! the host PID namespace. A third container runs a workload whose binary exists only
//! in its own image; its profiles must carry podman's container id and name its frames.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);

/// Runs podman, buildah or a script with this test's containers.conf.
fn run(conf: &Path, program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> Output {
    let program = program.as_ref().to_owned();
    let out = Command::new(&program)
        .args(args)
        .env("CONTAINERS_CONF", conf)
        .output()
        .unwrap_or_else(|e| panic!("{program:?}: {e} (apt-get install podman buildah runc)"));
    assert!(
        out.status.success(),
        "{program:?} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// What the manifest says of one container of the DaemonSet (or its init container).
struct Spec {
    command: Vec<String>,
    args: Vec<String>,
    uid: u32,
    user: String,
    /// The startup probe's command (the enricher's: a check of its loopback listener).
    probe: Vec<String>,
    caps_add: Vec<String>,
    memory_limit: String,
    read_only: bool,
    no_new_privs: bool,
    seccomp: String,
    localhost_profile: Option<String>,
}

fn strings(v: &serde_yaml::Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| {
            s.iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The pod template of packaging/kubernetes/firn.yaml's DaemonSet.
fn pod_template() -> serde_yaml::Value {
    let text = std::fs::read_to_string(repo_root().join("packaging/kubernetes/firn.yaml")).unwrap();
    use serde::Deserialize;
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v = serde_yaml::Value::deserialize(doc).expect("firn.yaml parses");
        if v["kind"].as_str() == Some("DaemonSet") {
            return v["spec"]["template"]["spec"].clone();
        }
    }
    panic!("firn.yaml has no DaemonSet");
}

fn spec(pod: &serde_yaml::Value, list: &str, name: &str) -> Spec {
    let c = pod[list]
        .as_sequence()
        .and_then(|cs| cs.iter().find(|c| c["name"].as_str() == Some(name)))
        .unwrap_or_else(|| panic!("no {list} entry {name} in firn.yaml"))
        .clone();
    let sc = &c["securityContext"];
    let uid = sc["runAsUser"].as_u64().expect("runAsUser");
    let gid = sc["runAsGroup"].as_u64().unwrap_or(uid);
    assert_eq!(
        strings(&sc["capabilities"]["drop"]),
        ["ALL"],
        "{name} drops ALL"
    );
    Spec {
        command: strings(&c["command"]),
        args: strings(&c["args"]),
        uid: uid as u32,
        user: format!("{uid}:{gid}"),
        probe: strings(&c["startupProbe"]["exec"]["command"]),
        caps_add: strings(&sc["capabilities"]["add"]),
        memory_limit: c["resources"]["limits"]["memory"]
            .as_str()
            .expect("a memory limit")
            .replace("Mi", "m"),
        read_only: sc["readOnlyRootFilesystem"].as_bool() == Some(true),
        no_new_privs: sc["allowPrivilegeEscalation"].as_bool() == Some(false),
        seccomp: sc["seccompProfile"]["type"]
            .as_str()
            .unwrap_or("")
            .to_string(),
        localhost_profile: sc["seccompProfile"]["localhostProfile"]
            .as_str()
            .map(str::to_string),
    }
}

/// `podman run` flags for a spec: what the kubelet would ask of the runtime.
fn run_flags(s: &Spec, seccomp_root: &Path) -> Vec<String> {
    let mut f = vec![
        "--user".to_string(),
        s.user.clone(),
        "--cap-drop".into(),
        "all".into(),
        "--memory".into(),
        s.memory_limit.clone(),
    ];
    if !s.caps_add.is_empty() {
        f.extend(["--cap-add".into(), s.caps_add.join(",")]);
    }
    if s.read_only {
        f.push("--read-only".into());
    }
    if s.no_new_privs {
        f.extend(["--security-opt".into(), "no-new-privileges".into()]);
    }
    match (s.seccomp.as_str(), &s.localhost_profile) {
        ("Localhost", Some(p)) => f.extend([
            "--security-opt".into(),
            format!("seccomp={}", seccomp_root.join(p).display()),
        ]),
        ("RuntimeDefault", _) => {}
        (other, _) => panic!("seccompProfile {other} in firn.yaml"),
    }
    f
}

/// An image holding one workload binary at /bin and the libraries it loads: a binary the
/// host has at no such path, so only the container's mount namespace can serve it.
fn workload_image(conf: &Path, binary: &Path, tag: &str) {
    let dir = TempDir::new("wimg");
    let root = dir.path();
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy(binary, root.join("bin").join(binary.file_name().unwrap())).unwrap();
    let ldd = Command::new("ldd").arg(binary).output().unwrap();
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        let lib = line
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .map(PathBuf::from);
        if let Some(lib) = lib {
            let to = root.join(lib.strip_prefix("/").unwrap());
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(&lib, &to).unwrap();
        }
    }
    let ctr = stdout(&run(conf, "buildah", &["from", "scratch"]));
    run(
        conf,
        "buildah",
        &["copy", "--quiet", &ctr, &root.display().to_string(), "/"],
    );
    run(conf, "buildah", &["commit", "--quiet", "--rm", &ctr, tag]);
}

struct Cleanup {
    conf: PathBuf,
    names: Vec<String>,
    pod: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("podman")
                .args(["rm", "-f", "-t", "2", n])
                .env("CONTAINERS_CONF", &self.conf)
                .output();
        }
        let _ = Command::new("podman")
            .args(["pod", "rm", "-f", &self.pod])
            .env("CONTAINERS_CONF", &self.conf)
            .output();
    }
}

#[test]
fn the_pod_profiles_a_container_under_podman() {
    if !can_run_bpf() {
        return;
    }
    if !firn_tests::containers::podman_usable() {
        return;
    }
    let dir = TempDir::new("pod");
    let conf = firn_tests::containers::containers_conf(dir.path());
    let image = "localhost/firn:test";
    let out = run(
        &conf,
        repo_root().join("packaging/image.sh"),
        &["--tag", image],
    );
    eprintln!("{}", stdout(&out));
    let work_image = "localhost/firn-test-workload:test";
    workload_image(&conf, &workload("busy"), work_image);

    let pod = pod_template();
    assert_eq!(pod["hostPID"].as_bool(), Some(true), "hostPID");
    assert_eq!(pod["automountServiceAccountToken"].as_bool(), Some(false));
    let init = spec(&pod, "initContainers", "seccomp-profile");
    let sampler = spec(&pod, "containers", "sampler");
    let enricher = spec(&pod, "containers", "enricher");

    let name = format!("firn-test-{}", std::process::id());
    let mut clean = Cleanup {
        conf: conf.clone(),
        names: vec![],
        pod: name.clone(),
    };
    // The node's kubelet seccomp directory, filled by the manifest's init step.
    let seccomp_root = dir.path().join("kubelet-seccomp");
    let run_dir = dir.path().join("run");
    let data = dir.path().join("data");
    for d in [&seccomp_root, &run_dir, &data] {
        std::fs::create_dir_all(d).unwrap();
    }
    // The emptyDirs: the socket's (the sampler makes the socket with the enricher's group)
    // and the enricher's data, owned by its uid as fsGroup would make it.
    std::os::unix::fs::chown(&data, Some(enricher.uid), Some(enricher.uid)).unwrap();
    let vol = |host: &Path, at: &str| format!("{}:{at}", host.display());
    let mut init_cmd: Vec<String> = vec![
        "run".into(),
        "--rm".into(),
        "-v".into(),
        vol(&seccomp_root, "/host-seccomp"),
    ];
    init_cmd.extend(run_flags(&init, &seccomp_root));
    init_cmd.push(image.into());
    init_cmd.extend(init.command.iter().cloned());
    let argv: Vec<&str> = init_cmd.iter().map(String::as_str).collect();
    run(&conf, "podman", &argv);
    let profile = seccomp_root.join(sampler.localhost_profile.as_deref().unwrap());
    assert_eq!(
        std::fs::read_to_string(&profile).unwrap(),
        std::fs::read_to_string(repo_root().join("packaging/seccomp/firn-sampler.json")).unwrap(),
        "the init step installed another profile"
    );

    run(
        &conf,
        "podman",
        &["pod", "create", "--name", &name, "--pid", "host"],
    );
    let start = |clean: &mut Cleanup, suffix: &str, s: &Spec, extra: &[String]| -> String {
        let cname = format!("{name}-{suffix}");
        clean.names.push(cname.clone());
        let mut a: Vec<String> = vec![
            "run".into(),
            "-d".into(),
            "--pod".into(),
            name.clone(),
            // Every container of a hostPID pod is in the host's PID namespace.
            "--pid".into(),
            "host".into(),
            "--name".into(),
            cname.clone(),
        ];
        a.extend(run_flags(s, &seccomp_root));
        a.extend(extra.iter().cloned());
        a.push(image.into());
        a.extend(s.command.iter().cloned());
        a.extend(s.args.iter().cloned());
        let argv: Vec<&str> = a.iter().map(String::as_str).collect();
        stdout(&run(&conf, "podman", &argv))
    };
    // The manifest's AppArmor choice for the sampler (unconfined); the runtime default
    // for the enricher.
    let sampler_id = start(
        &mut clean,
        "sampler",
        &sampler,
        &[
            "--security-opt".into(),
            "apparmor=unconfined".into(),
            "-v".into(),
            vol(&run_dir, "/run/firn"),
            "-v".into(),
            "/sys/kernel/btf:/sys/kernel/btf:ro".into(),
        ],
    );
    let logs = |id: &str| {
        let o = Command::new("podman")
            .args(["logs", id])
            .env("CONTAINERS_CONF", &conf)
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    assert!(
        wait_until(30 * SECS, || logs(&sampler_id).contains(SAMPLER_READY)),
        "the sampler's container did not finish setup:\n{}",
        logs(&sampler_id)
    );
    // No API server here: the enricher runs without --kubernetes; the pod IP is the pod's
    // loopback (its HTTP server is not under test).
    let mut e = enricher;
    e.args.retain(|a| a != "--kubernetes");
    for a in &mut e.args {
        *a = a.replace("$(POD_IP)", "127.0.0.1");
    }
    let enricher_id = start(
        &mut clean,
        "enricher",
        &e,
        &[
            "-v".into(),
            vol(&run_dir, "/run/firn"),
            "-v".into(),
            vol(&data, "/var/lib/firn"),
            // Test-only: the confined probe, to run inside this container (below).
            "-v".into(),
            format!("{}:{PROBE}:ro", bin("firn-confined-probe").display()),
            "-e".into(),
            "FIRN_NODE=pod-test-node".into(),
        ],
    );
    assert!(
        wait_until(30 * SECS, || logs(&enricher_id).contains(ENRICHER_READY)),
        "the enricher's container did not connect:\n{}",
        logs(&enricher_id)
    );

    // The steady state as the kernel reports it for each container's process.
    let pid_of = |id: &str| -> u32 {
        stdout(&run(
            &conf,
            "podman",
            &["inspect", "--format", "{{.State.Pid}}", id],
        ))
        .parse()
        .unwrap()
    };
    let sp = pid_of(&sampler_id);
    assert_eq!(status_field(sp, "CapEff").unwrap(), "0000000000080000");
    assert_eq!(status_field(sp, "CapBnd").unwrap(), "0000000000080000");
    assert_eq!(status_field(sp, "NoNewPrivs").unwrap(), "1");
    assert_eq!(status_field(sp, "Seccomp").unwrap(), "2");
    // The runtime's profile and the sampler's own.
    assert_eq!(status_field(sp, "Seccomp_filters").unwrap(), "2");
    assert!(status_field(sp, "Uid")
        .unwrap()
        .split_whitespace()
        .all(|u| u == "65533"));
    let ep = pid_of(&enricher_id);
    assert_eq!(status_field(ep, "CapEff").unwrap(), "0000000000000000");
    let enricher_uid = e.uid.to_string();
    assert_ne!(
        enricher_uid, "65532",
        "the nonroot uid of distroless images is not ours"
    );
    assert!(status_field(ep, "Uid")
        .unwrap()
        .split_whitespace()
        .all(|u| u == enricher_uid));
    assert_eq!(
        status_field(ep, "Seccomp_filters").unwrap(),
        "2",
        "runtime's and its own"
    );
    // The kubelet's probe, as the manifest gives it: run inside the enricher's
    // container, against its loopback listener.
    assert!(
        !e.probe.is_empty(),
        "the enricher has an exec startup probe"
    );
    let mut exec: Vec<&str> = vec!["exec", &enricher_id];
    exec.extend(e.probe.iter().map(String::as_str));
    run(&conf, "podman", &exec);

    let work = format!("{name}-work");
    clean.names.push(work.clone());
    let work_id = stdout(&run(
        &conf,
        "podman",
        // Another pod's process under the enricher's uid, a secret in its environment:
        // what hostPID would hand a taken-over enricher but for its confinement.
        &[
            "run",
            "-d",
            "--name",
            &work,
            "--user",
            &e.user,
            "-e",
            "FIRN_VICTIM_SECRET=hunter2",
            work_image,
            "/bin/busy",
            // Alive until the confinement checks at the end (removed by `clean`): 20 s
            // ran out before them in a loaded CI run.
            "120",
        ],
    ));
    assert_eq!(work_id.len(), 64, "podman's container id: {work_id}");
    let out = data.join("profiles");
    let mine = || -> Vec<(PathBuf, Value)> {
        index_entries(&out)
            .into_iter()
            .filter(|(_, l)| l["container_id"].as_str() == Some(work_id.as_str()))
            // runc, sampled in the container before its init execs the workload, is
            // rightly labelled with the container too, under whichever name it had
            // then (`runc`, `runc:[1:CHILD]`, `runc:[2:INIT]` all met in CI runs): the
            // workload is what is checked.
            .filter(|(_, l)| l["comm"].as_str() == Some("busy"))
            .collect()
    };
    assert!(
        wait_until(60 * SECS, || mine().len() >= 2),
        "no profiles with container_id {work_id}; labels seen: {:#?}\nsampler:\n{}\nenricher:\n{}",
        index_entries(&out)
            .iter()
            .map(|(_, l)| l.clone())
            .collect::<Vec<_>>(),
        logs(&sampler_id),
        logs(&enricher_id)
    );
    let entries = mine();
    let labels = &entries[0].1;
    assert_eq!(labels["node"], "pod-test-node", "{labels}");
    let files: Vec<PathBuf> = entries.iter().map(|(f, _)| f.clone()).collect();
    let tr = traces(&files);
    assert!(
        tr.iter()
            .any(|t| t.1.first().is_some_and(|f| f == "hot_leaf")
                && t.1.iter().any(|f| f == "middle")),
        "the workload's frames are not named (its binary is only in its container):\n{tr:#?}"
    );
    // What the memory limits are measured against: each container's peak.
    for (what, id) in [("sampler", &sampler_id), ("enricher", &enricher_id)] {
        let stats = run(
            &conf,
            "podman",
            &["stats", "--no-stream", "--format", "{{.MemUsage}}", id],
        );
        eprintln!("{what} container memory: {}", stdout(&stats));
    }
    // Read-only root filesystems, as the kernel sees the containers' mounts.
    for pid in [sp, ep] {
        let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
        let root = mounts
            .lines()
            .find(|l| l.split_whitespace().nth(4) == Some("/"))
            .expect("a root mount");
        let opts = root.split_whitespace().nth(5).unwrap_or("");
        assert!(
            opts.split(',').any(|o| o == "ro"),
            "process {pid}'s root is writable: {root}"
        );
    }
    confined_inside(&conf, &enricher_id, pid_of(&work_id), &e.args);
    drop(clean);
}

const PROBE: &str = "/usr/local/bin/firn-confined-probe";

/// The confined probe inside the enricher's container, with the manifest's arguments:
/// without its confinement it reads the same-uid workload's environment and files
/// (the control); with it, nothing of that process, no TCP port it was not given (the
/// enricher's own listener, for one), no exec.
fn confined_inside(conf: &Path, enricher: &str, victim: u32, args: &[String]) {
    let victim = victim.to_string();
    let attempt = |confined: &str| -> Value {
        let mut a: Vec<&str> = vec!["exec", "-e", confined, enricher, PROBE, &victim];
        a.extend(["/proc/1/root/etc/shadow", "7071", "7071", "--"]);
        a.extend(args.iter().map(String::as_str));
        let out = run(conf, "podman", &a);
        serde_json::from_str(&stdout(&out)).unwrap_or_else(|e| panic!("{e}: {}", stdout(&out)))
    };
    let control = attempt("FIRN_PROBE_UNCONFINED=1");
    eprintln!("in the pod, unconfined: {control}");
    for k in ["proc_environ", "proc_root", "tcp_unconfigured"] {
        assert_eq!(
            control[k], "ALLOWED",
            "{k} refused even unconfined: {control}"
        );
    }
    let r = attempt("FIRN_PROBE_UNCONFINED=0");
    eprintln!("in the pod, confined: {r}");
    for k in [
        "proc_environ",
        "proc_root",
        "proc_maps",
        "proc_mem",
        "proc_fd",
        "other_home",
        "tcp_unconfigured",
        "exec",
        "signal_victim",
        "ptrace",
        "process_vm_readv",
        "unshare_user",
        "mount",
    ] {
        assert_ne!(r[k], "ALLOWED", "{k} allowed in the pod: {r}");
    }
    assert_eq!(r["write_inside"], "ALLOWED", "its data volume: {r}");
}

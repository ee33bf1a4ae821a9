//! The upload tests' receivers, which no one here wrote the readers of: an OTLP
//! profiles server on the OpenTelemetry project's Python bindings, and a Parca
//! stand-in decoding with Parca's published client types (`tests/receivers/`,
//! installed by `tests/setup-tools.sh`). Each writes what arrives as JSON lines.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::{repo_root, Proc};

/// A loopback port no one listens on now (the kernel's pick, released at once).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

fn started(p: Proc, what: &str) -> Proc {
    assert!(
        p.wait_for("listening", Duration::from_secs(30)).is_some(),
        "{what} did not start (run tests/setup-tools.sh): {:#?}",
        p.lines()
    );
    p
}

/// The OTLP receiver on `port`, appending to `out`; `extra`: --delay S, --fail CODE:N.
pub fn start_otlp_receiver(port: u16, out: &Path, extra: &[&str]) -> Proc {
    let python = repo_root().join("target/test-venv/bin/python");
    let mut cmd = Command::new(python);
    cmd.arg(repo_root().join("tests/receivers/otlp_receiver.py"))
        .args(["--port", &port.to_string(), "--out"])
        .arg(out)
        .args(extra);
    started(Proc::spawn("otlp-receiver", cmd), "the OTLP receiver")
}

/// The Parca stand-in on `port`, appending to `out`; `extra`: --delay-ms N,
/// --fail CODE:N, --token T, --known BUILD_ID,….
pub fn start_parca_receiver(port: u16, out: &Path, extra: &[&str]) -> Proc {
    let dir = repo_root().join("tests/receivers");
    let mut cmd = Command::new("node");
    cmd.current_dir(&dir)
        .args(["--import", "./resolve-js.mjs", "parca_receiver.mjs"])
        .args(["--port", &port.to_string(), "--out"])
        .arg(out)
        .args(extra);
    started(Proc::spawn("parca-receiver", cmd), "the Parca receiver")
}

/// Every JSON line of a receiver's output (none yet: empty).
pub fn received(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Lines of one kind.
pub fn received_kind(out: &Path, kind: &str) -> Vec<Value> {
    received(out)
        .into_iter()
        .filter(|v| v["kind"] == kind)
        .collect()
}

/// A file in `dir` the enricher's user can read.
pub fn readable_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write file");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    p
}

/// A credential file in `dir`: the enricher's user's own, mode 0600.
pub fn secret_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write file");
    // As a credential should be: the enricher's user's own, unreadable by others (the
    // enricher refuses one every user may read).
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let (uid, gid) = crate::test_user("firn-test");
    nix::unistd::chown(
        &p,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )
    .expect("chown");
    p
}

/// The OpenSearch stand-in on `port` (Python's standard library only: no OpenSearch
/// server can run here), writing `out/state.json`; `extra`: --user U --password P,
/// --bulk-429 N, --mixed.
pub fn start_opensearch_standin(port: u16, out: &Path, extra: &[&str]) -> Proc {
    let mut cmd = Command::new("python3");
    cmd.arg(repo_root().join("tests/receivers/opensearch_standin.py"))
        .args(["--port", &port.to_string(), "--out"])
        .arg(out)
        .args(extra);
    started(
        Proc::spawn("opensearch-standin", cmd),
        "the OpenSearch stand-in",
    )
}

/// What the OpenSearch stand-in holds now (`state.json`).
pub fn standin_state(out: &Path) -> Value {
    std::fs::read_to_string(out.join("state.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null)
}

/// OTLP profiles of `pid` of one sample type.
pub fn otlp_profiles(out: &Path, pid: u32, ty: &str) -> Vec<Value> {
    received_kind(out, "profile")
        .into_iter()
        .filter(|p| p["type"] == ty && p["resource"]["process.pid"].as_u64() == Some(pid as u64))
        .collect()
}

/// The raw samples of `pid`'s series in what the Parca stand-in received, with the
/// sample types `types` (e.g. `["wallclock/nanoseconds"]`).
pub fn parca_samples(out: &Path, pid: u32, types: &[&str]) -> Vec<Value> {
    let mut v = Vec::new();
    for w in received_kind(out, "writeraw") {
        for s in w["series"].as_array().unwrap() {
            if s["labels"]["pid"].as_str() != Some(pid.to_string().as_str()) {
                continue;
            }
            for smp in s["samples"].as_array().unwrap() {
                let got: Vec<&str> = smp["types"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter_map(|t| t.as_str())
                    .collect();
                if got == types {
                    v.push(smp.clone());
                }
            }
        }
    }
    v
}

/// (time_nanos → sum of the first value) of `pid`'s raw samples of `types`.
fn parca_sums(out: &Path, pid: u32, types: &[&str]) -> std::collections::HashMap<u64, u64> {
    let mut m = std::collections::HashMap::new();
    for smp in parca_samples(out, pid, types) {
        // A string: JSON numbers in JavaScript cannot hold nanoseconds since 1970.
        let t: u64 = smp["time_nanos"].as_str().unwrap().parse().unwrap();
        *m.entry(t).or_insert(0) += smp["totals"][0].as_u64().unwrap();
    }
    m
}

/// (time_nanos → sample count) of `pid` in what the Parca stand-in received: its
/// on-CPU raw samples only (an off-CPU one beside them counts nanoseconds).
pub fn parca_rounds(out: &Path, pid: u32) -> std::collections::HashMap<u64, u64> {
    parca_sums(out, pid, &["samples/count", "cpu/nanoseconds"])
}

/// (time_nanos → off-CPU ns) of `pid`: its `wallclock` raw samples (Parca Agent's
/// off-CPU type).
pub fn parca_off_cpu_rounds(out: &Path, pid: u32) -> std::collections::HashMap<u64, u64> {
    parca_sums(out, pid, &["wallclock/nanoseconds"])
}

/// (time_unix_nano → total) of `pid`'s OTLP profiles of sample type `ty`.
pub fn otlp_rounds(out: &Path, pid: u32, ty: &str) -> std::collections::HashMap<u64, u64> {
    let mut m = std::collections::HashMap::new();
    for p in otlp_profiles(out, pid, ty) {
        let t = p["time_unix_nano"].as_u64().unwrap();
        *m.entry(t).or_insert(0) += p["total"].as_u64().unwrap_or(0);
    }
    m
}

/// A CA and a `localhost` server certificate it signs (webpki refuses a self-signed
/// leaf), made with openssl in `d`: (CA, certificate, key) PEM files.
pub fn test_certificates(d: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let (ca, cert, key) = (d.join("ca.pem"), d.join("cert.pem"), d.join("key.pem"));
    let ext = readable_file(
        d,
        "leaf.ext",
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    );
    let p = |s: &Path| s.display().to_string();
    for args in [
        vec![
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=firn test CA",
            "-keyout",
            &p(&d.join("ca.key")),
            "-out",
            &p(&ca),
        ],
        vec![
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            &p(&key),
            "-out",
            &p(&d.join("leaf.csr")),
        ],
        vec![
            "x509",
            "-req",
            "-in",
            &p(&d.join("leaf.csr")),
            "-CA",
            &p(&ca),
            "-CAkey",
            &p(&d.join("ca.key")),
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            &p(&ext),
            "-out",
            &p(&cert),
        ],
    ] {
        let out = Command::new("openssl")
            .args(&args)
            .output()
            .expect("openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    (ca, cert, key)
}

//! Helpers for firn's end-to-end tests: they run the real release binaries against
//! real workloads on this kernel. They need root; when BPF cannot be used they skip,
//! unless `CI=true` or `FIRN_REQUIRE_BPF=1`, where they fail.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use serde_json::Value;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the repository")
        .to_path_buf()
}

/// Whether a missing BPF environment must fail the test rather than skip it.
pub fn bpf_required() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
        || std::env::var("FIRN_REQUIRE_BPF").is_ok_and(|v| v == "1")
}

/// Returns false (skip) when this machine cannot run the sampler, or panics when
/// BPF is required.
pub fn can_run_bpf() -> bool {
    let root = nix::unistd::geteuid().is_root();
    let btf = Path::new("/sys/kernel/btf/vmlinux").exists();
    let bins = bin("firn-sampler").exists() && bin("firn-enricher").exists();
    if root && btf && bins {
        return true;
    }
    let why = format!(
        "cannot run the sampler here: root={root} btf={btf} release binaries built={bins} \
         (build with `cargo build --release`)"
    );
    if bpf_required() {
        panic!("{why}; CI=true or FIRN_REQUIRE_BPF=1 forbids skipping");
    }
    eprintln!("SKIPPED: {why}");
    false
}

/// A release binary of the workspace.
pub fn bin(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("FIRN_BIN_DIR") {
        return PathBuf::from(dir).join(name);
    }
    repo_root().join("target/release").join(name)
}

/// Compiles `tests/workloads/NAME.c` with clang (frame pointers everywhere), once.
pub fn workload(name: &str) -> PathBuf {
    let src = repo_root()
        .join("tests/workloads")
        .join(format!("{name}.c"));
    let out_dir = repo_root().join("target/workloads");
    std::fs::create_dir_all(&out_dir).expect("create target/workloads");
    let out = out_dir.join(name);
    let fresh = match (std::fs::metadata(&src), std::fs::metadata(&out)) {
        (Ok(s), Ok(o)) => o.modified().ok() >= s.modified().ok(),
        _ => false,
    };
    if !fresh {
        let tmp = out_dir.join(format!("{name}.tmp{}", std::process::id()));
        let status = Command::new("clang")
            .args([
                "-O2",
                "-g",
                "-fno-omit-frame-pointer",
                "-mno-omit-leaf-frame-pointer",
                "-pthread",
                "-o",
            ])
            .arg(&tmp)
            .arg(&src)
            .status()
            .expect("clang must be installed (apt-get install clang)");
        assert!(status.success(), "compiling {}", src.display());
        std::fs::rename(&tmp, &out).expect("rename workload");
    }
    out
}

/// A temporary directory readable by every user, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "firn-{tag}-{}-{}",
            std::process::id(),
            Instant::now().elapsed().as_nanos() ^ rand_u32() as u128
        ));
        std::fs::create_dir_all(&p).expect("create temp dir");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut b);
    }
    u32::from_ne_bytes(b)
}

/// A system user for tests, created when missing. Returns (uid, gid).
pub fn test_user(name: &str) -> (u32, u32) {
    if nix::unistd::User::from_name(name).ok().flatten().is_none() {
        let status = Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "--user-group",
                name,
            ])
            .status()
            .expect("useradd");
        assert!(status.success(), "useradd {name}");
    }
    let u = nix::unistd::User::from_name(name)
        .ok()
        .flatten()
        .expect("user exists after useradd");
    (u.uid.as_raw(), u.gid.as_raw())
}

/// A running process whose stderr (or stdout) lines are collected.
pub struct Proc {
    pub child: Child,
    pub lines: Arc<Mutex<Vec<String>>>,
    pub name: String,
}

fn collect(
    r: impl std::io::Read + Send + 'static,
    into: Arc<Mutex<Vec<String>>>,
    echo: Option<String>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            if let Some(tag) = &echo {
                eprintln!("[{tag}] {line}");
            }
            if let Ok(mut v) = into.lock() {
                v.push(line);
            }
        }
    });
}

impl Proc {
    /// Starts `cmd`, collecting stdout lines; stderr is echoed with a tag (and kept too).
    pub fn spawn(name: &str, mut cmd: Command) -> Proc {
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        collect(child.stdout.take().expect("stdout"), lines.clone(), None);
        collect(
            child.stderr.take().expect("stderr"),
            lines.clone(),
            Some(name.to_string()),
        );
        Proc {
            child,
            lines,
            name: name.to_string(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Waits until a line contains `needle`; returns it.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> Option<String> {
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            if let Some(l) = self.lines().into_iter().find(|l| l.contains(needle)) {
                return Some(l);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig);
    }

    /// SIGTERM, then wait up to 10 s, then SIGKILL. Returns the exit status.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Some(st);
        }
        self.signal(nix::sys::signal::Signal::SIGTERM);
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        self.child.wait().ok()
    }

    /// Waits for exit up to `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Starts the sampler on `socket` with extra flags; waits until it has confined itself.
pub fn start_sampler(binary: &Path, socket: &Path, extra: &[&str]) -> Proc {
    let mut cmd = Command::new(binary);
    cmd.arg("--socket")
        .arg(socket)
        .args(extra)
        .env("FIRN_LOG", "info");
    let p = Proc::spawn("sampler", cmd);
    assert!(
        p.wait_for("seccomp filter installed", Duration::from_secs(30))
            .is_some(),
        "sampler did not finish setup: {:#?}",
        p.lines()
    );
    p
}

/// Runs the enricher in `--dump` mode as `uid:gid` (setpriv), collecting JSON lines.
pub fn start_dump(socket: &Path, uid_gid: Option<(u32, u32)>, extra: &[&str]) -> Proc {
    let mut cmd = match uid_gid {
        Some((uid, gid)) => {
            let mut c = Command::new("setpriv");
            c.arg(format!("--reuid={uid}"))
                .arg(format!("--regid={gid}"))
                .arg("--clear-groups")
                .arg("--inh-caps=-all")
                .arg(bin("firn-enricher"));
            c
        }
        None => {
            let mut c = Command::new(bin("firn-enricher"));
            c.arg("--allow-root");
            c
        }
    };
    cmd.arg("--socket").arg(socket).arg("--dump").args(extra);
    Proc::spawn("enricher", cmd)
}

/// The `batch` objects received so far by a `--dump` enricher.
pub fn batches(p: &Proc) -> Vec<Value> {
    p.lines()
        .iter()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v.get("batch").cloned())
        .collect()
}

/// Waits until at least `n` batches arrived.
pub fn wait_batches(p: &Proc, n: usize, timeout: Duration) -> Vec<Value> {
    let t0 = Instant::now();
    loop {
        let b = batches(p);
        if b.len() >= n || t0.elapsed() > timeout {
            return b;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A counter's value in a batch.
pub fn counter(batch: &Value, name: &str) -> Option<u64> {
    batch["counters"]
        .as_array()?
        .iter()
        .find(|c| c[0].as_str() == Some(name))
        .and_then(|c| c[1].as_u64())
}

/// A field of /proc/<pid>/status, e.g. `VmRSS` (value text without the name).
pub fn status_field(pid: u32, field: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines().find_map(|l| {
        l.strip_prefix(&format!("{field}:"))
            .map(|v| v.trim().to_string())
    })
}

/// Resident memory of `pid` in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    status_field(pid, "VmRSS")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Starts a workload binary with args; waits for its "ready PID" line.
pub fn start_workload(path: &Path, args: &[&str]) -> Proc {
    let mut cmd = Command::new(path);
    cmd.args(args);
    let p = Proc::spawn("workload", cmd);
    assert!(
        p.wait_for("ready", Duration::from_secs(10)).is_some(),
        "workload did not start"
    );
    p
}

pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

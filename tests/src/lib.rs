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
        // FIRN_KEEP_TEMP=1 keeps it, to look at a failed test's profiles and logs.
        if std::env::var_os("FIRN_KEEP_TEMP").is_some() {
            eprintln!("kept {}", self.0.display());
            return;
        }
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
    start_sampler_under(&[], binary, socket, extra)
}

/// [`start_sampler`] under a wrapper command (e.g. `strace -f -o FILE`).
pub fn start_sampler_under(wrapper: &[&str], binary: &Path, socket: &Path, extra: &[&str]) -> Proc {
    let mut cmd = match wrapper.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(binary);
            c
        }
        None => Command::new(binary),
    };
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

/// A memory field of /proc/<pid>/status (`VmRSS`, `VmHWM`, ...) in KiB.
pub fn status_kib(pid: u32, field: &str) -> Option<u64> {
    status_field(pid, field)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Resident memory of `pid` in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmRSS")
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

/// Starts a workload as process `pid`: steers the kernel's next pid through
/// /proc/sys/kernel/ns_last_pid (root), retrying when another fork takes the number
/// first. None when it could not be had.
pub fn start_workload_as_pid(pid: u32, path: &Path, args: &[&str]) -> Option<Proc> {
    for _ in 0..100 {
        std::fs::write(
            "/proc/sys/kernel/ns_last_pid",
            pid.saturating_sub(1).to_string(),
        )
        .ok()?;
        let mut cmd = Command::new(path);
        cmd.args(args);
        let mut p = Proc::spawn("workload", cmd);
        if p.pid() == pid {
            assert!(
                p.wait_for("ready", Duration::from_secs(10)).is_some(),
                "workload did not start"
            );
            return Some(p);
        }
        let _ = p.child.kill();
        let _ = p.child.wait();
    }
    None
}

/// Polls `cond` every 100 ms until it holds (true) or `timeout` passes (false).
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if t0.elapsed() >= timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub use firn_schema::now_ns;

/// A running sampler + enricher pair: the sampler as root, the enricher as the
/// unprivileged test user, profiles in a temp directory.
pub struct Firn {
    pub dir: TempDir,
    pub sampler: Proc,
    pub enricher: Option<Proc>,
    pub socket: PathBuf,
    pub out: PathBuf,
    pub user: (u32, u32),
    pub http: String,
    sampler_args: Vec<String>,
}

static NEXT_PORT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);

/// A free-looking local port per test process and call.
fn http_port() -> u16 {
    let base = 17000 + (std::process::id() % 2000) as u16 * 4;
    base + NEXT_PORT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 4
}

impl Firn {
    pub fn start(tag: &str, sampler_args: &[&str]) -> Firn {
        Self::start_under(tag, &[], sampler_args)
    }

    /// [`Firn::start`] with the sampler under a wrapper command (see [`start_sampler_under`]).
    pub fn start_under(tag: &str, wrapper: &[&str], sampler_args: &[&str]) -> Firn {
        let dir = TempDir::new(tag);
        let user = test_user("firn-test");
        let socket = dir.path().join("s.sock");
        let out = dir.path().join("out");
        std::fs::create_dir_all(&out).unwrap();
        nix::unistd::chown(
            &out,
            Some(nix::unistd::Uid::from_raw(user.0)),
            Some(nix::unistd::Gid::from_raw(user.1)),
        )
        .unwrap();
        let mut args: Vec<String> = sampler_args.iter().map(|s| s.to_string()).collect();
        args.extend([
            "--allow-uid".into(),
            user.0.to_string(),
            "--socket-group".into(),
            user.1.to_string(),
        ]);
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let sampler = start_sampler_under(wrapper, &bin("firn-sampler"), &socket, &a);
        let mut f = Firn {
            dir,
            sampler,
            enricher: None,
            socket,
            out,
            user,
            http: String::new(),
            sampler_args: args,
        };
        f.start_enricher(&[]);
        f
    }

    /// Starts (or restarts) the enricher as the test user; waits until it is connected.
    pub fn start_enricher(&mut self, extra: &[&str]) {
        let p = self.spawn_enricher(extra);
        assert!(
            p.wait_for("connected to the sampler", Duration::from_secs(20))
                .is_some(),
            "enricher did not connect: {:#?}",
            p.lines()
        );
        self.enricher = Some(p);
    }

    /// Starts the enricher as the test user without waiting for the sampler.
    pub fn spawn_enricher(&mut self, extra: &[&str]) -> Proc {
        let port = http_port();
        self.http = format!("127.0.0.1:{port}");
        let mut cmd = Command::new("setpriv");
        cmd.arg(format!("--reuid={}", self.user.0))
            .arg(format!("--regid={}", self.user.1))
            .arg("--clear-groups")
            .arg("--inh-caps=-all")
            .arg(bin("firn-enricher"))
            .arg("--socket")
            .arg(&self.socket)
            .arg("--output-dir")
            .arg(&self.out)
            .arg("--http-address")
            .arg(&self.http)
            .args(extra)
            .env("FIRN_LOG", "info");
        Proc::spawn("enricher", cmd)
    }

    /// Restarts the sampler with the same flags (after it was killed).
    pub fn restart_sampler(&mut self) {
        let a: Vec<&str> = self.sampler_args.iter().map(String::as_str).collect();
        self.sampler = start_sampler(&bin("firn-sampler"), &self.socket, &a);
    }

    /// Profile files (all rounds) whose index labels have pid == `pid`.
    pub fn profiles_of(&self, pid: u32) -> Vec<PathBuf> {
        index_entries(&self.out)
            .into_iter()
            .filter(|(_, labels)| labels["pid"].as_str() == Some(pid.to_string().as_str()))
            .map(|(p, _)| p)
            .collect()
    }

    /// Waits until `pid` has profiles in at least `rounds` rounds.
    pub fn wait_profiles(&self, pid: u32, rounds: usize, timeout: Duration) -> Vec<PathBuf> {
        let t0 = Instant::now();
        loop {
            let p = self.profiles_of(pid);
            if p.len() >= rounds || t0.elapsed() > timeout {
                return p;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn get(&self, path: &str) -> (u16, Vec<u8>) {
        http_get(&self.http, path)
    }

    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics");
        String::from_utf8_lossy(&body).lines().find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == name).then(|| v.trim().parse().ok()).flatten()
        })
    }
}

/// Every (file, labels) of every round's index.jsonl under `out`.
pub fn index_entries(out: &Path) -> Vec<(PathBuf, Value)> {
    index_records(out)
        .into_iter()
        .map(|(f, e)| (f, e["labels"].clone()))
        .collect()
}

/// Every (file, whole index line) of every round under `out`: labels, samples,
/// session_id, round, start_ns, end_ns.
pub fn index_records(out: &Path) -> Vec<(PathBuf, Value)> {
    let mut v = Vec::new();
    let Ok(rd) = std::fs::read_dir(out) else {
        return v;
    };
    let mut dirs: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    for d in dirs {
        let Ok(text) = std::fs::read_to_string(d.join("index.jsonl")) else {
            continue;
        };
        for line in text.lines() {
            if let Ok(e) = serde_json::from_str::<Value>(line) {
                if let Some(f) = e["file"].as_str() {
                    v.push((d.join(f), e.clone()));
                }
            }
        }
    }
    v
}

/// A minimal HTTP/1.1 GET on loopback: (status, body).
pub fn http_get(addr: &str, path: &str) -> (u16, Vec<u8>) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, Vec::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    );
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let Some(split) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return (0, buf);
    };
    let head = String::from_utf8_lossy(&buf[..split]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut body = buf[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    (status, body)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..nl]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = nl + 2;
        out.extend_from_slice(&b[start..(start + size).min(b.len())]);
        b = &b[(start + size + 2).min(b.len())..];
    }
    out
}

/// `go tool pprof ARGS FILES…` (Debian's golang-go): the reference pprof reader.
pub fn go_pprof(args: &[&str], files: &[PathBuf]) -> String {
    let cache = repo_root().join("target/go-cache");
    let out = Command::new("go")
        .arg("tool")
        .arg("pprof")
        .args(args)
        .args(files)
        .env("GOCACHE", &cache)
        .env("GOPATH", repo_root().join("target/go-path"))
        .env("HOME", repo_root().join("target"))
        .output()
        .expect("go (apt-get install golang-go)");
    assert!(
        out.status.success(),
        "go tool pprof failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// `-traces` output as (count, frames leaf first).
pub fn parse_traces(text: &str) -> Vec<(u64, Vec<String>)> {
    let mut out: Vec<(u64, Vec<String>)> = Vec::new();
    for block in text.split("-----------+-------------------------------------------------------") {
        let mut cur: Option<(u64, Vec<String>)> = None;
        for line in block.lines() {
            // Label lines look like "       pid:  123"; frame lines are indented
            // past the count column.
            let t = line.trim();
            if t.is_empty() || (line.len() > 11 && line[..11].contains(':')) {
                continue;
            }
            if let Some((n, f)) = t.split_once(char::is_whitespace) {
                if let Ok(n) = n.trim().parse::<u64>() {
                    cur = Some((n, vec![f.trim().to_string()]));
                    continue;
                }
            }
            if let Some(c) = cur.as_mut() {
                c.1.push(t.to_string());
            }
        }
        if let Some(c) = cur {
            out.push(c);
        }
    }
    out
}

/// Builds a Go workload under tests/workloads/NAME with Debian's go, once.
pub fn go_workload(name: &str) -> PathBuf {
    let src = repo_root().join("tests/workloads").join(name);
    let out = repo_root().join("target/workloads").join(name);
    if !out.exists() {
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        let status = Command::new("go")
            .args(["build", "-o"])
            .arg(&out)
            .arg(".")
            .current_dir(&src)
            .env("GOCACHE", repo_root().join("target/go-cache"))
            .env("GOPATH", repo_root().join("target/go-path"))
            .env("HOME", repo_root().join("target"))
            .env("GOFLAGS", "-mod=mod")
            .env("GOPROXY", "off")
            .status()
            .expect("go (apt-get install golang-go)");
        assert!(status.success(), "go build {name}");
    }
    out
}

/// Compiles a C/C++ source with clang (frame pointers), with extra flags, once.
pub fn compile(src_name: &str, out_name: &str, flags: &[&str]) -> PathBuf {
    let src = repo_root().join("tests/workloads").join(src_name);
    let out_dir = repo_root().join("target/workloads");
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = out_dir.join(out_name);
    let fresh = match (std::fs::metadata(&src), std::fs::metadata(&out)) {
        (Ok(s), Ok(o)) => o.modified().ok() >= s.modified().ok(),
        _ => false,
    };
    if !fresh {
        let cc = if src_name.ends_with(".cpp") {
            "clang++"
        } else {
            "clang"
        };
        let tmp = out_dir.join(format!("{out_name}.tmp{}", std::process::id()));
        let status = Command::new(cc)
            .args([
                "-O2",
                "-g",
                "-fno-omit-frame-pointer",
                "-mno-omit-leaf-frame-pointer",
            ])
            .args(flags)
            .arg("-o")
            .arg(&tmp)
            .arg(&src)
            .status()
            .expect("clang must be installed");
        assert!(status.success(), "compiling {}", src.display());
        std::fs::rename(&tmp, &out).unwrap();
    }
    out
}

/// A cgroup v2 hierarchy this machine lets us create groups in: the unified one,
/// mounted alone or beside v1 (hybrid).
pub fn cgroup_root() -> PathBuf {
    for p in ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"] {
        if Path::new(p).join("cgroup.procs").exists()
            && Path::new(p).join("cgroup.controllers").exists()
        {
            return PathBuf::from(p);
        }
    }
    panic!("no cgroup v2 hierarchy found under /sys/fs/cgroup");
}

/// A nested cgroup created for a test, removed (innermost first) on drop.
pub struct Cgroup {
    dirs: Vec<PathBuf>,
}

impl Cgroup {
    pub fn create(rel: &str) -> Cgroup {
        let mut dirs = Vec::new();
        let mut p = cgroup_root();
        for seg in rel.split('/') {
            p = p.join(seg);
            if !p.exists() {
                std::fs::create_dir(&p).unwrap_or_else(|e| panic!("mkdir {}: {e}", p.display()));
                dirs.push(p.clone());
            }
        }
        Cgroup { dirs }
    }

    pub fn procs(&self) -> PathBuf {
        self.dirs.last().expect("a new cgroup").join("cgroup.procs")
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for d in self.dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// Runs the busy workload inside `cg` for `secs`; returns its pid after it exited.
pub fn busy_in(cg: &Cgroup, secs: u32) -> u32 {
    let script = format!(
        "echo $$ > '{}' && exec '{}' {secs}",
        cg.procs().display(),
        workload("busy").display()
    );
    let mut c = Command::new("sh");
    c.args(["-c", &script]);
    let mut p = Proc::spawn("cg-workload", c);
    let line = p
        .wait_for("ready", Duration::from_secs(10))
        .expect("workload started");
    let pid = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("ready PID");
    p.wait_exit(Duration::from_secs(u64::from(secs) + 20))
        .expect("workload ends");
    pid
}

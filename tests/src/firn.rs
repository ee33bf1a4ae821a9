//! Starting the real sampler and enricher: alone, as a `--dump` client, or as the
//! pair [`Firn`] that writes profiles.

use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::{bin, index_entries, test_user, Proc, TempDir};

/// Starts the sampler on `socket` with extra flags; waits until it has confined itself.
pub fn start_sampler(binary: &Path, socket: &Path, extra: &[&str]) -> Proc {
    start_sampler_under(&[], binary, socket, extra)
}

/// [`start_sampler`] under a wrapper command (e.g. `strace -f -o FILE`).
pub fn start_sampler_under(wrapper: &[&str], binary: &Path, socket: &Path, extra: &[&str]) -> Proc {
    let mut argv = vec![
        binary.display().to_string(),
        "--socket".into(),
        socket.display().to_string(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    spawn_sampler(wrapper, &argv)
}

/// Runs the sampler command line `argv` (under `wrapper`, if any); returns once it has
/// confined itself.
/// The halves' log filter: `FIRN_TEST_LOG` when set (say `debug` to chase a failure),
/// else info.
fn log_level() -> String {
    std::env::var("FIRN_TEST_LOG").unwrap_or_else(|_| "info".into())
}

fn spawn_sampler(wrapper: &[&str], argv: &[String]) -> Proc {
    let mut all = wrapper
        .iter()
        .map(|s| s.to_string())
        .chain(argv.iter().cloned());
    let mut cmd = Command::new(all.next().expect("a sampler command line"));
    cmd.args(all).env("FIRN_LOG", log_level());
    let p = Proc::spawn("sampler", cmd);
    assert!(
        p.wait_for(SAMPLER_READY, Duration::from_secs(30)).is_some(),
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

/// The sampler logs this once it has dropped its privileges and confined itself.
pub const SAMPLER_READY: &str = "seccomp filter installed";
/// The enricher logs this once it is subscribed.
pub const ENRICHER_READY: &str = "connected to the sampler";

/// How firn is started for a test or a benchmark: the one definition both use
/// (`firn-plan` prints it for tests/bench/firn_bench.py). The sampler runs as root and
/// lets only `user` connect; the enricher runs as `user` with no capabilities and
/// writes to `out`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Plan {
    pub socket: PathBuf,
    pub out: PathBuf,
    pub user: (u32, u32),
    /// The sampler's command line; ready once its stderr shows [`SAMPLER_READY`].
    pub sampler: Vec<String>,
    pub sampler_ready: &'static str,
    pub enricher_ready: &'static str,
}

impl Plan {
    /// Creates `user_name` if missing and `dir`/out owned by it; `sampler_args` come
    /// before the flags the plan adds.
    pub fn prepare(dir: &Path, user_name: &str, sampler_args: &[&str]) -> Plan {
        let user = test_user(user_name);
        let socket = dir.join("s.sock");
        let out = dir.join("out");
        std::fs::create_dir_all(&out).unwrap();
        nix::unistd::chown(
            &out,
            Some(nix::unistd::Uid::from_raw(user.0)),
            Some(nix::unistd::Gid::from_raw(user.1)),
        )
        .unwrap();
        let mut sampler: Vec<String> = vec![
            bin("firn-sampler").display().to_string(),
            "--socket".into(),
            socket.display().to_string(),
        ];
        sampler.extend(sampler_args.iter().map(|s| s.to_string()));
        sampler.extend([
            "--allow-uid".into(),
            user.0.to_string(),
            "--socket-group".into(),
            user.1.to_string(),
        ]);
        Plan {
            socket,
            out,
            user,
            sampler,
            sampler_ready: SAMPLER_READY,
            enricher_ready: ENRICHER_READY,
        }
    }

    /// The enricher's command line: as `user` (setpriv, no capabilities), serving HTTP
    /// on `http`; ready once its stderr shows [`ENRICHER_READY`].
    pub fn enricher(&self, http: &str, extra: &[&str]) -> Vec<String> {
        let mut argv: Vec<String> = vec![
            "setpriv".into(),
            format!("--reuid={}", self.user.0),
            format!("--regid={}", self.user.1),
            "--clear-groups".into(),
            "--inh-caps=-all".into(),
            bin("firn-enricher").display().to_string(),
            "--socket".into(),
            self.socket.display().to_string(),
            "--output-dir".into(),
            self.out.display().to_string(),
            "--http-address".into(),
            http.into(),
        ];
        argv.extend(extra.iter().map(|s| s.to_string()));
        argv
    }
}

/// A running sampler + enricher pair: the sampler as root, the enricher as the
/// unprivileged test user, profiles in a temp directory.
/// Sampler flags that turn off binary handles: the broker then reaches files only by
/// walking a live process's paths (for tests of that walk's checks).
pub const WALK_ONLY: &[&str] = &["--binary-handles", "0"];

/// The row pool of test samplers: 8 Mi rows, 64 MiB (why: `Firn::start_under_lazy`).
const TEST_POOL_ROWS: &str = "8388608";

pub struct Firn {
    pub dir: TempDir,
    pub sampler: Proc,
    pub enricher: Option<Proc>,
    pub socket: PathBuf,
    pub out: PathBuf,
    pub user: (u32, u32),
    pub http: String,
    plan: Plan,
    token: std::sync::Mutex<String>,
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

    /// [`Firn::start`] with flags for the enricher; `enricher_args` may name files
    /// under the test's directory, which is passed in.
    pub fn start_with(
        tag: &str,
        sampler_args: &[&str],
        enricher_args: impl FnOnce(&Path) -> Vec<String>,
    ) -> Firn {
        let mut f = Self::start_under_lazy(tag, &[], sampler_args);
        let extra = enricher_args(f.dir.path());
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        f.start_enricher(&extra);
        f
    }

    /// [`Firn::start`] with the sampler under a wrapper command (see [`start_sampler_under`]).
    pub fn start_under(tag: &str, wrapper: &[&str], sampler_args: &[&str]) -> Firn {
        let mut f = Self::start_under_lazy(tag, wrapper, sampler_args);
        f.start_enricher(&[]);
        f
    }

    /// The sampler only; the enricher is the caller's to start.
    fn start_under_lazy(tag: &str, wrapper: &[&str], sampler_args: &[&str]) -> Firn {
        let dir = TempDir::new(tag);
        // tests/run.sh builds the fuzz targets beside these tests; the toolchain it keeps
        // live (cc1 0.48 M rows, cargo 0.42 M, the linker plugin's libLLVM and libz3 about
        // 1.3 M) can fill the default pool of 2 Mi rows, and a test's new binaries are
        // then refused room until the enricher retries, rounds after the workload ended
        // (CI failed so once). Tests size the pool for that machine; the default is the
        // product's, measured by the benchmarks through `firn-plan`, which keep it.
        let mut args: Vec<&str> = sampler_args.to_vec();
        if !args.iter().any(|a| a.starts_with("--unwind-rows")) {
            args.extend(["--unwind-rows", TEST_POOL_ROWS]);
        }
        let plan = Plan::prepare(dir.path(), "firn-test", &args);
        let sampler = spawn_sampler(wrapper, &plan.sampler);
        Firn {
            socket: plan.socket.clone(),
            out: plan.out.clone(),
            user: plan.user,
            dir,
            sampler,
            enricher: None,
            http: String::new(),
            plan,
            token: Default::default(),
        }
    }

    /// Starts (or restarts) the enricher as the test user; waits until it is connected.
    pub fn start_enricher(&mut self, extra: &[&str]) {
        let p = self.spawn_enricher(extra);
        assert!(
            p.wait_for(ENRICHER_READY, Duration::from_secs(20))
                .is_some(),
            "enricher did not connect: {:#?}",
            p.lines()
        );
        self.enricher = Some(p);
    }

    /// Starts the enricher as the test user without waiting for the sampler.
    pub fn spawn_enricher(&mut self, extra: &[&str]) -> Proc {
        self.http = format!("127.0.0.1:{}", http_port());
        let argv = self.plan.enricher(&self.http, extra);
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]).env("FIRN_LOG", log_level());
        Proc::spawn("enricher", cmd)
    }

    /// Restarts the sampler with the same flags (after it was killed).
    pub fn restart_sampler(&mut self) {
        self.sampler = spawn_sampler(&[], &self.plan.sampler);
    }

    /// Waits until the enricher's start-up wave of unwind tables is built: its build time
    /// unmoved for a second (at most 30 s). A workload started then gets its table in
    /// milliseconds, not after every other binary of a busy machine (a build beside the
    /// tests: librustc_driver and libLLVM take a quarter second each).
    pub fn tables_settled(&self) {
        let t0 = Instant::now();
        let mut last = None;
        while t0.elapsed() < Duration::from_secs(30) {
            let now = self.metric("firn_enricher_unwind_table_build_ns_total");
            if now.is_some() && now == last {
                return;
            }
            last = now;
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// Profile files (all rounds) whose index labels have pid == `pid`.
    pub fn profiles_of(&self, pid: u32) -> Vec<PathBuf> {
        index_entries(&self.out)
            .into_iter()
            .filter(|(_, labels)| labels["pid"].as_str() == Some(pid.to_string().as_str()))
            .map(|(p, _)| p)
            .collect()
    }

    /// Waits until `pid` has at least `profiles` profiles. A profile per round, but for
    /// the round of a sample between the harness's fork and its exec, which holds a
    /// profile of the test binary's too, so it may return a round early.
    pub fn wait_profiles(&self, pid: u32, profiles: usize, timeout: Duration) -> Vec<PathBuf> {
        let t0 = Instant::now();
        loop {
            let p = self.profiles_of(pid);
            if p.len() >= profiles || t0.elapsed() > timeout {
                return p;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A GET with the enricher's HTTP token.
    pub fn get(&self, path: &str) -> (u16, Vec<u8>) {
        crate::http_get_with(
            &self.http,
            path,
            &[format!("Authorization: Bearer {}", self.token())],
        )
    }

    /// The token the enricher created under its output directory (the last one read,
    /// while the directory is gone).
    pub fn token(&self) -> String {
        let mut known = self.token.lock().unwrap_or_else(|e| e.into_inner());
        if let Ok(t) = std::fs::read_to_string(self.out.join(".http-token")) {
            *known = t.trim().to_string();
        }
        known.clone()
    }

    /// A URL of the enricher's that carries the token (for `go tool pprof`, a browser).
    pub fn url(&self, path: &str) -> String {
        let sep = if path.contains('?') { '&' } else { '?' };
        format!("http://{}{path}{sep}token={}", self.http, self.token())
    }

    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics");
        String::from_utf8_lossy(&body).lines().find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == name).then(|| v.trim().parse().ok()).flatten()
        })
    }
}

/// A sampler alone, on a socket in a temporary directory of its own: the set-up most
/// sampler tests share. Dereferences to its process.
pub struct SamplerRun {
    pub proc: Proc,
    pub socket: PathBuf,
    pub dir: TempDir,
}

impl SamplerRun {
    /// The release sampler with `args`; returns once it has confined itself.
    pub fn start(tag: &str, args: &[&str]) -> Self {
        Self::start_with(tag, &bin("firn-sampler"), &[], args)
    }

    /// `binary` (e.g. the forbidden-probe build) under `wrapper` (e.g. strace).
    pub fn start_with(tag: &str, binary: &Path, wrapper: &[&str], args: &[&str]) -> Self {
        let dir = TempDir::new(tag);
        let socket = dir.path().join("s.sock");
        let proc = start_sampler_under(wrapper, binary, &socket, args);
        Self { proc, socket, dir }
    }

    /// A `--dump` client as root.
    pub fn dump(&self, extra: &[&str]) -> Proc {
        start_dump(&self.socket, None, extra)
    }

    /// A `--dump` client as `uid:gid`.
    pub fn dump_as(&self, uid_gid: (u32, u32), extra: &[&str]) -> Proc {
        start_dump(&self.socket, Some(uid_gid), extra)
    }
}

impl Deref for SamplerRun {
    type Target = Proc;
    fn deref(&self) -> &Proc {
        &self.proc
    }
}

impl DerefMut for SamplerRun {
    fn deref_mut(&mut self) -> &mut Proc {
        &mut self.proc
    }
}

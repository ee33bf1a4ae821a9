//! Child processes whose output the tests read, and /proc facts about any process.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

    /// Whether it still runs (not exited, or exited but not yet reaped by us).
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
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

    /// SIGTERM to this process's first child (the program under a wrapper such as
    /// strace, which would only detach on a signal of its own), then waits for this
    /// process up to `timeout`.
    pub fn stop_child(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let pid = self.pid();
        let mut child = 0;
        let t0 = Instant::now();
        while child == 0 && t0.elapsed() < Duration::from_secs(10) {
            child = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .ok()
                .and_then(|c| c.split_whitespace().next().and_then(|p| p.parse().ok()))
                .unwrap_or(0);
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_ne!(child, 0, "{} has no child", self.name);
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child),
            nix::sys::signal::Signal::SIGTERM,
        );
        self.wait_exit(timeout)
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

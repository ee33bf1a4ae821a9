//! cgroup v2 groups for the label tests.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{workload, Proc};

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

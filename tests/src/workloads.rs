//! The workloads the tests profile: C programs built with clang, Go programs, and
//! starting them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{repo_root, Proc};

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

/// Builds a Go workload under tests/workloads/NAME with Debian's go, once.
pub fn go_workload(name: &str) -> PathBuf {
    let src = repo_root().join("tests/workloads").join(name);
    let out = repo_root().join("target/workloads").join(name);
    if !out.exists() {
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        go_build(&src, &[], &out);
    }
    out
}

/// `go build` of the module in `src` into `out`, offline, with the tests' build cache.
fn go_build(src: &Path, flags: &[&str], out: &Path) {
    let status = Command::new("go")
        .arg("build")
        .args(flags)
        .arg("-o")
        .arg(out)
        .arg(".")
        .current_dir(src)
        .env("GOCACHE", repo_root().join("target/go-cache"))
        .env("GOPATH", repo_root().join("target/go-path"))
        .env("HOME", repo_root().join("target"))
        .env("GOFLAGS", "-mod=mod")
        .env("GOPROXY", "off")
        .status()
        .expect("go (apt-get install golang-go)");
    assert!(status.success(), "go build {}", src.display());
}

/// Compiles a C/C++ source with clang (frame pointers), with extra flags, once.
pub fn compile(src_name: &str, out_name: &str, flags: &[&str]) -> PathBuf {
    let cc = if src_name.ends_with(".cpp") {
        "clang++"
    } else {
        "clang"
    };
    let mut all = vec![
        "-O2",
        "-g",
        "-fno-omit-frame-pointer",
        "-mno-omit-leaf-frame-pointer",
    ];
    all.extend_from_slice(flags);
    compile_plain(cc, src_name, out_name, &all)
}

/// Compiles `tests/workloads/SRC` with `cc` and exactly `flags` (no frame-pointer
/// flags added: the distribution's defaults), once: again only when the source is newer.
pub fn compile_plain(cc: &str, src_name: &str, out_name: &str, flags: &[&str]) -> PathBuf {
    let src = repo_root().join("tests/workloads").join(src_name);
    let out_dir = repo_root().join("target/workloads");
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = out_dir.join(out_name);
    let fresh = match (std::fs::metadata(&src), std::fs::metadata(&out)) {
        (Ok(s), Ok(o)) => o.modified().ok() >= s.modified().ok(),
        _ => false,
    };
    if !fresh {
        let tmp = out_dir.join(format!("{out_name}.tmp{}", std::process::id()));
        let status = Command::new(cc)
            .args(flags)
            .arg("-o")
            .arg(&tmp)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("{cc} must be installed: {e}"));
        assert!(status.success(), "compiling {}", src.display());
        std::fs::rename(&tmp, &out).unwrap();
    }
    out
}

/// Runs `script` with `sh -c` in a new private mount namespace (unshare).
pub fn in_mount_ns(script: &str) -> Proc {
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c", script]);
    Proc::spawn("ns", cmd)
}

/// A build id no run has seen: the time now, with `salt` (hex, for `--build-id=0x…`).
pub fn fresh_build_id(salt: u8) -> String {
    format!("{:016x}{salt:02x}", crate::now_ns())
}

/// `tests/workloads/SRC` built by plain `gcc -O2 -g` (no frame pointers) into `dir`
/// with build id `id`: a binary whose table no cache holds.
pub fn compile_fresh(src: &str, dir: &Path, id: &str) -> PathBuf {
    let out = dir.join(format!("{}-{id}", src.trim_end_matches(".c")));
    let status = Command::new("gcc")
        .args(["-O2", "-g", &format!("-Wl,--build-id=0x{id}"), "-o"])
        .arg(&out)
        .arg(repo_root().join("tests/workloads").join(src))
        .status()
        .expect("gcc must be installed");
    assert!(status.success(), "compiling {src}");
    out
}

/// The Go workload `name` linked into `dir` with GNU build id `id` (the compiled
/// packages come from the shared build cache: only the link runs).
pub fn go_workload_fresh(name: &str, dir: &Path, id: &str) -> PathBuf {
    let out = dir.join(format!("{name}-{id}"));
    let src = repo_root().join("tests/workloads").join(name);
    go_build(&src, &[&format!("-ldflags=-B 0x{id}")], &out);
    out
}

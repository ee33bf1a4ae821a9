//! Helpers of the Python-frame tests (`tests/tests/python*.rs`): the CPythons here,
//! the workload, and stacks read back with `go tool pprof -traces -lines`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::*;

const SECS: Duration = Duration::from_secs(1);
/// pyenv's builds the tests cover (with Debian's python3, 3.11.2).
pub const PYENV: [&str; 4] = ["3.10.13", "3.11.7", "3.12.1", "3.13.0"];

pub fn pyenv_root() -> Option<PathBuf> {
    Command::new("pyenv")
        .arg("root")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| PathBuf::from(s.trim()))
        .filter(|p| p.is_dir())
}

/// pyenv's CPython `full` (e.g. "3.12.1"); with CI=true a machine with pyenv must
/// have it.
pub fn pyenv_python(full: &str) -> Option<PathBuf> {
    let minor = &full[..full.rfind('.').unwrap_or(full.len())];
    let root = pyenv_root()?;
    let exe = root
        .join("versions")
        .join(full)
        .join(format!("bin/python{minor}"));
    if exe.exists() {
        return Some(exe);
    }
    assert!(!bpf_required(), "pyenv's CPython {full} is missing");
    eprintln!("skipped: no pyenv CPython {full}");
    None
}

/// (version, executable) of every CPython the tests cover.
pub fn interpreters() -> Vec<(String, PathBuf)> {
    let mut v = vec![("3.11.2".to_string(), PathBuf::from("/usr/bin/python3"))];
    for full in PYENV {
        if let Some(e) = pyenv_python(full) {
            v.push((full.to_string(), e));
        }
    }
    v
}

pub fn script() -> PathBuf {
    repo_root().join("tests/workloads/pychain.py")
}

/// The line of the workload's leaf statement.
pub fn leaf_line() -> u32 {
    let text = std::fs::read_to_string(script()).unwrap();
    text.lines()
        .position(|l| l.contains("# LEAF_LINE"))
        .unwrap() as u32
        + 1
}

pub fn start_python(exe: &Path, secs: &str) -> Proc {
    start_script(exe, &script(), secs)
}

pub fn start_script(exe: &Path, script: &Path, secs: &str) -> Proc {
    let mut cmd = Command::new(exe);
    cmd.arg(script).arg(secs);
    let p = Proc::spawn("python", cmd);
    assert!(
        p.wait_for("ready", 20 * SECS).is_some(),
        "{} did not start: {:?}",
        exe.display(),
        p.lines()
    );
    p
}

/// Waits until the sampler took the interpreter record of `pid`: its log line says so,
/// or (the line can be held back by the log's rate limit, 20 a call site, when firn
/// meets more Pythons on this host) the process's profiles hold a Python frame.
pub fn wait_interpreter(f: &Firn, pid: u32) {
    let needle = format!("pid={pid} ");
    let label = pid.to_string();
    let mut checked = std::time::Instant::now();
    let ok = wait_until(120 * SECS, || {
        if f.sampler
            .lines()
            .iter()
            .any(|l| l.contains("Python interpreter loaded") && l.contains(&needle))
        {
            return true;
        }
        if checked.elapsed() < 3 * SECS {
            return false;
        }
        checked = std::time::Instant::now();
        let files: Vec<PathBuf> = index_records(&f.out)
            .into_iter()
            .filter(|(_, r)| r["labels"]["pid"].as_str() == Some(label.as_str()))
            .map(|(p, _)| p)
            .collect();
        let last = &files[files.len().saturating_sub(2)..];
        !last.is_empty()
            && line_traces(last)
                .iter()
                .any(|(_, fr)| fr.iter().any(Fr::python))
    });
    assert!(
        ok,
        "no interpreter for {pid}: sampler {:#?}\nenricher {:#?}",
        f.sampler.lines().iter().rev().take(15).collect::<Vec<_>>(),
        f.enricher
            .as_ref()
            .map(|e| e.lines().into_iter().rev().take(15).collect::<Vec<_>>())
    );
}

/// A frame of `go tool pprof -traces -lines`: function, file, line.
#[derive(Debug, Clone)]
pub struct Fr {
    pub func: String,
    pub file: String,
    pub line: u32,
}

impl Fr {
    pub fn python(&self) -> bool {
        self.file.ends_with(".py")
    }
}

pub fn frames_of(names: &[String]) -> Vec<Fr> {
    names
        .iter()
        .map(|n| {
            // A frame without file and line prints as its name alone (firn's
            // `[python: …]` names have spaces).
            if n.starts_with('[') && n.ends_with(']') {
                return Fr {
                    func: n.clone(),
                    file: String::new(),
                    line: 0,
                };
            }
            let (func, loc) = n.rsplit_once(' ').unwrap_or((n.as_str(), ""));
            let (file, line) = loc.trim().rsplit_once(':').unwrap_or((loc.trim(), "0"));
            // pprof drops `<…>` from names as C++ template arguments, so `<module>`
            // prints as its file and line.
            if let Some((path, l)) = func.rsplit_once(':').filter(|(p, _)| p.ends_with(".py")) {
                return Fr {
                    func: "<module>".to_string(),
                    file: path.to_string(),
                    line: l.parse().unwrap_or(0),
                };
            }
            Fr {
                func: func.to_string(),
                file: file.to_string(),
                line: line.parse().unwrap_or(0),
            }
        })
        .collect()
}

pub fn line_traces(files: &[PathBuf]) -> Vec<(u64, Vec<Fr>)> {
    parse_traces(&go_pprof(
        &["-traces", "-lines", "-sample_index=samples"],
        files,
    ))
    .into_iter()
    .map(|(n, f)| (n, frames_of(&f)))
    .collect()
}

/// Whether the Python frames of `frames` (leaf first) hold `chain` in order, ending the
/// stack's Python frames.
pub fn python_chain(frames: &[Fr], chain: &[&str]) -> bool {
    let py: Vec<&str> = frames
        .iter()
        .filter(|f| f.python())
        .map(|f| f.func.as_str())
        .collect();
    let mut it = py.iter();
    chain.iter().all(|c| it.any(|p| p == c)) && py.last() == chain.last()
}

pub fn worst(
    t: &[(u64, Vec<Fr>)],
    counted: impl Fn(&[Fr]) -> bool,
    good: impl Fn(&[Fr]) -> bool,
) -> Vec<(u64, Vec<String>)> {
    let mut bad: Vec<_> = t
        .iter()
        .filter(|(_, f)| counted(f) && !good(f))
        .map(|(n, f)| {
            (
                *n,
                f.iter()
                    .map(|x| format!("{} {}:{}", x.func, x.file, x.line))
                    .collect(),
            )
        })
        .collect();
    bad.sort_by_key(|b| std::cmp::Reverse(b.0));
    bad.truncate(3);
    bad
}

/// The functions of every thread of `pid`, as `py-spy dump` reads them.
pub fn py_spy_dump(pid: u32) -> Vec<String> {
    let out = Command::new(repo_root().join("target/test-venv/bin/py-spy"))
        .args(["dump", "--pid", &pid.to_string()])
        .output()
        .expect("py-spy (tests/setup-tools.sh installs it)");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("    "))
        .filter_map(|l| l.trim().split(" (").next().map(str::to_string))
        .collect()
}

/// Every function name in `files`, as `go tool pprof -top` lists them.
pub fn files_names(files: &[PathBuf]) -> Vec<String> {
    parse_traces(&go_pprof(&["-traces", "-sample_index=samples"], files))
        .into_iter()
        .flat_map(|(_, f)| f)
        .collect()
}

//! Reading what firn wrote: the round indexes, its HTTP endpoint, and pprof files
//! through `go tool pprof`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::repo_root;

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

/// (round start_ns → samples) of process `pid` in the local sink's index: what the
/// upload tests compare each backend with.
pub fn pid_rounds(out: &Path, pid: u32) -> std::collections::BTreeMap<u64, u64> {
    let mut m = std::collections::BTreeMap::new();
    for (_, e) in index_records(out) {
        if e["labels"]["pid"].as_str() == Some(pid.to_string().as_str()) {
            if let (Some(t), Some(n)) = (e["start_ns"].as_u64(), e["samples"].as_u64()) {
                *m.entry(t).or_insert(0) += n;
            }
        }
    }
    m
}

/// Index records: (file, whole index line).
pub type Records = Vec<(PathBuf, Value)>;

/// `pid`'s index records under `out`.
pub fn pid_records(out: &Path, pid: u32) -> Records {
    index_records(out)
        .into_iter()
        .filter(|(_, e)| e["labels"]["pid"].as_str() == Some(pid.to_string().as_str()))
        .collect()
}

/// A workload's records (`pid_records`) split into its own and those of the harness's
/// fork before its exec. A sample between the fork and the exec is the test binary's,
/// another process to the sampler, in a record of its own named after the test binary,
/// or after nothing when the child exec'd before /proc could be read and no other
/// process described it. Fails the test when what is set aside is more than such a
/// sample can be: over 2 samples in all, or a record later than the workload's first
/// (a record of the workload that lost its labels is then caught, not set aside).
pub fn split_pre_exec(records: Records) -> (Records, Records) {
    let me = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    let (aside, own): (Vec<_>, Vec<_>) =
        records
            .into_iter()
            .partition(|(_, e)| match e["labels"]["executable"].as_str() {
                None | Some("") => true,
                Some(x) => Some(x) == me.as_deref(),
            });
    let first = own.iter().filter_map(|(_, e)| e["start_ns"].as_u64()).min();
    let samples = aside
        .iter()
        .map(|(_, e)| e["samples"].as_u64().unwrap_or(u64::MAX))
        .fold(0u64, u64::saturating_add);
    assert!(
        samples <= 2,
        "{samples} samples in records without the workload's executable: {aside:#?}"
    );
    for (_, e) in &aside {
        assert!(
            e["start_ns"].as_u64() <= first,
            "a record without the workload's executable after its first: {e}"
        );
    }
    (own, aside)
}

/// (round start_ns → off-CPU ns) of process `pid` in the local pprof files, each read
/// by `go tool pprof -sample_index=off_cpu` (the reference the backends are held to).
pub fn pid_off_cpu_rounds(out: &Path, pid: u32) -> std::collections::BTreeMap<u64, u64> {
    let mut m = std::collections::BTreeMap::new();
    for (file, e) in index_records(out) {
        if e["labels"]["pid"].as_str() != Some(pid.to_string().as_str()) {
            continue;
        }
        if let Some(t) = e["start_ns"].as_u64() {
            let ns: u64 = off_cpu_traces(&[file], &[]).iter().map(|x| x.0).sum();
            *m.entry(t).or_insert(0) += ns;
        }
    }
    m
}

/// Waits until a round that began at `since_ns` or later is in the index under `out`:
/// every round of a workload that ended before is written then.
pub fn wait_round_after(out: &Path, since_ns: u64, timeout: Duration) -> bool {
    crate::wait_until(timeout, || {
        index_records(out)
            .iter()
            .any(|(_, r)| r["start_ns"].as_u64() >= Some(since_ns))
    })
}

/// Owned command-line words.
pub fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// A minimal HTTP/1.1 GET on loopback without credentials: (status, body).
pub fn http_get(addr: &str, path: &str) -> (u16, Vec<u8>) {
    http_get_with(addr, path, &[])
}

/// [`http_get`] with extra header lines (`Name: value`); a `Host:` among them replaces
/// the address.
pub fn http_get_with(addr: &str, path: &str, headers: &[String]) -> (u16, Vec<u8>) {
    let (status, _, body) = http_request(addr, path, headers);
    (status, body)
}

/// A GET: (status, response head, body).
pub fn http_request(addr: &str, path: &str, headers: &[String]) -> (u16, String, Vec<u8>) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new(), Vec::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
    let host = if headers
        .iter()
        .any(|h| h.to_ascii_lowercase().starts_with("host:"))
    {
        String::new()
    } else {
        format!("Host: {addr}\r\n")
    };
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\n{host}{extra}Connection: close\r\n\r\n"
    );
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let Some(split) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return (0, String::new(), buf);
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
    (status, head, body)
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

/// The stacks of pprof `files` as (samples, frames leaf first), read by `go tool pprof`.
pub fn traces(files: &[PathBuf]) -> Vec<(u64, Vec<String>)> {
    assert!(!files.is_empty(), "no profiles");
    parse_traces(&go_pprof(&["-traces", "-sample_index=samples"], files))
}

/// The off-CPU stacks of pprof `files` as (nanoseconds, frames leaf first), with
/// `extra` arguments (e.g. `-tagfocus=…`), read by `go tool pprof`.
pub fn off_cpu_traces(files: &[PathBuf], extra: &[&str]) -> Vec<(u64, Vec<String>)> {
    assert!(!files.is_empty(), "no profiles");
    let mut args = vec!["-traces", "-sample_index=off_cpu", "-unit=ns"];
    args.extend_from_slice(extra);
    let text = go_pprof(&args, files);
    // Values print as `123ns`; the count column of parse_traces is a bare number.
    let bare: String = text
        .lines()
        .map(|l| {
            let t = l.trim_start();
            match t.split_once("ns ") {
                Some((n, rest)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                    format!("{}{n} {rest}\n", &l[..l.len() - t.len()])
                }
                _ => format!("{l}\n"),
            }
        })
        .collect();
    parse_traces(&bare)
}

/// Sample-weighted share of `traces` (leaf first) that `whole` accepts, among those
/// `counted` accepts.
pub fn share<T>(
    traces: &[(u64, Vec<T>)],
    counted: impl Fn(&[T]) -> bool,
    whole: impl Fn(&[T]) -> bool,
) -> (f64, u64) {
    let (mut all, mut good) = (0, 0);
    for (n, frames) in traces {
        if counted(frames) {
            all += n;
            if whole(frames) {
                good += n;
            }
        }
    }
    (good as f64 / all.max(1) as f64, all)
}

/// The heaviest traces `whole` rejects, for the log.
pub fn worst_stacks(
    traces: &[(u64, Vec<String>)],
    whole: impl Fn(&[String]) -> bool,
) -> Vec<&(u64, Vec<String>)> {
    let mut bad: Vec<_> = traces.iter().filter(|t| !whole(&t.1)).collect();
    bad.sort_by_key(|t| std::cmp::Reverse(t.0));
    bad.truncate(3);
    bad
}

/// Whether `frames` hold `chain` as consecutive frames.
pub fn has_chain(frames: &[String], chain: &[&str]) -> bool {
    frames
        .windows(chain.len())
        .any(|w| w.iter().zip(chain).all(|(f, c)| f == c))
}

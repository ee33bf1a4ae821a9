//! End-to-end tests of the sampler's hardening (issue: privileged-side hardening): each
//! finding of the security review, attacked or measured against the real binaries.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);
const FAST: &[&str] = &["--frequency", "99", "--round", "1"];

/// A mapped path that now leads to a device, a FIFO, a socket or a directory (a mount
/// in the process's own namespace covers it): the broker refuses each without opening
/// it. inotify on the special files sees any open, the way a device driver would.
#[test]
fn special_files_behind_a_mapping_are_never_opened() {
    if !can_run_bpf() {
        return;
    }
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    // Handles off: the path walk is under test (a handle taken before the covering
    // would serve the mapped file itself).
    let mut f = Firn::start("special", &[FAST, WALK_ONLY].concat());
    f.enricher.take().map(|mut e| e.stop());
    let busy = workload("busy");
    let t = f.dir.path().join("t");
    let kinds = ["dev", "fifo", "sock", "dir"];
    for k in kinds {
        std::fs::create_dir_all(t.join(format!("d-{k}"))).unwrap();
        std::fs::create_dir_all(t.join(format!("cover-{k}"))).unwrap();
        std::fs::copy(&busy, t.join(format!("d-{k}/ns-busy"))).unwrap();
    }
    let special = |k: &str| t.join(format!("cover-{k}/ns-busy"));
    nix::sys::stat::mknod(
        &special("dev"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        libc::makedev(1, 3),
    )
    .expect("mknod (root)");
    nix::unistd::mkfifo(
        &special("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o666),
    )
    .unwrap();
    let _sock = std::os::unix::net::UnixListener::bind(special("sock")).unwrap();
    std::fs::create_dir(special("dir")).unwrap();
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK).unwrap();
    for k in ["dev", "fifo", "dir"] {
        inotify
            .add_watch(&special(k), AddWatchFlags::IN_OPEN)
            .unwrap();
    }
    let t = t.display();
    let start: String = kinds
        .iter()
        .map(|k| format!("({t}/d-{k}/ns-busy 12 &) && "))
        .collect();
    let cover: String = kinds
        .iter()
        .map(|k| format!("mount --bind {t}/cover-{k} {t}/d-{k} && "))
        .collect();
    // The processes map their binaries and are sampled (and their maps recorded), then
    // the mounts cover the paths; the enricher starts after, so its broker requests meet
    // the covers.
    let mut ns = in_mount_ns(&format!(
        "{start}sleep 3 && {cover}echo rearranged && sleep 9"
    ));
    ns.wait_for("rearranged", 30 * SECS)
        .expect("namespace rearranged");
    f.start_enricher(&[]);
    ns.wait_exit(30 * SECS).unwrap();
    let refused = || {
        f.metric("firn_sampler_broker_refused_not_regular")
            .unwrap_or(0.0)
    };
    wait_until(10 * SECS, || refused() >= 4.0);
    assert!(
        refused() >= 4.0,
        "expected four refusals as not a regular file, got {}",
        refused()
    );
    let events = inotify.read_events().unwrap_or_default();
    assert!(
        events.is_empty(),
        "the sampler opened a special file: {events:?}"
    );
}

/// A process mapping one file thousands of times, at a path near PATH_MAX, would make a
/// record of megabytes: it is cut to the per-record bound, libraries kept, and counted.
#[test]
fn fat_process_records_are_trimmed() {
    if !can_run_bpf() {
        return;
    }
    let mut sampler = SamplerRun::start("fat", FAST);
    let dump = sampler.dump(&[]);
    let script = r#"
import mmap, os, sys, time
d = sys.argv[1]
for i in range(17):
    d = os.path.join(d, "%02d" % i + "x" * 200)
os.makedirs(d)
p = os.path.join(d, "lib.so")
with open(p, "wb") as f:
    f.write(b"\0" * 4096)
fd = os.open(p, os.O_RDONLY)
keep = [mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_EXEC)
        for _ in range(3000)]
# A child inherits them: a process that is fat from its first sample on (the parent may
# have been read before its mmaps, and nothing it runs would have it read again).
child = os.fork()
if child:
    os.waitpid(child, 0)
    sys.exit(0)
print("ready", os.getpid(), flush=True)
t = time.time()
x = 0
while time.time() - t < float(sys.argv[2]):
    x += 1
"#;
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.arg("-c")
        .arg(script)
        .arg(sampler.dir.path().join("long"))
        .arg("5");
    let mut w = Proc::spawn("fat", cmd);
    let pid: u64 = w
        .wait_for("ready", 20 * SECS)
        .expect("fat workload started")
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    w.wait_exit(20 * SECS);
    std::thread::sleep(2 * SECS);
    let got = batches(&dump);
    // A sample between the harness's fork and the exec makes a record of the earlier
    // program too (what BPF saw, no mappings): the python record is the largest.
    let record = got
        .iter()
        .flat_map(|b| b["processes"].as_array().cloned().unwrap_or_default())
        .filter(|p| p["pid"].as_u64() == Some(pid))
        .max_by_key(|p| p["mappings"].as_array().map_or(0, Vec::len))
        .expect("a record of the fat process");
    let maps = record["mappings"].as_array().unwrap();
    let bytes: usize = maps
        .iter()
        .map(|m| 72 + m["path"].as_str().unwrap_or("").len())
        .sum();
    assert!(
        bytes <= firn_sampler::MAX_RECORD_BYTES,
        "record of {} mappings, {bytes} bytes",
        maps.len()
    );
    // Its libraries (one mapping each) survived the cut of the repeated file.
    assert!(
        maps.iter()
            .any(|m| m["path"].as_str().unwrap_or("").contains("libc.so")),
        "libc was cut from the record"
    );
    let last = got.last().unwrap();
    assert!(counter(last, "process_records_trimmed").unwrap_or(0) >= 1);
    sampler.stop();
}

/// A peer whose allowed group is a supplementary one is let in (SO_PEERGROUPS).
#[test]
fn supplementary_groups_are_checked() {
    if !can_run_bpf() {
        return;
    }
    let (_, allowed_gid) = test_user("firn-test");
    let (uid, gid) = test_user("firn-test-denied");
    let mut sampler = SamplerRun::start(
        "groups",
        &["--round", "1", "--allow-gid", &allowed_gid.to_string()],
    );
    std::fs::set_permissions(
        &sampler.socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    let client = |groups: &str| {
        let mut c = Command::new("setpriv");
        c.arg(format!("--reuid={uid}"))
            .arg(format!("--regid={gid}"))
            .arg(groups)
            .arg("--inh-caps=-all")
            .arg(bin("firn-enricher"))
            .arg("--socket")
            .arg(&sampler.socket)
            .arg("--dump");
        Proc::spawn("enricher", c)
    };
    let mut member = client(&format!("--groups={allowed_gid}"));
    let got = wait_batches(&member, 2, 10 * SECS);
    assert!(
        got.len() >= 2,
        "a peer with the allowed group as a supplementary group got no batches"
    );
    member.stop();
    let mut stranger = client("--clear-groups");
    assert!(
        sampler.wait_for("peer not allowed", 10 * SECS).is_some(),
        "a peer without the group was not refused"
    );
    stranger.stop();
    assert!(batches(&stranger).is_empty());
    sampler.stop();
}

/// The socket is born with mode 0660 and its group: no chmod or chown by path after
/// `bind` (a compromised enricher with write access to the directory could swap a
/// symlink in), and nothing that follows links.
#[test]
fn socket_is_born_with_mode_and_group() {
    if !can_run_bpf() {
        return;
    }
    let dir = TempDir::new("sockmode");
    let sock = dir.path().join("s.sock");
    let trace = dir.path().join("trace");
    let (_, gid) = test_user("firn-test");
    let t = trace.display().to_string();
    let mut sampler = start_sampler_under(
        &[
            "strace",
            "-f",
            "-qq",
            "-o",
            &t,
            "-e",
            "trace=%file,fchmod,fchown",
        ],
        &bin("firn-sampler"),
        &sock,
        &["--round", "1", "--socket-group", &gid.to_string()],
    );
    let meta = std::fs::symlink_metadata(&sock).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o660, "socket mode");
    assert_eq!(meta.gid(), gid, "socket group");
    assert_eq!(meta.uid(), 0, "socket owner");
    sampler.stop_child(10 * SECS);
    let calls = std::fs::read_to_string(&trace).unwrap();
    for line in calls.lines() {
        let following = ["chmod(", "fchmodat(", "fchmodat2(", "chown("]
            .iter()
            .any(|c| line.contains(&format!(" {c}")))
            || (line.contains(" fchownat(") && !line.contains("AT_SYMLINK_NOFOLLOW"));
        assert!(!following, "a path-following mode or owner change: {line}");
    }
}

/// Every syscall a busy sampler makes after confinement is on the allow-list, and every
/// entry of the list is used (or documented as a rare path in drop.rs).
#[test]
fn allowed_syscalls_are_used() {
    if !can_run_bpf() {
        return;
    }
    let dir = TempDir::new("strace");
    let trace = dir.path().join("trace");
    let t = trace.display().to_string();
    let mut f = Firn::start_under("syscalls", &["strace", "-f", "-qq", "-o", &t], FAST);
    let busy = workload("busy");
    let churn = workload("churn");
    let mut b = start_workload(&busy, &["5"]);
    let pid = b.pid();
    // New processes every round (/proc reads, exits) beside the busy one.
    let mut c = Proc::spawn("churn", {
        let mut c = Command::new(&churn);
        c.args(["4", "50", "-"]);
        c
    });
    b.wait_exit(30 * SECS);
    c.wait_exit(30 * SECS);
    let tr = traces(&f.wait_profiles(pid, 2, 15 * SECS));
    assert!(
        tr.iter().any(|t| t.1.iter().any(|f| f == "hot_leaf")),
        "no symbolized stack: the broker did not serve"
    );
    f.sampler.stop_child(15 * SECS);
    let text = std::fs::read_to_string(&trace).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.contains("seccomp(SECCOMP_SET_MODE_FILTER"))
        .expect("the seccomp filter was installed");
    let mut used = BTreeSet::new();
    let mut refused = Vec::new();
    for l in &lines[start + 1..] {
        let Some(name) = syscall_of(l) else { continue };
        used.insert(name.to_string());
        if l.contains("= -1 EPERM") {
            refused.push(l.to_string());
        }
    }
    assert!(refused.is_empty(), "refused by the filter: {refused:#?}");
    let setup: BTreeSet<String> = lines[..=start]
        .iter()
        .filter_map(|l| syscall_of(l))
        .map(str::to_string)
        .collect();
    setup_is_covered(&setup, &used);
    let allowed: BTreeSet<String> = firn_sampler::ALLOWED
        .iter()
        .map(|a| a.syscall().to_string())
        .collect();
    let outside: Vec<_> = used.difference(&allowed).collect();
    assert!(outside.is_empty(), "used but not allowed: {outside:?}");
    let rare: BTreeSet<String> = firn_sampler::RARE.iter().map(|r| r.0.to_string()).collect();
    let unused: Vec<_> = allowed
        .difference(&used)
        .filter(|n| !rare.contains(*n))
        .collect();
    assert!(
        unused.is_empty(),
        "allowed but never used (remove, or document as rare): {unused:?}; used: {used:?}"
    );
    eprintln!(
        "{} allowed, {} used after confinement: {used:?}",
        allowed.len(),
        used.len()
    );
}

/// The syscall an strace line shows (a call, or the resumption of one).
fn syscall_of(line: &str) -> Option<&str> {
    let rest = line.split_once(' ').map_or("", |(_, r)| r).trim_start();
    let name = match rest.strip_prefix("<... ") {
        Some(r) => r.split_whitespace().next().unwrap_or(""),
        None => rest.split('(').next().unwrap_or(""),
    };
    (!name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .then_some(name)
}

/// What a real start and run used, checked against the two filters a deployment puts
/// around the sampler before its own: the container profile (generated from drop.rs)
/// must hold every setup syscall, and the systemd unit's SystemCallFilter, expanded by
/// systemd-analyze (systemd's own group tables), every syscall of its whole life.
fn setup_is_covered(setup: &BTreeSet<String>, steady: &BTreeSet<String>) {
    let listed: BTreeSet<&str> = firn_sampler::SETUP
        .iter()
        .map(|s| s.syscall())
        .chain(firn_sampler::ALLOWED.iter().map(|a| a.syscall()))
        .collect();
    let unlisted: Vec<_> = setup
        .iter()
        .filter(|n| !listed.contains(n.as_str()))
        .collect();
    assert!(
        unlisted.is_empty(),
        "setup used syscalls that drop.rs's SETUP does not list (the container profile \
         would refuse them): {unlisted:?}"
    );
    let unit = std::fs::read_to_string(repo_root().join("systemd/firn-sampler.service")).unwrap();
    let (mut allow, mut deny) = (BTreeSet::new(), BTreeSet::new());
    for line in unit.lines() {
        let Some(v) = line.strip_prefix("SystemCallFilter=") else {
            continue;
        };
        let (set, v) = match v.strip_prefix('~') {
            Some(v) => (&mut deny, v),
            None => (&mut allow, v),
        };
        for item in v.split_whitespace() {
            set.extend(expand_filter(item));
        }
    }
    assert!(
        !allow.is_empty(),
        "the sampler's unit has no SystemCallFilter allow-list"
    );
    let outside: Vec<_> = setup
        .iter()
        .chain(steady)
        .filter(|n| !allow.contains(*n) || deny.contains(*n))
        .collect();
    assert!(
        outside.is_empty(),
        "systemd/firn-sampler.service's SystemCallFilter refuses syscalls the sampler \
         makes: {outside:?}"
    );
}

/// A SystemCallFilter item as syscall names: a group expanded (recursively) by
/// `systemd-analyze syscall-filter`, or a name.
fn expand_filter(item: &str) -> BTreeSet<String> {
    if !item.starts_with('@') {
        return BTreeSet::from([item.to_string()]);
    }
    let out = Command::new("systemd-analyze")
        .args(["syscall-filter", item])
        .output()
        .expect("systemd-analyze (package systemd)");
    assert!(
        out.status.success(),
        "systemd-analyze syscall-filter {item}"
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut names = BTreeSet::new();
    for w in text.lines().skip(1) {
        let w = w.trim();
        if w.is_empty() || w.starts_with('#') {
            continue;
        }
        if w.starts_with('@') {
            names.extend(expand_filter(w));
        } else {
            names.insert(w.to_string());
        }
    }
    names
}

/// With `--user`, the sampler runs as that uid after setup, keeps only CAP_SYS_PTRACE,
/// still reads /proc and brokers binaries of other users' processes, and can no longer
/// read root-only files.
#[test]
fn runs_as_a_dedicated_user() {
    if !can_run_bpf() {
        return;
    }
    let (uid, gid) = test_user("firn-sampler-t");
    let mut args = FAST.to_vec();
    args.extend(["--user", "firn-sampler-t"]);
    let f = Firn::start("runas", &args);
    for field in ["Uid", "Gid"] {
        let want = if field == "Uid" { uid } else { gid };
        let v = status_field(f.sampler.pid(), field).unwrap();
        assert!(
            v.split_whitespace().all(|x| x == want.to_string()),
            "{field}: {v}"
        );
    }
    assert_eq!(
        status_field(f.sampler.pid(), "Groups").unwrap_or_default(),
        ""
    );
    assert_eq!(
        status_field(f.sampler.pid(), "CapEff").unwrap(),
        "0000000000080000"
    );
    assert_eq!(status_field(f.sampler.pid(), "Seccomp").unwrap(), "2");
    // A binary in a directory every user may read, run by root: sampled, recorded and
    // symbolized through the broker.
    let copy = f.dir.path().join("busy-runas");
    std::fs::copy(workload("busy"), &copy).unwrap();
    let mut w = start_workload(&copy, &["4"]);
    let pid = w.pid();
    w.wait_exit(20 * SECS);
    let tr = traces(&f.wait_profiles(pid, 2, 15 * SECS));
    assert!(
        tr.iter()
            .any(|t| t.1.first().is_some_and(|f| f == "hot_leaf")),
        "not symbolized under --user:\n{tr:#?}"
    );
    // Root-only files: readable by a uid-0 sampler, not by one that switched.
    let probe = bin("firn-sampler-probe");
    let mut p = SamplerRun::start_with("runas-probe", &probe, &[], &["--user", "firn-sampler-t"]);
    let line = p
        .wait_for("syscall=\"open_root_only\"", 10 * SECS)
        .expect("probe result");
    assert!(line.contains("outcome=EACCES"), "{line}");
    p.stop();
    assert!(Path::new("/etc/shadow").exists());
}

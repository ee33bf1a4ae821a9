//! Whole stacks from a binary's first sample: the sampler announces a new process as
//! soon as it has read it, the enricher sends its binaries' tables between rounds, and
//! keeps them on disk for the next run. Default 10 s rounds; binaries with build ids no
//! run has seen; every sample of each program counted, its first round included; read
//! back with `go tool pprof -traces`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use firn_tests::pyframes::{line_traces, python_chain, start_script};
use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);

/// Waits until a round that began at or after `since_ns` is written (so every round
/// with samples before it is), or 60 s.
fn wait_round_after(out: &Path, since_ns: u64) {
    let t0 = Instant::now();
    while t0.elapsed() < 60 * SECS {
        if index_records(out)
            .iter()
            .any(|(_, r)| r["start_ns"].as_u64().is_some_and(|s| s >= since_ns))
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    panic!("no round after the workloads ended was written");
}

/// Share of `pid`'s samples `whole` accepts among those `counted` accepts, per round
/// (for the log) and in all.
fn whole_share(
    f: &Firn,
    pid: u32,
    counted: impl Fn(&[String]) -> bool + Copy,
    whole: impl Fn(&[String]) -> bool + Copy,
) -> (f64, u64, Vec<String>) {
    // Not the harness's fork before its exec (a record of the test binary's under the
    // same pid, bounded by split_pre_exec).
    let (own, _) = split_pre_exec(pid_records(&f.out, pid));
    let mut files: Vec<PathBuf> = own.into_iter().map(|(p, _)| p).collect();
    files.sort();
    assert!(!files.is_empty(), "no profile of {pid}");
    let rounds = files
        .iter()
        .map(|p| {
            let (s, n) = share(&traces(std::slice::from_ref(p)), counted, whole);
            format!("{:.1} % of {n}", s * 100.0)
        })
        .collect();
    let t = traces(&files);
    let (s, n) = share(&t, counted, whole);
    if s < 0.95 {
        eprintln!("{pid}: not whole: {:#?}", worst_stacks(&t, whole));
    }
    (s, n, rounds)
}

#[test]
fn whole_stacks_from_the_first_sample_with_default_rounds() {
    if !can_run_bpf() {
        return;
    }
    // Built before firn starts: the compilers (cc1 has 480 k rows) would be new binaries
    // too, and their tables, spread over seconds by the enricher's budget, would be most
    // of what the histogram times.
    let bins = TempDir::new("first-bins");
    let chain8 = compile_fresh("chain.c", bins.path(), &fresh_build_id(1));
    let chain2 = compile_fresh("chain.c", bins.path(), &fresh_build_id(2));
    let go = go_workload_fresh("gospin", bins.path(), &fresh_build_id(3));
    let f = Firn::start("first", &["--frequency", "99"]);
    // Debian's python3: a new interpreter process gets its record with its first
    // announcement, so its Python frames are named from its first round too.
    let script = f.dir.path().join("spin.py");
    std::fs::write(
        &script,
        "import os, sys, time\n\ndef leaf(n):\n    x = 0\n    for i in range(n):\n        \
         x = (x * 31 + i) % 1000003\n    return x\n\ndef outer(end):\n    \
         while time.time() < end:\n        leaf(10000)\n\n\
         print('ready', os.getpid(), flush=True)\nouter(time.time() + float(sys.argv[1]))\n",
    )
    .unwrap();
    // Past the enricher's first round, whose tables are those of the node's processes.
    std::thread::sleep(3 * SECS);
    let mut c8 = start_workload(&chain8, &["8"]);
    let mut g = start_workload(&go, &["8"]);
    let mut py = start_script(std::path::Path::new("/usr/bin/python3"), &script, "8");
    for w in [&mut c8, &mut g, &mut py] {
        assert!(w.wait_exit(30 * SECS).is_some(), "workload did not end");
    }
    // The short one alone afterwards (a binary no run has seen either): with the CPUs
    // to itself it has ~200 samples in its life, not ~70 beside three others.
    let mut c2 = start_workload(&chain2, &["2"]);
    assert!(c2.wait_exit(30 * SECS).is_some(), "workload did not end");
    let pids = [c8.pid(), g.pid(), c2.pid(), py.pid()];
    wait_round_after(&f.out, now_ns());

    let any = |_: &[String]| true;
    let to_main = |fr: &[String]| fr.iter().any(|x| x == "main");
    let chain = |fr: &[String]| {
        has_chain(fr, &["chain_leaf", "chain_c", "chain_b", "chain_a", "main"])
            || !fr.iter().any(|x| x == "chain_leaf")
    };
    for (name, pid, min) in [("8 s", pids[0], 150), ("2 s", pids[2], 100)] {
        let (s, n, rounds) = whole_share(&f, pid, any, |fr| to_main(fr) && chain(fr));
        eprintln!(
            "gcc -O2 chain living {name}: {:.1} % of {n} samples whole to main; rounds {rounds:?}",
            s * 100.0
        );
        assert!(n >= min && s >= 0.95, "chain {name}: {s:.3} of {n}");
    }
    let leaf = |fr: &[String]| fr.iter().any(|x| x == "main.spinLeaf");
    let (s, n, rounds) = whole_share(&f, pids[1], leaf, |fr| {
        has_chain(fr, &["main.spinLeaf", "main.spinOuter", "main.main"])
    });
    eprintln!(
        "Go frameless leaf with its callers: {:.1} % of {n}; rounds {rounds:?}",
        s * 100.0
    );
    assert!(n >= 150 && s >= 0.95, "Go {s:.3} of {n}");
    let m = |k: &str| f.metric(k).unwrap_or(0.0);
    eprintln!(
        "row pool: {} rows in use; tables refused for room or size: {}",
        m("firn_sampler_unwind_rows_in_use"),
        m("firn_sampler_unwind_tables_refused_budget")
    );
    let (own, _) = split_pre_exec(pid_records(&f.out, pids[3]));
    let mut files: Vec<PathBuf> = own.into_iter().map(|(p, _)| p).collect();
    files.sort();
    let t = line_traces(&files);
    let (s, n) = share(
        &t,
        |_| true,
        |fr| python_chain(fr, &["leaf", "outer", "<module>"]),
    );
    let first = line_traces(&files[..1]);
    let (s1, n1) = share(
        &first,
        |_| true,
        |fr| python_chain(fr, &["leaf", "outer", "<module>"]),
    );
    eprintln!(
        "python3: {:.1} % of {n} samples with the whole Python chain; first round {:.1} % of {n1}",
        s * 100.0,
        s1 * 100.0
    );
    assert!(n >= 150 && s >= 0.90, "python3 {s:.3} of {n}");

    // From a binary's first sample to its table in the sampler, on /metrics.
    let count = m("firn_enricher_unwind_table_ready_seconds_count");
    let quick = m("firn_enricher_unwind_table_ready_seconds_bucket{le=\"0.25\"}");
    let fast = m("firn_enricher_unwind_table_ready_seconds_bucket{le=\"0.05\"}");
    eprintln!(
        "tables ready: {count} timed, {fast} within 50 ms, {quick} within 250 ms; \
         {} sent between rounds",
        m("firn_enricher_unwind_tables_early_total")
    );
    assert!(count >= 3.0, "the three binaries' tables were timed");
    assert!(quick >= count / 2.0, "median over 250 ms");
    assert!(m("firn_sampler_processes_announced") >= 3.0);
}

/// The modification time of `p`, in seconds since the epoch.
fn mtime(p: &Path) -> u64 {
    std::fs::metadata(p)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs())
}

/// Waits up to 60 s for `what` to hold.
fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < 60 * SECS, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn tables_come_from_the_disk_cache_after_a_restart_and_a_damaged_one_is_built_again() {
    if !can_run_bpf() {
        return;
    }
    const CACHE: &[&str] = &["--unwind-cache-size", "128MiB"];
    let mut f = Firn::start_with("uwcache", &["--frequency", "99", "--round", "1"], |_| {
        CACHE.iter().map(|s| s.to_string()).collect()
    });
    let id = fresh_build_id(7);
    let chain = compile_fresh("chain.c", f.dir.path(), &id);
    // Its entry: the build id, then the digest of what the table is built from.
    let cache = f.out.join(".unwind-cache");
    let find = || {
        std::fs::read_dir(&cache)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&format!("b-{id}-")))
            })
    };
    let mut c = start_workload(&chain, &["300"]);
    wait_until("the chain's table on disk", || find().is_some());
    let entry = find().unwrap();
    let good = std::fs::read(&entry).unwrap();
    assert!(
        f.metric("firn_enricher_unwind_table_cache_misses_total")
            .unwrap_or(0.0)
            >= 1.0
    );

    // A restart: the table is read from disk (the read marks it used), not built.
    let restart = |f: &mut Firn| {
        if let Some(mut e) = f.enricher.take() {
            e.stop();
        }
        let old = std::process::Command::new("touch")
            .args(["-d", "2001-01-01"])
            .arg(&entry)
            .status()
            .unwrap();
        assert!(old.success());
        f.start_enricher(CACHE);
    };
    restart(&mut f);
    wait_until("the cached table read", || {
        mtime(&entry) > 1_000_000_000 + 10_000_000
    });
    let hits = f
        .metric("firn_enricher_unwind_table_cache_hits_total")
        .unwrap_or(0.0);
    assert!(hits >= 1.0, "no cache hit");
    assert_eq!(std::fs::read(&entry).unwrap(), good);
    assert_eq!(
        f.metric("firn_enricher_unwind_table_cache_corrupt_total"),
        Some(0.0)
    );

    // One row byte flipped while the enricher is down: refused, counted, built again.
    let mut bad = good.clone();
    let at = bad.len() - 3;
    bad[at] ^= 0x40;
    if let Some(mut e) = f.enricher.take() {
        e.stop();
    }
    std::fs::write(&entry, &bad).unwrap();
    f.start_enricher(CACHE);
    wait_until("the damaged entry counted", || {
        f.metric("firn_enricher_unwind_table_cache_corrupt_total")
            .unwrap_or(0.0)
            >= 1.0
    });
    wait_until("the entry rebuilt", || {
        std::fs::read(&entry).is_ok_and(|b| b == good)
    });
    // Its stacks from then on are whole.
    let since = now_ns();
    std::thread::sleep(5 * SECS);
    wait_round_after(&f.out, now_ns());
    let files: Vec<PathBuf> = index_records(&f.out)
        .into_iter()
        .filter(|(_, r)| {
            r["labels"]["pid"].as_str() == Some(c.pid().to_string().as_str())
                && r["start_ns"].as_u64().is_some_and(|s| s >= since)
        })
        .map(|(p, _)| p)
        .collect();
    let t = traces(&files);
    let (s, n) = share(
        &t,
        |_| true,
        |fr| has_chain(fr, &["chain_leaf", "chain_c", "chain_b", "chain_a", "main"]),
    );
    eprintln!("after the rebuild: {:.1} % of {n} whole", s * 100.0);
    assert!(
        n >= 200 && s >= 0.95,
        "{s:.3} of {n}: {:?}",
        worst_stacks(&t, |_| false)
    );
    c.stop();
}

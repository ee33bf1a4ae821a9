//! Whole user stacks without frame pointers: the enricher builds unwind tables from each
//! binary's CFI, the sampler checks them into BPF maps, the BPF program walks them.
//! Read back with `go tool pprof -traces`, measured once every workload's table is in.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);
const FAST: &[&str] = &["--frequency", "99", "--round", "1"];

/// Waits until a round of `pid` that began at or after `since_ns` holds a stack that
/// `whole` accepts: its tables are in. Read from the profiles, as a user would: the
/// sampler's "unwind table loaded" line is rate-limited per call site (20, then one per
/// 10 s), so with more than 20 tables at start a workload's line may never come.
fn wait_whole(f: &Firn, pid: u32, since_ns: u64, what: &str, whole: impl Fn(&[String]) -> bool) {
    let t0 = Instant::now();
    // Generous: under CI the fuzz build runs meanwhile, and the enricher first meets
    // rustc's and LLVM's large binaries.
    while t0.elapsed() < 180 * SECS {
        if let Some(newest) = files_since(f, pid, since_ns).pop() {
            if traces(&[newest]).iter().any(|(_, fr)| whole(fr)) {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    panic!(
        "{what} (pid {pid}) never showed a whole stack: sampler {:#?}",
        f.sampler.lines().iter().rev().take(20).collect::<Vec<_>>()
    );
}

/// Profile files of `pid` from rounds that began at or after `since_ns` (wall clock):
/// the enricher may write rounds late (while it builds tables), so files are chosen by
/// their round's start, not by when they appeared.
fn files_since(f: &Firn, pid: u32, since_ns: u64) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = index_records(&f.out)
        .into_iter()
        .filter(|(_, r)| {
            r["labels"]["pid"].as_str() == Some(pid.to_string().as_str())
                && r["start_ns"].as_u64().is_some_and(|s| s >= since_ns)
        })
        .map(|(p, _)| p)
        .collect();
    files.sort();
    files
}

/// Waits for at least `n` such files (or 60 s).
fn wait_files_since(f: &Firn, pid: u32, since_ns: u64, n: usize) -> Vec<PathBuf> {
    let t0 = Instant::now();
    loop {
        let files = files_since(f, pid, since_ns);
        if files.len() >= n || t0.elapsed() > 60 * SECS {
            return files;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn python_loop(dir: &std::path::Path) -> Proc {
    let script = dir.join("loop.py");
    std::fs::write(
        &script,
        "import os, sys, time\nprint('ready', os.getpid(), flush=True)\n\
         end = time.time() + float(sys.argv[1])\nx = 0\n\
         while time.time() < end:\n    for i in range(10000):\n        x = (x * 31 + i) % 1000003\n",
    )
    .unwrap();
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.arg(&script).arg("120");
    let p = Proc::spawn("python3", cmd);
    assert!(
        p.wait_for("ready", 10 * SECS).is_some(),
        "python3 did not start"
    );
    p
}

#[test]
fn whole_stacks_without_frame_pointers() {
    if !can_run_bpf() {
        return;
    }
    // Built before firn starts: a compiler sampled meanwhile (clang maps 110 MiB of
    // libLLVM) would make the enricher's first rounds slow.
    // Plain `gcc -O2`: the distribution's default flags, no frame pointers.
    let chain = compile_plain("gcc", "chain.c", "chain-gcc", &["-O2", "-g"]);
    let gospin = go_workload("gospin");
    let throw = compile_plain("clang++", "throw.cpp", "throw-nofp", &["-O2", "-g"]);
    let jit = compile_plain("gcc", "jit.c", "jit-nofp", &["-O2", "-g"]);
    let f = Firn::start("unwind", FAST);
    let objdump = Command::new("objdump")
        .arg("-d")
        .arg(&chain)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&objdump.stdout);
    let body = text.split("<chain_b>:").nth(1).unwrap_or_default();
    assert!(
        !body
            .lines()
            .take(3)
            .any(|l| l.contains("push") && l.contains("%rbp")),
        "the gcc build set up a frame pointer; the test would prove nothing"
    );
    let mut c = start_workload(&chain, &["120"]);
    let mut g = start_workload(&gospin, &["120"]);
    let mut r = start_workload(&bin("firn-spin"), &["120"]);
    let mut p = python_loop(f.dir.path());
    let mut x = start_workload(&throw, &["120"]);
    let mut j = start_workload(&jit, &["120"]);
    let pids = [c.pid(), g.pid(), r.pid(), p.pid(), x.pid(), j.pid()];

    let started = now_ns();
    let main_of = |fr: &[String]| fr.iter().any(|x| x == "main");
    wait_whole(&f, pids[0], started, "gcc -O2 chain", |fr| {
        has_chain(fr, &["chain_leaf", "chain_c", "chain_b", "chain_a", "main"])
    });
    wait_whole(&f, pids[1], started, "Go", |fr| {
        has_chain(fr, &["main.spinLeaf", "main.spinOuter", "main.main"])
    });
    wait_whole(&f, pids[2], started, "Rust", main_of);
    wait_whole(&f, pids[3], started, "python3", |fr| {
        fr.iter().any(|x| x == "Py_RunMain")
    });
    wait_whole(&f, pids[4], started, "C++ throwing", main_of);
    wait_whole(&f, pids[5], started, "anonymous code", |fr| {
        fr.iter().any(|x| x.starts_with("[unwind stopped"))
    });
    let since = now_ns();
    std::thread::sleep(10 * SECS);
    let files: Vec<Vec<PathBuf>> = pids
        .iter()
        .map(|&pid| wait_files_since(&f, pid, since, 8))
        .collect();
    for w in [&mut c, &mut g, &mut r, &mut p, &mut x, &mut j] {
        w.stop();
    }

    let any = |_: &[String]| true;
    // C without frame pointers: the whole chain to main.
    let t = traces(&files[0]);
    let (s, n) = share(
        &t,
        |fr| fr.iter().any(|x| x == "chain_leaf"),
        |fr| has_chain(fr, &["chain_leaf", "chain_c", "chain_b", "chain_a", "main"]),
    );
    eprintln!(
        "gcc -O2 chain: {:.1} % of {n} samples whole; not: {:?}",
        s * 100.0,
        worst_stacks(&t, |fr| !fr.iter().any(|x| x == "chain_leaf")
            || has_chain(
                fr,
                &["chain_leaf", "chain_c", "chain_b", "chain_a", "main"]
            ))
    );
    assert!(n >= 50 && s >= 0.95, "C chain {s:.3} of {n}:\n{t:#?}");
    let (to_main, _) = share(&t, any, |fr| fr.iter().any(|x| x == "main"));
    assert!(to_main >= 0.95, "C samples reaching main: {to_main:.3}");

    // Go: the frameless leaf keeps its caller.
    let t = traces(&files[1]);
    let (s, n) = share(
        &t,
        |fr| fr.iter().any(|x| x == "main.spinLeaf"),
        |fr| has_chain(fr, &["main.spinLeaf", "main.spinOuter", "main.main"]),
    );
    eprintln!(
        "Go leaf -> caller -> grandparent: {:.1} % of {n}",
        s * 100.0
    );
    assert!(n >= 50 && s >= 0.95, "Go {s:.3} of {n}:\n{t:#?}");

    // Rust release build (no frame pointers).
    let t = traces(&files[2]);
    let (s, n) = share(
        &t,
        |fr| fr.iter().any(|x| x.ends_with("spin_leaf")),
        |fr| {
            let i = fr.iter().position(|x| x.ends_with("spin_leaf"));
            i.is_some_and(|i| {
                fr.get(i + 1).is_some_and(|x| x.ends_with("spin_mid"))
                    && fr.get(i + 2).is_some_and(|x| x.ends_with("spin_top"))
                    && fr[i..].iter().any(|x| x == "main")
            })
        },
    );
    eprintln!("Rust release: {:.1} % of {n} whole", s * 100.0);
    assert!(n >= 50 && s >= 0.95, "Rust {s:.3} of {n}:\n{t:#?}");

    // The distribution's python3 reaches Py_RunMain.
    let t = traces(&files[3]);
    let (s, n) = share(&t, any, |fr| fr.iter().any(|x| x == "Py_RunMain"));
    eprintln!(
        "python3 reaching Py_RunMain: {:.1} % of {n}; not: {:?}",
        s * 100.0,
        worst_stacks(&t, |fr| fr.iter().any(|x| x == "Py_RunMain"))
    );
    assert!(n >= 50 && s >= 0.90, "python3 {s:.3} of {n}:\n{t:#?}");

    // C++ exceptions in flight: samples inside the runtime's unwinder still reach main.
    let t = traces(&files[4]);
    let (s, n) = share(&t, any, |fr| fr.iter().any(|x| x == "main"));
    let (in_eh, _) = share(&t, any, |fr| {
        fr.iter().any(|x| {
            x.starts_with("_Unwind_") || x.starts_with("__cxa_") || x.starts_with("__gxx_")
        })
    });
    eprintln!(
        "C++ throwing: {:.1} % of {n} reach main ({:.1} % inside the exception runtime)",
        s * 100.0,
        in_eh * 100.0
    );
    assert!(
        n >= 50 && s >= 0.90,
        "C++ exceptions {s:.3} of {n}:\n{t:#?}"
    );
    assert!(
        in_eh > 0.1,
        "the workload did not spend its time throwing:\n{t:#?}"
    );

    // Code in anonymous memory: stacks stop cleanly at a marker frame.
    let t = traces(&files[5]);
    let marker = "[unwind stopped: code outside file mappings: JIT, anonymous or vDSO]";
    let (s, n) = share(&t, any, |fr| fr.iter().any(|x| x == marker));
    eprintln!(
        "anonymous code: {:.1} % of {n} end in the marker",
        s * 100.0
    );
    assert!(n >= 50 && s >= 0.90, "JIT {s:.3} of {n}:\n{t:#?}");
    assert!(
        f.metric("firn_sampler_bpf_unwind_end_no_mapping")
            .unwrap_or(0.0)
            > 0.0
    );

    // The BPF program counted frames walked with rows.
    let rows = f
        .metric("firn_sampler_bpf_unwind_table_frames")
        .unwrap_or(0.0);
    assert!(rows > 0.0, "no frame was walked with a table row");
    // Whole stacks as above with the CPUs' memos of rows found answering many of them.
    let memo = f
        .metric("firn_sampler_bpf_unwind_row_memo_hits")
        .unwrap_or(0.0);
    eprintln!("frames by rows {rows}, rows from the memo {memo}");
    assert!(memo > 0.0, "no row came from the memo");
    assert!(
        f.metric("firn_enricher_unwind_tables_sent_total")
            .unwrap_or(0.0)
            >= 4.0
    );
    // Debian's python3 (stripped, libpython linked in) is recognised from its file.
    assert!(
        f.metric("firn_enricher_python_interpreters_found_total")
            .unwrap_or(0.0)
            >= 1.0
    );
    assert_eq!(
        f.metric("firn_enricher_python_interpreters_unknown_total")
            .unwrap_or(0.0),
        0.0
    );
}

#[test]
fn a_refused_table_keeps_frame_pointer_stacks() {
    if !can_run_bpf() {
        return;
    }
    // Every table is over this limit: all refused, every stack walked by frame pointers.
    let f = Firn::start(
        "unwind-refused",
        &[
            "--frequency",
            "99",
            "--round",
            "1",
            "--unwind-table-rows",
            "8",
        ],
    );
    let mut w = start_workload(&workload("busy"), &["60"]);
    let pid = w.pid();
    let t0 = Instant::now();
    while f
        .metric("firn_sampler_unwind_tables_refused_budget")
        .unwrap_or(0.0)
        < 1.0
    {
        assert!(t0.elapsed() < 30 * SECS, "no refusal counted");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        f.metric("firn_enricher_unwind_tables_refused_total")
            .unwrap_or(0.0)
            >= 1.0
    );
    let since = now_ns();
    let files = wait_files_since(&f, pid, since, 5);
    w.stop();
    let t = traces(&files);
    let (s, n) = share(
        &t,
        |fr| fr.iter().any(|x| x == "hot_leaf"),
        |fr| has_chain(fr, &["hot_leaf", "middle", "outer"]),
    );
    eprintln!(
        "refused table, frame pointers: {:.1} % of {n} whole",
        s * 100.0
    );
    assert!(n >= 50 && s >= 0.90, "{s:.3} of {n}:\n{t:#?}");
    assert!(
        f.sampler
            .lines()
            .iter()
            .any(|l| l.contains("unwind table refused")),
        "the refusal was not logged"
    );
}

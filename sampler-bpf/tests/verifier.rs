//! The verifier's cost of the sampling programs: instructions processed and peak states
//! when the kernel checks them at load. Every change to the unwinder is measured by
//! these two numbers; the kernel refuses a program past 1,000,000 processed
//! instructions, so the test fails well before that (800,000) to leave room on other
//! kernels. Needs root (BPF); fails instead of skipping when CI=true or
//! FIRN_REQUIRE_BPF=1.

use std::mem::MaybeUninit;
use std::sync::Mutex;

use firn_sampler_bpf::ProfileSkelBuilder;
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::PrintLevel;

/// The verifier's limit is 1,000,000; past this a kernel's verifier change could break
/// the load. firn_sample takes 105k on 6.18.44 (v1272) with the walk state on a page
/// of its own (107k before; 230k while each lookup of it kept its key in a stack slot
/// of its own; 113k before the memo of rows; 559k when the verifier walked the unwinder
/// once per map set, and past the limit on that kernel while the mapping search moved
/// its bounds by branches): the limit catches a change that multiplies it again.
const FAIL_ABOVE: u64 = 600_000;
const WARN_ABOVE: u64 = 450_000;

static LOG: Mutex<String> = Mutex::new(String::new());

fn keep(_: PrintLevel, msg: String) {
    if let Ok(mut l) = LOG.lock() {
        l.push_str(&msg);
    }
}

fn required() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
        || std::env::var("FIRN_REQUIRE_BPF").is_ok_and(|v| v == "1")
}

/// (program, processed instructions, peak states) from libbpf's copy of the load log.
fn stats(log: &str) -> Vec<(String, u64, u64)> {
    let mut out = Vec::new();
    let mut prog = None;
    for line in log.lines() {
        if let Some(rest) = line.split("prog '").nth(1) {
            prog = rest.split('\'').next().map(str::to_string);
        }
        let Some(rest) = line.split("processed ").nth(1) else {
            continue;
        };
        let insns = rest.split(' ').next().and_then(|n| n.parse().ok());
        let peak = line
            .split("peak_states ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .and_then(|n| n.parse().ok());
        if let (Some(p), Some(i), Some(s)) = (prog.clone(), insns, peak) {
            out.push((p, i, s));
        }
    }
    out
}

#[test]
fn the_programs_stay_within_the_verifiers_budget() {
    if !is_root() {
        assert!(!required(), "CI=true: the verifier test needs root");
        eprintln!("skipped: needs root");
        return;
    }
    libbpf_rs::set_print(Some((PrintLevel::Debug, keep)));
    let mut storage = MaybeUninit::uninit();
    let mut open = ProfileSkelBuilder::default()
        .open(&mut storage)
        .expect("opening the skeleton");
    // Statistics only (BPF_LOG_STATS): the full log of these programs is gigabytes.
    open.progs.firn_sample.set_log_level(4);
    open.progs.firn_switch.set_log_level(4);
    let loaded = open.load();
    libbpf_rs::set_print(None);
    let log = LOG.lock().map(|l| l.clone()).unwrap_or_default();
    let _skel = loaded.unwrap_or_else(|e| panic!("loading the programs: {e}\n{log}"));
    let found = stats(&log);
    for name in ["firn_sample", "firn_switch"] {
        let Some((_, insns, peak)) = found.iter().find(|(p, _, _)| p == name) else {
            panic!("no verifier statistics for {name} in libbpf's log:\n{log}");
        };
        eprintln!("verifier: {name} processed {insns} instructions, peak states {peak}");
        if *insns > WARN_ABOVE {
            eprintln!("warning: {name} is past {WARN_ABOVE} processed instructions");
        }
        assert!(
            *insns <= FAIL_ABOVE,
            "{name}: {insns} processed instructions, over {FAIL_ABOVE}"
        );
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn statistics_are_read_from_the_log() {
    let log = "libbpf: prog 'firn_sample': -- BEGIN PROG LOAD LOG --\n\
               processed 615234 insns (limit 1000000) max_states_per_insn 12 total_states 9000 peak_states 4321 mark_read 99\n\
               -- END PROG LOAD LOG --\n";
    assert_eq!(stats(log), vec![("firn_sample".to_string(), 615_234, 4321)]);
}

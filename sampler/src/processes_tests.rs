//! Tests of the process table (`processes.rs`).

use super::*;

/// A `sleep` whose loader is done: its mappings stay as they are from here.
fn child() -> std::process::Child {
    let kid = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("sleep");
    let maps = format!("/proc/{}/maps", kid.id());
    for _ in 0..500 {
        let m = std::fs::read_to_string(&maps).unwrap_or_default();
        if m.contains("/sleep") && m.contains("libc") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    kid
}

/// A `sleep` as the process table keys it.
fn keyed_child() -> (std::process::Child, ProcKey) {
    let kid = child();
    let pid = kid.id();
    let k = ProcKey {
        tgid: pid,
        start_ns: procfs::start_ns_of(pid).expect("a live child"),
        exec_id: 0,
    };
    (kid, k)
}

#[test]
fn a_spent_round_budget_defers_reads_to_the_next_round() {
    let c = Counters::default();
    let mut kids = [child(), child()];
    let pids: Vec<u32> = kids.iter().map(std::process::Child::id).collect();
    let starts: Vec<u64> = pids
        .iter()
        .map(|&p| procfs::start_ns_of(p).expect("a live child"))
        .collect();
    // One byte a round: the first read spends it.
    let mut t = ProcessTable::with_budgets(1, MAX_TABLE_BYTES);
    let keys: Vec<ProcKey> = pids
        .iter()
        .zip(&starts)
        .map(|(&tgid, &start_ns)| ProcKey {
            tgid,
            start_ns,
            exec_id: 0,
        })
        .collect();
    let a = t.observe(keys[0], b"sleep", (&[], false), 1, &c);
    let b = t.observe(keys[1], b"sleep", (&[], false), 1, &c);
    assert!(t.get(keys[0]).unwrap().record.complete);
    let deferred = t.get(keys[1]).unwrap();
    assert!(!deferred.record.complete);
    assert_eq!(deferred.record.comm, b"sleep");
    assert_eq!(c.process_reads_deferred.get(), 1);
    // The next round reads it: same id, a new version for subscribers.
    t.begin_round(2, &c);
    assert_eq!(t.observe(keys[1], b"sleep", (&[], false), 2, &c), b);
    let read = t.get(keys[1]).unwrap();
    assert!(read.record.complete);
    assert_eq!(read.version, 2);
    assert_ne!(a, b);
    assert_eq!(c.processes_read.get(), 2);
    for k in &mut kids {
        let _ = k.kill();
        let _ = k.wait();
    }
}

#[test]
fn remap_reads_back_off_and_keep_to_their_rate() {
    let c = Counters::default();
    let (mut kid, k) = keyed_child();
    let mut t = ProcessTable::default();
    t.observe(k, b"sleep", (&[], false), 1, &c);
    // Its mappings are as read: nothing changes, and the next event waits.
    t.remap(k, (1, 1_000_000_000), &c);
    t.remap(k, (1, 1_050_000_000), &c);
    assert_eq!(c.remap_events.get(), 2);
    assert_eq!(c.remap_events_skipped.get(), 1);
    assert_eq!(c.remap_reads_changed.get(), 0);
    // Far apart in time, but over the reads' rate: the bucket's burst and no more.
    let before = c.mapping_refreshes.get();
    for i in 0..200u64 {
        t.remap(k, (1, (i + 2) * REMAP_MAX_NS), &c);
    }
    let read = c.mapping_refreshes.get() - before;
    assert!(read <= REMAP_READS_BURST as u64 + 5, "{read} reads");
    assert!(c.remap_reads_limited.get() >= 90);
    let _ = kid.kill();
    let _ = kid.wait();
}

#[test]
fn remap_reads_leave_half_the_budget_and_take_no_other_program() {
    let c = Counters::default();
    let (mut kid, k) = keyed_child();
    // The first read spends more than half the round's budget: no REMAP read is left.
    let mut t = ProcessTable::with_budgets(1 << 10, MAX_TABLE_BYTES);
    t.observe(k, b"sleep", (&[], false), 1, &c);
    t.remap(k, (1, REMAP_MAX_NS), &c);
    assert_eq!(c.remap_reads_no_budget.get(), 1);
    // A full budget, but an executable the mappings do not hold where BPF saw it (the
    // process exec'd since): the read is not taken.
    t.begin_round(2, &c);
    let known = t.by_key.get_mut(&k).expect("known");
    known.exe = ExeSeen {
        dev: 1,
        ino: 1,
        start_code: 0x1000,
        facts: None,
    };
    let (version, mappings) = (known.version, known.record.mappings.clone());
    t.remap(k, (2, 2 * REMAP_MAX_NS), &c);
    assert_eq!(c.mapping_reads_other_program.get(), 1);
    let known = t.get(k).expect("known");
    assert_eq!(
        (known.version, &known.record.mappings),
        (version, &mappings)
    );
    let _ = kid.kill();
    let _ = kid.wait();
}

#[test]
fn the_table_keeps_to_its_bytes() {
    let c = Counters::default();
    // Room for about one placeholder record: each new process pushes out the oldest.
    let mut t = ProcessTable::with_budgets(0, 200);
    let mut ids = Vec::new();
    for (round, pid) in (1..=5u64).zip(u32::MAX - 5..) {
        ids.push(t.observe(key(pid, 0), b"gone", (&[], false), round, &c));
    }
    assert_eq!(t.len(), 1);
    assert_eq!(
        t.sweep(6, &c),
        ids[..4],
        "subscribers are told the evicted records are gone"
    );
    assert!(t.sweep(7, &c).is_empty(), "and told once");
    assert!(t.get(key(u32::MAX - 1, 0)).is_some(), "the newest stays");
    assert_eq!(c.processes_evicted_bytes.get(), 4);
    assert_eq!(
        t.take_unseen().len(),
        4,
        "the BPF side is told to forget them"
    );
}

fn key(tgid: u32, exec_id: u32) -> ProcKey {
    ProcKey {
        tgid,
        start_ns: 1,
        exec_id,
    }
}

#[test]
fn an_exec_is_a_new_process_and_ended_ones_go_after_their_rounds() {
    let c = Counters::default();
    let mut t = ProcessTable::with_budgets(0, MAX_TABLE_BYTES);
    let (before, after) = (key(u32::MAX - 1, 4), key(u32::MAX - 1, 5));
    t.discover(before, (b"sh", ExeSeen::default(), 0), (1, 0), &c);
    let a = t.observe(before, b"sh", (&[], false), 1, &c);
    let b = t.observe(after, b"prog", (&[], false), 1, &c);
    assert_ne!(a, b, "one pid, two programs, two records");
    assert_eq!(t.get(before).unwrap().record.comm, b"sh");
    assert_eq!(t.get(after).unwrap().record.comm, b"prog");
    // The shell exec'd in round 1, the program exited in round 2.
    t.ended(before, Ending::Exec, 1);
    t.ended(after, Ending::Exit, 2);
    assert!(
        t.sweep(2, &c).is_empty(),
        "round 1's samples are still to be sent"
    );
    assert_eq!(t.sweep(3, &c), vec![a]);
    assert_eq!(t.sweep(4, &c), vec![b]);
    assert!(
        t.take_unseen().is_empty(),
        "the BPF side forgot them itself"
    );
}

#[test]
fn rounds_of_ten_seconds_keep_an_ended_process_one_round_after_its_own() {
    let c = Counters::default();
    for (seconds, forgotten_at) in [(10, 2), (60, 2), (9, 3), (2, 3)] {
        let mut t = ProcessTable::with_budgets(0, MAX_TABLE_BYTES).with_round_seconds(seconds);
        let k = key(u32::MAX - 1, 4);
        let id = t.observe(k, b"sh", (&[], false), 1, &c);
        t.ended(k, Ending::Exit, 1);
        assert!(
            t.sweep(1, &c).is_empty(),
            "its last samples go out in round 1"
        );
        for round in 2..forgotten_at {
            assert!(
                t.sweep(round, &c).is_empty(),
                "{seconds} s rounds: kept in {round}"
            );
        }
        assert_eq!(t.sweep(forgotten_at, &c), vec![id], "{seconds} s rounds");
    }
}

#[test]
fn a_table_emptied_after_a_storm_gives_its_room_back() {
    let mut m: std::collections::HashMap<u64, u64> = (0..10_000).map(|i| (i, i)).collect();
    let grown = m.capacity();
    m.retain(|&k, _| k < 300);
    super::shrink_after_storm(&mut m);
    assert!(m.capacity() < grown / 8, "{} of {grown}", m.capacity());
    assert_eq!(m.len(), 300);
    // A table in use is left alone: no rehash every round.
    let cap = m.capacity();
    m.retain(|&k, _| k < 200);
    super::shrink_after_storm(&mut m);
    assert_eq!(m.capacity(), cap);
}

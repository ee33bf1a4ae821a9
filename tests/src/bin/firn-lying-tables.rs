//! A subscriber that lies in its unwind tables to read another process's memory back
//! through its stacks (DESIGN rule 9), for `tests/tests/lying_tables.rs`:
//!   firn-lying-tables SOCKET PID
//! It waits for the record of process PID, then sends table after table for the files
//! behind its mappings, each a single rule for the whole file: CFA = rsp + k for every
//! whole-word k up to 2 KiB; the same with the caller's rbp loaded from slots below
//! the CFA (pointer chasing: a later frame without a row is walked by frame pointers
//! from there); CFA = rbp + k; a signal frame. Last, on fresh connections,
//! rows whose offsets are not whole words, which must close the connection.
//! Prints one JSON line: every user frame of PID's samples, the stack ends, the last
//! counters, what was sent and what was refused.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use firn_schema::firn_capnp::{subscription, table_result};
use firn_schema::unwind_row::{self as k, Row};
use firn_tests::liar::{connect, run_local, subscribe, victim_record, Seen};

fn row(cfa: u8, cfa_offset: u16, rbp: u8, rbp_offset8: i8) -> Vec<u8> {
    Row {
        pc: 0,
        cfa_offset,
        cfa,
        rbp,
        rbp_offset8,
    }
    .to_bytes()
    .to_vec()
}

/// Every lie, in the order sent.
fn lies() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for off in (8..=2048).step_by(8) {
        out.push(row(k::CFA_RSP, off, k::RBP_SAME, 0));
    }
    for off in (8..=512).step_by(8) {
        for slot in [-1i8, -2, -3, -4, -6, -8, -16, -32] {
            out.push(row(k::CFA_RSP, off, k::RBP_AT_CFA, slot));
        }
    }
    for off in (8..=256).step_by(8) {
        for slot in [-1i8, -2, -4] {
            out.push(row(k::CFA_RBP, off, k::RBP_AT_CFA, slot));
        }
        out.push(row(k::CFA_RBP, off, k::RBP_SAME, 0));
    }
    out.push(row(k::CFA_SIGNAL, 0, k::RBP_SAME, 0));
    out
}

/// Sends `rows` as the whole table of mapping `index`; whether it was taken.
async fn send(
    sub: &subscription::Client,
    (id, version): (u64, u32),
    index: u32,
    rows: &[u8],
) -> Option<bool> {
    let mut r = sub.load_unwind_table_request();
    r.get().set_process_id(id);
    r.get().set_mapping_index(index);
    r.get().set_mappings_version(version);
    r.get().set_first_row(0);
    r.get().set_total_rows((rows.len() / 8) as u32);
    r.get().set_rows(rows);
    let reply = r.send().promise.await.ok()?;
    let taken = matches!(
        reply.get().and_then(|r| r.get_result()).map(|r| r.which()),
        Ok(Ok(table_result::Done(())))
    );
    Some(taken)
}

async fn run(sock: String, pid: u32) -> String {
    let seen = Rc::new(RefCell::new(Seen::default()));
    let session = connect(&sock).await;
    let sub = subscribe(&session, pid, &seen).await;
    let Some((id, version, maps)) = victim_record(&seen).await else {
        return "{\"error\":\"no record of the process\"}".into();
    };
    let indices: Vec<u32> = (0..maps.len() as u32).collect();
    let (mut taken, mut refused) = (0u32, 0u32);
    // The victim's own binary (its lowest mapping) always gets the lie; the others get
    // it every other time, and a table without rules in between, so that their frames
    // are walked by frame pointers from whatever rbp the lie loaded.
    let no_rule = row(k::CFA_NONE, 0, k::RBP_SAME, 0);
    for (n, lie) in lies().iter().enumerate() {
        for &index in &indices {
            let rows = if index == 0 || n % 2 == 0 {
                lie
            } else {
                &no_rule
            };
            match send(&sub, (id, version), index, rows).await {
                Some(true) => taken += 1,
                Some(false) => refused += 1,
                None => return format!("{{\"error\":\"closed after {taken} tables\"}}"),
            }
        }
        // A few samples under each lie (99 Hz).
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    // The batches of the last rounds.
    tokio::time::sleep(Duration::from_secs(3)).await;
    // The tables go with their subscription; the next connections may send their own.
    drop(sub);
    drop(session);
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Offsets that are not whole words: each closes its connection.
    let mut closed_unaligned = 0;
    for bad in [
        row(k::CFA_RSP, 13, k::RBP_SAME, 0),
        row(k::CFA_RBP, 12, k::RBP_SAME, 0),
    ] {
        let s = connect(&sock).await;
        let other = Rc::new(RefCell::new(Seen::default()));
        let sub = subscribe(&s, pid, &other).await;
        let Some((id, version, _)) = victim_record(&other).await else {
            continue;
        };
        let answer = send(&sub, (id, version), 0, &bad).await;
        let closed = tokio::time::timeout(Duration::from_secs(10), s.ended)
            .await
            .is_ok();
        if answer.is_none() && closed {
            closed_unaligned += 1;
        }
    }
    let s = seen.borrow();
    serde_json::json!({
        "tables_taken": taken,
        "tables_refused": refused,
        "closed_unaligned": closed_unaligned,
        "samples": s.samples,
        "frames": s.frames,
        "ends": s.ends,
        "counters": s.counters,
    })
    .to_string()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(sock), Some(pid)) = (args.get(1), args.get(2).and_then(|p| p.parse().ok())) else {
        eprintln!("usage: firn-lying-tables SOCKET PID");
        std::process::exit(2);
    };
    println!("{}", run_local(run(sock.clone(), pid)));
}

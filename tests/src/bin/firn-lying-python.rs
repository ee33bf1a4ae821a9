//! A subscriber that lies in CPython interpreter records to read another process's
//! memory back through Python frames' names (DESIGN rule 9), for
//! `tests/tests/lying_python.rs`:
//!   firn-lying-python SOCKET PID
//! It waits for the record of process PID (a CPython), sends the honest record for its
//! interpreter (from the file, as the enricher builds it), then lie after lie: every
//! offset moved by a word, the runtime moved word by word, each type swapped for
//! another or moved, the eval range moved over the text, the image shifted, addresses
//! out of reach. Prints one JSON line: what was taken and refused (by reason), the
//! victim's user frames, every Python code blob received (hex), the last counters.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use firn_schema::firn_capnp::{interpreter_result, subscription};
use firn_schema::python_record::Record;
use firn_tests::liar::{connect, run_local, subscribe, victim_record, Seen};

/// Every lie, from the honest record.
fn lies(honest: &Record) -> Vec<(String, Record)> {
    let mut out = Vec::new();
    let bytes = honest.to_bytes();
    for i in 0..23 {
        let mut b = bytes;
        let at = 80 + 2 * i;
        let o = u16::from_le_bytes([b[at], b[at + 1]]).wrapping_add(8);
        b[at..at + 2].copy_from_slice(&o.to_le_bytes());
        if let Some(r) = Record::from_bytes(&b) {
            out.push((format!("offset {i}"), r));
        }
    }
    for k in (-48i64..=48).filter(|k| *k != 0) {
        let mut r = *honest;
        r.runtime = honest.runtime.wrapping_add_signed(8 * k);
        out.push((format!("runtime {k:+}"), r));
    }
    let types = [
        honest.code_type,
        honest.str_type,
        honest.bytes_type,
        honest.runtime,
    ];
    for (i, &t) in types.iter().enumerate() {
        for d in [0i64, -16, -8, 8, 16] {
            let v = t.wrapping_add_signed(d);
            let mut r = *honest;
            r.code_type = v;
            out.push((format!("code_type {i} {d:+}"), r));
            let mut r = *honest;
            r.str_type = v;
            out.push((format!("str_type {i} {d:+}"), r));
            let mut r = *honest;
            r.bytes_type = v;
            out.push((format!("bytes_type {i} {d:+}"), r));
        }
    }
    for k in 1..=8u64 {
        let mut r = *honest;
        let len = honest.eval.1 - honest.eval.0;
        r.eval = (
            honest.eval.0.saturating_sub(k * 65536),
            honest.eval.1.saturating_sub(k * 65536).max(len),
        );
        r.eval_cold = (0, 0);
        out.push((format!("eval -{k}"), r));
    }
    for k in [-3i64, -2, -1, 1, 2, 3] {
        let mut r = *honest;
        r.text_delta = honest.text_delta.wrapping_add_signed(4096 * k);
        out.push((format!("text_delta {k:+}"), r));
    }
    for far in [1u64 << 46, 0x1000, honest.runtime + (512 << 20)] {
        let mut r = *honest;
        r.runtime = far;
        out.push((format!("far {far:#x}"), r));
    }
    out
}

async fn send(
    sub: &subscription::Client,
    (id, version, index): (u64, u32, u32),
    rec: &Record,
) -> Option<String> {
    let mut r = sub.load_interpreter_request();
    r.get().set_process_id(id);
    r.get().set_mapping_index(index);
    r.get().set_mappings_version(version);
    r.get().set_record(&rec.to_bytes());
    let reply = r.send().promise.await.ok()?;
    let res = reply.get().ok()?.get_result().ok()?;
    Some(match res.which().ok()? {
        interpreter_result::Done(()) => "taken".into(),
        interpreter_result::Refused(why) => format!("{:?}", why.ok()?),
    })
}

async fn run(sock: String, pid: u32) -> String {
    let seen = Rc::new(RefCell::new(Seen::default()));
    let session = connect(&sock).await;
    let sub = subscribe(&session, pid, &seen).await;
    let Some((id, version, maps)) = victim_record(&seen).await else {
        return "{\"error\":\"no record of the process\"}".into();
    };
    // The interpreter's file, as any enricher reads it.
    let mut found = None;
    for (i, (start, end, off, path)) in maps.iter().enumerate() {
        let Ok(data) = std::fs::read(path) else {
            continue;
        };
        if let Ok(interp) = firn_enricher::cpython::analyze(&data, path) {
            let rec = interp.to_record();
            if rec.eval.0 >= *off && rec.eval.1 <= off + (end - start) {
                found = Some((i as u32, rec));
                break;
            }
        }
    }
    let Some((index, honest)) = found else {
        return "{\"error\":\"no CPython among the victim's mappings\"}".into();
    };
    let key = (id, version, index);
    let honest_answer = send(&sub, key, &honest).await.unwrap_or_default();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut answers: BTreeMap<String, u64> = BTreeMap::new();
    for (what, lie) in lies(&honest) {
        let answer = loop {
            match send(&sub, key, &lie).await {
                Some(a) if a == "RateLimited" => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Some(a) => break a,
                None => return format!("{{\"error\":\"closed at {what}\"}}"),
            }
        };
        *answers.entry(answer.clone()).or_default() += 1;
        if answer == "taken" {
            // A few samples under each lie (99 Hz).
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
    }
    // The honest record again, then the batches of the last rounds.
    let again = send(&sub, key, &honest).await.unwrap_or_default();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let s = seen.borrow();
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    serde_json::json!({
        "honest": honest_answer,
        "again": again,
        "answers": answers,
        "samples": s.samples,
        "frames": s.frames,
        "python_code": s.python_code.iter().map(|b| hex(b)).collect::<Vec<_>>(),
        "counters": s.counters,
    })
    .to_string()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(sock), Some(pid)) = (args.get(1), args.get(2).and_then(|p| p.parse().ok())) else {
        eprintln!("usage: firn-lying-python SOCKET PID");
        std::process::exit(2);
    };
    println!("{}", run_local(run(sock.clone(), pid)));
}

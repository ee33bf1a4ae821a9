//! Hostile clients against a running, confined sampler: each misbehaviour is counted
//! and its connection closed, while a well-behaved subscriber keeps receiving every
//! round and the sampler's memory stays under the stated bound.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::{Duration, Instant};

use firn_tests::*;
use serde_json::Value;

const SECS: Duration = Duration::from_secs(1);
/// The sampler's memory bound under attack (README, reliability): peak RSS, setup
/// included (steady state is ~7 MiB).
const SAMPLER_PEAK_RSS_KIB: u64 = 24 * 1024;

fn hostile(sock: &std::path::Path, scenario: &str) -> Value {
    let out = Command::new(bin("firn-hostile"))
        .arg(sock)
        .arg(scenario)
        .output()
        .expect("run firn-hostile");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| {
        panic!(
            "{scenario}: no result ({e}): {text} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[test]
fn hostile_clients_are_counted_and_cut_off() {
    if !can_run_bpf() {
        return;
    }
    let mut sampler = SamplerRun::start(
        "hostile",
        &[
            "--round",
            "1",
            "--write-stall-seconds",
            "2",
            "--max-connections",
            "8",
        ],
    );
    let spid = sampler.child.id();
    let good = sampler.dump(&[]);
    assert!(good.wait_for("\"connected\"", 10 * SECS).is_some());
    let _busy = start_workload(&workload("busy"), &["600"]);

    // (scenario, counter it must raise, whether the connection must be closed)
    let cases = [
        ("oversized", "protocol_errors", true),
        ("nested", "protocol_errors", true),
        ("wrong-version", "protocol_mismatches", true),
        ("never-issued", "broker_requests_never_issued", true),
        ("unknown-process", "broker_refused_unknown", false),
        ("fd-flood", "request_floods", true),
        ("unknown-method", "unknown_methods", true),
        ("unknown-interface", "unknown_methods", true),
        ("flood", "request_floods", true),
        // Messages capnp-rpc would answer by itself, before any budgeted method: a
        // million Bootstraps stop at the second; kinds a two-party sampler never
        // accepts close at once.
        ("bootstrap-flood", "rpc_bootstraps_refused", true),
        ("disembargo", "rpc_messages_refused", true),
        ("slowloris", "stalled_connections", true),
        // Unwind tables: malformed rows close the connection; budgets and unknown
        // identities are refused and counted; a guessed id closes.
        ("table-unsorted", "unwind_tables_refused_malformed", true),
        ("table-bad-kind", "unwind_tables_refused_malformed", true),
        ("table-oversized", "unwind_tables_refused_budget", false),
        ("table-unknown", "unwind_tables_refused_unknown", false),
        ("table-never-issued", "broker_requests_never_issued", true),
        ("table-flood", "request_floods", true),
        // Rows spread to make the page directory large: taken, with pages grown to fit
        // the directory's room (the pool's use is checked below).
        ("table-spread", "unwind_rows_loaded", false),
    ];
    for (scenario, counter_name, must_close) in cases {
        let before = batches(&good).len();
        let seen_before = batches(&good)
            .last()
            .and_then(|b| counter(b, counter_name))
            .unwrap_or(0);
        let t0 = Instant::now();
        let r = hostile(&sampler.socket, scenario);
        assert_eq!(
            r["closed"].as_bool(),
            Some(must_close),
            "{scenario}: {r} (sampler log: {:#?})",
            sampler.lines().iter().rev().take(10).collect::<Vec<_>>()
        );
        // Every round still reaches the good subscriber: one per second while it ran.
        let rounds = t0.elapsed().as_secs() as usize;
        let after = wait_batches(&good, before + rounds.max(2), 10 * SECS);
        assert!(
            after.len() + 2 >= before + rounds.max(2),
            "{scenario}: the good subscriber got {} batches in {rounds} s",
            after.len() - before
        );
        // The count travels in the next round's batch.
        let t1 = Instant::now();
        let seen = loop {
            let seen = batches(&good)
                .last()
                .and_then(|b| counter(b, counter_name))
                .unwrap_or(0);
            if seen > seen_before || t1.elapsed() > 5 * SECS {
                break seen;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(seen > seen_before, "{scenario}: {counter_name} not counted");
        assert!(
            sampler.child.try_wait().unwrap().is_none(),
            "{scenario}: sampler died"
        );
        let hwm = status_kib(spid, "VmHWM").unwrap_or(0);
        assert!(
            hwm <= SAMPLER_PEAK_RSS_KIB,
            "{scenario}: sampler peak RSS {hwm} KiB over the bound"
        );
        eprintln!("{scenario}: {r}; {counter_name} {seen}; sampler VmHWM {hwm} KiB");
        if scenario == "table-spread" {
            // 16,384 rows and their directory: at most an eighth more, however spread.
            let in_use = batches(&good)[before..]
                .iter()
                .filter_map(|b| counter(b, "unwind_rows_in_use"))
                .max()
                .unwrap_or(0);
            assert!(
                in_use > 16_384 && in_use <= 16_384 + 2_048,
                "table-spread: {in_use} rows in the pool"
            );
        }
    }

    // More connections than the limit: the extra ones are refused at once; silent ones
    // are closed when the handshake time runs out.
    let silent: Vec<UnixStream> = (0..10)
        .filter_map(|_| UnixStream::connect(&sampler.socket).ok())
        .collect();
    let mut closed = 0;
    for mut s in silent {
        s.set_read_timeout(Some(15 * SECS)).unwrap();
        let mut b = [0u8; 8];
        if matches!(s.read(&mut b), Ok(0) | Err(_)) {
            closed += 1;
        }
    }
    assert_eq!(closed, 10, "silent connections were not all closed");
    let last = wait_batches(&good, batches(&good).len() + 2, 10 * SECS);
    let last = last.last().unwrap();
    assert!(counter(last, "connections_refused_limit").unwrap() >= 1);
    assert!(counter(last, "handshake_timeouts").unwrap() >= 1);
    assert!(status_kib(spid, "VmHWM").unwrap_or(0) <= SAMPLER_PEAK_RSS_KIB);
    sampler.stop();
}

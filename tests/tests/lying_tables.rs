//! DESIGN rule 9: a subscriber that lies in its unwind tables gets back nothing of a
//! root process's memory but that process's code addresses. The review that made this
//! a rule read a victim's key and the tail of its password through well-formed tables.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use firn_tests::liar::code_ranges;
use firn_tests::*;
use serde_json::Value;

/// 16 secret words, each one the old walk would have recorded as a frame (in
/// [4096, 2^47)): 8 key words, and 8 password words of six printable bytes and two
/// zero bytes (the tail of a password in its buffer).
fn secrets() -> Vec<u64> {
    use std::io::Read;
    let mut raw = vec![0u8; 128];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut raw))
        .expect("random bytes");
    let mut out = Vec::new();
    for (i, c) in raw.chunks_exact(8).take(16).enumerate() {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        if i < 8 {
            out.push((u64::from_le_bytes(w) & ((1 << 47) - 1)) | (1 << 40));
        } else {
            for b in &mut w[..6] {
                *b = b'!' + *b % 90;
            }
            w[6] = 0;
            w[7] = 0;
            out.push(u64::from_le_bytes(w));
        }
    }
    out
}

#[test]
fn lying_tables_get_back_code_addresses_only() {
    if !can_run_bpf() {
        return;
    }
    let dir = TempDir::new("lying-tables");
    let words = secrets();
    let file = dir.path().join("secrets");
    let text: String = words.iter().map(|w| format!("{w:x}\n")).collect();
    std::fs::write(&file, text).expect("write secrets");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    // The victim runs as root: the liar could read none of it itself.
    let victim = start_workload(&workload("secret"), &[file.to_str().expect("path")]);
    let pid = victim.pid();
    let code = code_ranges(pid);
    let is_code = |a: u64| code.iter().any(|&(s, e)| a >= s && a < e);
    assert!(
        words.iter().all(|&w| !is_code(w)),
        "a random secret fell into the victim's code; run again"
    );

    let sampler = SamplerRun::start("lying-tables", &["--round", "1", "--frequency", "99"]);
    let out = Command::new(bin("firn-lying-tables"))
        .arg(&sampler.socket)
        .arg(pid.to_string())
        .output()
        .expect("run firn-lying-tables");
    let text = String::from_utf8_lossy(&out.stdout);
    let r: Value =
        serde_json::from_str(text.lines().last().unwrap_or_default()).unwrap_or_else(|e| {
            panic!(
                "no result ({e}): {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    eprintln!(
        "tables taken {} refused {}; victim samples {}; ends {}; unaligned closed {}",
        r["tables_taken"], r["tables_refused"], r["samples"], r["ends"], r["closed_unaligned"]
    );

    // The attack ran: its tables were loaded and walked over the victim's stack.
    let counters = &r["counters"];
    let count = |name: &str| counters[name].as_u64().unwrap_or(0);
    assert!(r["tables_taken"].as_u64().unwrap_or(0) >= 700, "{r}");
    assert!(r["samples"].as_u64().unwrap_or(0) >= 500, "{r}");
    assert!(count("bpf_unwind_table_frames") > 500, "{counters}");
    assert!(count("bpf_unwind_end_bad_frame") > 100, "{counters}");
    // Its reads went through the stack windows, whose 512-byte edges the offsets to
    // 2 KiB cross.
    assert!(count("bpf_unwind_stack_windows") > 0, "{counters}");
    // And some rows came from the CPUs' memos of rows found, which each replaced table
    // empties: a lie answered from a memo meets the same checks.
    assert!(count("bpf_unwind_row_memo_hits") > 0, "{counters}");

    // Every frame is code of the victim; no secret word anywhere the liar looks.
    let frames: Vec<u64> = r["frames"]
        .as_array()
        .expect("frames")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    let distinct: BTreeSet<u64> = frames.iter().copied().collect();
    let not_code: Vec<String> = distinct
        .iter()
        .filter(|&&a| !is_code(a))
        .map(|a| format!("{a:#x}"))
        .collect();
    assert!(
        not_code.is_empty(),
        "frames outside the victim's code: {not_code:?}"
    );
    for w in &words {
        assert!(!distinct.contains(w), "secret {w:#x} came back as a frame");
        let values: Vec<u64> = counters
            .as_object()
            .expect("counters")
            .values()
            .filter_map(Value::as_u64)
            .collect();
        assert!(!values.contains(w), "secret {w:#x} came back as a counter");
    }
    assert!(
        !r["ends"]
            .as_object()
            .expect("ends")
            .contains_key("Some(ReadFault)"),
        "a read fault would tell which addresses are mapped: {}",
        r["ends"]
    );
    // Offsets that are not whole words never reach the maps: the connection closes.
    assert_eq!(r["closed_unaligned"].as_u64(), Some(2), "{r}");
    assert!(count("unwind_tables_refused_malformed") >= 1 || r["closed_unaligned"] == 2);
    drop(sampler);
    drop(victim);
}

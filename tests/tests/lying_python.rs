//! DESIGN rule 9 for the Python walk: a subscriber that lies in its interpreter records
//! (offsets, the runtime, the types, the eval range, the image) gets back no byte of a
//! root Python process's secrets: not in a code object's names, not as a frame.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use firn_schema::python_code::{frame, CodeBlob};
use firn_tests::liar::code_ranges;
use firn_tests::*;

fn random(n: usize) -> Vec<u8> {
    use std::io::Read;
    let mut raw = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut raw))
        .expect("random bytes");
    raw
}

#[test]
fn lying_python_records_get_back_no_secret() {
    if !can_run_bpf() {
        return;
    }
    let dir = TempDir::new("lying-python");
    let text: String = random(40)
        .iter()
        .map(|b| char::from(b'A' + b % 26))
        .collect();
    let bytes = random(48);
    let hexed: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    let file = dir.path().join("secrets");
    std::fs::write(&file, format!("{text} {hexed}\n")).expect("write secrets");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    // Debian's python3 as root: the liar could read none of its memory itself.
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.arg(repo_root().join("tests/workloads/pysecret.py"))
        .arg(&file);
    let victim = Proc::spawn("pysecret", cmd);
    assert!(victim
        .wait_for("ready", 20 * std::time::Duration::from_secs(1))
        .is_some());
    let pid = victim.pid();
    let code = code_ranges(pid);

    let sampler = SamplerRun::start("lying-python", &["--round", "1", "--frequency", "99"]);
    let out = Command::new(bin("firn-lying-python"))
        .arg(&sampler.socket)
        .arg(pid.to_string())
        .output()
        .expect("run firn-lying-python");
    let out_text = String::from_utf8_lossy(&out.stdout);
    let r: Value = serde_json::from_str(out_text.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| {
            panic!(
                "no result ({e}): {out_text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    eprintln!(
        "honest {}, again {}; answers {}; victim samples {}",
        r["honest"], r["again"], r["answers"], r["samples"]
    );
    let counters = &r["counters"];
    let count = |name: &str| counters[name].as_u64().unwrap_or(0);
    eprintln!(
        "python frames {} no thread {} read faults {} not code {} bad types {} copied {}",
        count("bpf_python_frames"),
        count("bpf_python_no_thread"),
        count("bpf_python_read_faults"),
        count("bpf_python_not_code"),
        count("bpf_python_bad_types"),
        count("bpf_python_code_copied")
    );
    // The attack ran: the honest record and some lies were taken and walked.
    assert_eq!(r["honest"], "taken", "{r}");
    assert_eq!(r["again"], "taken", "{r}");
    let answers = &r["answers"];
    assert!(answers["taken"].as_u64().unwrap_or(0) >= 20, "{answers}");
    // Every moved offset is another layout than the version's: refused.
    assert!(answers["Invalid"].as_u64().unwrap_or(0) >= 23, "{answers}");
    assert!(
        answers["OutsideMapping"].as_u64().unwrap_or(0) >= 3,
        "{answers}"
    );
    assert!(count("bpf_python_frames") > 100, "{counters}");
    assert!(
        count("bpf_python_bad_types") > 0,
        "type lies were caught: {counters}"
    );

    // The names that came back are the victim's code's; no secret byte among them.
    let blobs: Vec<Vec<u8>> = r["python_code"]
        .as_array()
        .expect("blobs")
        .iter()
        .map(|h| {
            let h = h.as_str().unwrap_or_default();
            (0..h.len() / 2)
                .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap_or(0))
                .collect()
        })
        .collect();
    let names: Vec<String> = blobs
        .iter()
        .filter_map(|b| CodeBlob::parse(b).map(|c| String::from_utf8_lossy(c.name).into_owned()))
        .collect();
    assert!(
        names.iter().any(|n| n == "hold"),
        "the victim's frames were named: {names:?}"
    );
    for secret in [text.as_bytes(), &bytes[..]] {
        for w in secret.windows(8) {
            assert!(
                !blobs.iter().any(|b| b.windows(8).any(|x| x == w)),
                "a secret came back in a code blob"
            );
        }
    }
    // Native frames are the victim's code; Python frames are tagged ids.
    let frames: Vec<u64> = r["frames"]
        .as_array()
        .expect("frames")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    let bad: Vec<String> = frames
        .iter()
        .filter(|&&a| !frame::is_python(a) && !code.iter().any(|&(s, e)| a >= s && a < e))
        .map(|a| format!("{a:#x}"))
        .collect();
    assert!(bad.is_empty(), "frames outside the victim's code: {bad:?}");
    assert!(
        frames.iter().any(|&a| frame::is_python(a)),
        "no Python frame at all"
    );
    drop(sampler);
    drop(victim);
}

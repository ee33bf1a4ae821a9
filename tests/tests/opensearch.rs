//! End-to-end tests of the OpenSearch sink (issue: OpenSearch). No OpenSearch server can
//! run on these machines, so the real sampler and enricher send to a stand-in
//! (`tests/receivers/opensearch_standin.py`) that plays the documented `_bulk` and
//! `_index_template` API, checks every NDJSON line, the auth header and the template's
//! mappings, and answers with per-item errors and 429 when asked. What arrives is compared
//! with the local sink's index for the same rounds.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);
const FAST: &[&str] = &["--frequency", "99", "--round", "2"];
const PASSWORD: &str = "pw-7c41e0";

/// Enricher flags for the stand-in at `port` with the password file under `dir`.
fn sink_args(dir: &Path, port: u16, password: &str) -> Vec<String> {
    let pw = secret_file(dir, "os-password", &format!("{password}\n"));
    let mut a = strs(&["--opensearch-url"]);
    a.push(format!("http://127.0.0.1:{port}"));
    a.extend(strs(&[
        "--opensearch-username",
        "firn",
        "--opensearch-password-file",
    ]));
    a.push(pw.display().to_string());
    // Quick retries: the tests wait for backends that come back.
    a.extend(strs(&["--upload-backoff-max", "2s"]));
    a
}

/// (round start in ms → samples) of `pid` in the local sink's index.
fn local_rounds(out: &Path, pid: u32) -> BTreeMap<u64, u64> {
    pid_rounds(out, pid)
        .into_iter()
        .map(|(t, n)| (t / 1_000_000, n))
        .collect()
}

/// Documents of one type for `pid` in the stand-in.
fn docs(state: &Value, doc_type: &str, pid: u32) -> Vec<Value> {
    state["docs"]
        .as_object()
        .map(|m| {
            m.values()
                .filter(|d| {
                    d["doc_type"] == doc_type
                        && d["labels"]["pid"].as_str() == Some(pid.to_string().as_str())
                })
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

/// (round start in ms → samples) of `pid`'s profile documents.
fn remote_rounds(state: &Value, pid: u32) -> BTreeMap<u64, u64> {
    let mut m = BTreeMap::new();
    for d in docs(state, "profile", pid) {
        *m.entry(d["start"].as_u64().unwrap()).or_insert(0) += d["samples"].as_u64().unwrap();
    }
    m
}

fn upload_metric(f: &Firn, name: &str) -> f64 {
    f.metric(&format!(
        "firn_enricher_upload_{name}{{sink=\"opensearch\"}}"
    ))
    .unwrap_or(-1.0)
}

/// Off-CPU time (--off-cpu) of the `offcpu` workload `pid`: its profile documents'
/// `off_cpu_ns` per round as the local pprof files' (read by `go tool pprof`), its stack
/// documents naming where it waited; the template and the index an older enricher
/// left were given the new fields.
fn off_cpu_documents(f: &Firn, state: &Value, pid: u32) {
    let local = off_cpu_rounds_ms(f, pid);
    let mut remote = BTreeMap::new();
    for d in docs(state, "profile", pid) {
        let ns = d["off_cpu_ns"]
            .as_u64()
            .expect("off_cpu_ns on a profile document");
        *remote.entry(d["start"].as_u64().unwrap()).or_insert(0) += ns;
        let top = d["off_cpu_top_functions"].as_array().unwrap();
        let listed: u64 = top.iter().map(|t| t["off_cpu_ns"].as_u64().unwrap()).sum();
        assert!(listed <= ns && (ns == 0 || !top.is_empty()), "{d}");
    }
    assert_eq!(remote, local, "off-CPU ns per round");
    let total: u64 = local.values().sum();
    assert!(
        total > 2_000_000_000,
        "{total} ns off CPU in 5 s of waiting"
    );
    let stacks = docs(state, "stack", pid);
    let waited = |f: &str| {
        stacks.iter().any(|s| {
            s["off_cpu_ns"].as_u64() > Some(0)
                && s["frames"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|x| x.as_str().is_some_and(|x| x.contains(f)))
        })
    };
    assert!(
        waited("wait_pipe") && waited("pipe_read"),
        "no stack wait_pipe … pipe_read"
    );
    let t = &state["templates"]["firn-profiles"];
    assert_eq!(t["_meta"]["mapping"], 2, "the older template was replaced");
    for (name, m) in state["indices"].as_object().unwrap() {
        assert_eq!(
            m["properties"]["off_cpu_ns"]["type"], "long",
            "index {name}"
        );
    }
    assert!(state["counts"]["mapping_puts"].as_u64() >= Some(1));
    eprintln!(
        "off-CPU documents: {:.3} s over {} rounds, as the local files; {} stack documents",
        total as f64 / 1e9,
        local.len(),
        stacks.len()
    );
}

/// (round start in ms → off-CPU ns) of `pid` in the local pprof files.
fn off_cpu_rounds_ms(f: &Firn, pid: u32) -> BTreeMap<u64, u64> {
    pid_off_cpu_rounds(&f.out, pid)
        .into_iter()
        .map(|(t, n)| (t / 1_000_000, n))
        .collect()
}

#[test]
fn documents_match_the_local_index() {
    if !can_run_bpf() {
        return;
    }
    let rx = TempDir::new("os-rx");
    let port = free_port();
    // An enricher of the mapping before off-CPU time left its template and index.
    let old = repo_root().join("tests/receivers/opensearch_template_v1.json");
    let _standin = start_opensearch_standin(
        port,
        rx.path(),
        &[
            "--user",
            "firn",
            "--password",
            PASSWORD,
            "--mixed",
            "--bulk-429",
            "1",
            "--old-template",
            &old.display().to_string(),
        ],
    );
    let args = [FAST, &["--off-cpu"]].concat();
    let f = Firn::start_with("os", &args, |dir| sink_args(dir, port, PASSWORD));
    let waits = compile_plain("gcc", "offcpu.c", "offcpu-gcc", &["-O2", "-g", "-pthread"]);
    let mut w = start_workload(&workload("busy"), &["5"]);
    let mut w2 = start_workload(&waits, &["5"]);
    let (pid, wpid) = (w.pid(), w2.pid());
    w.wait_exit(30 * SECS).expect("busy ends");
    w2.wait_exit(30 * SECS).expect("offcpu ends");
    // Every round of the workloads written before the comparisons.
    assert!(wait_round_after(&f.out, now_ns(), 20 * SECS));
    assert!(f.wait_profiles(pid, 2, 15 * SECS).len() >= 2);
    let caught_up = wait_until(30 * SECS, || {
        let state = standin_state(rx.path());
        let remote = remote_rounds(&state, pid);
        let local = local_rounds(&f.out, pid);
        let waited = local_rounds(&f.out, wpid);
        !local.is_empty()
            && local.keys().all(|k| remote.contains_key(k))
            && waited
                .keys()
                .all(|k| remote_rounds(&state, wpid).contains_key(k))
            && state["pending_retry"] == 0
    });
    let state = standin_state(rx.path());
    let local = local_rounds(&f.out, pid);
    assert!(
        caught_up,
        "rounds missing in OpenSearch: local {local:?}, remote {:?}; counts {}; enricher:\n{:#?}",
        remote_rounds(&state, pid),
        state["counts"],
        f.enricher.as_ref().unwrap().lines()
    );
    assert_eq!(
        state["violations"],
        serde_json::json!([]),
        "the stand-in's checks"
    );
    assert_eq!(remote_rounds(&state, pid), local, "samples per round");
    // The template went in before any document, with firn's mappings.
    let t = &state["templates"]["firn-profiles"];
    assert_eq!(t["index_patterns"][0], "firn-profiles-*");
    assert_eq!(
        t["template"]["mappings"]["properties"]["frames"]["type"],
        "keyword"
    );
    assert_eq!(state["counts"]["unauthorized"], 0);
    // Profile documents: labels as the local index's, CPU, top functions, a pprof link
    // that serves the local file.
    let profiles = docs(&state, "profile", pid);
    // A sample between the fork and the exec is the test binary's process under the same
    // pid, with a document of its own; of busy's, the fullest round (its first and last
    // are partial, a few samples in start-up or exit code).
    let p = profiles
        .iter()
        .filter(|p| p["labels"]["executable"] == "busy")
        .max_by_key(|p| p["samples"].as_u64())
        .unwrap_or_else(|| panic!("no profile document of the pid is busy's: {profiles:#?}"));
    assert_eq!(p["comm"], "busy");
    assert_eq!(
        p["cpu_ns"].as_u64().unwrap(),
        p["samples"].as_u64().unwrap() * (1_000_000_000 / 99)
    );
    assert_eq!(p["top_functions"][0]["function"], "hot_leaf", "{p}");
    let url = p["pprof_url"].as_str().unwrap();
    let path = url
        .split_once(&f.http)
        .map(|(_, p)| p)
        .expect("a link to this enricher");
    let (status, body) = f.get(path);
    assert_eq!(status, 200, "{url}");
    assert_eq!(
        body,
        std::fs::read(f.out.join(p["pprof_file"].as_str().unwrap())).unwrap()
    );
    assert_eq!(f.get("/rounds/..%2f..%2fetc/passwd").0, 400);
    // Stack documents: frames leaf first, summing to the profile's samples (those the
    // stand-in refused excepted).
    let stacks = docs(&state, "stack", pid);
    assert!(
        stacks.iter().any(|s| s["leaf"] == "hot_leaf"
            && s["frames"][1] == "middle"
            && s["frames"][2] == "outer"),
        "no stack hot_leaf <- middle <- outer"
    );
    let refused: Vec<String> = state["rejected_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let mut stack_sums: HashMap<String, u64> = HashMap::new();
    for s in &stacks {
        *stack_sums
            .entry(s["profile_id"].as_str().unwrap().to_string())
            .or_insert(0) += s["samples"].as_u64().unwrap();
    }
    if refused.is_empty() {
        for p in &profiles {
            assert_eq!(
                stack_sums.get(p["profile_id"].as_str().unwrap()).copied(),
                p["samples"].as_u64(),
                "stacks of {p}"
            );
        }
    }
    // Per-item answers: refusals counted and not retried, 429 items sent again, the
    // whole-request 429 retried.
    let c = &state["counts"];
    assert!(c["item_429"].as_u64().unwrap() > 0, "{c}");
    // Rounds keep coming (every thread's waits make many stack documents): compare the
    // two counts between requests.
    let counts = || {
        let c = standin_state(rx.path())["counts"].clone();
        [
            (
                upload_metric(&f, "documents_retried_total"),
                c["item_429"].as_f64(),
            ),
            (
                upload_metric(&f, "documents_rejected_total"),
                c["item_400"].as_f64(),
            ),
        ]
    };
    assert!(
        wait_until(20 * SECS, || counts().iter().all(|(m, c)| Some(*m) == *c)),
        "retried and refused items, the enricher's counts against the stand-in's: {:?}",
        counts()
    );
    assert!(upload_metric(&f, "retries_total") >= 1.0, "the 429 answer");
    assert_eq!(
        f.metric("firn_enricher_opensearch_template_upgrades_total"),
        Some(1.0)
    );
    assert_eq!(
        f.metric("firn_enricher_opensearch_template_installs_total"),
        Some(0.0)
    );
    off_cpu_documents(&f, &state, wpid);
    dashboards_fit_the_template(&state["templates"]["firn-profiles"]);
    flame_graph_renders(&rx, &stacks);
    let lines = f.enricher.as_ref().unwrap().lines().join("\n");
    assert!(!lines.contains(PASSWORD), "the password reached the log");
    let (_, metrics) = f.get("/metrics");
    assert!(!String::from_utf8_lossy(&metrics).contains(PASSWORD));
}

#[test]
fn down_then_back_loses_nothing_and_a_wrong_password_is_not_retried_in_a_loop() {
    if !can_run_bpf() {
        return;
    }
    let rx = TempDir::new("os-down");
    let port = free_port();
    // Down at start: nothing listens.
    let f = Firn::start_with("osdown", FAST, |dir| sink_args(dir, port, "wrong"));
    let mut w = start_workload(&workload("busy"), &["6"]);
    let pid = w.pid();
    w.wait_exit(30 * SECS).expect("busy ends");
    assert!(f.wait_profiles(pid, 2, 15 * SECS).len() >= 2);
    assert!(
        wait_until(10 * SECS, || upload_metric(&f, "retries_total") >= 1.0),
        "no retries while down"
    );
    assert_eq!(upload_metric(&f, "failing"), 1.0);
    // Back, but the enricher's password is wrong: refused once, then nothing is sent
    // until SIGHUP.
    let mut standin =
        start_opensearch_standin(port, rx.path(), &["--user", "firn", "--password", PASSWORD]);
    let enricher = f.enricher.as_ref().unwrap();
    assert!(
        enricher
            .wait_for("refused firn's credentials", 20 * SECS)
            .is_some(),
        "no clear message for a wrong password: {:#?}",
        enricher.lines()
    );
    std::thread::sleep(8 * SECS);
    let state = standin_state(rx.path());
    assert_eq!(
        state["counts"]["unauthorized"], 1,
        "a refused password was tried again without a SIGHUP"
    );
    assert_eq!(
        f.metric("firn_enricher_opensearch_auth_failures_total"),
        Some(1.0)
    );
    // The right password and SIGHUP: every round the local sink wrote arrives.
    std::fs::write(f.dir.path().join("os-password"), format!("{PASSWORD}\n")).unwrap();
    f.enricher
        .as_ref()
        .unwrap()
        .signal(nix::sys::signal::Signal::SIGHUP);
    let caught_up = wait_until(40 * SECS, || {
        let remote = remote_rounds(&standin_state(rx.path()), pid);
        let local = local_rounds(&f.out, pid);
        !local.is_empty() && local.iter().all(|(k, n)| remote.get(k) == Some(n))
    });
    let state = standin_state(rx.path());
    assert!(
        caught_up,
        "rounds lost while OpenSearch was down or refusing: local {:?}, remote {:?}",
        local_rounds(&f.out, pid),
        remote_rounds(&state, pid)
    );
    assert_eq!(state["violations"], serde_json::json!([]));
    assert!(wait_until(10 * SECS, || upload_metric(&f, "failing") == 0.0));
    standin.stop();
}

/// packaging/opensearch/firn-dashboards.ndjson (no OpenSearch Dashboards runs here): every
/// line is a saved object, every reference names an object of the file, and every field
/// a visualization or the search uses is mapped by the template firn installed.
fn dashboards_fit_the_template(template: &Value) {
    let text =
        std::fs::read_to_string(repo_root().join("packaging/opensearch/firn-dashboards.ndjson"))
            .unwrap();
    let objects: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a saved object per line"))
        .collect();
    let ids: Vec<(&str, &str)> = objects
        .iter()
        .map(|o| (o["type"].as_str().unwrap(), o["id"].as_str().unwrap()))
        .collect();
    let props = &template["template"]["mappings"]["properties"];
    let mapped = |f: &str| !props[f].is_null();
    for o in &objects {
        for r in o["references"].as_array().unwrap() {
            let want = (r["type"].as_str().unwrap(), r["id"].as_str().unwrap());
            assert!(
                ids.contains(&want),
                "{} refers to a missing {want:?}",
                o["id"]
            );
        }
        let a = &o["attributes"];
        if let Some(vis) = a["visState"].as_str() {
            let vis: Value = serde_json::from_str(vis).expect("visState is JSON");
            for agg in vis["aggs"].as_array().unwrap() {
                let f = agg["params"]["field"].as_str().unwrap();
                assert!(mapped(f), "{}: field {f} is not in the template", o["id"]);
            }
        }
        for c in a["columns"].as_array().into_iter().flatten() {
            let c = c.as_str().unwrap();
            assert!(mapped(c), "{}: column {c} is not in the template", o["id"]);
        }
        if let Some(s) = a["kibanaSavedObjectMeta"]["searchSourceJSON"].as_str() {
            let s: Value = serde_json::from_str(s).expect("searchSourceJSON is JSON");
            if let Some(q) = s["query"]["query"].as_str() {
                if let Some((field, _)) = q.split_once(':') {
                    assert!(mapped(field), "{}: query field {field}", o["id"]);
                }
            }
        }
    }
    assert!(ids.contains(&("index-pattern", "firn-profiles")));
    assert!(ids.iter().any(|(t, _)| *t == "dashboard"));
}

/// The Dashboards flame graph (Vega), rendered by Vega 5 itself in Node over the stack
/// documents that arrived: the workload's call chain is drawn.
fn flame_graph_renders(rx: &TempDir, stacks: &[Value]) {
    let docs = rx.path().join("stacks.json");
    std::fs::write(&docs, serde_json::to_vec(stacks).unwrap()).unwrap();
    let svg = rx.path().join("flame.svg");
    let out = std::process::Command::new("node")
        .current_dir(repo_root().join("tests/receivers"))
        .arg("vega_flame.mjs")
        .arg(repo_root().join("packaging/opensearch/firn-dashboards.ndjson"))
        .arg(&docs)
        .arg(&svg)
        .output()
        .expect("node (tests/setup-tools.sh installs it and vega)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the Vega flame graph does not render: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(text.trim()).expect("vega_flame.mjs prints JSON");
    assert_eq!(v["root_share"], 1.0, "{v}");
    for want in ["hot_leaf", "middle", "outer", "main"] {
        assert!(
            v["svg_text"].as_array().unwrap().iter().any(|n| n == want),
            "{want} not drawn in the flame graph: {v}"
        );
    }
}

/// SIGTERM while OpenSearch is down: the rounds waiting in memory go to the spool, and
/// the next enricher on the same spool delivers every one once the backend is back (an
/// enricher used to spool OTLP and Parca only, and lose OpenSearch's queue).
#[test]
fn sigterm_during_an_outage_loses_no_round() {
    if !can_run_bpf() {
        return;
    }
    let rx = TempDir::new("os-term");
    let port = free_port();
    let mut f = Firn::start_with("osterm", FAST, |dir| sink_args(dir, port, PASSWORD));
    let mut w = start_workload(&workload("busy"), &["6"]);
    let pid = w.pid();
    w.wait_exit(30 * SECS).expect("busy ends");
    assert!(f.wait_profiles(pid, 3, 20 * SECS).len() >= 3);
    assert!(
        wait_until(10 * SECS, || upload_metric(&f, "retries_total") >= 1.0),
        "no retries while down"
    );
    let queued = upload_metric(&f, "queue_requests");
    assert!(queued >= 3.0, "{queued} requests wait in memory");
    let status = f.enricher.as_mut().unwrap().stop();
    assert!(status.is_some_and(|s| s.success()), "SIGTERM: {status:?}");
    let spooled: Vec<_> = std::fs::read_dir(f.out.join(".spool/opensearch"))
        .map(|d| d.flatten().collect())
        .unwrap_or_default();
    assert!(
        spooled.len() as f64 >= queued,
        "{} requests spooled at SIGTERM, {queued} were queued",
        spooled.len()
    );
    // The next enricher starts while the backend is still down, then it comes back.
    let extra = sink_args(f.dir.path(), port, PASSWORD);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    f.start_enricher(&extra);
    std::thread::sleep(3 * SECS);
    let mut standin =
        start_opensearch_standin(port, rx.path(), &["--user", "firn", "--password", PASSWORD]);
    let local = local_rounds(&f.out, pid);
    let caught_up = wait_until(40 * SECS, || {
        let remote = remote_rounds(&standin_state(rx.path()), pid);
        local.iter().all(|(k, n)| remote.get(k) == Some(n))
    });
    let state = standin_state(rx.path());
    assert!(
        caught_up,
        "rounds lost across SIGTERM: local {local:?}, remote {:?}",
        remote_rounds(&state, pid)
    );
    // Once each: a profile document per local index record of the workload's pid, none
    // twice. A round can hold two records of the pid (a sample between the fork and the
    // exec is the test binary's), so records are counted, not rounds.
    let profiles = docs(&state, "profile", pid);
    let records = index_records(&f.out)
        .iter()
        .filter(|(_, e)| e["labels"]["pid"].as_str() == Some(pid.to_string().as_str()))
        .count();
    assert_eq!(profiles.len(), records, "{profiles:#?}");
    assert_eq!(state["violations"], serde_json::json!([]));
    standin.stop();
}

/// A backend that answers 1.5 GiB (hostile, or something on a plain-http path): the
/// enricher reads no more than its bound, counts it, retries, and stays small.
#[test]
fn a_huge_answer_is_refused_unread() {
    if !can_run_bpf() {
        return;
    }
    let rx = TempDir::new("os-huge");
    let port = free_port();
    let mut standin = start_opensearch_standin(
        port,
        rx.path(),
        &[
            "--user",
            "firn",
            "--password",
            PASSWORD,
            "--huge-answers",
            "2",
        ],
    );
    let f = Firn::start_with("oshuge", FAST, |dir| sink_args(dir, port, PASSWORD));
    let mut w = start_workload(&workload("busy"), &["6"]);
    let pid = w.pid();
    w.wait_exit(30 * SECS).expect("busy ends");
    assert!(
        wait_until(60 * SECS, || upload_metric(&f, "answers_too_large_total")
            >= 2.0),
        "the huge answers were not refused and counted"
    );
    let local = local_rounds(&f.out, pid);
    assert!(
        wait_until(40 * SECS, || {
            let remote = remote_rounds(&standin_state(rx.path()), pid);
            !local.is_empty() && local.iter().all(|(k, n)| remote.get(k) == Some(n))
        }),
        "rounds were lost after the huge answers"
    );
    let epid = f.enricher.as_ref().unwrap().pid();
    let hwm = status_kib(epid, "VmHWM").unwrap_or(u64::MAX);
    let sent = standin_state(rx.path())["counts"]["huge_bytes_sent"]
        .as_u64()
        .unwrap_or(0);
    eprintln!(
        "huge answers: stand-in wrote {} MiB; enricher peak {} MiB",
        sent >> 20,
        hwm >> 10
    );
    assert!(
        hwm < 96 * 1024,
        "enricher peak RSS {hwm} KiB after 1.5 GiB answers"
    );
    assert!(
        sent < 512 << 20,
        "the enricher read {sent} bytes of the answers"
    );
    standin.stop();
}

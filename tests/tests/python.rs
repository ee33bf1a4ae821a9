//! Python frames, read in BPF and named by the enricher, on every CPython here:
//! Debian's python3 (3.11, stripped, non-PIE, libpython linked in) and pyenv's builds
//! (3.10 to 3.13, shared libpython, PIE). Read back with `go tool pprof -traces`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use firn_tests::pyframes::*;
use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);
const FAST: &[&str] = &["--frequency", "99", "--round", "1"];

#[test]
fn python_frames_on_every_version() {
    if !can_run_bpf() {
        return;
    }
    let pythons = interpreters();
    let mut f = Firn::start("python", FAST);
    let mut procs: Vec<(String, Proc)> = pythons
        .iter()
        .map(|(v, exe)| (v.clone(), start_python(exe, "150")))
        .collect();
    // An interpreter firn does not know (3.9): counted, its native frames kept.
    let mut unknown = pyenv_python("3.9.18").map(|e| start_python(&e, "150"));
    // One that corrupts its own code object.
    let corrupt_script = repo_root().join("tests/workloads/pycorrupt.py");
    let mut corrupt = pyenv_python("3.12.1").map(|e| start_script(&e, &corrupt_script, "150"));
    for p in procs.iter().map(|(_, p)| p).chain(&corrupt) {
        wait_interpreter(&f, p.pid());
    }
    // The names arrive with the first samples after the record; a round to settle.
    std::thread::sleep(3 * SECS);
    let since = now_ns();
    // py-spy reads the same processes meanwhile: what it names, firn must name too.
    let mut spied: Vec<std::collections::BTreeSet<String>> = vec![Default::default(); procs.len()];
    let t0 = Instant::now();
    while t0.elapsed() < 10 * SECS {
        for ((_, p), names) in procs.iter().zip(&mut spied) {
            names.extend(py_spy_dump(p.pid()));
        }
        std::thread::sleep(SECS);
    }
    let files_since = |f: &Firn, pid: u32, since: u64, n: usize| {
        let pid = pid.to_string();
        let t0 = Instant::now();
        loop {
            let files: Vec<PathBuf> = index_records(&f.out)
                .into_iter()
                .filter(|(_, r)| {
                    r["labels"]["pid"].as_str() == Some(pid.as_str())
                        && r["start_ns"].as_u64().is_some_and(|s| s >= since)
                })
                .map(|(p, _)| p)
                .collect();
            if files.len() >= n || t0.elapsed() > 60 * SECS {
                break files;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let files_of = |pid: u32| files_since(&f, pid, since, 8);
    let files: Vec<Vec<PathBuf>> = procs.iter().map(|(_, p)| files_of(p.pid())).collect();
    let unknown_files = unknown.as_ref().map(|p| files_of(p.pid()));
    let corrupt_files = corrupt.as_ref().map(|p| files_of(p.pid()));
    let corrupt_alive = corrupt.as_mut().map(|p| p.running());
    // A new subscriber (the enricher restarted) is sent every code object's names again.
    if let Some(mut e) = f.enricher.take() {
        e.stop();
    }
    f.start_enricher(&[]);
    let restart = now_ns();
    let again = files_since(&f, procs[0].1.pid(), restart, 3);
    let renamed = !again.is_empty()
        && line_traces(&again)
            .iter()
            .any(|(_, fr)| fr.iter().any(|x| x.func == "leaf" && x.python()));
    for p in procs
        .iter_mut()
        .map(|(_, p)| p)
        .chain(&mut unknown)
        .chain(&mut corrupt)
    {
        p.stop();
    }
    let leaf = leaf_line();
    let mut failures = Vec::new();
    for (((version, _), files), spied) in procs.iter().zip(&files).zip(&spied) {
        let t = line_traces(files);
        // Every function py-spy saw is named in firn's profile (3.11 on, firn shows
        // the qualified name: `K.method` for py-spy's `method`).
        let named: std::collections::BTreeSet<&str> = t
            .iter()
            .flat_map(|(_, fr)| fr.iter().filter(|x| x.python()).map(|x| x.func.as_str()))
            .collect();
        let missed: Vec<&String> = spied
            .iter()
            .filter(|n| {
                !named
                    .iter()
                    .any(|f| f == n || f.ends_with(&format!(".{n}")))
            })
            .collect();
        eprintln!("CPython {version}: py-spy named {spied:?}");
        if spied.is_empty() || !missed.is_empty() {
            failures.push(format!(
                "{version}: py-spy named {spied:?}, firn missed {missed:?}"
            ));
        }
        // 3.10 names frames by co_name, later versions by co_qualname.
        let method = if version.starts_with("3.10") {
            "method"
        } else {
            "K.method"
        };
        let chain = ["leaf", method, "gen", "outer", "<module>"];
        let in_chain = |fr: &[Fr]| {
            fr.iter()
                .any(|x| x.python() && chain.contains(&x.func.as_str()))
        };
        let (whole, n) = share(&t, in_chain, |fr| python_chain(fr, &chain));
        // The leaf Python frame carries the running statement's line: the loop's
        // statement or its `for` (the only two the leaf runs).
        let leaf_first = |fr: &[Fr]| {
            fr.iter()
                .find(|x| x.python())
                .is_some_and(|x| x.func == "leaf")
        };
        let (lines, nl) = share(&t, leaf_first, |fr| {
            fr.iter()
                .find(|x| x.python())
                .is_some_and(|x| x.line == leaf || x.line == leaf - 1)
        });
        // A C extension called from Python: its native frames are on the leaf side of
        // `hash_it`, and the thread keeps its Python frames while it runs without the
        // GIL.
        let hashing = |fr: &[Fr]| {
            fr.iter()
                .position(|x| x.func == "hash_it")
                .is_some_and(|i| i > 0 && fr[..i].iter().all(|x| !x.python()))
        };
        // The hasher thread's samples in native code (libcrypto, _hashlib).
        let in_sha = |fr: &[Fr]| {
            fr.first().is_some_and(|x| {
                let f = x.func.to_ascii_lowercase();
                f.contains("sha256") || f.contains("libcrypto") || f.contains("evp_")
            })
        };
        if std::env::var_os("FIRN_TEST_DEBUG").is_some() {
            let hasher = |fr: &[Fr]| fr.iter().any(|x| x.func == "hashing");
            eprintln!("{version} hasher: {:#?}", worst(&t, hasher, |_| false));
        }
        let (kept, ns) = share(&t, in_sha, |fr| {
            hashing(fr) && fr.iter().any(|x| x.func == "hashing")
        });
        eprintln!(
            "CPython {version}: chain whole in {:.1} % of {n}; leaf line in {:.1} % of {nl}; \
             sha256 samples with their Python frames {:.1} % of {ns}",
            whole * 100.0,
            lines * 100.0,
            kept * 100.0
        );
        if !(n >= 100 && whole >= 0.95) {
            failures.push(format!(
                "{version}: chain {whole:.3} of {n}: {:#?}",
                worst(&t, in_chain, |fr| python_chain(fr, &chain))
            ));
        }
        if !(nl >= 100 && lines >= 0.95) {
            failures.push(format!("{version}: leaf line {lines:.3} of {nl}"));
        }
        if !(ns >= 20 && kept >= 0.90) {
            failures.push(format!(
                "{version}: GIL-released C frames {kept:.3} of {ns}: {:#?}",
                worst(&t, in_sha, hashing)
            ));
        }
    }
    // The unknown interpreter: counted, and its profile keeps native frames only.
    if let Some(files) = unknown_files {
        let t = line_traces(&files);
        let python = t.iter().any(|(_, fr)| fr.iter().any(Fr::python));
        let native = t.iter().any(|(_, fr)| {
            fr.iter()
                .any(|x| x.func.contains("_PyEval_EvalFrameDefault"))
        });
        eprintln!("CPython 3.9: Python frames {python}, eval loop frames {native}");
        if python || !native {
            failures.push(format!(
                "3.9: Python frames {python}, eval loop frames {native}"
            ));
        }
        let unknown = f
            .metric("firn_enricher_python_interpreters_unknown_total")
            .unwrap_or(0.0);
        if unknown < 1.0 {
            failures.push(format!("3.9 not counted as unknown: {unknown}"));
        }
    }
    // The corrupted code object: the process lives, its frame is shown unnamed, and no
    // other process's profile has a name it made.
    if let Some(cfiles) = corrupt_files {
        let t = line_traces(&cfiles);
        // Its name is a bytes object (refused) and its file unmapped (never read
        // whole, so its names are never sent): either way no name and no file.
        let (unnamed, n) = share(
            &t,
            |fr| fr.iter().any(|x| x.func == "<module>"),
            |fr| {
                fr.iter().any(|x| {
                    (x.func == "[python: no name]" || x.func == "[python: unknown code]")
                        && x.file.is_empty()
                })
            },
        );
        if std::env::var_os("FIRN_TEST_DEBUG").is_some() {
            eprintln!("corrupt: {:#?}", worst(&t, |_| true, |_| false));
        }
        eprintln!(
            "corrupted code object: shown unnamed in {:.1} % of {n}",
            unnamed * 100.0
        );
        let wrong: Vec<_> = files_names(&cfiles)
            .into_iter()
            .filter(|n| n.contains("corrupted_loop"))
            .collect();
        if corrupt_alive != Some(true) || n < 50 || unnamed < 0.9 || !wrong.is_empty() {
            failures.push(format!(
                "corrupt: alive {corrupt_alive:?}, unnamed {unnamed:.3} of {n}, names {wrong:?}"
            ));
        }
        for (v, fs) in procs.iter().map(|(v, _)| v).zip(&files) {
            let names = files_names(fs);
            if names
                .iter()
                .any(|n| n.contains("no name") || n.contains("corrupted_loop"))
            {
                failures.push(format!("{v}: a name of the corrupted process"));
            }
        }
    }
    if !renamed {
        failures.push(format!(
            "after the enricher's restart no `leaf` in {again:?}"
        ));
    }
    assert!(failures.is_empty(), "{failures:#?}");
    for name in ["python_frames_named", "python_interpreters_sent"] {
        let v = f
            .metric(&format!("firn_enricher_{name}_total"))
            .unwrap_or(0.0);
        assert!(v > 0.0, "{name} = {v}");
    }
    assert_eq!(
        f.metric("firn_enricher_python_interpreters_refused_total"),
        Some(0.0)
    );
}

//! The enricher's HTTP server as a hostile neighbour sees it (security review, round
//! two, findings 4 and 5): a DNS-rebinding page, another site's page in a browser, a
//! local user without the token, 64 clients asking for the view at once, connections
//! left open. The real sampler and enricher; the clients are plain sockets.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);
/// The enricher container's memory limit in packaging/kubernetes/firn.yaml.
const POD_LIMIT_KIB: u64 = 192 * 1024;

fn bearer(f: &Firn) -> String {
    format!("Authorization: Bearer {}", f.token())
}

#[test]
fn only_this_server_s_names_same_site_pages_and_the_token_are_answered() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start("http-access", &["--frequency", "49", "--round", "2"]);
    assert!(
        wait_until(20 * SECS, || f.get("/profiles").0 == 200
            && !f.token().is_empty()),
        "the enricher never answered with its token"
    );
    let auth = bearer(&f);
    let port = f.http.rsplit(':').next().unwrap().to_string();

    // DNS rebinding: the attacker's name resolving to 127.0.0.1, token or not.
    for path in [
        "/",
        "/api/view",
        "/pprof/cpu?seconds=5",
        "/metrics",
        "/healthz",
    ] {
        let (status, _) = http_get_with(
            &f.http,
            path,
            &[
                format!("Host: rebind.attacker.example:{port}"),
                auth.clone(),
            ],
        );
        assert_eq!(status, 421, "{path} answered a foreign Host");
    }
    // The right name on the wrong port is a rebinding too.
    assert_eq!(
        http_get_with(
            &f.http,
            "/profiles",
            &["Host: localhost:1".into(), auth.clone()]
        )
        .0,
        421
    );
    assert_eq!(
        http_get_with(
            &f.http,
            "/profiles",
            &[format!("Host: localhost:{port}"), auth.clone()]
        )
        .0,
        200
    );

    // Another site's page, in a browser that holds the cookie.
    let cookie = format!("Cookie: firn_token={}", f.token());
    for foreign in [
        "Origin: http://evil.example".to_string(),
        format!(
            "Origin: http://127.0.0.1:{}",
            port.parse::<u16>().unwrap() + 1
        ),
        "Origin: null".into(),
        "Sec-Fetch-Site: cross-site".into(),
        "Sec-Fetch-Site: same-site".into(),
    ] {
        for path in [
            "/api/view",
            "/pprof/cpu?seconds=5",
            "/profiles",
            "/debug/pprof/profile",
        ] {
            let (status, _) = http_get_with(&f.http, path, &[foreign.clone(), cookie.clone()]);
            assert_eq!(status, 403, "{path} with {foreign}");
        }
    }
    // The page's own requests, and scrapers (which send no Origin) of /metrics.
    let own = [
        format!("Origin: http://{}", f.http),
        "Sec-Fetch-Site: same-origin".into(),
        cookie.clone(),
    ];
    assert_eq!(http_get_with(&f.http, "/api/view", &own).0, 200);
    assert_eq!(
        http_get_with(
            &f.http,
            "/metrics",
            &["Sec-Fetch-Site: cross-site".into(), auth.clone()]
        )
        .0,
        200
    );

    // No token, a wrong one, or a prefix of it: nothing but /healthz.
    let wrong = "Authorization: Bearer 0123456789abcdef0123456789abcdef".to_string();
    let prefix = format!("Authorization: Bearer {}", &f.token()[..32]);
    for path in [
        "/",
        "/api/view",
        "/profiles",
        "/pprof/cpu?seconds=5",
        "/metrics",
    ] {
        for h in [vec![], vec![wrong.clone()], vec![prefix.clone()]] {
            assert_eq!(http_get_with(&f.http, path, &h).0, 401, "{path} with {h:?}");
        }
    }
    assert_eq!(http_get(&f.http, "/healthz").0, 200, "probes need no token");
    // pprof asks /symbolz without the download's query; its answer is a constant.
    assert_eq!(http_get(&f.http, "/symbolz").0, 200);
    // The enricher's own profile is off unless asked for (it starts work on a GET).
    assert_eq!(f.get("/debug/pprof/profile?seconds=1").0, 404);

    // Opening the printed URL sets the cookie and leaves the token out of the address.
    let (status, head, _) = http_request(&f.http, &format!("/?token={}", f.token()), &[]);
    assert_eq!(status, 303, "{head}");
    let set = head
        .lines()
        .find_map(|l| {
            l.strip_prefix("set-cookie: ")
                .or_else(|| l.strip_prefix("Set-Cookie: "))
        })
        .unwrap_or_else(|| panic!("no cookie set: {head}"));
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    let jar = format!("Cookie: {}", set.split(';').next().unwrap());
    let (status, page) = http_get_with(&f.http, "/", &[jar]);
    assert_eq!(status, 200);
    assert!(
        String::from_utf8_lossy(&page).contains("<html"),
        "not the page"
    );

    // The token file is the enricher user's alone: another local user cannot read it.
    let other = test_user("firn-other");
    let token_file = f.out.join(".http-token");
    let read = Command::new("setpriv")
        .args([
            &format!("--reuid={}", other.0),
            &format!("--regid={}", other.1),
            "--clear-groups",
            "cat",
        ])
        .arg(&token_file)
        .output()
        .unwrap();
    assert!(!read.status.success(), "another user read the token");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "token file mode");

    // Every refusal counted.
    for (name, at_least) in [
        ("firn_enricher_http_refused_host_total", 6.0),
        ("firn_enricher_http_refused_origin_total", 20.0),
        ("firn_enricher_http_refused_token_total", 15.0),
    ] {
        let got = f.metric(name).unwrap_or(0.0);
        assert!(got >= at_least, "{name} = {got}");
    }
}

/// What the watcher saw of the enricher: its peak RSS (VmHWM), the most anonymous and
/// file-backed resident memory sampled (RssAnon, RssFile, KiB: which kind a peak is
/// tells heap from mapped files), and the most threads.
struct Watched {
    hwm_kib: u64,
    anon_kib: u64,
    file_kib: u64,
    threads: u64,
}

/// Samples the enricher every 100 ms while `running`.
fn watch(pid: u32, running: Arc<AtomicBool>) -> std::thread::JoinHandle<Watched> {
    std::thread::spawn(move || {
        let mut w = Watched {
            hwm_kib: 0,
            anon_kib: 0,
            file_kib: 0,
            threads: 0,
        };
        while running.load(Ordering::Relaxed) {
            let t = status_field(pid, "Threads")
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
            w.threads = w.threads.max(t);
            w.anon_kib = w.anon_kib.max(status_kib(pid, "RssAnon").unwrap_or(0));
            w.file_kib = w.file_kib.max(status_kib(pid, "RssFile").unwrap_or(0));
            std::thread::sleep(Duration::from_millis(100));
        }
        w.hwm_kib = status_kib(pid, "VmHWM").unwrap_or(0);
        w
    })
}

#[test]
fn sixty_four_view_clients_stay_under_the_pod_limit_and_rounds_keep_coming() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start("http-load", &["--frequency", "99", "--round", "2"]);
    // Watched from its start: the tables of a build beside it come at any time.
    let enricher = f.enricher.as_ref().unwrap().pid();
    let running = Arc::new(AtomicBool::new(true));
    let watcher = watch(enricher, running.clone());
    // Work with many distinct stacks, so that each view has a tree to build.
    let mut busy = start_workload(&workload("busy"), &["40"]);
    let mut chain = start_workload(&workload("chain"), &["40"]);
    let pid = busy.pid();
    assert!(
        f.wait_profiles(pid, 3, 20 * SECS).len() >= 3,
        "no profiles before the load"
    );
    let base_kib = status_kib(enricher, "VmRSS").unwrap_or(0);
    let rounds_before = pid_rounds(&f.out, pid).len();

    let answered = Arc::new(AtomicU64::new(0));
    let busy_answers = Arc::new(AtomicU64::new(0));
    let load = Duration::from_secs(20);
    let clients: Vec<_> = (0..64)
        .map(|i| {
            let (addr, auth) = (f.http.clone(), bearer(&f));
            let (answered, busy_answers) = (answered.clone(), busy_answers.clone());
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let mut codes = Vec::new();
                while t0.elapsed() < load {
                    // Half the clients ask for the view, half for the host's pprof.
                    let path = if i % 2 == 0 {
                        "/api/view?minutes=60"
                    } else {
                        "/pprof/cpu?seconds=3600"
                    };
                    let (status, _) = http_get_with(&addr, path, std::slice::from_ref(&auth));
                    match status {
                        200 => answered.fetch_add(1, Ordering::Relaxed),
                        503 => busy_answers.fetch_add(1, Ordering::Relaxed),
                        _ => 0,
                    };
                    codes.push(status);
                }
                codes
            })
        })
        .collect();
    let mut statuses = std::collections::BTreeMap::<u16, u64>::new();
    for c in clients {
        for s in c.join().unwrap() {
            *statuses.entry(s).or_default() += 1;
        }
    }
    running.store(false, Ordering::Relaxed);
    let Watched {
        hwm_kib: peak_kib,
        anon_kib,
        file_kib,
        threads,
    } = watcher.join().unwrap();
    let rounds_during = pid_rounds(&f.out, pid).len() - rounds_before;
    let lag = f
        .metric("firn_enricher_round_lag_seconds")
        .unwrap_or(f64::MAX);
    eprintln!(
        "64 clients for {load:?}: answers {statuses:?}; enricher RSS {base_kib} KiB before, \
         peak {peak_kib} KiB (RssAnon at most {anon_kib}, RssFile {file_kib}), at most \
         {threads} threads; {rounds_during} rounds written meanwhile, lag after {lag:.3} s"
    );
    // What the tables cost meanwhile (a build beside the test brings many binaries).
    let tables: Vec<String> = [
        "unwind_tables_built",
        "unwind_tables_sent",
        "unwind_tables_refused",
        "unwind_table_cache_hits",
        "unwind_table_cache_misses",
    ]
    .iter()
    .map(|n| {
        let v = f
            .metric(&format!("firn_enricher_{n}_total"))
            .unwrap_or(-1.0);
        format!("{n} {v}")
    })
    .collect();
    eprintln!("tables: {}", tables.join(", "));
    busy.wait_exit(60 * SECS);
    chain.wait_exit(60 * SECS);
    assert!(
        answered.load(Ordering::Relaxed) > 0,
        "no client was answered: {statuses:?}"
    );
    assert!(
        statuses.keys().all(|s| [200, 503].contains(s)),
        "answers other than 200 and 503: {statuses:?}"
    );
    assert!(
        peak_kib < POD_LIMIT_KIB,
        "the enricher peaked at {peak_kib} KiB, over the pod's limit"
    );
    // Two costly queries at a time: the event loop, the sampler link and a few
    // runtime threads beside them; not one thread per client.
    assert!(threads <= 24, "{threads} threads for 64 clients");
    // Rounds of 2 s: 10 in the load; a few may land just after it.
    assert!(
        rounds_during >= 7,
        "only {rounds_during} rounds written during the load"
    );
    assert!(lag < 2.0, "round lag {lag} s after the load");
}

#[test]
fn connections_past_the_limit_are_closed_and_idle_ones_time_out() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start_with("http-conns", &["--round", "2"], |_| {
        strs(&["--http-max-connections", "8"])
    });
    assert!(wait_until(20 * SECS, || f.get("/healthz").0 == 200));
    // 8 idle connections hold every slot; the next ones are closed at once.
    let idle: Vec<TcpStream> = (0..8)
        .map(|_| TcpStream::connect(&f.http).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut closed = 0;
    for _ in 0..8 {
        let mut s = TcpStream::connect(&f.http).unwrap();
        s.set_read_timeout(Some(2 * SECS)).unwrap();
        let _ = write!(s, "GET /healthz HTTP/1.1\r\nHost: {}\r\n\r\n", f.http);
        let mut buf = [0u8; 64];
        if matches!(s.read(&mut buf), Ok(0) | Err(_)) {
            closed += 1;
        }
    }
    assert_eq!(closed, 8, "connections past the limit were served");
    // Idle connections (no request sent) end after the header timeout, freeing slots.
    let t0 = Instant::now();
    for mut s in idle {
        s.set_read_timeout(Some(30 * SECS)).unwrap();
        let mut buf = [0u8; 64];
        let _ = s.read(&mut buf);
    }
    let held = t0.elapsed();
    assert!(held < 20 * SECS, "idle connections were kept {held:?}");
    assert!(
        wait_until(5 * SECS, || f.get("/healthz").0 == 200),
        "no slot came back after the idle ones ended"
    );
    let refused = f
        .metric("firn_enricher_http_connections_refused_total")
        .unwrap_or(0.0);
    assert!(refused >= 8.0, "refused connections counted {refused}");
}

#[test]
fn the_enricher_s_own_profile_answers_only_when_turned_on() {
    if !can_run_bpf() {
        return;
    }
    let f = Firn::start_with("http-self", &["--round", "2"], |_| {
        strs(&["--http-self-profile"])
    });
    assert!(wait_until(20 * SECS, || f.get("/healthz").0 == 200));
    assert_eq!(http_get(&f.http, "/debug/pprof/profile?seconds=1").0, 401);
    let dir = f.dir.path().join("self");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("self.pb.gz");
    let (status, body) = f.get("/debug/pprof/profile?seconds=2");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    std::fs::write(&file, body).unwrap();
    // go tool pprof reads it: a CPU profile of the enricher itself.
    let top = go_pprof(&["-raw", "-symbolize=none"], &[file]);
    assert!(top.contains("PeriodType: cpu"), "{top}");
}

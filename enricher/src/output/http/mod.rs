//! The local web view and scrape endpoints.
//!
//! `/` the page (flame graph, top functions, CPU over time; see `view/`) and its
//! `/api/view` query · `/metrics` Prometheus text · `/healthz` · `/profiles` latest label sets with sample
//! counts · `/profiles/{id}` one pprof · `/pprof/cpu?seconds=N[&label=value…]` a
//! whole-host CPU profile of the last N seconds (what Parca's `scrape_configs` fetch) ·
//! `/debug/pprof/profile?seconds=N` the enricher's own CPU profile (pprof crate).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use firn_schema::now_ns;

pub(crate) mod view;

use super::{layout, Published, Sink};
use crate::metrics::Metrics;
use crate::model::{LabelSet, Round};
use crate::pprof as profile;

/// How far back `/pprof/cpu` can reach.
pub(crate) const MAX_WINDOW: Duration = Duration::from_secs(3600);
/// Rounds kept for `/pprof/cpu` at most, whatever their length.
const MAX_ROUNDS: usize = 720;
/// Stack entries kept for `/pprof/cpu` at most, over all kept rounds: the memory bound
/// (a few tens of MiB of symbolized frames). Past it the oldest rounds go first, so on a
/// busy or churning node the window reaches back less than `MAX_WINDOW`.
const MAX_RECENT_STACKS: usize = 20_000;
/// Rounds a label set stays in `/profiles` after its last profile.
const LATEST_ROUNDS: u64 = 6;

pub(crate) struct Latest {
    pub(crate) id: String,
    pub(crate) labels: Arc<LabelSet>,
    pub(crate) samples: i64,
    pub(crate) round: u64,
    pub(crate) gz: Arc<Vec<u8>>,
}

#[derive(Default)]
pub(crate) struct Inner {
    pub(crate) latest: Vec<Latest>,
    pub(crate) recent: VecDeque<Arc<Round>>,
    /// Stack entries over `recent`.
    pub(crate) recent_stacks: usize,
    pub(crate) last_batch: Option<SystemTime>,
    pub(crate) round_seconds: u32,
    /// End of the newest round dropped for the stack bound (not for age).
    pub(crate) evicted_through_ns: u64,
}

pub(crate) struct Shared {
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) inner: Mutex<Inner>,
    profiling: AtomicBool,
    /// The local sink's directory, for `/rounds/<round>/<file>` (the OpenSearch
    /// documents' pprof links).
    output_dir: std::path::PathBuf,
}

impl Shared {
    pub(crate) fn new(metrics: Arc<Metrics>, output_dir: std::path::PathBuf) -> Arc<Self> {
        Arc::new(Self {
            metrics,
            inner: Mutex::new(Inner::default()),
            profiling: AtomicBool::new(false),
            output_dir,
        })
    }

    /// The sampler's round length (for /healthz's idea of a stale batch).
    pub(crate) fn set_round_seconds(&self, secs: u32) {
        if let Ok(mut g) = self.inner.lock() {
            g.round_seconds = secs;
        }
    }

    /// Publishes a finished round: its profiles replace those of the same label sets,
    /// label sets unseen for a few rounds leave `/profiles`.
    pub(crate) fn publish(&self, round: Arc<Round>, latest: Vec<Latest>) {
        let Ok(mut g) = self.inner.lock() else { return };
        let now = round.round;
        g.latest.retain(|l| {
            now.saturating_sub(l.round) < LATEST_ROUNDS
                && !latest.iter().any(|n| n.labels == l.labels)
        });
        g.latest.extend(latest);
        g.latest.sort_by_key(|l| std::cmp::Reverse(l.samples));
        g.last_batch = Some(SystemTime::now());
        let horizon = now_ns().saturating_sub(MAX_WINDOW.as_nanos() as u64);
        g.recent_stacks += round.stacks.len();
        g.recent.push_back(round);
        loop {
            let too_old = g.recent.front().is_some_and(|r| r.end_ns < horizon);
            let too_big = g.recent.len() > 1
                && (g.recent.len() > MAX_ROUNDS || g.recent_stacks > MAX_RECENT_STACKS);
            if !(too_old || too_big) {
                break;
            }
            let Some(old) = g.recent.pop_front() else {
                break;
            };
            g.recent_stacks -= old.stacks.len();
            if !too_old {
                g.evicted_through_ns = g.evicted_through_ns.max(old.end_ns);
                Metrics::inc(&self.metrics.window_rounds_evicted);
                tracing::info!(
                    round = old.round,
                    "/pprof/cpu window over its stack bound; oldest round left out"
                );
            }
        }
    }
}

/// The sink that publishes each round to the HTTP endpoints.
pub(crate) fn sink(state: &Arc<Shared>) -> Box<dyn Sink> {
    Box::new(HttpSink(state.clone()))
}

struct HttpSink(Arc<Shared>);

impl Sink for HttpSink {
    fn round(&mut self, p: &Published<'_>) {
        let latest = p
            .profiles
            .iter()
            .map(|e| Latest {
                id: p.layout.id(e.group),
                labels: e.labels.clone(),
                samples: e.samples,
                round: p.round.round,
                gz: e.gz.clone(),
            })
            .collect();
        self.0.publish(p.round.clone(), latest);
    }
}

pub(crate) fn router(state: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/static/app.js", get(script))
        .route("/static/style.css", get(style))
        .route("/api/view", get(view))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/profiles", get(list))
        .route("/profiles/{id}", get(one))
        .route("/rounds/{round}/{file}", get(round_file))
        .route("/pprof/cpu", get(host_cpu))
        .route("/debug/pprof/profile", get(self_profile))
        .route("/symbolz", get(symbolz).post(symbolz))
        .with_state(state)
}

/// `go tool pprof URL` asks the server of a profile to name the frames the profile left
/// as addresses (remote symbolization, POST of addresses; a 404 made it exit 1). The
/// enricher already named every frame it could, so it answers that it knows no more
/// (gperftools' `num_symbols: 0`, and no symbol lines): pprof keeps those addresses.
async fn symbolz(State(s): State<Arc<Shared>>) -> Response {
    count(&s);
    ([(header::CONTENT_TYPE, "text/plain")], "num_symbols: 0\n").into_response()
}

/// Everything the page loads comes from here: no inline script, no other origin.
const CSP: &str = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'";

async fn page(State(s): State<Arc<Shared>>) -> Response {
    count(&s);
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CSP),
        ],
        view::PAGE,
    )
        .into_response()
}

async fn script(State(s): State<Arc<Shared>>) -> Response {
    count(&s);
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        view::SCRIPT,
    )
        .into_response()
}

async fn style(State(s): State<Arc<Shared>>) -> Response {
    count(&s);
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        view::STYLE,
    )
        .into_response()
}

/// The page's query: the window's call tree, top functions, CPU per round, processes.
async fn view(State(s): State<Arc<Shared>>, Query(q): Query<HashMap<String, String>>) -> Response {
    count(&s);
    let q = match view::Query::parse(&q) {
        Ok(q) => q,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    let now = now_ns();
    let from = now.saturating_sub(q.minutes * 60 * 1_000_000_000);
    let (rounds, shortened): (Vec<Arc<Round>>, bool) = match s.inner.lock() {
        Ok(g) => (
            g.recent
                .iter()
                .filter(|r| r.end_ns > from)
                .cloned()
                .collect(),
            g.evicted_through_ns > from,
        ),
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    // The tree of 20,000 stacks takes milliseconds; off the event loop all the same.
    let built = tokio::task::spawn_blocking(move || view::build(&rounds, &q, from, now, shortened));
    match built.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn count(s: &Shared) {
    Metrics::inc(&s.metrics.http_requests);
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    count(&s);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

async fn healthz(State(s): State<Arc<Shared>>) -> Response {
    count(&s);
    let Ok(g) = s.inner.lock() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let stale = Duration::from_secs(u64::from(g.round_seconds.max(10)) * 3);
    match g.last_batch.map(|t| t.elapsed().unwrap_or_default()) {
        Some(age) if age > stale => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("no batch from the sampler for {}s\n", age.as_secs()),
        )
            .into_response(),
        Some(age) => format!("ok: last batch {}s ago\n", age.as_secs()).into_response(),
        None => "ok: waiting for the first batch\n".into_response(),
    }
}

async fn list(State(s): State<Arc<Shared>>) -> Response {
    count(&s);
    let Ok(g) = s.inner.lock() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let items: Vec<serde_json::Value> = g
        .latest
        .iter()
        .map(|l| {
            serde_json::json!({
                "id": l.id,
                "round": l.round,
                "samples": l.samples,
                "labels": l.labels.iter().cloned().collect::<HashMap<String, String>>(),
                "url": format!("/profiles/{}", l.id),
            })
        })
        .collect();
    axum::Json(items).into_response()
}

async fn one(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    count(&s);
    let found = s
        .inner
        .lock()
        .ok()
        .and_then(|g| g.latest.iter().find(|l| l.id == id).map(|l| l.gz.clone()));
    match found {
        Some(gz) => (
            [(header::CONTENT_TYPE, "application/octet-stream")],
            gz.as_ref().clone(),
        )
            .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            "no such profile among the latest (see /profiles)\n",
        )
            .into_response(),
    }
}

/// A round's pprof file from the local sink's directory, while retention keeps it. Both
/// names are checked against the sink's own patterns: no other file can be named.
async fn round_file(
    State(s): State<Arc<Shared>>,
    Path((round, file)): Path<(String, String)>,
) -> Response {
    count(&s);
    let round_ok = layout::is_round_folder(&round);
    let file_ok = layout::is_profile_file(&file);
    let dir = &s.output_dir;
    if !round_ok || !file_ok {
        return (
            StatusCode::BAD_REQUEST,
            "give /rounds/<YYYYMMDDTHHMMSSZ-rNNNNNN>/<name>.pb.gz, as the index lists them\n",
        )
            .into_response();
    }
    // Files of one round are small (one process), read at once.
    match std::fs::read(dir.join(&round).join(&file)) {
        Ok(bytes) => (
            [
                (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                (
                    header::CONTENT_DISPOSITION,
                    format!("attachment; filename=\"{round}-{file}\""),
                ),
            ],
            bytes,
        )
            .into_response(),
        Err(_) => (
            StatusCode::NOT_FOUND,
            "no such round file (retention may have removed it)\n",
        )
            .into_response(),
    }
}

/// The `seconds` parameter, or the message for a 400.
fn seconds(q: &HashMap<String, String>, default: u64, max: u64) -> Result<u64, String> {
    match q.get("seconds") {
        None => Ok(default),
        Some(v) => match v.parse::<u64>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => Err(format!("seconds must be an integer from 1 to {max}\n")),
        },
    }
}

async fn host_cpu(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    count(&s);
    let secs = match seconds(&q, 30, MAX_WINDOW.as_secs()) {
        Ok(n) => n,
        Err(msg) => return (StatusCode::BAD_REQUEST, msg).into_response(),
    };
    let matchers: Vec<(String, String)> = q.into_iter().filter(|(k, _)| k != "seconds").collect();
    let now = now_ns();
    let from = now.saturating_sub(secs * 1_000_000_000);
    let rounds: Vec<Arc<Round>> = match s.inner.lock() {
        Ok(g) => g
            .recent
            .iter()
            .filter(|r| r.end_ns > from)
            .cloned()
            .collect(),
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    let freq = rounds.first().map_or(19, |r| r.frequency_hz);
    let start = rounds
        .first()
        .map_or(from, |r| r.start_ns.min(from.max(r.start_ns)));
    let mut b = profile::Builder::new(freq, start, now);
    for r in &rounds {
        for st in &r.stacks {
            let matches = matchers
                .iter()
                .all(|(k, v)| st.labels.iter().any(|(lk, lv)| lk == k && lv == v));
            if matches {
                b.add(st);
            }
        }
    }
    match profile::encode_gz(&b.finish()) {
        Ok(gz) => ([(header::CONTENT_TYPE, "application/octet-stream")], gz).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn self_profile(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    count(&s);
    let secs = match seconds(&q, 30, 300) {
        Ok(n) => n,
        Err(msg) => return (StatusCode::BAD_REQUEST, msg).into_response(),
    };
    if s.profiling.swap(true, Ordering::AcqRel) {
        return (StatusCode::CONFLICT, "a self-profile is already running\n").into_response();
    }
    let result = tokio::task::spawn_blocking(move || -> Result<Vec<u8>, String> {
        let guard = pprof::ProfilerGuardBuilder::default()
            .frequency(99)
            .blocklist(&["libc", "libgcc", "pthread", "vdso"])
            .build()
            .map_err(|e| e.to_string())?;
        std::thread::sleep(Duration::from_secs(secs));
        let report = guard.report().build().map_err(|e| e.to_string())?;
        let p = report.pprof().map_err(|e| e.to_string())?;
        profile::encode_gz(&p).map_err(|e| e.to_string())
    })
    .await;
    s.profiling.store(false, Ordering::Release);
    match result {
        Ok(Ok(gz)) => ([(header::CONTENT_TYPE, "application/octet-stream")], gz).into_response(),
        Ok(Err(e)) => (StatusCode::INTERNAL_SERVER_ERROR, e).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

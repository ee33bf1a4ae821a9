//! The endpoints' handlers. The costly ones (the view's query, `/pprof/cpu`) run off
//! the event loop, at most [`HEAVY_AT_ONCE`] at a time over all clients.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use firn_schema::now_ns;

use super::{view, Shared, MAX_WINDOW};
use crate::metrics::Metrics;
use crate::model::Round;
use crate::output::layout;
use crate::pprof as profile;

/// Costly queries at once over all clients; the rest wait for their turn.
pub(super) const HEAVY_AT_ONCE: usize = 2;
/// Longest wait for a turn: past it the answer is 503 (the server is busy).
const HEAVY_WAIT: Duration = Duration::from_secs(20);

/// Runs `work` on a blocking thread once a heavy slot is free (503 if none frees in
/// time): many clients cost queued requests, not threads and their trees.
pub(super) async fn heavy<T: Send + 'static>(
    s: &Shared,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Response> {
    let Ok(Ok(permit)) = tokio::time::timeout(HEAVY_WAIT, s.heavy.clone().acquire_owned()).await
    else {
        Metrics::inc(&s.metrics.http_busy);
        return Err((StatusCode::SERVICE_UNAVAILABLE, "busy: try again shortly\n").into_response());
    };
    let out = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        work()
    })
    .await;
    out.map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response())
}

/// `go tool pprof URL` asks the server of a profile to name the frames the profile left
/// as addresses (remote symbolization, POST of addresses; a 404 made it exit 1). The
/// enricher already named every frame it could, so it answers that it knows no more
/// (gperftools' `num_symbols: 0`, and no symbol lines): pprof keeps those addresses.
pub(super) async fn symbolz(State(s): State<Arc<Shared>>) -> Response {
    count(&s);
    ([(header::CONTENT_TYPE, "text/plain")], "num_symbols: 0\n").into_response()
}

/// Everything the page loads comes from here: no inline script, no other origin.
const CSP: &str = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'";

pub(super) async fn page(State(s): State<Arc<Shared>>) -> Response {
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

pub(super) async fn script(State(s): State<Arc<Shared>>) -> Response {
    count(&s);
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        view::SCRIPT,
    )
        .into_response()
}

pub(super) async fn style(State(s): State<Arc<Shared>>) -> Response {
    count(&s);
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        view::STYLE,
    )
        .into_response()
}

/// The page's query: the window's call tree, top functions, CPU per round, processes.
pub(super) async fn view(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
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
    match heavy(&s, move || view::build(&rounds, &q, from, now, shortened)).await {
        Ok(v) => axum::Json(v).into_response(),
        Err(busy) => busy,
    }
}

fn count(s: &Shared) {
    Metrics::inc(&s.metrics.http_requests);
}

pub(super) async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    count(&s);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

pub(super) async fn healthz(State(s): State<Arc<Shared>>) -> Response {
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

pub(super) async fn list(State(s): State<Arc<Shared>>) -> Response {
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

pub(super) async fn one(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
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
pub(super) async fn round_file(
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

pub(super) async fn host_cpu(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    count(&s);
    let secs = match seconds(&q, 30, MAX_WINDOW.as_secs()) {
        Ok(n) => n,
        Err(msg) => return (StatusCode::BAD_REQUEST, msg).into_response(),
    };
    let matchers: Vec<(String, String)> = q
        .into_iter()
        .filter(|(k, _)| k != "seconds" && k != "token")
        .collect();
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
    let built = heavy(&s, move || {
        let freq = rounds.first().map_or(19, |r| r.frequency_hz);
        let start = rounds
            .first()
            .map_or(from, |r| r.start_ns.min(from.max(r.start_ns)));
        let types = match rounds.iter().any(|r| r.off_cpu) {
            true => profile::SampleTypes::OnAndOffCpu,
            false => profile::SampleTypes::OnCpu,
        };
        let mut b = profile::Builder::of(types, freq, start, now);
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
        profile::encode_gz(&b.finish())
    })
    .await;
    match built {
        Ok(Ok(gz)) => ([(header::CONTENT_TYPE, "application/octet-stream")], gz).into_response(),
        Ok(Err(e)) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
        Err(busy) => busy,
    }
}

pub(super) async fn self_profile(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    count(&s);
    if !s.self_profile {
        return (
            StatusCode::NOT_FOUND,
            "the enricher's own profile is off (--http-self-profile turns it on)\n",
        )
            .into_response();
    }
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

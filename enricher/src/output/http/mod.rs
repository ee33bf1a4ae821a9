//! The local web view and scrape endpoints.
//!
//! `/` the page (flame graph, top functions, CPU over time; see `view/`) and its
//! `/api/view` query · `/metrics` Prometheus text · `/healthz` · `/profiles` latest label
//! sets with sample counts · `/profiles/{id}` one pprof · `/rounds/<round>/<file>` a
//! round's pprof file · `/pprof/cpu?seconds=N[&label=value…]` a whole-host CPU profile of
//! the last N seconds (what Parca's `scrape_configs` fetch) · `/debug/pprof/profile`
//! the enricher's own CPU profile, with `--http-self-profile` only.
//!
//! Every request passes [`access`] first (the Host it names, where a browser's request
//! comes from, the bearer token), and [`serve`] bounds connections and their time.

use std::collections::VecDeque;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::routing::get;
use axum::Router;
use firn_schema::now_ns;

mod access;
mod routes;
mod serve;
pub(crate) mod view;

pub(crate) use access::{ensure_token, token_path, view_url, Access};
pub(crate) use serve::serve;

use super::{Published, Sink};
use crate::metrics::Metrics;
use crate::model::{LabelSet, Round};

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
    /// `/debug/pprof/profile` answers (`--http-self-profile`).
    self_profile: bool,
    /// Turns of the costly queries, shared by all clients.
    heavy: Arc<tokio::sync::Semaphore>,
    /// The local sink's directory, for `/rounds/<round>/<file>` (the OpenSearch
    /// documents' pprof links).
    output_dir: std::path::PathBuf,
}

impl Shared {
    pub(crate) fn new(
        metrics: Arc<Metrics>,
        output_dir: std::path::PathBuf,
        self_profile: bool,
    ) -> Arc<Self> {
        Arc::new(Self {
            metrics,
            inner: Mutex::new(Inner::default()),
            profiling: AtomicBool::new(false),
            self_profile,
            heavy: Arc::new(tokio::sync::Semaphore::new(routes::HEAVY_AT_ONCE)),
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

/// Every endpoint, behind the access checks.
pub(crate) fn router(state: Arc<Shared>, access: Arc<Access>) -> Router {
    use routes::*;
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
        .layer(axum::middleware::from_fn_with_state(access, access::check))
        .with_state(state)
}

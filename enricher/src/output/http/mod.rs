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

use std::collections::{HashSet, VecDeque};
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
/// Stack entries kept for `/pprof/cpu` at most, over all kept rounds: bounds a query's
/// work. Past it, or past [`MAX_RECENT_BYTES`], the oldest rounds go first, so on a busy
/// or churning node the window reaches back less than `MAX_WINDOW`.
const MAX_RECENT_STACKS: usize = 20_000;
/// Bytes the kept rounds hold at most, as [`round_bytes`] counts them: bounds memory.
/// Stacks of short-lived processes share neither labels nor mappings: under churn
/// (50 new processes a second) 20,000 of them held about 10 MiB (about 500 bytes each,
/// counted and seen in RSS alike), with the symbolizer's budget the most of the
/// enricher's peak; deep stacks of long-lived ones cost about 1.3 KiB each.
const MAX_RECENT_BYTES: usize = 8 << 20;
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
    /// [`round_bytes`] over `recent`.
    pub(crate) recent_bytes: usize,
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
        {
            // A set, not a scan of `latest` per entry: a node with many label sets
            // (a process label each) made that quadratic every round.
            let fresh: HashSet<&LabelSet> = latest.iter().map(|n| &*n.labels).collect();
            g.latest.retain(|l| {
                now.saturating_sub(l.round) < LATEST_ROUNDS && !fresh.contains(&*l.labels)
            });
        }
        g.latest.extend(latest);
        g.latest.sort_by_key(|l| std::cmp::Reverse(l.samples));
        g.last_batch = Some(SystemTime::now());
        let horizon = now_ns().saturating_sub(MAX_WINDOW.as_nanos() as u64);
        g.recent_stacks += round.stacks.len();
        g.recent_bytes += round_bytes(&round);
        g.recent.push_back(round);
        loop {
            let too_old = g.recent.front().is_some_and(|r| r.end_ns < horizon);
            let too_big = g.recent.len() > 1
                && (g.recent.len() > MAX_ROUNDS
                    || g.recent_stacks > MAX_RECENT_STACKS
                    || g.recent_bytes > MAX_RECENT_BYTES);
            if !(too_old || too_big) {
                break;
            }
            let Some(old) = g.recent.pop_front() else {
                break;
            };
            g.recent_stacks -= old.stacks.len();
            g.recent_bytes = g.recent_bytes.saturating_sub(round_bytes(&old));
            if !too_old {
                g.evicted_through_ns = g.evicted_through_ns.max(old.end_ns);
                Metrics::inc(&self.metrics.window_rounds_evicted);
                tracing::info!(
                    round = old.round,
                    "/pprof/cpu window over its stack or byte bound; oldest round left out"
                );
            }
        }
        (self.metrics.window_bytes)
            .store(g.recent_bytes as u64, std::sync::atomic::Ordering::Relaxed);
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

/// The heap a round holds beyond what it shares with the symbolizer (whose named lines
/// are bounded by `--symbol-frames`): its stacks and frames, and each label set,
/// mapping and mapping text once however many stacks share it. An estimate (allocator
/// overhead as two words an allocation), the same each time it is taken of a round, so
/// that what a round added on entry is what it takes away when it leaves.
pub(crate) fn round_bytes(round: &Round) -> usize {
    use crate::model::{Frame, MappingSpec, StackSample};
    use std::collections::HashSet;
    use std::mem::size_of;
    const ALLOC: usize = 2 * size_of::<usize>();
    let mut labels = HashSet::new();
    let mut mappings = HashSet::new();
    let mut texts = HashSet::new();
    let mut n = round.stacks.capacity() * size_of::<StackSample>();
    for s in &round.stacks {
        n += ALLOC + s.frames.len() * size_of::<Frame>();
        if labels.insert(Arc::as_ptr(&s.labels)) {
            n += ALLOC * 2 + s.labels.capacity() * size_of::<(String, String)>();
            n += s
                .labels
                .iter()
                .map(|(k, v)| k.capacity() + v.capacity() + 2 * ALLOC)
                .sum::<usize>();
        }
        for f in s.frames.iter() {
            if let Frame::User {
                mapping: Some(m), ..
            } = f
            {
                if mappings.insert(Arc::as_ptr(m)) {
                    n += ALLOC + size_of::<MappingSpec>();
                    for t in [&m.file, &m.build_id] {
                        if texts.insert(Arc::as_ptr(t) as *const u8) {
                            n += 2 * ALLOC + t.len();
                        }
                    }
                }
            }
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Frame, MappingSpec, StackSample};

    /// A round of `n` stacks of short-lived processes: a label set and a mapping each.
    fn churn_round(round: u64, n: usize) -> Arc<Round> {
        let stacks = (0..n)
            .map(|i| {
                let labels: LabelSet = ["comm", "executable", "node", "pid", "systemd_unit"]
                    .iter()
                    .map(|k| (k.to_string(), format!("value-{round}-{i}-of-some-length")))
                    .collect();
                let map = Arc::new(MappingSpec {
                    start: 0x1000,
                    limit: 0x2000,
                    offset: 0,
                    file: Arc::from("/usr/lib/x86_64-linux-gnu/libc.so.6"),
                    build_id: Arc::from("00112233445566778899aabbccddeeff00112233"),
                    symbolized: true,
                });
                let frames: Vec<Frame> = (0..8)
                    .map(|a| Frame::User {
                        mapping: Some(map.clone()),
                        address: 0x1000 + a,
                        lines: None,
                    })
                    .collect();
                StackSample {
                    process_id: i as u64,
                    labels: Arc::new(labels),
                    frames: frames.into(),
                    count: 1,
                    off_cpu_ns: 0,
                }
            })
            .collect();
        Arc::new(Round {
            session_id: 1,
            round,
            start_ns: now_ns(),
            end_ns: now_ns(),
            frequency_hz: 99,
            off_cpu: false,
            stacks,
        })
    }

    #[test]
    fn a_shared_label_set_and_mapping_count_once() {
        let one = churn_round(1, 1);
        let mut two = Round {
            stacks: vec![one.stacks[0].clone(), one.stacks[0].clone()],
            ..*churn_round(1, 0)
        };
        two.stacks.shrink_to_fit();
        let extra = round_bytes(&two) - round_bytes(&one);
        let per_stack = std::mem::size_of::<StackSample>()
            + 2 * std::mem::size_of::<usize>()
            + 8 * std::mem::size_of::<Frame>();
        assert_eq!(extra, per_stack);
    }

    #[test]
    fn the_latest_profile_of_a_label_set_replaces_its_last_and_old_ones_expire() {
        let shared = Shared::new(Arc::new(Metrics::default()), std::env::temp_dir(), false);
        let labels = |v: &str| Arc::new(vec![("pid".to_string(), v.to_string())]);
        let latest = |round: u64, v: &str, samples: i64| Latest {
            id: format!("{v}-{round}"),
            labels: labels(v),
            samples,
            round,
            gz: Arc::new(Vec::new()),
        };
        shared.publish(
            churn_round(1, 0),
            vec![latest(1, "a", 5), latest(1, "b", 9)],
        );
        shared.publish(churn_round(2, 0), vec![latest(2, "a", 7)]);
        let ids = |s: &Shared| -> Vec<String> {
            s.inner
                .lock()
                .unwrap()
                .latest
                .iter()
                .map(|l| l.id.clone())
                .collect()
        };
        // One entry a label set, the busiest first.
        assert_eq!(ids(&shared), ["b-1", "a-2"]);
        shared.publish(churn_round(1 + LATEST_ROUNDS, 0), vec![]);
        assert_eq!(ids(&shared), ["a-2"]);
    }

    #[test]
    fn churn_fills_the_window_to_its_byte_bound_not_its_stack_bound() {
        let metrics = Arc::new(Metrics::default());
        let shared = Shared::new(metrics.clone(), std::env::temp_dir(), false);
        // 1,000 stacks a round: fewer than the stack bound over 19 rounds.
        for r in 1..=19 {
            shared.publish(churn_round(r, 1000), vec![]);
        }
        let g = shared.inner.lock().unwrap();
        assert!(g.recent_stacks < MAX_RECENT_STACKS);
        assert!(g.recent_bytes <= MAX_RECENT_BYTES, "{}", g.recent_bytes);
        assert!(g.recent.len() < 19, "{} rounds kept", g.recent.len());
        let evicted = metrics
            .window_rounds_evicted
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(evicted as usize, 19 - g.recent.len());
        let gauge = metrics
            .window_bytes
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(gauge as usize, g.recent_bytes);
    }
}

//! Log set-up shared by both binaries: an `EnvFilter` spec, plain text on stderr, and a
//! rate limit per call site, so a flood of one kind of event (hostile clients, a
//! process storm, a failing disk) cannot flood the journal or cost the sampler CPU.
//! Each call site may log a burst of [`BURST`] lines, then one every
//! [`REFILL`]; what is held back is counted ([`suppressed`]), and both binaries report
//! that count with their other counters.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::callsite::Identifier;
use tracing::{Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Filter, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Lines a call site may log at once.
pub const BURST: f64 = 20.0;
/// Then one line per call site this often.
pub const REFILL: Duration = Duration::from_secs(10);

static SUPPRESSED: AtomicU64 = AtomicU64::new(0);

/// Log lines held back by the rate limit since start.
pub fn suppressed() -> u64 {
    SUPPRESSED.load(Ordering::Relaxed)
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error(
        "invalid log filter {spec:?}: {source} (examples: \"info\", \"warn,firn_sampler=debug\")"
    )]
    Filter {
        spec: String,
        source: tracing_subscriber::filter::ParseError,
    },
    #[error("a global logger is already installed: {0}")]
    Init(#[from] tracing_subscriber::util::TryInitError),
}

/// Installs the global logger: `spec` is an `EnvFilter` directive list.
pub fn init(spec: &str) -> Result<(), LogError> {
    let filter = EnvFilter::try_new(spec).map_err(|source| LogError::Filter {
        spec: spec.to_string(),
        source,
    })?;
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(RateLimit::new(BURST, REFILL));
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .try_init()?;
    Ok(())
}

/// A token bucket: `rate` tokens a second up to `burst`; each allowed event takes one.
/// The one rate limiter of firn: log lines per call site here, and the sampler's call
/// and broker budgets.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    tokens: f64,
    rate: f64,
    burst: f64,
    last: Instant,
}

impl TokenBucket {
    /// Starts full.
    pub fn new(rate: f64, burst: f64) -> Self {
        Self::new_at(rate, burst, Instant::now())
    }

    fn new_at(rate: f64, burst: f64, now: Instant) -> Self {
        Self {
            tokens: burst,
            rate,
            burst,
            last: now,
        }
    }

    /// Whether an event may happen now.
    pub fn allow(&mut self) -> bool {
        self.allow_at(Instant::now())
    }

    /// Whether an event may happen at `now` (not before the last call's `now`).
    pub fn allow_at(&mut self, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// A token bucket per call site. Call sites are static and few (one per `warn!` etc. in
/// the program), so the map is bounded by the program, not by input.
pub struct RateLimit {
    burst: f64,
    per_sec: f64,
    sites: Mutex<HashMap<Identifier, TokenBucket>>,
}

impl RateLimit {
    pub fn new(burst: f64, refill: Duration) -> Self {
        Self {
            burst,
            per_sec: 1.0 / refill.as_secs_f64().max(1e-3),
            sites: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a line from `site` may be written now.
    pub fn allow(&self, site: Identifier, now: Instant) -> bool {
        let Ok(mut sites) = self.sites.lock() else {
            return true;
        };
        let allowed = sites
            .entry(site)
            .or_insert_with(|| TokenBucket::new_at(self.per_sec, self.burst, now))
            .allow_at(now);
        if !allowed {
            SUPPRESSED.fetch_add(1, Ordering::Relaxed);
        }
        allowed
    }
}

impl<S: Subscriber> Filter<S> for RateLimit {
    fn enabled(&self, _meta: &Metadata<'_>, _cx: &Context<'_, S>) -> bool {
        // Decided per event below; spans pass.
        true
    }

    fn callsite_enabled(&self, _meta: &'static Metadata<'static>) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::sometimes()
    }

    fn event_enabled(&self, event: &tracing::Event<'_>, _cx: &Context<'_, S>) -> bool {
        self.allow(event.metadata().callsite(), Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Not zero-sized: call sites are told apart by address.
    struct Site(#[allow(dead_code)] u8);
    impl tracing::callsite::Callsite for Site {
        fn set_interest(&self, _: tracing::subscriber::Interest) {}
        fn metadata(&self) -> &Metadata<'_> {
            unimplemented!()
        }
    }
    static A: Site = Site(1);
    static B: Site = Site(2);

    #[test]
    fn bucket_refills_at_its_rate_up_to_its_burst() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new_at(10.0, 2.0, t0);
        assert!(b.allow_at(t0) && b.allow_at(t0));
        assert!(!b.allow_at(t0));
        assert!(b.allow_at(t0 + Duration::from_millis(100)));
        assert!(!b.allow_at(t0 + Duration::from_millis(100)));
        // Idle for long: no more than the burst.
        let later = t0 + Duration::from_secs(60);
        assert!(b.allow_at(later) && b.allow_at(later));
        assert!(!b.allow_at(later));
    }

    #[test]
    fn burst_then_refill_per_site() {
        let rl = RateLimit::new(3.0, Duration::from_secs(10));
        let t0 = Instant::now();
        let a = || Identifier(&A);
        let before = suppressed();
        assert!((0..3).all(|_| rl.allow(a(), t0)));
        assert!(!rl.allow(a(), t0));
        // Another site has its own budget.
        assert!(rl.allow(Identifier(&B), t0));
        assert!(!rl.allow(a(), t0 + Duration::from_secs(9)));
        assert!(rl.allow(a(), t0 + Duration::from_secs(11)));
        assert!(!rl.allow(a(), t0 + Duration::from_secs(11)));
        assert!(suppressed() >= before + 3);
    }
}

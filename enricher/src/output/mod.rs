//! Outputs: every place a round's profiles go. Each is a [`Sink`]; [`Outputs`] holds the
//! list, groups and encodes a round once (one pprof per label set) and hands the same
//! [`Published`] round to every sink, and reaches every sink at SIGHUP and shutdown.
//!
//! Adding an output is one module with a `start` and one line in [`Outputs::start`].
//! Sinks share what they need through this module (the published round, the names of
//! its profiles in [`layout`], the binaries' files through [`BinaryFiles`]) and the
//! infrastructure beside it ([`delivery`], [`grpc`]); no sink imports another.

pub(crate) mod delivery;
pub(crate) mod group;
pub(crate) mod grpc;
pub(crate) mod http;
pub(crate) mod layout;
mod local;
pub(crate) mod opensearch;
pub(crate) mod otlp;
pub(crate) mod parca;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::metrics::Metrics;
use crate::model::Round;
use crate::settings::{ProfileBy, Settings};
use group::{Encoded, Groups};
use layout::RoundLayout;

/// The files of binaries the enricher holds, by build id (Parca's debuginfo upload
/// sends them).
pub(crate) trait BinaryFiles {
    fn file_of(&self, build_id: &[u8]) -> Option<std::fs::File>;
}

/// One round as every sink receives it: grouped and encoded once.
pub(crate) struct Published<'a> {
    pub(crate) round: &'a Arc<Round>,
    /// Each group's label set and its stacks (indices into `round.stacks`).
    pub(crate) groups: &'a Groups,
    /// The groups' gzip pprof profiles.
    pub(crate) profiles: &'a [Encoded],
    /// Where each group's profile lives (folder, file, id, link).
    pub(crate) layout: &'a RoundLayout,
    pub(crate) binaries: &'a dyn BinaryFiles,
}

pub(crate) type Done<'a> = Pin<Box<dyn Future<Output = ()> + 'a>>;

/// An output. A sink never blocks the round loop: it writes, queues or hands off.
pub(crate) trait Sink {
    /// Takes one round.
    fn round(&mut self, round: &Published<'_>);
    /// SIGHUP: reads what it reads from files again (credentials).
    fn reload(&mut self) {}
    /// At shutdown: has up to `grace` to finish what waits, and keeps the rest for the
    /// next run.
    fn shutdown(&mut self, _grace: Duration) -> Done<'_> {
        Box::pin(async {})
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum OutputError {
    #[error("--otlp-endpoint: {0}")]
    Otlp(grpc::GrpcError),
    #[error("--parca-address: {0}")]
    Parca(grpc::GrpcError),
    #[error("{0}")]
    Credentials(#[from] crate::credentials::CredentialError),
    #[error("{0}")]
    OpenSearch(#[from] opensearch::OpenSearchError),
}

/// Every output that is on.
pub(crate) struct Outputs {
    sinks: Vec<Box<dyn Sink>>,
    by: ProfileBy,
}

impl Outputs {
    /// Starts every configured output (inside the runtime: upload channels connect
    /// lazily, so a backend that is down at start only delays delivery).
    pub(crate) fn start(
        s: &Settings,
        metrics: &Arc<Metrics>,
        http: &Arc<http::Shared>,
    ) -> Result<Self, OutputError> {
        let sinks: Vec<Box<dyn Sink>> = [
            Some(local::start(s, metrics)),
            Some(http::sink(http)),
            otlp::start(s, metrics)?,
            parca::start(s, metrics)?,
            opensearch::start(s, metrics)?,
        ]
        .into_iter()
        .flatten()
        .collect();
        Ok(Self {
            sinks,
            by: s.profile_by,
        })
    }

    /// Groups and encodes `round` once and gives it to every sink.
    pub(crate) fn round(&mut self, round: Round, binaries: &dyn BinaryFiles) {
        let round = Arc::new(round);
        let groups = group::groups(&round, self.by);
        let profiles = group::per_label_set(&round, &groups);
        let layout = RoundLayout::new(&round, &groups);
        let published = Published {
            round: &round,
            groups: &groups,
            profiles: &profiles,
            layout: &layout,
            binaries,
        };
        for sink in &mut self.sinks {
            sink.round(&published);
        }
    }

    pub(crate) fn reload(&mut self) {
        for sink in &mut self.sinks {
            sink.reload();
        }
    }

    /// Every sink's shutdown, at once.
    pub(crate) async fn shutdown(&mut self, grace: Duration) {
        futures::future::join_all(self.sinks.iter_mut().map(|s| s.shutdown(grace))).await;
    }
}

//! The round's first step after the process table: the binaries its user frames lie in
//! that the symbol cache lacks, asked of the sampler's broker.

use super::{dev_of, Enricher, SamplerLink, MAX_OPENS_PER_ROUND, RETRY_ROUNDS};
use crate::batch::Batch;
use crate::broker::BrokerError;
use crate::metrics::Metrics;
use crate::processes::Binary;

impl Enricher {
    /// Asks the broker for binaries this batch needs and the cache lacks.
    pub(super) async fn fetch_binaries<L: SamplerLink>(&mut self, batch: &Batch, link: Option<&L>) {
        let round = batch.round;
        let mut wanted: Vec<(u64, usize)> = Vec::new();
        let mut asked_files = std::collections::HashSet::new();
        for s in &batch.samples {
            let Some(e) = self.processes.get_mut(s.process_id) else {
                continue;
            };
            for &addr in &s.user_frames {
                let Some((idx, m)) = e.mapping_of(addr) else {
                    continue;
                };
                match e.binaries[idx] {
                    Binary::Known(ref id) if self.symbolizer.contains(id) => continue,
                    Binary::Failed { retry_round } if retry_round > round => continue,
                    _ => {}
                }
                let key = (dev_of(m), m.inode);
                if let Some(id) = self.symbolizer.lookup_file(key.0, key.1) {
                    e.binaries[idx] = Binary::Known(id);
                } else if asked_files.insert(key) {
                    wanted.push((s.process_id, idx));
                }
            }
        }
        let Some(link) = link else { return };
        for (pid_id, idx) in wanted.into_iter().take(MAX_OPENS_PER_ROUND) {
            let Some(e) = self.processes.get(pid_id) else {
                continue;
            };
            let version = e.record.mappings_version;
            Metrics::inc(&self.metrics.broker_requests);
            let result = link.open(pid_id, idx as u32, version).await;
            let outcome = match result {
                Ok(fd) => match self.symbolizer.load(fd) {
                    Ok(id) => Binary::Known(id),
                    Err(e) => {
                        tracing::info!(error = %e, "binary not loadable; its frames stay addresses");
                        Binary::Failed {
                            retry_round: round + RETRY_ROUNDS,
                        }
                    }
                },
                Err(BrokerError::Refused(r)) => {
                    Metrics::inc(&self.metrics.broker_refusals);
                    tracing::info!(process_id = pid_id, mapping = idx, reason = ?r, "broker refused; the frames stay addresses");
                    Binary::Failed {
                        retry_round: round + RETRY_ROUNDS,
                    }
                }
                Err(e) => {
                    Metrics::inc(&self.metrics.broker_errors);
                    tracing::warn!(error = %e, "broker request failed");
                    Binary::Failed {
                        retry_round: round + 1,
                    }
                }
            };
            if let Some(e) = self.processes.get_mut(pid_id) {
                if let Some(slot) = e.binaries.get_mut(idx) {
                    *slot = outcome;
                }
            }
        }
    }
}

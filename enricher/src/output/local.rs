//! The local sink: gzip pprof files under the output directory, one folder per round
//! (UTC time in its name) with a JSON-lines index mapping each file to its label set
//! and the sampler session, round and time span it covers;
//! retention by total size and age. A round is written under a temporary name and
//! renamed into place whole, so a reader never sees part of one. When the disk is
//! nearly full or the directory is unwritable, rounds are skipped, counted, logged once,
//! and writing resumes by itself once possible.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::{layout, Published, Sink};
use crate::metrics::Metrics;
use crate::model::Round;

#[derive(Debug, thiserror::Error)]
enum SinkError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("only {free} bytes free under {path}, keeping at least {min}")]
    DiskFull { path: PathBuf, free: u64, min: u64 },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SinkError + 'a {
    move |source| SinkError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

struct Settings {
    dir: PathBuf,
    max_bytes: u64,
    max_age: Duration,
    /// Rounds are skipped while the filesystem has less free space than this.
    min_free_bytes: u64,
}

/// One profile to write: its label set and gzip pprof bytes.
struct Item<'a> {
    labels: &'a crate::model::LabelSet,
    samples: i64,
    gz: &'a [u8],
    name: String,
}

struct LocalSink {
    s: Settings,
    metrics: Arc<Metrics>,
    failing: bool,
}

pub(super) fn start(s: &crate::settings::Settings, metrics: &Arc<Metrics>) -> Box<dyn Sink> {
    Box::new(LocalSink {
        s: Settings {
            dir: s.output_dir.clone(),
            max_bytes: s.retention_size,
            max_age: s.retention_age,
            min_free_bytes: s.min_free,
        },
        metrics: metrics.clone(),
        failing: false,
    })
}

impl Sink for LocalSink {
    fn round(&mut self, p: &Published<'_>) {
        let items: Vec<Item<'_>> = p
            .profiles
            .iter()
            .map(|e| Item {
                labels: &e.labels,
                samples: e.samples,
                gz: &e.gz,
                name: p.layout.file(e.group),
            })
            .collect();
        self.write_round(p.round, p.layout.folder(), &items);
    }
}

impl LocalSink {
    /// Writes one round; on failure nothing of it remains. Then applies retention. A
    /// round without samples writes nothing (an idle machine would leave a folder per
    /// round holding an empty index).
    fn write_round(&mut self, round: &Round, folder: &str, items: &[Item<'_>]) {
        let written = if items.is_empty() {
            Metrics::inc(&self.metrics.rounds_empty);
            None
        } else {
            Some(self.try_write(round, folder, items))
        };
        match written {
            None => {}
            Some(Ok(dir)) => {
                if self.failing {
                    tracing::info!(dir = %self.s.dir.display(), "local sink writing again");
                    self.failing = false;
                }
                Metrics::inc(&self.metrics.rounds_written);
                Metrics::add(&self.metrics.profiles_written, items.len() as u64);
                tracing::debug!(dir = %dir.display(), profiles = items.len(), "round written");
            }
            Some(Err(e)) => {
                if matches!(e, SinkError::DiskFull { .. }) {
                    Metrics::inc(&self.metrics.sink_disk_full);
                } else {
                    Metrics::inc(&self.metrics.sink_errors);
                }
                if !self.failing {
                    tracing::warn!(error = %e, "local sink stopped writing; will retry every round");
                    self.failing = true;
                }
            }
        }
        if let Err(e) = self.retention() {
            tracing::debug!(error = %e, "retention pass failed");
        }
    }

    fn free_bytes(&self) -> Result<u64, SinkError> {
        let st = nix::sys::statvfs::statvfs(&self.s.dir).map_err(|e| SinkError::Io {
            what: "statvfs",
            path: self.s.dir.clone(),
            source: e.into(),
        })?;
        Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
    }

    fn try_write(
        &self,
        round: &Round,
        name: &str,
        items: &[Item<'_>],
    ) -> Result<PathBuf, SinkError> {
        std::fs::create_dir_all(&self.s.dir).map_err(io("creating", &self.s.dir))?;
        let need: u64 = items.iter().map(|i| i.gz.len() as u64).sum::<u64>() + 64 * 1024;
        let free = self.free_bytes()?;
        if free < self.s.min_free_bytes + need {
            return Err(SinkError::DiskFull {
                path: self.s.dir.clone(),
                free,
                min: self.s.min_free_bytes,
            });
        }
        let tmp = self.s.dir.join(format!(".tmp-{name}"));
        let result = (|| {
            std::fs::create_dir(&tmp).map_err(io("creating", &tmp))?;
            let mut index = String::new();
            for item in items {
                let path = tmp.join(&item.name);
                std::fs::write(&path, item.gz).map_err(io("writing", &path))?;
                let labels: serde_json::Map<String, serde_json::Value> = item
                    .labels
                    .iter()
                    .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                    .collect();
                index.push_str(
                    &serde_json::json!({
                        "file": item.name,
                        "labels": labels,
                        "samples": item.samples,
                        "session_id": round.session_id,
                        "round": round.round,
                        "start_ns": round.start_ns,
                        "end_ns": round.end_ns,
                    })
                    .to_string(),
                );
                index.push('\n');
            }
            let idx = tmp.join("index.jsonl");
            std::fs::write(&idx, index).map_err(io("writing", &idx))?;
            let fin = self.s.dir.join(name);
            std::fs::rename(&tmp, &fin).map_err(io("renaming into", &fin))?;
            Ok(fin)
        })();
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        result
    }

    /// Removes the oldest round folders while over the size budget or past the age.
    fn retention(&self) -> Result<(), SinkError> {
        let mut rounds: Vec<(PathBuf, u64, SystemTime)> = Vec::new();
        let rd = std::fs::read_dir(&self.s.dir).map_err(io("listing", &self.s.dir))?;
        for entry in rd.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(".tmp-") {
                // Left by a crash mid-write: never complete, never read.
                let _ = std::fs::remove_dir_all(&path);
                continue;
            }
            if !path.is_dir() || !layout::is_round_folder(&name) {
                continue;
            }
            let size = std::fs::read_dir(&path)
                .map(|d| {
                    d.flatten()
                        .filter_map(|f| f.metadata().ok())
                        .map(|m| m.len())
                        .sum()
                })
                .unwrap_or(0);
            let mtime = entry
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            rounds.push((path, size, mtime));
        }
        rounds.sort_by(|a, b| a.0.cmp(&b.0));
        let mut total: u64 = rounds.iter().map(|r| r.1).sum();
        let now = SystemTime::now();
        for (path, size, mtime) in rounds {
            let old = now.duration_since(mtime).unwrap_or_default() > self.s.max_age;
            if total <= self.s.max_bytes && !old {
                break;
            }
            if std::fs::remove_dir_all(&path).is_ok() {
                total = total.saturating_sub(size);
                Metrics::inc(&self.metrics.sink_retention_removed);
            }
        }
        Ok(())
    }
}

//! The on-disk spool of one sink: one file per request, named by its id, and the id of
//! the last one delivered.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};

use super::Request;

#[derive(Debug, thiserror::Error)]
pub(crate) enum SpoolError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("a request of {size} bytes is larger than the whole spool ({max} bytes)")]
    TooLarge { size: u64, max: u64 },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SpoolError + 'a {
    move |source| SpoolError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// The on-disk spool: one file per request, named by its id.
pub(super) struct Spool {
    pub(super) dir: PathBuf,
    pub(super) max_bytes: u64,
    pub(super) entries: VecDeque<(String, u64)>,
    pub(super) bytes: u64,
    pub(super) delivered: Option<String>,
}

const SUFFIX: &str = ".req";

impl Spool {
    /// Opens (creating) the spool; requests at or below the delivered mark and half-written
    /// files are removed.
    pub(super) fn open(dir: &Path, max_bytes: u64) -> Result<Spool, SpoolError> {
        std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
        let mark = dir.join("delivered");
        let delivered = std::fs::read_to_string(&mark)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty());
        let mut entries = Vec::new();
        for e in std::fs::read_dir(dir)
            .map_err(io("listing", dir))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(".tmp-") {
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            let Some(id) = name.strip_suffix(SUFFIX) else {
                continue;
            };
            if delivered.as_deref().is_some_and(|d| id <= d) {
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            let size = e.metadata().map(|m| m.len()).unwrap_or(0);
            entries.push((id.to_string(), size));
        }
        entries.sort();
        let bytes = entries.iter().map(|e| e.1).sum();
        Ok(Spool {
            dir: dir.to_path_buf(),
            max_bytes,
            entries: entries.into(),
            bytes,
            delivered,
        })
    }

    pub(super) fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}{SUFFIX}"))
    }

    /// Writes a request; the oldest spooled requests make room. Returns how many were
    /// removed for room (to be counted as dropped, whether the write then succeeded).
    pub(super) fn push(&mut self, r: &Request) -> (usize, Result<(), SpoolError>) {
        let size = r.body.len() as u64;
        if size > self.max_bytes {
            let e = SpoolError::TooLarge {
                size,
                max: self.max_bytes,
            };
            return (0, Err(e));
        }
        let mut evicted = 0;
        while self.bytes + size > self.max_bytes {
            let Some((id, _)) = self.entries.front().cloned() else {
                break;
            };
            self.remove(&id);
            evicted += 1;
        }
        let tmp = self.dir.join(format!(".tmp-{}", r.id));
        let fin = self.path(&r.id);
        let written = std::fs::write(&tmp, r.body.as_slice())
            .map_err(io("writing", &tmp))
            .and_then(|()| std::fs::rename(&tmp, &fin).map_err(io("renaming", &fin)));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return (evicted, Err(e));
        }
        self.entries.push_back((r.id.clone(), size));
        self.bytes += size;
        (evicted, Ok(()))
    }

    pub(super) fn read(&self, id: &str) -> Result<Vec<u8>, SpoolError> {
        let p = self.path(id);
        std::fs::read(&p).map_err(io("reading", &p))
    }

    pub(super) fn remove(&mut self, id: &str) -> bool {
        let Some(i) = self.entries.iter().position(|e| e.0 == id) else {
            return false;
        };
        if let Some((_, size)) = self.entries.remove(i) {
            self.bytes -= size;
        }
        let _ = std::fs::remove_file(self.path(id));
        true
    }

    pub(super) fn mark_delivered(&mut self, id: &str) -> Result<(), SpoolError> {
        if self.delivered.as_deref().is_some_and(|d| d >= id) {
            return Ok(());
        }
        let tmp = self.dir.join(".tmp-delivered");
        let fin = self.dir.join("delivered");
        std::fs::write(&tmp, id).map_err(io("writing", &tmp))?;
        std::fs::rename(&tmp, &fin).map_err(io("renaming", &fin))?;
        self.delivered = Some(id.to_string());
        Ok(())
    }
}

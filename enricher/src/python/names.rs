//! Names of Python frames: the code blobs the BPF walk copied (Batch.pythonCode),
//! decoded and kept by code id, and a tagged frame turned into its function, file and
//! line. The blobs are bytes of the profiled process: every length is bounded by the
//! blob's own parse, names are shown as the process wrote them (lossy UTF-8), and a
//! frame whose code object is not known is named as such, never guessed.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use firn_schema::python_code::{code_flags, frame, CodeBlob};

use super::lines::{line_at, Format};
use crate::model::Line;

/// Bytes of decoded code objects kept (names and line tables); the least recently
/// used go first (the sampler sends a code object's names once).
pub const MAX_BYTES: usize = 32 << 20;
/// What one entry costs beyond its bytes.
const ENTRY_OVERHEAD: usize = 96;

/// One code object, decoded.
#[derive(Debug)]
struct Code {
    name: Arc<str>,
    file: Arc<str>,
    first_line: u32,
    format: Option<Format>,
    table: Box<[u8]>,
    /// The last round (`Names::tick`) a frame was named from it.
    used: AtomicU64,
}

impl Code {
    fn cost(&self) -> usize {
        ENTRY_OVERHEAD + self.name.len() + self.file.len() + self.table.len()
    }
}

/// What became of a blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Taken {
    New,
    Known,
    Malformed,
}

/// The code objects met, by id (ids are seeded per sampler run and per process, so a
/// new sampler session starts over).
#[derive(Debug, Default)]
pub struct Names {
    codes: HashMap<u64, Arc<Code>>,
    order: VecDeque<u64>,
    bytes: usize,
    /// Rounds seen ([`Names::next_round`]).
    tick: u64,
    evicted: u64,
}

impl Names {
    pub fn len(&self) -> usize {
        self.codes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.codes.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Code objects dropped for room since the start.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// A new round: entries used in this one or the last are kept over older ones.
    pub fn next_round(&mut self) {
        self.tick += 1;
    }

    /// A new sampler session: its ids mean other code objects.
    pub fn clear(&mut self) {
        self.codes.clear();
        self.order.clear();
        self.bytes = 0;
        self.tick = 0;
    }

    /// Decodes one blob and keeps it.
    pub fn take(&mut self, blob: &[u8]) -> Taken {
        let Some(b) = CodeBlob::parse(blob) else {
            return Taken::Malformed;
        };
        if self.codes.contains_key(&b.id) {
            return Taken::Known;
        }
        let text = |bytes: &[u8], cut: bool, what: &str| -> Arc<str> {
            if bytes.is_empty() {
                return Arc::from(what);
            }
            let mut s = String::from_utf8_lossy(bytes).into_owned();
            if cut {
                s.push('…');
            }
            Arc::from(s.as_str())
        };
        let unnamed = if b.flags & code_flags::NOT_ASCII != 0 {
            "[python: name not ASCII]"
        } else {
            "[python: no name]"
        };
        let code = Code {
            name: text(b.name, b.flags & code_flags::NAME_CUT != 0, unnamed),
            file: text(b.file, b.flags & code_flags::FILE_CUT != 0, ""),
            first_line: b.first_line,
            format: Format::of_minor(b.minor),
            table: b.table.into(),
            used: AtomicU64::new(self.tick),
        };
        self.bytes += code.cost();
        self.codes.insert(b.id, Arc::new(code));
        self.order.push_back(b.id);
        // Oldest first, but one used lately gets another turn (a few a call, so that a
        // cache of code all in use costs no pass over it per blob).
        let mut turns = self.order.len().min(64);
        while self.bytes > MAX_BYTES {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            let recent = self
                .codes
                .get(&old)
                .is_some_and(|c| c.used.load(Ordering::Relaxed) + 1 >= self.tick);
            if recent && turns > 0 {
                turns -= 1;
                self.order.push_back(old);
                continue;
            }
            if let Some(c) = self.codes.remove(&old) {
                self.bytes -= c.cost();
                self.evicted += 1;
            }
        }
        Taken::New
    }

    /// The function, file and line of a Python frame; `None` when its code object is
    /// not known here.
    pub fn line(&self, entry: u64) -> Option<Line> {
        let (id, index) = frame::parts(entry);
        let c = self.codes.get(&id)?;
        c.used.store(self.tick, Ordering::Relaxed);
        let first = i32::try_from(c.first_line).unwrap_or(0);
        let line = c
            .format
            .and_then(|f| line_at(f, &c.table, first, index.saturating_mul(2)))
            .unwrap_or(c.first_line);
        Some(Line {
            function: c.name.clone(),
            file: c.file.clone(),
            line,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(id: u64, name: &'static [u8], table: &'static [u8]) -> Vec<u8> {
        CodeBlob {
            id,
            first_line: 10,
            minor: 10,
            flags: 0,
            name,
            file: b"/srv/app.py",
            table,
        }
        .to_bytes()
    }

    #[test]
    fn frames_are_named_from_their_blobs() {
        let mut n = Names::default();
        // 3.10 pairs: 4 bytes of bytecode on line 10, then 6 on line 12.
        assert_eq!(n.take(&blob(5, b"K.method", &[4, 0, 6, 2])), Taken::New);
        assert_eq!(n.take(&blob(5, b"K.method", &[])), Taken::Known);
        assert_eq!(n.take(&[1, 2, 3]), Taken::Malformed);
        let entry = |index: u64| frame::TAG | 5 << frame::INDEX_BITS | index;
        let l = n.line(entry(3)).expect("named");
        assert_eq!(
            (&*l.function, &*l.file, l.line),
            ("K.method", "/srv/app.py", 12)
        );
        assert_eq!(n.line(entry(0)).map(|l| l.line), Some(10));
        // Past the table: the function's first line rather than a guess.
        assert_eq!(n.line(entry(500)).map(|l| l.line), Some(10));
        assert!(n.line(frame::TAG | 6 << frame::INDEX_BITS).is_none());
    }

    #[test]
    fn the_cache_is_bounded() {
        let mut n = Names::default();
        static TABLE: [u8; 3584] = [0; 3584];
        let mut id = 0;
        while n.bytes() <= MAX_BYTES - 8192 {
            id += 1;
            n.take(&blob(id, b"f", &TABLE));
        }
        // Two rounds on, the first code object is still in use; the second is not.
        n.next_round();
        n.next_round();
        assert!(n.line(frame::TAG | 1 << frame::INDEX_BITS).is_some());
        for _ in 0..100 {
            id += 1;
            n.take(&blob(id, b"f", &TABLE));
        }
        assert!(n.bytes() <= MAX_BYTES);
        assert!(n.evicted() >= 90);
        assert!(
            n.line(frame::TAG | 1 << frame::INDEX_BITS).is_some(),
            "in use: kept"
        );
        assert!(
            n.line(frame::TAG | 2 << frame::INDEX_BITS).is_none(),
            "oldest gone"
        );
        assert!(n.line(frame::TAG | id << frame::INDEX_BITS).is_some());
    }
}

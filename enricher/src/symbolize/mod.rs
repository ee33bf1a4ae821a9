//! User-frame symbolization with blazesym, on files the sampler brokered.
//!
//! Binaries are cached by identity (build id, else device + inode + size + mtime),
//! shared by every process that maps them, in a bounded LRU. Each cached binary keeps
//! its fd open and is known to blazesym as `/proc/self/fd/N`; eviction tells blazesym to
//! forget that path before the fd (and so the number) is released. A frame that cannot
//! be symbolized gets no name here, never a guessed one.
//!
//! blazesym parses whatever ELF and DWARF a binary carries; fuzzing found inputs on
//! which it panics (an unchecked file index in its line tables). Its calls run
//! [`contained`]: a panic there is caught and counted, the binary is marked poisoned
//! (its frames stay addresses, it is never parsed again), and the enricher lives.

use std::cell::Cell;
use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{CodeInfo, Input, Sym, Symbolized};
use nix::sys::stat::fstat;

use crate::metrics::Metrics;

/// Frames remembered per binary before its frame cache is cleared.
const MAX_FRAMES_PER_BINARY: usize = 1 << 16;

#[derive(Debug, thiserror::Error)]
pub enum SymError {
    #[error("stat of the brokered file: {0}")]
    Stat(nix::errno::Errno),
    #[error("reading the ELF file: {0}")]
    Elf(blazesym::Error),
    #[error("the ELF parser panicked on this file (malformed)")]
    Panicked,
}

thread_local! {
    static CONTAINED: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is inside [`contained`]: a panic hook may stay quiet, since
/// the panic is caught, counted and logged there.
pub fn panic_is_contained() -> bool {
    CONTAINED.with(Cell::get)
}

/// Runs `f`, turning a panic into None.
pub fn contained<T>(f: impl FnOnce() -> T) -> Option<T> {
    let outer = CONTAINED.with(|c| c.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CONTAINED.with(|c| c.set(outer));
    r.ok()
}

/// Identity of a binary: its build id when it has one, else the file's identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BinaryId {
    BuildId(Vec<u8>),
    File {
        dev: u64,
        ino: u64,
        size: i64,
        mtime: i64,
    },
}

/// One pprof line: a function (possibly inlined) at a source position.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Line {
    pub function: Arc<str>,
    pub file: Arc<str>,
    pub line: u32,
}

/// The lines of one frame, innermost (most deeply inlined) first, the function that
/// holds the code last (pprof's order).
pub type Lines = Arc<[Line]>;

struct Loaded {
    /// Keeps `/proc/self/fd/N` naming this file while blazesym may open it.
    _fd: OwnedFd,
    path: PathBuf,
    build_id: Option<Vec<u8>>,
    /// No `.symtab` section (None: not an ELF file object could read).
    stripped: Option<bool>,
    frames: HashMap<u64, Option<Lines>>,
    /// The parser panicked on this file once: never parse it again.
    poisoned: bool,
}

pub struct Symbolizer {
    inner: blazesym::symbolize::Symbolizer,
    binaries: lru::LruCache<BinaryId, Loaded>,
    by_file: HashMap<(u64, u64), BinaryId>,
    metrics: Arc<Metrics>,
}

impl Symbolizer {
    pub fn new(capacity: usize, metrics: Arc<Metrics>) -> Self {
        let inner = blazesym::symbolize::Symbolizer::builder()
            // Paths are our own fds, which do not change under us.
            .enable_auto_reload(false)
            .enable_code_info(true)
            .enable_inlined_fns(true)
            .enable_demangling(true)
            .build();
        Self {
            inner,
            binaries: lru::LruCache::new(
                NonZeroUsize::new(capacity.max(1)).unwrap_or(NonZeroUsize::MIN),
            ),
            by_file: HashMap::new(),
            metrics,
        }
    }

    /// The cached binary for a mapping's device and inode, if one is loaded.
    pub fn lookup_file(&mut self, dev: u64, ino: u64) -> Option<BinaryId> {
        let id = self.by_file.get(&(dev, ino))?.clone();
        self.binaries.contains(&id).then_some(id)
    }

    pub fn build_id(&self, id: &BinaryId) -> Option<&[u8]> {
        self.binaries.peek(id).and_then(|b| b.build_id.as_deref())
    }

    /// Whether the binary lacks a symbol table (`.symtab`).
    pub fn stripped(&self, id: &BinaryId) -> Option<bool> {
        self.binaries.peek(id).and_then(|b| b.stripped)
    }

    pub fn len(&self) -> usize {
        self.binaries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.binaries.is_empty()
    }

    /// Whether `id` is still cached (not evicted).
    pub fn contains(&self, id: &BinaryId) -> bool {
        self.binaries.contains(id)
    }

    /// Adds a brokered file to the cache and returns its identity.
    pub fn load(&mut self, fd: OwnedFd) -> Result<BinaryId, SymError> {
        let st = fstat(&fd).map_err(SymError::Stat)?;
        let path = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        let build_id = contained(|| blazesym::helper::read_elf_build_id(&path))
            .ok_or_else(|| self.panicked(None))?
            .map_err(|e| {
                Metrics::inc(&self.metrics.binary_load_errors);
                SymError::Elf(e)
            })?
            .map(|b| b.into_owned());
        let dev = st.st_dev;
        let ino = st.st_ino;
        let id = match &build_id {
            Some(b) if !b.is_empty() => BinaryId::BuildId(b.clone()),
            _ => BinaryId::File {
                dev,
                ino,
                size: st.st_size,
                mtime: st.st_mtime,
            },
        };
        self.by_file.insert((dev, ino), id.clone());
        if self.binaries.contains(&id) {
            // The same binary reached through another file (e.g. another container
            // layer): the cached copy serves, this fd closes.
            return Ok(id);
        }
        Metrics::inc(&self.metrics.binaries_loaded);
        let stripped = std::fs::File::open(&path)
            .ok()
            .and_then(|f| contained(|| lacks_symtab(f)).flatten());
        let loaded = Loaded {
            _fd: fd,
            path,
            build_id,
            stripped,
            frames: HashMap::new(),
            poisoned: false,
        };
        if let Some((old_id, old)) = self.binaries.push(id.clone(), loaded) {
            if old_id != id {
                self.evicted(&old_id, old);
            }
        }
        Ok(id)
    }

    /// Counts and logs a contained parser panic; returns the load error for it.
    fn panicked(&self, id: Option<&BinaryId>) -> SymError {
        Metrics::inc(&self.metrics.symbolizer_panics);
        tracing::warn!(
            binary = ?id,
            "the symbolizer panicked on a malformed binary; its frames stay addresses"
        );
        SymError::Panicked
    }

    fn evicted(&mut self, id: &BinaryId, old: Loaded) {
        Metrics::inc(&self.metrics.binaries_evicted);
        let evict = blazesym::symbolize::evict::Elf::new(old.path.clone());
        if let Err(e) = self.inner.evict(&evict.into()) {
            tracing::debug!(error = %e, "blazesym eviction");
        }
        self.by_file.retain(|_, v| v != id);
        drop(old);
    }

    /// Lines for each file offset (None: no symbol covers it).
    pub fn symbolize(&mut self, id: &BinaryId, offsets: &[u64]) -> Vec<Option<Lines>> {
        let Some(bin) = self.binaries.get_mut(id) else {
            return vec![None; offsets.len()];
        };
        if bin.poisoned {
            return vec![None; offsets.len()];
        }
        let mut misses: Vec<u64> = offsets
            .iter()
            .copied()
            .filter(|o| !bin.frames.contains_key(o))
            .collect();
        misses.sort_unstable();
        misses.dedup();
        Metrics::add(
            &self.metrics.symbol_cache_hits,
            (offsets.len() - misses.len().min(offsets.len())) as u64,
        );
        if !misses.is_empty() {
            Metrics::add(&self.metrics.symbol_cache_misses, misses.len() as u64);
            if bin.frames.len() + misses.len() > MAX_FRAMES_PER_BINARY {
                bin.frames.clear();
            }
            let src = Source::Elf(Elf::new(bin.path.clone()));
            let inner = &self.inner;
            let result = contained(|| {
                inner
                    .symbolize(&src, Input::FileOffset(&misses))
                    .map(|r| r.into_iter().map(owned_lines).collect::<Vec<_>>())
            });
            let Some(result) = result else {
                bin.poisoned = true;
                bin.frames.clear();
                let path = bin.path.clone();
                self.panicked(Some(id));
                // Its half-parsed state goes too.
                let _ = contained(|| {
                    self.inner
                        .evict(&blazesym::symbolize::evict::Elf::new(path).into())
                });
                return vec![None; offsets.len()];
            };
            match result {
                Ok(results) => {
                    for (off, lines) in misses.iter().zip(results) {
                        bin.frames.insert(*off, lines);
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "symbolization failed for a binary");
                    for off in &misses {
                        bin.frames.insert(*off, None);
                    }
                }
            }
        }
        offsets
            .iter()
            .map(|o| bin.frames.get(o).cloned().flatten())
            .collect()
    }
}

fn owned_lines(r: Symbolized<'_>) -> Option<Lines> {
    match r {
        Symbolized::Sym(sym) => Some(lines_of(&sym)),
        Symbolized::Unknown(_) => None,
    }
}

/// Reads only the ELF and section headers (through a read cache, never the whole file).
fn lacks_symtab(file: std::fs::File) -> Option<bool> {
    use object::read::elf::{ElfFile32, ElfFile64};
    use object::read::{Object, ReadCache};
    let cache = ReadCache::new(file);
    let has = match object::FileKind::parse(&cache).ok()? {
        object::FileKind::Elf64 => ElfFile64::<object::Endianness, _>::parse(&cache)
            .ok()?
            .section_by_name(".symtab")
            .is_some(),
        object::FileKind::Elf32 => ElfFile32::<object::Endianness, _>::parse(&cache)
            .ok()?
            .section_by_name(".symtab")
            .is_some(),
        _ => return None,
    };
    Some(!has)
}

fn file_of(ci: Option<&CodeInfo<'_>>) -> (Arc<str>, u32) {
    match ci {
        Some(ci) => (
            Arc::from(ci.to_path().to_string_lossy().as_ref()),
            ci.line.unwrap_or(0),
        ),
        None => (Arc::from(""), 0),
    }
}

/// blazesym reports the function, its code position, and the inlined calls from the
/// outermost to the innermost, each with the position of its call site. pprof wants
/// the innermost first: each inlined function at the position of the next call (or,
/// for the innermost, of the instruction), the real function last.
fn lines_of(sym: &Sym<'_>) -> Lines {
    let mut lines = Vec::with_capacity(sym.inlined.len() + 1);
    let mut position = file_of(sym.code_info.as_deref());
    for inl in sym.inlined.iter().rev() {
        lines.push(Line {
            function: Arc::from(inl.name.as_ref()),
            file: position.0.clone(),
            line: position.1,
        });
        position = file_of(inl.code_info.as_ref());
    }
    lines.push(Line {
        function: Arc::from(sym.name.as_ref()),
        file: position.0,
        line: position.1,
    });
    lines.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every input the symbolize_elf fuzz target ever crashed on: a panic inside
    /// blazesym is contained, counted, and poisons only that binary.
    #[test]
    fn fuzz_regressions_are_contained() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/regressions/symbolize_elf");
        let metrics = Arc::new(Metrics::default());
        let mut inputs = 0;
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            inputs += 1;
            let mut sym = Symbolizer::new(2, metrics.clone());
            let file = std::fs::File::open(entry.path()).unwrap();
            let Ok(id) = sym.load(file.into()) else {
                continue;
            };
            let len = entry.metadata().unwrap().len();
            let offsets: Vec<u64> = (0..64u64).map(|i| i * (len / 48 + 1)).collect();
            assert_eq!(sym.symbolize(&id, &offsets).len(), offsets.len());
            // A poisoned binary answers without parsing again.
            assert_eq!(sym.symbolize(&id, &offsets).len(), offsets.len());
        }
        assert!(inputs > 0, "no regression inputs under {}", dir.display());
        assert!(
            metrics
                .symbolizer_panics
                .load(std::sync::atomic::Ordering::Relaxed)
                >= 1,
            "the known blazesym panic was not met (fixed upstream? then this input is just a regression)"
        );
    }

    #[test]
    fn symtab_detection() {
        let me = std::fs::File::open("/proc/self/exe").unwrap();
        assert_eq!(super::lacks_symtab(me), Some(false));
        let text = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(super::lacks_symtab(text), None);
    }
}

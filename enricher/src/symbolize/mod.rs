//! User-frame symbolization with blazesym, on files the sampler brokered.
//!
//! Binaries are cached by identity (build id, else device + inode + size + mtime),
//! shared by every process that maps them, in a bounded LRU. Each cached binary keeps
//! its fd open and is known to blazesym as `/proc/self/fd/N`, in a blazesym symbolizer
//! of its own while its parse is held, so nothing parsed outlives the binary's entry
//! or is found again under a reused fd number. A frame that cannot be symbolized gets
//! no name here, never a guessed one. A binary's separate debug file is found by
//! build id and opened here, never by the links the binary names ([`debug_file`]).
//!
//! Memory is bounded three ways ([`Limits`]): binaries kept open, frames remembered
//! (one LRU over all binaries, so a frame is symbolized once), and bytes of symbol
//! tables and DWARF held parsed. The last is most of the enricher's RSS: blazesym maps
//! a binary and reads its tables and debug sections, and builds function and line
//! tables on the heap. Past the budget, parses are dropped by what they cost to make
//! again and when they were last needed ([`room`]); a binary whose DWARF does not fit
//! is named from its symbol tables alone.
//!
//! blazesym parses whatever ELF and DWARF a binary carries; fuzzing found inputs on
//! which it panics (an unchecked file index in its line tables). Its calls run
//! [`contained`]: a panic there is caught and counted, the binary is marked unparsed
//! (its frames stay addresses, it is never parsed again), and the enricher lives.

use std::cell::Cell;
use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;

mod debug_file;
mod elf;
mod limits;
mod room;
mod symtab;

use debug_file::DebugFile;
use elf::elf_facts;
pub(crate) use elf::hex;
pub use limits::Limits;
use nix::sys::stat::fstat;
use room::{Floor, Rate, Room};

use crate::metrics::Metrics;
use crate::model::{BinaryId, Lines};

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
pub(crate) fn contained<T>(f: impl FnOnce() -> T) -> Option<T> {
    let outer = CONTAINED.with(|c| c.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CONTAINED.with(|c| c.set(outer));
    r.ok()
}

/// Where separate debug files are looked up by build id (`.build-id/xx/rest.debug`),
/// as gdb and perf do. Root's to write; the debug file's own links (dwz's
/// `.gnu_debugaltlink`) are resolved by blazesym from these too.
const DEBUG_DIRS: [&str; 2] = ["/usr/lib/debug", "/lib/debug"];

struct Loaded {
    /// Keeps `/proc/self/fd/N` naming this file while blazesym may open it.
    fd: OwnedFd,
    path: PathBuf,
    /// Frames are cached under this number (never reused), not the id.
    serial: u64,
    build_id: Option<Vec<u8>>,
    /// No `.symtab` section (None: not an ELF file object could read).
    stripped: Option<bool>,
    /// Symbolized with DWARF (within the budget), else from the symbol tables.
    dwarf: bool,
    /// Its separate debug file, looked up first; the binary answers what it does not.
    debug: Option<DebugFile>,
    /// Bytes a parse reads and holds: symbol tables, plus DWARF when `dwarf`.
    cost: u64,
    /// This binary's parse, while held (counted in the budget). A blazesym symbolizer
    /// of its own: dropping it frees all the parse holds, the separate debug file's
    /// too, which evicting the binary's path from a shared one left cached (libc's
    /// 10 MiB of DWARF inflated from libc6-dbg stayed after every drop).
    parsed: Option<blazesym::symbolize::Symbolizer>,
    /// Its parse was dropped for room once (parsing it again is a reparse).
    dropped: bool,
    /// What its last parse took (with the lookups that made it), once parsed.
    parse_ns: Option<u64>,
    /// Its worth held ([`room`]): set when its parse is needed.
    credit: f64,
    /// Never parsed (again): the parser panicked on it once, its symbol tables are
    /// over the ceiling ([`Limits::ceiling`]), or it changed since it was loaded.
    unparsed: bool,
    /// Size, modification and change times at load ([`stamp`]).
    stamp: [i64; 5],
    /// Where its symbol tables lie (a 64-bit file), and its segments.
    tables: Option<symtab::Tables>,
    loads: Vec<elf::Segment>,
}

pub struct Symbolizer {
    binaries: lru::LruCache<BinaryId, Loaded>,
    by_file: HashMap<(u64, u64), BinaryId>,
    frames: lru::LruCache<(u64, u64), Option<Lines>>,
    limits: Limits,
    bytes_held: u64,
    floor: Floor,
    /// What whole parses cost a byte: the price of one never made ([`room`]).
    rate: Rate,
    next_serial: u64,
    debug_dirs: Vec<PathBuf>,
    metrics: Arc<Metrics>,
}

impl Symbolizer {
    pub fn new(limits: Limits, metrics: Arc<Metrics>) -> Self {
        let count = |n: usize| NonZeroUsize::new(n.max(1)).unwrap_or(NonZeroUsize::MIN);
        Self {
            binaries: lru::LruCache::new(count(limits.binaries)),
            by_file: HashMap::new(),
            frames: lru::LruCache::new(count(limits.frames)),
            limits,
            bytes_held: 0,
            floor: Floor::default(),
            rate: Rate::default(),
            next_serial: 0,
            debug_dirs: DEBUG_DIRS.iter().map(PathBuf::from).collect(),
            metrics,
        }
    }

    /// Looks up separate debug files under `dirs` instead of the system's.
    #[cfg(test)]
    fn with_debug_dirs(mut self, dirs: &[&std::path::Path]) -> Self {
        self.debug_dirs = dirs.iter().map(|d| d.to_path_buf()).collect();
        self
    }

    /// The cached binary for a mapping's device and inode, if one is loaded.
    pub(crate) fn lookup_file(&mut self, dev: u64, ino: u64) -> Option<BinaryId> {
        let id = self.by_file.get(&(dev, ino))?.clone();
        self.binaries.contains(&id).then_some(id)
    }

    pub fn build_id(&self, id: &BinaryId) -> Option<&[u8]> {
        self.binaries.peek(id).and_then(|b| b.build_id.as_deref())
    }

    /// A new handle on a cached binary's file, by its build id (for debuginfo upload).
    pub(crate) fn binary_file(&self, build_id: &[u8]) -> Option<std::fs::File> {
        let b = self.binaries.peek(&BinaryId::BuildId(build_id.to_vec()))?;
        b.fd.try_clone().ok().map(std::fs::File::from)
    }

    /// Whether the binary lacks a symbol table (`.symtab`).
    pub fn stripped(&self, id: &BinaryId) -> Option<bool> {
        self.binaries.peek(id).and_then(|b| b.stripped)
    }

    pub(crate) fn len(&self) -> usize {
        self.binaries.len()
    }

    /// Whether `id` is still cached (not evicted).
    pub(crate) fn contains(&self, id: &BinaryId) -> bool {
        self.binaries.contains(id)
    }

    /// Bytes of symbol tables and DWARF whose parsed state is held now.
    pub fn bytes_held(&self) -> u64 {
        self.bytes_held
    }

    /// Named frames cached now.
    pub(crate) fn frames_cached(&self) -> usize {
        self.frames.len()
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
        let facts_of = |path: &std::path::Path| {
            std::fs::File::open(path)
                .ok()
                .and_then(|f| contained(|| elf_facts(f)).flatten())
        };
        let mut facts = None;
        if let Some(cached) = self.binaries.peek(&id) {
            // The same binary reached through another file (e.g. another container
            // layer): the cached copy serves, this fd closes. Unless the cached copy
            // was stripped and this one has its symbol table (a stripped and an
            // unstripped build share a build id): then this one replaces it.
            facts = (cached.stripped == Some(true))
                .then(|| facts_of(&path))
                .flatten()
                .filter(|f| f.symtab);
            if facts.is_none() {
                self.by_file.insert((dev, ino), id.clone());
                return Ok(id);
            }
            if let Some(old) = self.binaries.pop(&id) {
                self.evicted(&id, old);
            }
            Metrics::inc(&self.metrics.binaries_replaced_by_unstripped);
        }
        self.by_file.insert((dev, ino), id.clone());
        Metrics::inc(&self.metrics.binaries_loaded);
        let facts = facts.or_else(|| facts_of(&path));
        let debug_file::Plan {
            debug,
            sym_bytes,
            debug_bytes,
        } = debug_file::plan(
            &self.debug_dirs,
            build_id.as_deref(),
            facts.as_ref(),
            &st,
            self.limits.ceiling(),
            &self.metrics,
        );
        let budget = self.limits.budget_bytes;
        let dwarf = debug_bytes > 0 && sym_bytes.saturating_add(debug_bytes) <= budget;
        if debug_bytes > 0 && !dwarf {
            Metrics::inc(&self.metrics.binaries_over_symbol_budget);
            tracing::info!(
                binary = ?id,
                debug_bytes,
                sym_bytes,
                budget,
                "debug info larger than the budget (--symbol-budget): names from the symbol tables, no file:line or inline frames"
            );
        }
        let unparsed = sym_bytes > self.limits.ceiling();
        if unparsed {
            Metrics::inc(&self.metrics.binaries_over_symbol_ceiling);
            tracing::info!(
                binary = ?id,
                sym_bytes,
                ceiling = self.limits.ceiling(),
                "symbol tables larger than 4 × --symbol-budget: not parsed, its frames stay addresses"
            );
        }
        tracing::debug!(
            build_id = build_id.as_deref().map(hex),
            sym_bytes,
            debug_bytes,
            dwarf,
            "binary loaded for symbols"
        );
        self.next_serial += 1;
        let loaded = Loaded {
            fd,
            path,
            serial: self.next_serial,
            build_id,
            stripped: facts.as_ref().map(|f| !f.symtab),
            dwarf,
            debug,
            cost: sym_bytes + if dwarf { debug_bytes } else { 0 },
            parsed: None,
            dropped: false,
            parse_ns: None,
            credit: 0.0,
            unparsed,
            stamp: stamp(&st),
            tables: facts.as_ref().and_then(|f| f.tables),
            loads: facts.as_ref().map(|f| f.loads.clone()).unwrap_or_default(),
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
        if old.parsed.is_some() {
            self.bytes_held -= old.cost;
        }
        self.by_file.retain(|_, v| v != id);
        drop(old);
    }

    /// Makes room for `id`'s parse (`cost` bytes) by dropping others; false when it
    /// is not to be kept ([`room`]).
    fn make_room(&mut self, id: &BinaryId, cost: u64, parse_ns: Option<u64>) -> bool {
        let held = self
            .binaries
            .iter()
            .filter(|(k, b)| b.parsed.is_some() && *k != id)
            .map(|(k, b)| (k.clone(), b.credit, b.cost))
            .collect();
        let free = self.limits.budget_bytes.saturating_sub(self.bytes_held);
        let priced = parse_ns.map(|ns| self.floor.credit(ns, cost));
        let newcomer = priced.or_else(|| self.floor.credit_at(self.rate));
        let victims = match room::make_room(&mut self.floor, held, free, cost, newcomer) {
            Room::Fits => return true,
            Room::NotKept => return false,
            Room::Drop(v) => v,
        };
        for victim in victims {
            let Some(b) = self.binaries.peek_mut(&victim) else {
                continue;
            };
            b.parsed = None;
            b.dropped = true;
            self.bytes_held -= b.cost;
            tracing::debug!(
                build_id = b.build_id.as_deref().map(hex),
                cost = b.cost,
                need = cost,
                "symbol parse dropped for room"
            );
            Metrics::inc(&self.metrics.symbol_parses_dropped);
        }
        true
    }

    /// Whether the file changed since its headers were read (so what a parse would
    /// read now was not sized, nor checked for links); then it is never parsed
    /// again, and a parse held of it is dropped.
    fn changed_since_load(&mut self, id: &BinaryId) -> bool {
        let Some(bin) = self.binaries.peek_mut(id) else {
            return true;
        };
        if fstat(&bin.fd).is_ok_and(|st| stamp(&st) == bin.stamp) {
            return false;
        }
        bin.unparsed = true;
        if bin.parsed.take().is_some() {
            self.bytes_held -= bin.cost;
        }
        Metrics::inc(&self.metrics.binaries_changed_after_load);
        tracing::info!(binary = ?id, "binary changed since it was loaded: not parsed, its frames stay addresses");
        true
    }

    /// Credits the held parses of binaries a round asks for frames, before any of them
    /// makes room: the order in which the round asks them then does not matter ([`room`]).
    pub fn asked<'a>(&mut self, ids: impl IntoIterator<Item = &'a BinaryId>) {
        for id in ids {
            if let Some(b) = self.binaries.peek_mut(id) {
                if let (Some(_), Some(ns)) = (&b.parsed, b.parse_ns) {
                    b.credit = self.floor.credit(ns, b.cost);
                }
            }
        }
    }

    /// Lines for each file offset (None: no symbol covers it).
    pub fn symbolize(&mut self, id: &BinaryId, offsets: &[u64]) -> Vec<Option<Lines>> {
        self.asked([id]);
        let Some(bin) = self.binaries.get(id) else {
            return vec![None; offsets.len()];
        };
        if bin.unparsed {
            return vec![None; offsets.len()];
        }
        let (serial, path, dwarf, cost, held, parse_ns) = (
            bin.serial,
            bin.path.clone(),
            bin.dwarf,
            bin.cost,
            bin.parsed.is_some(),
            bin.parse_ns,
        );
        let mut misses: Vec<u64> = offsets
            .iter()
            .copied()
            .filter(|&o| self.frames.get(&(serial, o)).is_none())
            .collect();
        misses.sort_unstable();
        misses.dedup();
        Metrics::add(
            &self.metrics.symbol_cache_hits,
            (offsets.len() - misses.len().min(offsets.len())) as u64,
        );
        let mut fresh: HashMap<u64, Option<Lines>> = HashMap::new();
        if !misses.is_empty() && !self.changed_since_load(id) {
            Metrics::add(&self.metrics.symbol_cache_misses, misses.len() as u64);
            // A parse larger than the whole budget is made for this round only: making
            // room for it would only make the others parse again. A parse held already
            // is counted in the bytes held: it needs no more room.
            // (A budget of 0 keeps nothing, whatever a parse is estimated at.)
            let over = cost > self.limits.budget_bytes || self.limits.budget_bytes == 0;
            let keep = !over && (held || self.make_room(id, cost, parse_ns));
            // A parse not kept for room reads no DWARF: made whole, it would sit on a
            // full budget for the round (under churn, the enricher's peak). Its frames
            // are named from the symbol tables and not cached, so that they get their
            // file:line once the binary's parse is held.
            let lean = !keep && !over && dwarf;
            let Some(bin) = self.binaries.peek_mut(id) else {
                return vec![None; offsets.len()];
            };
            // A parse not kept reads the symbol tables through a small buffer when it
            // can: blazesym would map them and index every symbol for the round.
            let scan = (!keep)
                .then(|| symtab::Scan::of(bin.tables.as_ref()?, &bin.loads, bin.debug.as_ref()))
                .flatten();
            let parsed = match scan {
                Some(_) => None,
                None => Some(
                    bin.parsed
                        .take()
                        .unwrap_or_else(|| parser(&self.debug_dirs)),
                ),
            };
            let started = std::time::Instant::now();
            let result = contained(|| match (&scan, &parsed) {
                (Some(scan), _) => {
                    Metrics::inc(&self.metrics.symbol_table_scans);
                    scan.lookup(bin.fd.as_fd(), &misses).map_err(|e| {
                        Metrics::inc(&self.metrics.symbol_table_scan_errors);
                        e.to_string()
                    })
                }
                (None, Some(parsed)) => {
                    debug_file::lookup(parsed, &path, dwarf && !lean, bin.debug.as_ref(), &misses)
                        .map_err(|e| e.to_string())
                }
                (None, None) => Ok(vec![None; misses.len()]),
            });
            let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
            Metrics::add(&self.metrics.symbolize_ns, took);
            // A lean parse's time says nothing of what the whole one costs.
            if !held && !lean {
                bin.parse_ns = Some(took);
            }
            let Some(result) = result else {
                // Its half-parsed state goes with `parsed`, dropped contained too.
                contained(move || drop(parsed));
                bin.unparsed = true;
                if held {
                    self.bytes_held -= cost;
                }
                self.panicked(Some(id));
                return vec![None; offsets.len()];
            };
            if keep {
                bin.parsed = parsed;
                bin.credit = self.floor.credit(bin.parse_ns.unwrap_or(took), cost);
                if !held {
                    self.rate.add(took, cost);
                    self.bytes_held += cost;
                    if bin.dropped {
                        Metrics::inc(&self.metrics.symbol_reparses);
                    }
                }
            } else if over {
                Metrics::inc(&self.metrics.symbol_parses_transient);
            } else {
                Metrics::inc(&self.metrics.symbol_parses_not_kept);
                if lean {
                    Metrics::inc(&self.metrics.symbol_parses_lean);
                }
            }
            if !held {
                tracing::debug!(
                    build_id = bin.build_id.as_deref().map(hex),
                    cost,
                    took_us = took / 1000,
                    keep,
                    reparse = bin.dropped,
                    lean,
                    "symbols parsed"
                );
            }
            let results = result.unwrap_or_else(|e| {
                tracing::debug!(error = %e, "symbolization failed for a binary");
                vec![None; misses.len()]
            });
            for (&off, lines) in misses.iter().zip(results) {
                fresh.insert(off, lines.clone());
                if lean {
                    continue;
                }
                if let Some((key, _)) = self.frames.push((serial, off), lines) {
                    if key != (serial, off) {
                        Metrics::inc(&self.metrics.symbol_frames_evicted);
                    }
                }
            }
        }
        offsets
            .iter()
            .map(|&o| match fresh.get(&o) {
                Some(l) => l.clone(),
                None => self.frames.peek(&(serial, o)).cloned().flatten(),
            })
            .collect()
    }
}

/// What changes when a file is written to.
fn stamp(st: &nix::sys::stat::FileStat) -> [i64; 5] {
    [
        st.st_size,
        st.st_mtime,
        st.st_mtime_nsec,
        st.st_ctime,
        st.st_ctime_nsec,
    ]
}

/// A blazesym symbolizer for one binary's parse.
fn parser(debug_dirs: &[PathBuf]) -> blazesym::symbolize::Symbolizer {
    blazesym::symbolize::Symbolizer::builder()
        // Paths are our own fds, which do not change under us.
        .enable_auto_reload(false)
        .enable_code_info(true)
        .enable_inlined_fns(true)
        .enable_demangling(true)
        .set_debug_dirs(Some(debug_dirs))
        .build()
}

#[cfg(test)]
mod file_tests;
#[cfg(test)]
mod tests;

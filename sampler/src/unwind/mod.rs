//! Unwind tables and process mappings for the BPF unwinder.
//!
//! The enricher builds a table per file from its CFI (the sampler parses no ELF or
//! DWARF) and sends it in chunks of fixed-size rows. Here each row is checked (sorted,
//! kinds and offsets in range), the table is held to its budgets, and the rows are
//! copied into the program's `rows` array through a window of it mapped for the chunk
//! (an mmapable array: one copy, not a map-update command per row); `tables` then
//! points the file at its run. The sampler also writes each process's executable
//! mappings (from the /proc/PID/maps it reads anyway) into `procmaps`.
//!
//! A wrong table can only make the unwinder read the wrong words of the sampled
//! process's own user memory (bpf_probe_read_user, which faults safely) and so produce
//! wrong user stacks: the verifier bounds every loop and map access whatever the rows
//! say. Tables last while the subscription that sent them does.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;

use firn_sampler_bpf::types::{firn_cfa_kind as Cfa, firn_rbp_kind as Rbp};
use firn_schema::unwind_row as row_kinds;
use libbpf_rs::libbpf_sys;

use crate::counters::{add, bump, Counters};
use crate::procfs::{Mapping, ProcessRecord};

pub(crate) mod ends;
pub(crate) mod epoch;
pub mod pages;
pub(crate) mod python;
mod rows;
use rows::write_rows;
pub use rows::{check_rows, check_rows_with, Pool, TableError};
pub(crate) use rows::{map_shared, page_size};

/// Bytes of one row on the wire and in the `rows` map.
pub const ROW_BYTES: usize = firn_schema::firn_capnp::UNWIND_ROW_BYTES as usize;
const _: () = assert!(ROW_BYTES == std::mem::size_of::<firn_sampler_bpf::types::firn_unwind_row>());
/// The BPF binary search takes 24 steps: a table has fewer rows than 2^24.
pub(crate) const MAX_TABLE_ROWS: u32 = (1 << 24) - 1;
/// Default size of the row pool (`--unwind-rows`): 16 MiB of kernel memory, allocated
/// at start (an mmapable array cannot grow). It holds the 1.7 M rows of a node compiling
/// with clang (libLLVM alone 0.95 M); an idle node uses 0.4 M. Tables of files no known
/// process maps are evicted to make room, so it bounds the tables in use, not ever loaded.
pub(crate) const DEFAULT_POOL_ROWS: u32 = 2 << 20;
/// Default row limit of one table (`--unwind-table-rows`): 8 MiB.
pub(crate) const DEFAULT_TABLE_ROWS: u32 = 1 << 20;
/// `firn_table.pages` is a u16.
const _: () = assert!(pages::MAX_PAGES <= u16::MAX as u32);
/// Files with a table at once (`tables` map entries).
pub(crate) const MAX_TABLES: usize = 4096;
/// Executable mappings of a process the unwinder sees (`FIRN_MAX_MAPPINGS`).
pub(crate) const MAX_MAPPINGS: usize = 60;
const _: () = assert!(
    std::mem::size_of::<firn_sampler_bpf::types::firn_proc_maps>() == 16 + MAX_MAPPINGS * 32
);

// The wire's kinds are the BPF program's.
const _: () = {
    assert!(row_kinds::CFA_NONE as u32 == Cfa::FIRN_CFA_NONE.0);
    assert!(row_kinds::CFA_RSP as u32 == Cfa::FIRN_CFA_RSP.0);
    assert!(row_kinds::CFA_RBP as u32 == Cfa::FIRN_CFA_RBP.0);
    assert!(row_kinds::CFA_PLT as u32 == Cfa::FIRN_CFA_PLT.0);
    assert!(row_kinds::CFA_SIGNAL as u32 == Cfa::FIRN_CFA_SIGNAL.0);
    assert!(row_kinds::CFA_UNSUPPORTED as u32 == Cfa::FIRN_CFA_UNSUPPORTED.0);
    assert!(row_kinds::CFA_STOP as u32 == Cfa::FIRN_CFA_STOP.0);
    assert!(row_kinds::CFA_KINDS as u32 == Cfa::FIRN_CFA_KINDS.0);
    assert!(row_kinds::RBP_SAME as u32 == Rbp::FIRN_RBP_SAME.0);
    assert!(row_kinds::RBP_AT_CFA as u32 == Rbp::FIRN_RBP_AT_CFA.0);
    assert!(row_kinds::RBP_UNKNOWN as u32 == Rbp::FIRN_RBP_UNKNOWN.0);
    assert!(row_kinds::RBP_KINDS as u32 == Rbp::FIRN_RBP_KINDS.0);
};

/// A file as the BPF maps name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct FileKey {
    pub(crate) inode: u64,
    pub(crate) dev: u32,
}

impl FileKey {
    pub(crate) fn of(m: &Mapping) -> Self {
        Self {
            inode: m.inode,
            dev: (m.dev_major & 0xfff) << 20 | (m.dev_minor & 0xf_ffff),
        }
    }

    fn bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.inode.to_ne_bytes());
        b[8..12].copy_from_slice(&self.dev.to_ne_bytes());
        b
    }
}

struct Maps {
    rows: OwnedFd,
    tables: OwnedFd,
    procmaps: OwnedFd,
    /// `proc_epoch`: see [`Unwind::processes_changed`].
    epoch: epoch::ProcEpoch,
}

#[derive(Debug, Clone, Copy)]
struct Installed {
    first: u32,
    /// Its run in the pool: the rows, then the page directory.
    run: u32,
    /// Install order, for evicting the oldest unused table first.
    seq: u64,
}

#[derive(Debug)]
struct Pending {
    file: FileKey,
    first: u32,
    total: u32,
    next: u32,
    last_pc: Option<u32>,
    /// Its run in the pool: the rows, then room for the page directory.
    run: u32,
    pages: pages::PageIndex,
    /// Time spent on its chunks so far (checks, writes, publication).
    spent: std::time::Duration,
}

/// Limits of the tables (flags).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) pool_rows: u32,
    pub(crate) table_rows: u32,
}

/// The unwinder's maps, written by the sampler.
pub struct Unwind {
    /// None: no BPF maps (a test or fuzz harness); tables are refused as disabled.
    maps: Option<Maps>,
    limits: Limits,
    pool: Pool,
    installed: HashMap<FileKey, Installed>,
    /// Subscription whose tables are in the maps.
    owner: Option<u64>,
    pending: Option<Pending>,
    seq: u64,
    /// Files each process in `procmaps` maps, by tgid, and how many processes map a file.
    processes: HashMap<u32, (u64, u32, Vec<FileKey>)>,
    users: HashMap<FileKey, u32>,
    /// CPython interpreters of processes, for the walk's Python frames.
    python: python::Interpreters,
    counters: Rc<Counters>,
}

impl Unwind {
    /// Takes the maps' fds (duplicated before confinement): rows, tables and procmaps,
    /// and the Python walk's pyprocs, pyseen and pyepoch; and the mapping of proc_epoch.
    pub(crate) fn new(
        (rows, tables, procmaps): (OwnedFd, OwnedFd, OwnedFd),
        (pyprocs, pyseen, pyepoch): (OwnedFd, OwnedFd, OwnedFd),
        proc_epoch: epoch::ProcEpoch,
        limits: Limits,
        counters: Rc<Counters>,
    ) -> Self {
        Self {
            maps: Some(Maps {
                rows,
                tables,
                procmaps,
                epoch: proc_epoch,
            }),
            limits,
            pool: Pool::new(limits.pool_rows),
            installed: HashMap::new(),
            owner: None,
            pending: None,
            seq: 0,
            processes: HashMap::new(),
            users: HashMap::new(),
            python: python::Interpreters::new(Some(pyprocs), Some((pyseen, pyepoch))),
            counters,
        }
    }

    /// What the walk knows of processes changed: `seen` (deleted by the sampler),
    /// `pyprocs`, `procmaps` or `tables`. Moving the epoch drops every CPU's memo of the
    /// process it sampled last and of the mappings it resolved, which then look all four
    /// up again. Called after the change, and before a released row run is reused.
    pub(crate) fn processes_changed(&self) {
        if let Some(m) = &self.maps {
            m.epoch.bump();
        }
    }

    /// No maps at all: every table is refused as disabled (harnesses without BPF).
    pub fn disabled(counters: Rc<Counters>) -> Self {
        let limits = Limits {
            pool_rows: 0,
            table_rows: 0,
        };
        Self {
            maps: None,
            limits,
            pool: Pool::new(0),
            installed: HashMap::new(),
            owner: None,
            pending: None,
            seq: 0,
            processes: HashMap::new(),
            users: HashMap::new(),
            python: python::Interpreters::new(None, None),
            counters,
        }
    }

    /// The Python walk's maps, for a new subscriber (see python::Interpreters).
    pub(crate) fn python(&self) -> &python::Interpreters {
        &self.python
    }

    pub(crate) fn enabled(&self) -> bool {
        self.limits.pool_rows > 0 && self.maps.is_some()
    }

    /// Takes one chunk of the table for `file` from subscription `owner`. `Ok(Some(t))`:
    /// the table is complete and in use, after `t` of the sampler's time over its chunks.
    pub(crate) fn take_chunk(
        &mut self,
        owner: u64,
        file: FileKey,
        first_row: u32,
        total: u32,
        bytes: &[u8],
    ) -> Result<Option<std::time::Duration>, TableError> {
        let t0 = std::time::Instant::now();
        if self.owner.is_some_and(|o| o != owner) {
            return Err(TableError::NotOwner);
        }
        if first_row == 0 {
            self.abandon_pending();
            if total == 0 {
                return Err(TableError::Empty);
            }
            let limit = self.limits.table_rows.min(MAX_TABLE_ROWS);
            if total > limit {
                return Err(TableError::TooLarge { rows: total, limit });
            }
            let run = total + pages::capacity(total);
            let first = self.alloc(run, file)?;
            self.owner = Some(owner);
            self.pending = Some(Pending {
                file,
                first,
                total,
                next: 0,
                last_pc: None,
                run,
                pages: pages::PageIndex::for_first_chunk(total, bytes),
                spent: std::time::Duration::ZERO,
            });
        }
        let Some(pending) = self.pending.as_mut() else {
            return Err(TableError::OutOfOrder);
        };
        if pending.file != file || pending.total != total || pending.next != first_row {
            return Err(TableError::OutOfOrder);
        }
        let (first, next, last_pc) = (pending.first, pending.next, pending.last_pc);
        let n = (bytes.len() / ROW_BYTES) as u32;
        let checked = if u64::from(first_row) + u64::from(n) > u64::from(total) {
            Err(TableError::OutOfOrder)
        } else {
            let ix = &mut pending.pages;
            check_rows_with(bytes, first_row, last_pc, |pc| ix.push(pc)).and_then(
                |last| match &self.maps {
                    Some(m) => write_rows(&m.rows, first + first_row, bytes).map(|()| last),
                    None => Err(TableError::Map(-libc::ENODEV)),
                },
            )
        };
        let last = match checked {
            Ok(l) => l,
            Err(e) => {
                self.abandon_pending();
                return Err(e);
            }
        };
        let Some(mut p) = self.pending.take() else {
            return Err(TableError::OutOfOrder);
        };
        p.next = next + n;
        p.last_pc = Some(last);
        if p.next < p.total {
            p.spent += t0.elapsed();
            self.pending = Some(p);
            return Ok(None);
        }
        let spent = p.spent;
        self.publish(p)?;
        let spent = spent + t0.elapsed();
        add(
            &self.counters.unwind_table_load_ns,
            u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX),
        );
        Ok(Some(spent))
    }

    fn alloc(&mut self, rows: u32, file: FileKey) -> Result<u32, TableError> {
        if let Some(first) = self.pool.alloc(rows) {
            if self.installed.len() < MAX_TABLES || self.installed.contains_key(&file) {
                return Ok(first);
            }
            self.pool.release(first, rows);
        }
        // Make room from tables of files no known process maps, oldest first.
        let mut unused: Vec<(u64, FileKey)> = self
            .installed
            .iter()
            .filter(|(f, _)| self.users.get(f).copied().unwrap_or(0) == 0 && **f != file)
            .map(|(f, t)| (t.seq, *f))
            .collect();
        unused.sort_unstable_by_key(|(seq, _)| *seq);
        for (_, f) in unused {
            self.remove(f);
            bump(&self.counters.unwind_tables_evicted);
            if self.installed.len() < MAX_TABLES {
                if let Some(first) = self.pool.alloc(rows) {
                    return Ok(first);
                }
            }
        }
        Err(TableError::NoRoom { rows })
    }

    fn publish(&mut self, mut p: Pending) -> Result<(), TableError> {
        let c = self.counters.clone();
        let dir = std::mem::replace(&mut p.pages, pages::PageIndex::new(0)).finish();
        let Some(maps) = &self.maps else {
            self.pool.release(p.first, p.run);
            return Err(TableError::Map(-libc::ENODEV));
        };
        // The directory after the rows; the room it did not need goes back.
        let len = dir.entries.len() as u32;
        let bytes: Vec<u8> = dir.entries.iter().flat_map(|e| e.to_ne_bytes()).collect();
        if let Err(e) = write_rows(&maps.rows, p.first + p.total, &bytes) {
            self.pool.release(p.first, p.run);
            return Err(e);
        }
        self.pool
            .release(p.first + p.total + len, p.run - p.total - len);
        p.run = p.total + len;
        let value = firn_sampler_bpf::types::firn_table {
            first: p.first,
            count: p.total,
            base: dir.base,
            pages: len as u16,
            shift: dir.shift,
            ..Default::default()
        };
        let key = p.file.bytes();
        // SAFETY: key is 16 bytes (firn_file_key), value a firn_table; both outlive the
        // call.
        let ret = unsafe {
            libbpf_sys::bpf_map_update_elem(
                maps.tables.as_raw_fd(),
                key.as_ptr().cast(),
                (&raw const value).cast(),
                u64::from(libbpf_sys::BPF_ANY),
            )
        };
        if ret < 0 {
            self.pool.release(p.first, p.run);
            return Err(TableError::Map(ret));
        }
        // A replaced table's run is released below and may be reused.
        self.processes_changed();
        self.seq += 1;
        if let Some(old) = self.installed.insert(
            p.file,
            Installed {
                first: p.first,
                run: p.run,
                seq: self.seq,
            },
        ) {
            self.pool.release(old.first, old.run);
        }
        bump(&c.unwind_tables_loaded);
        add(&c.unwind_rows_loaded, u64::from(p.total));
        c.unwind_rows_in_use.set(self.rows_in_use());
        Ok(())
    }

    fn remove(&mut self, file: FileKey) {
        if let Some(t) = self.installed.remove(&file) {
            let key = file.bytes();
            if let Some(m) = &self.maps {
                // SAFETY: key is a 16-byte firn_file_key. Deleted before the run is
                // reused, so a walk that starts after this never reads another file's
                // rows for this one (one under way may: wrong rows, still rule 9's).
                unsafe {
                    libbpf_sys::bpf_map_delete_elem(m.tables.as_raw_fd(), key.as_ptr().cast())
                };
            }
            self.processes_changed();
            self.pool.release(t.first, t.run);
        }
    }

    fn abandon_pending(&mut self) {
        if let Some(p) = self.pending.take() {
            self.pool.release(p.first, p.run);
        }
    }

    /// The subscription `owner` ended: its tables go.
    pub(crate) fn drop_owner(&mut self, owner: u64) {
        if self.owner != Some(owner) {
            return;
        }
        self.abandon_pending();
        let files: Vec<FileKey> = self.installed.keys().copied().collect();
        for f in files {
            self.remove(f);
        }
        self.python.clear();
        self.processes_changed();
        self.counters.python_interpreters_in_use.set(0);
        self.owner = None;
        self.counters.unwind_rows_in_use.set(0);
        tracing::info!(
            subscriber = owner,
            "the unwind tables of a subscription that ended were removed"
        );
    }

    pub(crate) fn rows_in_use(&self) -> u64 {
        u64::from(self.limits.pool_rows - self.pool.free_rows())
    }

    /// Writes the executable mappings of a process just read from /proc.
    /// The caller moves the epoch once after a batch of these ([`Self::processes_changed`]).
    pub(crate) fn set_process(&mut self, key: crate::processes::ProcKey, rec: &ProcessRecord) {
        let c = self.counters.clone();
        let Some(bpf) = &self.maps else { return };
        if !rec.complete {
            return;
        }
        let mut value = firn_sampler_bpf::types::firn_proc_maps {
            start_ns: key.start_ns,
            exec_id: key.exec_id,
            ..Default::default()
        };
        // Files, then anonymous code (inode 0), in one list sorted by start.
        let mut maps: Vec<(u64, u64, u64, Option<FileKey>)> = rec
            .mappings
            .iter()
            .map(|m| (m.start, m.end, m.offset, Some(FileKey::of(m))))
            .chain(rec.code.iter().map(|&(s, e)| (s, e, 0, None)))
            .collect();
        maps.sort_unstable_by_key(|m| m.0);
        if maps.len() > MAX_MAPPINGS {
            bump(&c.unwind_mappings_truncated);
        }
        let mut files = Vec::new();
        let mut kept = 0;
        for &(start, end, offset, file) in &maps {
            // Mappings and file offsets are whole pages; a length or offset past what
            // 32 bits of pages hold (16 TiB) is no real mapping's.
            let (Ok(pages), Ok(offset_pages)) = (
                u32::try_from((end - start) >> 12),
                u32::try_from(offset >> 12),
            ) else {
                continue;
            };
            let Some(slot) = value.m.get_mut(kept) else {
                break;
            };
            kept += 1;
            slot.start = start;
            slot.pages = pages;
            slot.offset_pages = offset_pages;
            if let Some(f) = file {
                slot.inode = f.inode;
                slot.dev = f.dev;
                if !files.contains(&f) {
                    files.push(f);
                }
            }
        }
        value.count = kept as u32;
        // SAFETY: key is a u32 tgid; value a whole firn_proc_maps, both live for the call.
        let ret = unsafe {
            libbpf_sys::bpf_map_update_elem(
                bpf.procmaps.as_raw_fd(),
                (&raw const key.tgid).cast(),
                (&raw const value).cast(),
                u64::from(libbpf_sys::BPF_ANY),
            )
        };
        if ret < 0 {
            bump(&c.unwind_procmaps_failed);
            return;
        }
        for f in &files {
            *self.users.entry(*f).or_default() += 1;
        }
        if let Some((start_ns, exec_id, old)) = self
            .processes
            .insert(key.tgid, (key.start_ns, key.exec_id, files))
        {
            self.unuse(&old);
            // Another process under this pid now (an exec, or a pid reused): the old
            // one's interpreter goes with its mappings.
            if (start_ns, exec_id) != (key.start_ns, key.exec_id) {
                self.python.forget(crate::processes::ProcKey {
                    tgid: key.tgid,
                    start_ns,
                    exec_id,
                });
            }
        }
    }

    /// Gives the process index's room back after a storm of processes.
    pub(crate) fn shrink_after_storm(&mut self) {
        crate::processes::shrink_after_storm(&mut self.processes);
    }

    /// The process is forgotten: its mappings go, unless the pid is another process's
    /// by now (reuse, or its next program after an exec).
    /// The caller moves the epoch once after a batch of these ([`Self::processes_changed`]).
    pub(crate) fn forget_process(&mut self, key: crate::processes::ProcKey) {
        match self.processes.get(&key.tgid) {
            Some(&(start, exec, _)) if start == key.start_ns && exec == key.exec_id => {}
            _ => return,
        }
        if let Some((_, _, files)) = self.processes.remove(&key.tgid) {
            self.unuse(&files);
        }
        self.python.forget(key);
        self.counters
            .python_interpreters_in_use
            .set(self.python.loaded() as u64);
        if let Some(m) = &self.maps {
            // SAFETY: key is a u32 tgid.
            unsafe {
                libbpf_sys::bpf_map_delete_elem(
                    m.procmaps.as_raw_fd(),
                    (&raw const key.tgid).cast(),
                )
            };
        }
    }

    fn unuse(&mut self, files: &[FileKey]) {
        for f in files {
            if let Some(n) = self.users.get_mut(f) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.users.remove(f);
                }
            }
        }
    }
}

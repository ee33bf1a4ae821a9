//! CPython interpreters for the BPF walk (`pyprocs`), from the enricher's records.
//!
//! A record (firn_schema::python_record) says which CPython version a mapped file is,
//! where its runtime state, types and eval loop are, and the version's field offsets.
//! The sampler parses no ELF: it checks the record field by field
//! ([`Record::check`]: a known version with exactly that version's standard layout),
//! places the eval loop inside the mapping the subscriber named and the objects near
//! it, and writes the result for that one process. What the walk then reads is still
//! checked in the process's memory (type words and type names), so a lying record can
//! only spoil the Python frames of the process it names (DESIGN rule 9).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use firn_sampler_bpf::types::firn_py_proc;
use firn_schema::python_record::{Invalid, Record, USER_END};
use libbpf_rs::libbpf_sys;

use crate::counters::bump;
use crate::processes::ProcKey;
use crate::procfs::Mapping;

/// Objects of an interpreter lie within this distance of the start of its file's
/// image (the mapping's start less its file offset): a shared libpython's data follows
/// its text, Debian's python3 keeps `_PyRuntime` a few MiB above it.
const MAX_IMAGE_BYTES: u64 = 256 << 20;
/// What the walk reads of a frame and of a code object, at most (profile.bpf.h).
const FRAME_BUF: u16 = 128;
const CODE_BUF: u16 = 256;
/// Entries of `pyprocs` (profile.bpf.h's map).
const MAX_PROCESSES: usize = 4096;

const _: () = assert!(std::mem::size_of::<firn_py_proc>() == 136);

/// Why an interpreter was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum InterpreterError {
    #[error("the record is not 128 bytes of format 1")]
    Malformed,
    #[error("the record failed its check: {0}")]
    Invalid(Invalid),
    #[error("the eval loop or an object lies outside the mapping's reach")]
    Outside,
    #[error("the process's mappings are not in the unwinder's map")]
    UnknownProcess,
    #[error("another subscription provides the tables")]
    NotOwner,
    #[error("the interpreter map is full")]
    NoRoom,
    #[error("the map update failed: {0}")]
    Map(i32),
}

/// The interpreters in `pyprocs`, by tgid, the map of code objects already copied
/// (`pyseen`) and its epoch (`pyepoch`, which drops the walk's per-CPU caches of it).
pub(crate) struct Interpreters {
    procs: Option<OwnedFd>,
    seen: Option<(OwnedFd, OwnedFd)>,
    loaded: HashMap<u32, ProcKey>,
}

impl Interpreters {
    pub(crate) fn new(procs: Option<OwnedFd>, seen: Option<(OwnedFd, OwnedFd)>) -> Self {
        Self {
            procs,
            seen,
            loaded: HashMap::new(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.procs.is_some()
    }

    pub(crate) fn loaded(&self) -> usize {
        self.loaded.len()
    }

    /// Checks `bytes` for process `key`'s mapping `m` and writes it for the walk.
    pub(crate) fn load(
        &mut self,
        key: ProcKey,
        m: &Mapping,
        bytes: &[u8],
    ) -> Result<(), InterpreterError> {
        let rec = Record::from_bytes(bytes).ok_or(InterpreterError::Malformed)?;
        rec.check().map_err(InterpreterError::Invalid)?;
        let value = place(&rec, key, m)?;
        if !self.loaded.contains_key(&key.tgid) && self.loaded.len() >= MAX_PROCESSES {
            return Err(InterpreterError::NoRoom);
        }
        let Some(fd) = &self.procs else {
            return Err(InterpreterError::Map(-libc::ENODEV));
        };
        // SAFETY: key is a u32 tgid; value a whole firn_py_proc, both live for the call.
        let ret = unsafe {
            libbpf_sys::bpf_map_update_elem(
                fd.as_raw_fd(),
                (&raw const key.tgid).cast(),
                (&raw const value).cast(),
                u64::from(libbpf_sys::BPF_ANY),
            )
        };
        if ret < 0 {
            return Err(InterpreterError::Map(ret));
        }
        self.loaded.insert(key.tgid, key);
        Ok(())
    }

    /// The process ended (or exec'd): its entry goes, unless the pid is another's.
    pub(crate) fn forget(&mut self, key: ProcKey) {
        if self.loaded.get(&key.tgid) == Some(&key) {
            self.loaded.remove(&key.tgid);
            self.delete(key.tgid);
        }
    }

    /// The subscription that sent them ended: every entry goes.
    pub(crate) fn clear(&mut self) {
        let tgids: Vec<u32> = self.loaded.drain().map(|(t, _)| t).collect();
        for t in tgids {
            self.delete(t);
        }
    }

    fn delete(&self, tgid: u32) {
        if let Some(fd) = &self.procs {
            // SAFETY: key is a u32 tgid.
            unsafe { libbpf_sys::bpf_map_delete_elem(fd.as_raw_fd(), (&raw const tgid).cast()) };
        }
    }

    /// A new subscriber gets every code object's names again: the walk copies a code
    /// object only when `pyseen` does not have it.
    pub(crate) fn forget_seen(&self) -> u64 {
        let Some((seen, epoch)) = &self.seen else {
            return 0;
        };
        // A failure leaves some marks: those code objects are not sent again (counted
        // as fewer reset).
        let n =
            crate::drain::take_all(seen.as_fd(), (8, 1), (1024, 1 << 20), |_, _| {}).unwrap_or(0);
        bump_epoch(epoch.as_fd());
        n as u64
    }
}

/// Adds one to the u64 of an array map of one entry (an epoch the walk compares its
/// per-CPU caches against). Only the sampler writes these, from one thread, so a read
/// and a write do not lose a step.
pub(super) fn bump_epoch(fd: BorrowedFd<'_>) {
    let (zero, mut e) = (0u32, 0u64);
    // SAFETY: the map is an array of one u64 under key 0 (a lookup of it does not
    // fail); key and value live for the calls.
    unsafe {
        libbpf_sys::bpf_map_lookup_elem(
            fd.as_raw_fd(),
            (&raw const zero).cast(),
            (&raw mut e).cast(),
        );
        e = e.wrapping_add(1);
        libbpf_sys::bpf_map_update_elem(
            fd.as_raw_fd(),
            (&raw const zero).cast(),
            (&raw const e).cast(),
            u64::from(libbpf_sys::BPF_ANY),
        );
    }
}

/// The record's addresses in process `key`, whose mapping `m` holds the eval loop.
fn place(rec: &Record, key: ProcKey, m: &Mapping) -> Result<firn_py_proc, InterpreterError> {
    let outside = InterpreterError::Outside;
    let len = m.end.checked_sub(m.start).ok_or(outside)?;
    let file_end = m.offset.checked_add(len).ok_or(outside)?;
    // File offsets of the mapping → its addresses.
    let code_at = |(s, e): (u64, u64)| -> Result<(u64, u64), InterpreterError> {
        if s < m.offset || e > file_end {
            return Err(outside);
        }
        Ok((m.start + (s - m.offset), m.start + (e - m.offset)))
    };
    let eval = code_at(rec.eval)?;
    let cold = if rec.eval_cold == (0, 0) {
        (0, 0)
    } else {
        code_at(rec.eval_cold)?
    };
    // The file's image starts where offset 0 would be mapped; its virtual addresses
    // are shifted by the text segment's p_vaddr - p_offset.
    let image = m.start.checked_sub(m.offset).ok_or(outside)?;
    let bias = image.checked_sub(rec.text_delta).ok_or(outside)?;
    let object = |vaddr: u64| -> Result<u64, InterpreterError> {
        let a = bias.checked_add(vaddr).ok_or(outside)?;
        if a < image || a - image >= MAX_IMAGE_BYTES || a >= USER_END {
            return Err(outside);
        }
        Ok(a)
    };
    let frame_span = [rec.frame_previous, rec.frame_code, rec.frame_instr]
        .into_iter()
        .map(|o| o + 8)
        .chain([rec.boundary_offset + 1])
        .max()
        .unwrap_or(0);
    // Of a code object the walk reads its fields, not its whole fixed part.
    let code_span = [
        rec.object_type,
        rec.code_name,
        rec.code_filename,
        rec.code_linetable,
        rec.code_firstlineno,
    ]
    .into_iter()
    .map(|o| o + 8)
    .max()
    .unwrap_or(0)
    .min(rec.code_size.max(8));
    if frame_span > FRAME_BUF || code_span > CODE_BUF {
        return Err(InterpreterError::Invalid(Invalid::Offset));
    }
    Ok(firn_py_proc {
        start_ns: key.start_ns,
        exec_id: key.exec_id,
        minor: rec.minor,
        position: rec.position,
        boundary: rec.boundary,
        cstack: rec.cstack,
        types_checked: 0,
        reserved: [0; 3],
        frame_span,
        code_span,
        eval_start: eval.0,
        eval_end: eval.1,
        cold_start: cold.0,
        cold_end: cold.1,
        runtime: object(rec.runtime)?,
        code_type: object(rec.code_type)?,
        str_type: object(rec.str_type)?,
        bytes_type: object(rec.bytes_type)?,
        runtime_interpreters: rec.runtime_interpreters,
        interp_threads_head: rec.interp_threads_head,
        tstate_next: rec.tstate_next,
        tstate_thread_id: rec.tstate_thread_id,
        tstate_frame: rec.tstate_frame,
        cframe_frame: rec.cframe_frame,
        frame_previous: rec.frame_previous,
        frame_code: rec.frame_code,
        frame_instr: rec.frame_instr,
        boundary_offset: rec.boundary_offset,
        code_adaptive: rec.code_adaptive,
        code_filename: rec.code_filename,
        code_name: rec.code_name,
        code_linetable: rec.code_linetable,
        code_firstlineno: rec.code_firstlineno,
        object_type: rec.object_type,
        type_name: rec.type_name,
        str_state: rec.str_state,
        str_length: rec.str_length,
        str_ascii_data: rec.str_ascii_data,
        bytes_size: rec.bytes_size,
        bytes_data: rec.bytes_data,
        ..Default::default()
    })
}

impl super::Unwind {
    /// Takes an interpreter record from subscription `owner` for the process whose
    /// mappings start at `start_ns` (its tgid's entry in the unwinder's map).
    pub(crate) fn load_interpreter(
        &mut self,
        owner: u64,
        tgid: u32,
        start_ns: u64,
        m: &Mapping,
        bytes: &[u8],
    ) -> Result<(), InterpreterError> {
        if self.owner.is_some_and(|o| o != owner) {
            return Err(InterpreterError::NotOwner);
        }
        // The process as the unwinder's map has it now, and only if it still maps the
        // named file: a record of the program before an exec names a file the new one
        // may not map.
        let key = match self.processes.get(&tgid) {
            Some((s, exec_id, files))
                if *s == start_ns && files.contains(&super::FileKey::of(m)) =>
            {
                ProcKey {
                    tgid,
                    start_ns,
                    exec_id: *exec_id,
                }
            }
            _ => return Err(InterpreterError::UnknownProcess),
        };
        let r = self.python.load(key, m, bytes);
        let c = &self.counters;
        match &r {
            Ok(()) => {
                self.processes_changed();
                self.owner = Some(owner);
                bump(&c.python_interpreters_loaded);
            }
            Err(InterpreterError::Invalid(_) | InterpreterError::Malformed) => {
                bump(&c.python_interpreters_refused_invalid)
            }
            Err(InterpreterError::Outside) => bump(&c.python_interpreters_refused_outside),
            Err(_) => bump(&c.python_interpreters_refused_other),
        }
        c.python_interpreters_in_use
            .set(self.python.loaded() as u64);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        let (minor, offsets) = firn_schema::python_record::LAYOUTS[2];
        let mut b = Record {
            minor,
            micro: 1,
            position: firn_schema::python_record::POSITION_POINTER,
            boundary: firn_schema::python_record::BOUNDARY_OWNER,
            cstack: 3,
            text_delta: 0,
            runtime: 0x64_3340,
            code_type: 0x54_9e80,
            str_type: 0x56_3c20,
            bytes_type: 0x54_8840,
            eval: (0x10_bdc0, 0x11_882d),
            eval_cold: (0x10_ba24, 0x10_bdb0),
            ..Record::default()
        }
        .to_bytes();
        for (i, o) in offsets.iter().enumerate() {
            b[80 + 2 * i..82 + 2 * i].copy_from_slice(&o.to_le_bytes());
        }
        Record::from_bytes(&b).expect("a record")
    }

    fn text() -> Mapping {
        Mapping {
            start: 0x7f00_0010_0000,
            end: 0x7f00_0030_0000,
            offset: 0x10_0000,
            dev_major: 8,
            dev_minor: 1,
            inode: 42,
            path: b"/usr/lib/libpython3.12.so.1.0"[..].into(),
            cut: false,
        }
    }

    const KEY: ProcKey = ProcKey {
        tgid: 7,
        start_ns: 1,
        exec_id: 0,
    };

    #[test]
    fn a_record_is_placed_in_its_process() {
        let r = record();
        assert_eq!(r.check(), Ok(()));
        let p = place(&r, KEY, &text()).expect("placed");
        assert_eq!(p.eval_start, 0x7f00_0010_0000 + 0xbdc0);
        assert_eq!(p.runtime, 0x7f00_0000_0000 + 0x64_3340);
        assert_eq!((p.frame_span, p.code_span), (71, 144));
    }

    #[test]
    fn records_outside_their_mapping_are_refused() {
        let mut r = record();
        r.eval = (0x40_0000, 0x40_1000);
        assert_eq!(
            place(&r, KEY, &text()).err(),
            Some(InterpreterError::Outside)
        );
        let mut r = record();
        r.runtime = MAX_IMAGE_BYTES + 8;
        assert_eq!(
            place(&r, KEY, &text()).err(),
            Some(InterpreterError::Outside)
        );
        let mut r = record();
        r.text_delta = 0x7f00_0000_0008;
        assert_eq!(
            place(&r, KEY, &text()).err(),
            Some(InterpreterError::Outside)
        );
        let mut i = Interpreters::new(None, None);
        let mut lie = record().to_bytes();
        lie[80] = 56;
        assert_eq!(
            i.load(KEY, &text(), &lie),
            Err(InterpreterError::Invalid(Invalid::Layout))
        );
        assert_eq!(
            i.load(KEY, &text(), &lie[..100]),
            Err(InterpreterError::Malformed)
        );
    }
}

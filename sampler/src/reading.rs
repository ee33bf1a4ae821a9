//! One process's record at its discovery: read from /proc, or, when the process is gone
//! or exec'd first, what BPF saw with its executable placed from another process of the
//! same file ([`Layouts`]).

use std::cell::RefCell;

use crate::counters::{add, bump, Counters};
use crate::facts;
use crate::handles::Handles;
use crate::layouts::{ExeSeen, Layouts};
use crate::processes::ProcKey;
use crate::procfs::{self, ProcError, ProcessRecord};

/// The record read from /proc, trimmed to its bound, or a placeholder of BPF facts (with
/// its executable from `layouts` when gone). Its mapped files are queued for handles
/// ([`ProcessTable::take_handles`]).
pub(crate) fn read_record(
    key: ProcKey,
    (comm, exe, cgroup): (&[u8], ExeSeen, Option<&[u8]>),
    (handles, layouts): (&RefCell<Handles>, &mut Layouts),
    counters: &Counters,
) -> (ProcessRecord, usize) {
    let (tgid, start_ns) = (key.tgid, key.start_ns);
    let t0 = std::time::Instant::now();
    let got = match exe.facts.filter(|f| facts::usable(&exe, f)) {
        Some(f) => match facts::read_process((tgid, start_ns), &exe, &f, cgroup) {
            Ok((r, read, Some(dir))) => {
                bump(&counters.processes_read_from_facts);
                Ok((r, read, dir))
            }
            // A kernel thread: nothing to read, nothing to hold.
            Ok((r, _, None)) => {
                bump(&counters.processes_read);
                bump(&counters.processes_read_from_facts);
                return (r, 0);
            }
            // Not the executable BPF saw where it saw it: exec'd, reused, or a
            // filesystem whose maps name another inode than `exe`. The stat-checked
            // read tells which.
            Err((ProcError::Execed { .. }, spent)) => {
                bump(&counters.process_facts_mismatched);
                procfs::read_process_at(tgid, start_ns, exe.ino, cgroup)
                    .map(|(r, read, dir)| (r, read + spent, dir))
            }
            Err((e, _)) => Err(e),
        },
        None => procfs::read_process_at(tgid, start_ns, exe.ino, cgroup),
    };
    add(
        &counters.process_read_ns,
        u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX),
    );
    match got {
        Ok((mut r, read, dir)) => {
            bump(&counters.processes_read);
            if r.trim_to(procfs::MAX_RECORD_BYTES) {
                bump(&counters.process_records_trimmed);
                tracing::warn!(
                    pid = tgid,
                    kept_mappings = r.mappings.len(),
                    max_bytes = procfs::MAX_RECORD_BYTES,
                    "process record over its byte bound; mappings past it left out"
                );
            }
            handles.borrow_mut().queue(dir, &r.mappings, counters);
            layouts.learn(exe, &r);
            (r, read)
        }
        Err(e) => {
            let mut record = placeholder(tgid, start_ns, comm);
            match e {
                ProcError::Gone { .. } | ProcError::Reused { .. } => {
                    layouts.describe(exe, &mut record, counters);
                    bump(&counters.processes_gone);
                    tracing::info!(
                        pid = tgid,
                        "process gone before /proc could be read; sent with what BPF saw"
                    );
                }
                ProcError::Execed { .. } => {
                    layouts.describe(exe, &mut record, counters);
                    bump(&counters.processes_execed_before_read);
                    tracing::info!(
                        pid = tgid,
                        "process exec'd before /proc could be read; its earlier program \
                         is sent with what BPF saw"
                    );
                }
                _ => {
                    bump(&counters.process_read_errors);
                    tracing::warn!(pid = tgid, error = %e, "process record unreadable");
                }
            }
            (record, 0)
        }
    }
}

/// A record of what BPF saw: pid, start time, thread comm.
pub(crate) fn placeholder(tgid: u32, start_ns: u64, comm: &[u8]) -> ProcessRecord {
    ProcessRecord {
        pid: tgid,
        start_ns,
        comm: comm.split(|&b| b == 0).next().unwrap_or_default().to_vec(),
        complete: false,
        ..Default::default()
    }
}

//! Batches from the sampler, read into owned values with every list checked against
//! the schema's limits. Anything over a limit rejects the whole batch.

use firn_schema::firn_capnp::{self, batch, StackStatus, UnwindEnd};
use firn_schema::limits;
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("malformed batch: {0}")]
    Capnp(#[from] capnp::Error),
    #[error("batch has {got} {what}, over the limit of {limit}")]
    TooMany {
        what: &'static str,
        got: u32,
        limit: u32,
    },
    #[error("sample refers to kernel symbol {index} of {len}")]
    BadSymbol { index: u32, len: usize },
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Mapping {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) file_offset: u64,
    pub(crate) dev_major: u32,
    pub(crate) dev_minor: u32,
    pub(crate) inode: u64,
    pub(crate) path: String,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Process {
    pub(crate) process_id: u64,
    pub(crate) pid: u32,
    pub(crate) start_time_ns: u64,
    pub(crate) ppid: u32,
    pub(crate) uid: u32,
    pub(crate) comm: String,
    pub(crate) exe: String,
    pub(crate) cmdline: Vec<String>,
    pub(crate) cgroup: String,
    pub(crate) mappings: Vec<Mapping>,
    pub(crate) mappings_version: u32,
    pub(crate) complete: bool,
    /// CLOCK_BOOTTIME ns of its first sample as the sampler heard of it (0: unknown).
    #[serde(skip)]
    pub(crate) first_sample_ns: u64,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Stack {
    Ok,
    Absent,
    Lost,
    Error,
}

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub(crate) process_id: u64,
    pub(crate) pid: u32,
    pub(crate) tid: u32,
    pub(crate) comm: String,
    pub(crate) count: u64,
    pub(crate) user_frames: Vec<u64>,
    pub(crate) kernel_frames: Vec<u32>,
    pub(crate) user_stack: Stack,
    pub(crate) kernel_stack: Stack,
    /// Why the unwinder stopped early, when the stack is known to be cut short.
    pub(crate) user_end: Option<&'static str>,
    /// The cgroup v2 id it was taken in (0: unknown); its path in some `Batch.cgroups`.
    pub(crate) cgroup_id: u64,
    /// Nanoseconds off CPU under these stacks (--off-cpu; `count` is then 0).
    pub(crate) off_cpu_ns: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Batch {
    pub(crate) session_id: u64,
    pub(crate) round: u64,
    pub(crate) start_time_ns: u64,
    pub(crate) end_time_ns: u64,
    pub(crate) frequency_hz: u32,
    pub(crate) dropped_batches: u64,
    pub(crate) processes: Vec<Process>,
    pub samples: Vec<Sample>,
    pub(crate) kernel_symbols: Vec<String>,
    pub(crate) counters: Vec<(String, u64)>,
    pub(crate) forgotten_processes: Vec<u64>,
    /// Unwind tables the sampler evicted, in all.
    pub(crate) tables_evicted: u64,
    /// Python code objects' names as the BPF walk copied them (decoded by
    /// `python::names`, which bounds each).
    pub(crate) python_code: Vec<Vec<u8>>,
    /// Cgroup id → path, for ids not sent before.
    pub(crate) cgroups: Vec<(u64, String)>,
    /// The sampler times off-CPU waits (its profiles carry the off-CPU type).
    pub(crate) off_cpu: bool,
}

fn check(what: &'static str, got: u32, limit: u32) -> Result<(), DecodeError> {
    if got > limit {
        Err(DecodeError::TooMany { what, got, limit })
    } else {
        Ok(())
    }
}

fn bytes(d: capnp::data::Reader<'_>, what: &'static str) -> Result<String, DecodeError> {
    check(what, d.len() as u32, limits::MAX_PATH_BYTES)?;
    Ok(String::from_utf8_lossy(d).into_owned())
}

/// The marker frame of a user stack the unwinder could not finish. Stacks that ended
/// while walking frame pointers get none: they may well be whole.
fn unwind_marker(e: Result<UnwindEnd, capnp::NotInSchema>) -> Option<&'static str> {
    match e {
        Ok(UnwindEnd::NoProcess) => Some("[unwind stopped: process mappings not read yet]"),
        Ok(UnwindEnd::NoMapping) => {
            Some("[unwind stopped: code outside file mappings: JIT, anonymous or vDSO]")
        }
        Ok(UnwindEnd::Unsupported) => Some("[unwind stopped: unsupported CFA rule]"),
        Ok(UnwindEnd::ReadFault) => Some("[unwind stopped: stack memory unreadable]"),
        Ok(UnwindEnd::DepthLimit) => Some("[unwind stopped: 127-frame limit]"),
        Ok(UnwindEnd::BadFrame) => Some("[unwind stopped: caller frame not code of the process]"),
        Ok(UnwindEnd::Complete | UnwindEnd::NoTable | UnwindEnd::NotInTable) => None,
        Err(_) => Some("[unwind stopped: unknown reason]"),
    }
}

fn stack(s: Result<StackStatus, capnp::NotInSchema>) -> Stack {
    match s {
        Ok(StackStatus::Ok) => Stack::Ok,
        Ok(StackStatus::Absent) => Stack::Absent,
        Ok(StackStatus::Lost) => Stack::Lost,
        Ok(StackStatus::Error) | Err(_) => Stack::Error,
    }
}

pub(crate) fn counters(
    list: capnp::struct_list::Reader<'_, firn_schema::firn_capnp::counter::Owned>,
) -> Result<Vec<(String, u64)>, DecodeError> {
    check("counters", list.len(), limits::MAX_COUNTERS)?;
    list.iter()
        .map(|c| Ok((c.get_name()?.to_string().unwrap_or_default(), c.get_value())))
        .collect()
}

pub fn decode(b: batch::Reader<'_>) -> Result<Batch, DecodeError> {
    let syms = b.get_kernel_symbols()?;
    check("kernel symbols", syms.len(), limits::MAX_KERNEL_SYMBOLS)?;
    let kernel_symbols = syms
        .iter()
        .map(|s| {
            let s = s?;
            check("symbol bytes", s.len() as u32, limits::MAX_SYMBOL_BYTES)?;
            Ok(String::from_utf8_lossy(s.as_bytes()).into_owned())
        })
        .collect::<Result<Vec<_>, DecodeError>>()?;

    let processes = processes(b.get_processes()?)?;
    let samples = samples(b.get_samples()?, kernel_symbols.len())?;
    // Blobs past the bound are cut rather than the batch refused: its samples and
    // records matter more than a few names (counted by the caller as missing).
    let code = b.get_python_code()?;
    let python_code = code
        .iter()
        .take(limits::MAX_PYTHON_CODES as usize)
        .map(|c| {
            let c = c?;
            check(
                "python code bytes",
                c.len() as u32,
                limits::PYTHON_CODE_MAX_BYTES,
            )?;
            Ok(c.to_vec())
        })
        .collect::<Result<Vec<_>, DecodeError>>()?;
    let list = b.get_cgroups()?;
    check("cgroups", list.len(), limits::MAX_SAMPLES)?;
    let cgroups = list
        .iter()
        .map(|c| Ok((c.get_id(), bytes(c.get_path()?, "cgroup bytes")?)))
        .collect::<Result<Vec<_>, DecodeError>>()?;
    let forgotten = b.get_forgotten_processes()?;
    check(
        "forgotten processes",
        forgotten.len(),
        limits::MAX_PROCESSES,
    )?;
    Ok(Batch {
        forgotten_processes: forgotten.iter().collect(),
        session_id: b.get_session_id(),
        round: b.get_round(),
        start_time_ns: b.get_start_time_ns(),
        end_time_ns: b.get_end_time_ns(),
        frequency_hz: b.get_frequency_hz(),
        dropped_batches: b.get_dropped_batches(),
        tables_evicted: b.get_unwind_tables_evicted(),
        processes,
        samples,
        kernel_symbols,
        counters: counters(b.get_counters()?)?,
        python_code,
        cgroups,
        off_cpu: b.get_off_cpu(),
    })
}

/// The records of an announcement (a new process's, between rounds).
pub(crate) fn announced(
    p: firn_capnp::batch_sink::announce_params::Reader<'_>,
) -> Result<Vec<Process>, DecodeError> {
    processes(p.get_processes()?)
}

/// The batch's process records, every list and field within its bound.
fn processes(
    procs: capnp::struct_list::Reader<'_, firn_capnp::process::Owned>,
) -> Result<Vec<Process>, DecodeError> {
    check("processes", procs.len(), limits::MAX_PROCESSES)?;
    let mut processes = Vec::with_capacity(procs.len() as usize);
    for p in procs.iter() {
        let maps = p.get_mappings()?;
        check("mappings", maps.len(), limits::MAX_MAPPINGS)?;
        let args = p.get_cmdline()?;
        check("arguments", args.len(), limits::MAX_CMDLINE_ARGS)?;
        processes.push(Process {
            process_id: p.get_process_id(),
            pid: p.get_pid(),
            start_time_ns: p.get_start_time_ns(),
            ppid: p.get_ppid(),
            uid: p.get_uid(),
            comm: bytes(p.get_comm()?, "comm bytes")?,
            exe: bytes(p.get_exe()?, "exe bytes")?,
            cmdline: args
                .iter()
                .map(|a| bytes(a?, "argument bytes"))
                .collect::<Result<_, _>>()?,
            cgroup: bytes(p.get_cgroup()?, "cgroup bytes")?,
            mappings: maps
                .iter()
                .map(|m| {
                    Ok(Mapping {
                        start: m.get_start(),
                        end: m.get_end(),
                        file_offset: m.get_file_offset(),
                        dev_major: m.get_dev_major(),
                        dev_minor: m.get_dev_minor(),
                        inode: m.get_inode(),
                        path: bytes(m.get_path()?, "path bytes")?,
                    })
                })
                .collect::<Result<_, DecodeError>>()?,
            mappings_version: p.get_mappings_version(),
            complete: p.get_complete(),
            first_sample_ns: p.get_first_sample_ns(),
        });
    }

    Ok(processes)
}

/// The batch's samples; kernel frames must index the batch's `symbols` symbols.
fn samples(
    list: capnp::struct_list::Reader<'_, firn_capnp::sample::Owned>,
    symbols: usize,
) -> Result<Vec<Sample>, DecodeError> {
    check("samples", list.len(), limits::MAX_SAMPLES)?;
    let mut samples = Vec::with_capacity(list.len() as usize);
    for s in list.iter() {
        let user = s.get_user_frames()?;
        check("user frames", user.len(), limits::MAX_FRAMES)?;
        let kernel = s.get_kernel_frames()?;
        check("kernel frames", kernel.len(), limits::MAX_FRAMES)?;
        let kernel_frames: Vec<u32> = kernel.iter().collect();
        if let Some(&index) = kernel_frames.iter().find(|&&i| i as usize >= symbols) {
            return Err(DecodeError::BadSymbol {
                index,
                len: symbols,
            });
        }
        samples.push(Sample {
            process_id: s.get_process_id(),
            pid: s.get_pid(),
            tid: s.get_tid(),
            comm: bytes(s.get_comm()?, "comm bytes")?,
            count: s.get_count(),
            user_frames: user.iter().collect(),
            kernel_frames,
            user_stack: stack(s.get_user_stack()),
            kernel_stack: stack(s.get_kernel_stack()),
            user_end: if user.is_empty() {
                None
            } else {
                unwind_marker(s.get_user_stack_end())
            },
            cgroup_id: s.get_cgroup_id(),
            off_cpu_ns: s.get_off_cpu_ns(),
        });
    }
    Ok(samples)
}

//! Process records read from /proc. Everything here is kernel-formatted text about
//! other processes; it is bounded, split only as far as needed, and forwarded as
//! bytes for the enricher to interpret (DESIGN.md rule 1).

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};

use firn_schema::limits;
use nix::fcntl::{openat, OFlag};
use nix::sys::stat::{fstat, Mode};

/// Bytes read of /proc/<pid>/maps at most. It is parsed as it streams in, so only the
/// executable file mappings kept are held, never the text.
const MAX_MAPS_BYTES: u64 = 16 << 20;
const MAX_STAT_BYTES: usize = 2048;
/// Bytes one process record may take on the wire (estimated by [`ProcessRecord::wire_bytes`]);
/// mappings past it are left out. A typical process needs a few KiB, a large browser
/// process some tens.
pub const MAX_RECORD_BYTES: usize = 256 << 10;

#[derive(Debug, thiserror::Error)]
pub(crate) enum ProcError {
    #[error("process {pid} is gone")]
    Gone { pid: u32 },
    #[error("pid {pid} now belongs to another process")]
    Reused { pid: u32 },
    #[error("reading /proc/{pid}/{file}: {source}")]
    Io {
        pid: u32,
        file: &'static str,
        source: std::io::Error,
    },
    #[error("/proc/{pid}/stat has an unexpected format")]
    Format { pid: u32 },
    #[error("process {pid} exec'd another program before it could be read")]
    Execed { pid: u32 },
}

/// A record's text that repeats across processes (paths, cgroup files, command lines),
/// shared between records by the table (`texts.rs`).
pub(crate) type Text = std::rc::Rc<[u8]>;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Mapping {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) offset: u64,
    pub(crate) dev_major: u32,
    pub(crate) dev_minor: u32,
    pub(crate) inode: u64,
    pub(crate) path: Text,
    /// The kernel printed a longer path than is kept: it can never be resolved, so it is
    /// never walked (not sent: the enricher sees the kept prefix).
    pub(crate) cut: bool,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct ProcessRecord {
    pub(crate) pid: u32,
    pub(crate) start_ns: u64,
    pub(crate) ppid: u32,
    pub(crate) uid: u32,
    pub(crate) comm: Vec<u8>,
    pub(crate) exe: Text,
    /// The arguments, each followed by a NUL (none empty; see [`Self::args`]).
    pub(crate) cmdline: Text,
    pub(crate) cgroup: Text,
    pub(crate) mappings: Vec<Mapping>,
    /// Anonymous executable ranges (JIT code, the vDSO): for the unwinder's check that
    /// every frame is code of the process; not sent.
    pub(crate) code: Vec<(u64, u64)>,
    pub(crate) complete: bool,
    /// CLOCK_BOOTTIME ns when the BPF event of its first sample was read (0: found in a
    /// round's samples).
    pub(crate) first_sample_ns: u64,
}

/// Bytes a field costs on the wire beyond its text: Cap'n Proto pointer and padding.
const FIELD_OVERHEAD: usize = 16;
/// A mapping's fixed part: six integers and the path pointer.
const MAPPING_FIXED: usize = 56;

impl ProcessRecord {
    /// The command line's arguments.
    pub(crate) fn args(&self) -> impl Iterator<Item = &[u8]> {
        self.cmdline.split(|&b| b == 0).filter(|a| !a.is_empty())
    }

    /// An upper estimate of the record's size in a batch.
    pub(crate) fn wire_bytes(&self) -> usize {
        let text = |b: &[u8]| b.len() + FIELD_OVERHEAD;
        96 + text(&self.comm)
            + text(&self.exe)
            + text(&self.cgroup)
            + self.args().map(text).sum::<usize>()
            + self
                .mappings
                .iter()
                .map(|m| MAPPING_FIXED + text(&m.path))
                .sum::<usize>()
    }

    /// Leaves out mappings until the record takes at most `max` bytes: repeated mappings
    /// of one file go first (a process mapping one file thousands of times should not
    /// crowd out its libraries), then the highest addresses. Whether anything was cut.
    pub(crate) fn trim_to(&mut self, max: usize) -> bool {
        let total = self.wire_bytes();
        if total <= max {
            return false;
        }
        let cost = |m: &Mapping| MAPPING_FIXED + m.path.len() + FIELD_OVERHEAD;
        let fixed = total - self.mappings.iter().map(cost).sum::<usize>();
        let mut seen = std::collections::HashSet::new();
        let first: Vec<bool> = self
            .mappings
            .iter()
            .map(|m| seen.insert((m.dev_major, m.dev_minor, m.inode)))
            .collect();
        let mut keep = vec![false; self.mappings.len()];
        let mut used = fixed;
        for pass_first in [true, false] {
            for (i, m) in self.mappings.iter().enumerate() {
                if keep[i] || first[i] != pass_first {
                    continue;
                }
                if used + cost(m) > max {
                    continue;
                }
                used += cost(m);
                keep[i] = true;
            }
        }
        let mut i = 0;
        self.mappings.retain(|_| {
            i += 1;
            keep[i - 1]
        });
        true
    }
}

/// First address above user space (x86_64, 4-level paging).
const USER_SPACE_END: u64 = 1 << 47;

/// Clock ticks per second used by /proc/<pid>/stat's start time (USER_HZ).
fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

/// The record of `pid`, whose leader started at `start_ns` (boot-time ns, as BPF saw
/// it; else `Reused`), the bytes read and the verified `/proc/<pid>` fd (for handles
/// through the process's root). With `exe_ino` not 0 the process must still run that
/// executable, else it exec'd meanwhile (`Execed`). `cgroup`: the text of the cgroup
/// it was sampled in, when already known (then not read again).
pub(crate) fn read_process_at(
    pid: u32,
    start_ns: u64,
    exe_ino: u64,
    cgroup: Option<&[u8]>,
) -> Result<(ProcessRecord, usize, OwnedFd), ProcError> {
    // A directory fd of /proc/<pid> keeps naming this very process: if it exits and the
    // pid is reused, reads through the fd fail instead of describing the newcomer.
    let (dir, stat, parsed) = verified(pid, start_ns)?;
    if parsed.exited {
        // Reading on would give a record with no executable and no mappings.
        return Err(ProcError::Gone { pid });
    }
    if exe_ino != 0 {
        // stat follows the exe link to the file it names.
        match nix::sys::stat::fstatat(&dir, "exe", nix::fcntl::AtFlags::empty()) {
            Ok(st) if st.st_ino == exe_ino => {}
            Ok(_) => return Err(ProcError::Execed { pid }),
            Err(e) => return Err(io_err(pid, "exe", e)),
        }
    }
    let uid = fstat(dir.as_fd()).map_err(|e| io_err(pid, "", e))?.st_uid;
    let exe: Text = nix::fcntl::readlinkat(dir.as_fd(), "exe")
        .map(|p| {
            let mut b = p.into_encoded_bytes();
            b.truncate(limits::MAX_PATH_BYTES as usize);
            b.into()
        })
        .unwrap_or_default();
    // Mappings before the rest: a short-lived process may be gone at the next read.
    let ((mappings, code), maps_read) = read_maps(&dir, pid)?;
    if exe.is_empty() && mappings.is_empty() && !parsed.kernel_thread {
        // Its memory went while it was read (exit_mm comes before the zombie state).
        return Err(ProcError::Gone { pid });
    }
    let cmdline = read_cmdline(&dir, pid);
    let cgroup: Text = match cgroup {
        Some(c) => c.into(),
        // Unreadable (gone by now): kept with what was read, as with `cmdline`.
        None => cgroup_of(&dir, pid).unwrap_or_default().into(),
    };
    let read = stat.len() + exe.len() + cgroup.len() + maps_read;
    let record = ProcessRecord {
        pid,
        start_ns,
        ppid: parsed.ppid,
        uid,
        comm: parsed.comm,
        exe,
        cmdline,
        cgroup,
        mappings,
        code,
        complete: true,
        first_sample_ns: 0,
    };
    let read = read + record.cmdline.len();
    Ok((record, read, dir))
}

/// Executable file mappings and anonymous executable ranges of a process.
pub(crate) type Maps = (Vec<Mapping>, Vec<(u64, u64)>);

/// Reads only the executable mappings again (after a sample fell outside them), of the
/// process that started at `start_ns` (not a successor with its pid). Also returns the
/// bytes read and the verified `/proc/<pid>` directory fd.
pub(crate) fn read_mappings(pid: u32, start_ns: u64) -> Result<(Maps, usize, OwnedFd), ProcError> {
    let dir = open_verified(pid, start_ns)?;
    let (maps, n) = read_maps(&dir, pid)?;
    Ok((maps, n, dir))
}

/// The start time of `pid` as the BPF program reports it (boot-time ns, at the clock
/// tick's precision), for tests that observe real processes.
#[cfg(test)]
pub(crate) fn start_ns_of(pid: u32) -> Option<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    Some(parse_stat(&stat)?.start_ticks * (1_000_000_000 / clock_ticks()))
}

/// Whether /proc/<pid> still belongs to the process that started at `start_ns`.
pub(crate) fn is_alive(pid: u32, start_ns: u64) -> bool {
    let Ok(dir) = open_proc_dir(pid) else {
        return false;
    };
    let Ok(stat) = read_bounded(&dir, pid, "stat", MAX_STAT_BYTES) else {
        return false;
    };
    parse_stat(&stat).is_some_and(|s| s.start_ticks == start_ns / (1_000_000_000 / clock_ticks()))
}

/// `/proc/<pid>/cgroup` of the process that started at `start_ns` (after it moved).
pub(crate) fn read_cgroup(pid: u32, start_ns: u64) -> Result<Vec<u8>, ProcError> {
    cgroup_of(&verified(pid, start_ns)?.0, pid)
}

/// The arguments of the process at `dir` (none when unreadable: gone by now).
pub(crate) fn read_cmdline(dir: &OwnedFd, pid: u32) -> Text {
    read_bounded(dir, pid, "cmdline", limits::MAX_CMDLINE_BYTES as usize)
        .map(|c| split_cmdline(&c))
        .unwrap_or_default()
}

pub(crate) fn cgroup_of(dir: &OwnedFd, pid: u32) -> Result<Vec<u8>, ProcError> {
    read_bounded(dir, pid, "cgroup", limits::MAX_PATH_BYTES as usize)
}

/// A directory fd of /proc/<pid>, checked to belong to the process that started at
/// `start_ns`. Everything opened through it later refers to that very process.
pub(crate) fn open_verified(pid: u32, start_ns: u64) -> Result<OwnedFd, ProcError> {
    verified(pid, start_ns).map(|(dir, _, _)| dir)
}

/// [`open_verified`], also returning the stat text it read and its parse.
fn verified(pid: u32, start_ns: u64) -> Result<(OwnedFd, Vec<u8>, Stat), ProcError> {
    let dir = open_proc_dir(pid)?;
    let stat = read_bounded(&dir, pid, "stat", MAX_STAT_BYTES)?;
    let parsed = parse_stat(&stat).ok_or(ProcError::Format { pid })?;
    if parsed.start_ticks != start_ns / (1_000_000_000 / clock_ticks()) {
        return Err(ProcError::Reused { pid });
    }
    Ok((dir, stat, parsed))
}

pub(crate) fn open_proc_dir(pid: u32) -> Result<OwnedFd, ProcError> {
    let path = format!("/proc/{pid}");
    nix::fcntl::open(
        path.as_str(),
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| match e {
        nix::errno::Errno::ENOENT | nix::errno::Errno::ESRCH => ProcError::Gone { pid },
        e => io_err(pid, "", e),
    })
}

fn io_err(pid: u32, file: &'static str, e: nix::errno::Errno) -> ProcError {
    if matches!(e, nix::errno::Errno::ESRCH | nix::errno::Errno::ENOENT) {
        ProcError::Gone { pid }
    } else {
        ProcError::Io {
            pid,
            file,
            source: e.into(),
        }
    }
}

/// At most `max` bytes of a file whose kernel side hands over all it holds that fits in
/// one read (a seq_file record such as stat or cgroup, cmdline, a sysfs attribute): a
/// short read is its end, so no read is made just to see 0. (Not so for maps, which is
/// read through a BufReader.)
pub(crate) fn read_short(fd: impl AsFd, max: usize) -> nix::Result<Vec<u8>> {
    let mut buf = vec![0u8; max.min(4096)];
    let mut len = 0;
    loop {
        if len == buf.len() {
            if len >= max {
                break;
            }
            buf.resize((2 * len).min(max), 0);
        }
        let n = nix::unistd::read(&fd, &mut buf[len..])?;
        len += n;
        if n == 0 || len < buf.len() {
            break;
        }
    }
    buf.truncate(len);
    Ok(buf)
}

fn read_bounded(
    dir: &OwnedFd,
    pid: u32,
    file: &'static str,
    max: usize,
) -> Result<Vec<u8>, ProcError> {
    let fd = openat(
        dir.as_fd(),
        file,
        OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::empty(),
    )
    .map_err(|e| io_err(pid, file, e))?;
    let err = |e: nix::errno::Errno| match e {
        nix::errno::Errno::ESRCH => ProcError::Gone { pid },
        e => ProcError::Io {
            pid,
            file,
            source: e.into(),
        },
    };
    let mut buf = read_short(&fd, max).map_err(err)?;
    // A record keeps some of these (cgroup) for rounds: not with 4 KiB of spare room.
    buf.shrink_to_fit();
    Ok(buf)
}

/// linux/sched.h: the task is a kernel thread.
const PF_KTHREAD: u64 = 0x0020_0000;

struct Stat {
    comm: Vec<u8>,
    /// Z (zombie) or X (dead): its memory, maps and exe are gone already.
    exited: bool,
    /// PF_KTHREAD: no executable and no mappings, by nature.
    kernel_thread: bool,
    ppid: u32,
    start_ticks: u64,
}

/// `pid (comm) state ppid … starttime(22) …`; comm may hold spaces and parentheses,
/// so fields are counted from the last ')'.
fn parse_stat(stat: &[u8]) -> Option<Stat> {
    let open = stat.iter().position(|&b| b == b'(')?;
    let close = stat.iter().rposition(|&b| b == b')')?;
    let comm = stat.get(open + 1..close)?.to_vec();
    let rest = std::str::from_utf8(stat.get(close + 1..)?).ok()?;
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    // fields[0] is field 3 (state).
    let exited = matches!(*fields.first()?, "Z" | "X");
    let ppid = fields.get(1)?.parse().ok()?;
    let flags: u64 = fields.get(6)?.parse().ok()?;
    let start_ticks = fields.get(19)?.parse().ok()?;
    Some(Stat {
        comm,
        exited,
        kernel_thread: flags & PF_KTHREAD != 0,
        ppid,
        start_ticks,
    })
}

/// The arguments of a raw command line, each followed by a NUL: empty ones left out,
/// at most MAX_CMDLINE_ARGS.
fn split_cmdline(raw: &[u8]) -> Text {
    let mut out = Vec::with_capacity(raw.len() + 1);
    for a in raw
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .take(limits::MAX_CMDLINE_ARGS as usize)
    {
        out.extend_from_slice(a);
        out.push(0);
    }
    out.into()
}

/// Anonymous executable ranges kept per process at most.
pub(crate) const MAX_CODE_RANGES: usize = 16;

pub(crate) fn read_maps(dir: &OwnedFd, pid: u32) -> Result<(Maps, usize), ProcError> {
    let fd = openat(
        dir.as_fd(),
        "maps",
        OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::empty(),
    )
    .map_err(|e| io_err(pid, "maps", e))?;
    let reader = std::io::BufReader::with_capacity(64 << 10, File::from(fd).take(MAX_MAPS_BYTES));
    let (all, read) = parse_maps_from(reader).map_err(|e| match e.raw_os_error() {
        Some(libc::ESRCH) => ProcError::Gone { pid },
        _ => ProcError::Io {
            pid,
            file: "maps",
            source: e,
        },
    })?;
    let (files, anon): (Vec<Mapping>, Vec<Mapping>) = all.into_iter().partition(|m| m.inode != 0);
    let code = anon.iter().map(|m| (m.start, m.end)).collect();
    Ok(((files, code), read))
}

/// Keeps executable mappings: `start-end perms offset maj:min inode  path`. Those of
/// files have an inode; anonymous ones (JIT code, the vDSO; at most
/// [`MAX_CODE_RANGES`]) have inode 0.
#[cfg(test)]
pub(crate) fn parse_maps(maps: &[u8]) -> Vec<Mapping> {
    parse_maps_from(maps).map_or_else(|_| Vec::new(), |(m, _)| m)
}

/// [`parse_maps`] on a stream; also returns the bytes read. Once the mappings kept
/// would fill a record, further mappings of a file already kept are skipped (a process
/// mapping one file thousands of times must not crowd out the libraries after them), and
/// at twice that nothing more is kept. [`ProcessRecord::trim_to`] makes the final cut.
pub(crate) fn parse_maps_from(
    mut r: impl std::io::BufRead,
) -> std::io::Result<(Vec<Mapping>, usize)> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let (mut read, mut kept, mut anon) = (0usize, 0usize, 0usize);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = r.read_until(b'\n', &mut line)?;
        if n == 0 {
            break;
        }
        read += n;
        if out.len() >= limits::MAX_MAPPINGS as usize || kept > 2 * MAX_RECORD_BYTES {
            continue;
        }
        let text = line.strip_suffix(b"\n").unwrap_or(&line);
        let Some(m) = parse_maps_line(text) else {
            continue;
        };
        if m.inode == 0 {
            anon += 1;
            if anon <= MAX_CODE_RANGES {
                out.push(m);
            }
            continue;
        }
        let first = seen.insert((m.dev_major, m.dev_minor, m.inode));
        if !first && kept > MAX_RECORD_BYTES {
            continue;
        }
        kept += MAPPING_FIXED + FIELD_OVERHEAD + m.path.len();
        out.push(m);
    }
    Ok((out, read))
}

fn parse_maps_line(line: &[u8]) -> Option<Mapping> {
    let mut it = line.splitn(6, |&b| b == b' ');
    let range = it.next()?;
    let perms = it.next()?;
    let offset = it.next()?;
    let dev = it.next()?;
    let inode = it.next()?;
    let path = it.next().unwrap_or_default();
    if perms.get(2) != Some(&b'x') {
        return None;
    }
    let inode: u64 = std::str::from_utf8(inode).ok()?.parse().ok()?;
    let hex = |b: &[u8]| u64::from_str_radix(std::str::from_utf8(b).ok()?, 16).ok();
    let dash = range.iter().position(|&b| b == b'-')?;
    let colon = dev.iter().position(|&b| b == b':')?;
    let path = path.trim_ascii_start();
    let (start, end) = (hex(&range[..dash])?, hex(&range[dash + 1..])?);
    // [vsyscall] lies above user space; no stack frame is ever there.
    if inode == 0 && (end > USER_SPACE_END || start >= end) {
        return None;
    }
    Some(Mapping {
        start,
        end,
        offset: hex(offset)?,
        dev_major: u32::try_from(hex(&dev[..colon])?).ok()?,
        dev_minor: u32::try_from(hex(&dev[colon + 1..])?).ok()?,
        inode,
        path: path[..path.len().min(limits::MAX_PATH_BYTES as usize)].into(),
        cut: path.len() > limits::MAX_PATH_BYTES as usize,
    })
}

#[cfg(test)]
#[path = "procfs_tests.rs"]
mod tests;

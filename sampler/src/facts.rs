//! A new process's record from what BPF saw at its first sample and the /proc files
//! only the process can tell. The NEW event carries what `/proc/<pid>/stat`, the
//! directory's owner and the `exe` link would say (the main thread's comm, the parent,
//! the effective uid, whether it is a kernel thread; the executable's device, inode and
//! where its code lies), so discovery opens the directory and reads `maps`, `cmdline`
//! and (unless its cgroup is known) `cgroup`: four files fewer and six system calls
//! fewer than [`procfs::read_process_at`], on the sampler's busiest path.
//!
//! What the stat read checked is checked on the mappings instead: the executable BPF
//! saw must be mapped, and hold the code where BPF saw it (`start_code`). A process
//! that exec'd since maps another file, or the same file elsewhere (address space
//! layout randomisation places each run apart); a pid reused by another process too.
//! Only a pid reused, within the moment between the sample and the read, by a process
//! of the same executable placed at the same address would pass (built without PIE, or
//! run with address randomisation off: `randomize_va_space=0`, `ADDR_NO_RANDOMIZE`), and
//! it would be described as that process. The same check keeps a REMAP read from
//! taking a later program's mappings ([`exe_mapping`]).

use std::os::fd::OwnedFd;

use crate::layouts::ExeSeen;
use crate::procfs::{self, ProcError, ProcessRecord};

/// What the NEW event says of a process beyond its key and executable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct Facts {
    pub(crate) ppid: u32,
    pub(crate) euid: u32,
    pub(crate) kernel_thread: bool,
    /// The main thread's comm (NUL-padded).
    pub(crate) comm: [u8; firn_sampler_bpf::COMM_LEN],
}

impl Facts {
    fn comm(&self) -> Vec<u8> {
        self.comm
            .split(|&b| b == 0)
            .next()
            .unwrap_or_default()
            .to_vec()
    }
}

/// Whether `exe` and `facts` are enough to read the process without its stat file.
pub(crate) fn usable(exe: &ExeSeen, facts: &Facts) -> bool {
    facts.kernel_thread || (exe.ino != 0 && exe.start_code != 0)
}

/// The mapping of `mappings` that holds the executable BPF saw where BPF saw its code;
/// `None` when `exe` is not known (nothing to check against: `Some` of nothing).
pub(crate) fn exe_mapping<'m>(
    exe: &ExeSeen,
    mappings: &'m [procfs::Mapping],
) -> Option<Option<&'m procfs::Mapping>> {
    if exe.ino == 0 || exe.start_code == 0 {
        return None;
    }
    let file = (exe.dev >> 20, exe.dev & 0xf_ffff, exe.ino);
    Some(
        mappings
            .iter()
            .filter(|m| (m.dev_major, m.dev_minor, m.inode) == file)
            .find(|m| holds(m, exe.start_code)),
    )
}

/// The record of `pid` (started at `start_ns`), the bytes read and its `/proc/<pid>`
/// directory fd (none for a kernel thread, which has nothing to read). A failure says
/// what it had read before it (to be charged to the round's budget).
pub(crate) fn read_process(
    (pid, start_ns): (u32, u64),
    exe: &ExeSeen,
    facts: &Facts,
    cgroup: Option<&[u8]>,
) -> Result<(ProcessRecord, usize, Option<OwnedFd>), (ProcError, usize)> {
    let mut record = ProcessRecord {
        pid,
        start_ns,
        ppid: facts.ppid,
        uid: facts.euid,
        comm: facts.comm(),
        complete: true,
        ..Default::default()
    };
    if facts.kernel_thread {
        // Kernel threads live in the root cgroup; its text is what the caller knows, or
        // the v2 root's.
        record.cgroup = cgroup.unwrap_or(b"0::/\n").into();
        return Ok((record, 0, None));
    }
    let dir = procfs::open_proc_dir(pid).map_err(|e| (e, 0))?;
    // Mappings first: a short-lived process may be gone at the next read.
    let ((mappings, code), maps_read) = procfs::read_maps(&dir, pid).map_err(|e| (e, 0))?;
    let Some(Some(exe_map)) = exe_mapping(exe, &mappings) else {
        return Err((
            if mappings.is_empty() {
                // Its memory went while it was read (exit_mm comes before the zombie
                // state).
                ProcError::Gone { pid }
            } else {
                ProcError::Execed { pid }
            },
            maps_read,
        ));
    };
    record.exe = exe_map.path.clone();
    record.cmdline = procfs::read_cmdline(&dir, pid);
    record.cgroup = match cgroup {
        Some(c) => c.into(),
        // Unreadable (gone by now): kept with what was read, as with `cmdline`.
        None => procfs::cgroup_of(&dir, pid).unwrap_or_default().into(),
    };
    record.mappings = mappings;
    record.code = code;
    let read = maps_read + record.cgroup.len() + record.cmdline.len();
    Ok((record, read, Some(dir)))
}

fn holds(m: &procfs::Mapping, addr: u64) -> bool {
    m.start <= addr && addr < m.end
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// This test's own process, as BPF would see it: its executable's file and where
    /// its code lies (from its own maps).
    fn own() -> (ExeSeen, Facts) {
        let meta = std::fs::metadata("/proc/self/exe").expect("own exe");
        let dev = meta.dev();
        let (major, minor) = (libc_major(dev), libc_minor(dev));
        let maps = std::fs::read("/proc/self/maps").expect("own maps");
        let code = procfs::parse_maps(&maps)
            .into_iter()
            .find(|m| m.inode == meta.ino())
            .expect("the executable is mapped");
        let mut comm = [0u8; firn_sampler_bpf::COMM_LEN];
        comm[..4].copy_from_slice(b"test");
        (
            ExeSeen {
                dev: major << 20 | minor,
                ino: meta.ino(),
                start_code: code.start + 16,
                facts: None,
            },
            Facts {
                ppid: 1,
                euid: 0,
                kernel_thread: false,
                comm,
            },
        )
    }

    fn libc_major(dev: u64) -> u32 {
        (((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff)) as u32
    }

    fn libc_minor(dev: u64) -> u32 {
        (((dev >> 12) & 0xffff_ff00) | (dev & 0xff)) as u32
    }

    #[test]
    fn a_live_process_is_read_from_its_facts_and_mappings() {
        let (exe, facts) = own();
        let pid = std::process::id();
        let (r, read, dir) =
            read_process((pid, 7), &exe, &facts, Some(b"0::/x\n")).expect("own process readable");
        assert!(dir.is_some() && read > 0 && r.complete);
        assert_eq!((r.ppid, r.uid, r.comm.as_slice()), (1, 0, &b"test"[..]));
        assert_eq!(
            r.exe.to_vec(),
            std::fs::read_link("/proc/self/exe")
                .unwrap()
                .into_os_string()
                .into_encoded_bytes()
        );
        assert!(!r.cmdline.is_empty() && *r.cgroup == *b"0::/x\n");
    }

    #[test]
    fn another_program_under_the_pid_is_refused() {
        let (mut exe, facts) = own();
        let pid = std::process::id();
        // The file mapped, its code elsewhere: another run of it, or a reused pid.
        exe.start_code = 0x10;
        assert!(matches!(
            read_process((pid, 7), &exe, &facts, None),
            Err((ProcError::Execed { .. }, n)) if n > 0
        ));
        // Another file.
        exe.ino += 1;
        assert!(read_process((pid, 7), &exe, &facts, None).is_err());
    }

    #[test]
    fn a_kernel_thread_costs_no_read() {
        let facts = Facts {
            kernel_thread: true,
            ..Default::default()
        };
        let (r, read, dir) =
            read_process((2, 1), &ExeSeen::default(), &facts, None).expect("kernel thread");
        assert!(dir.is_none() && read == 0 && r.mappings.is_empty() && r.complete);
        assert_eq!(&*r.cgroup, b"0::/\n");
        assert!(usable(&ExeSeen::default(), &facts));
        assert!(!usable(&ExeSeen::default(), &Facts::default()));
    }
}

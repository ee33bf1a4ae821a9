//! Where a process's executable lies, learned from the processes of each file that were
//! read: a process gone before /proc could be read (a short-lived one sampled in its
//! last milliseconds) is described from another process of the same file. The kernel's
//! loader places all of an executable's segments by one bias, and BPF reports where it
//! put the code (`mm->start_code`) at the first sample, so the other process's mappings
//! of that file, moved by the difference, are this process's. Only the executable:
//! libraries lie where each process's mmap base put them.

use std::collections::{HashMap, VecDeque};

use crate::counters::{bump, Counters};
use crate::procfs::{Mapping, ProcessRecord};

/// What the layouts keep at most, in bytes of paths and mappings: ~1,000 executables of
/// typical paths; the oldest learned go first.
const MAX_BYTES: usize = 256 << 10;

/// User addresses end here on x86-64 and aarch64 (47 and 48 bits): a moved mapping
/// past it is not this process's.
const USER_END: u64 = 1 << 48;

/// The executable a process ran at its first sample, as BPF saw it (all 0: none), and
/// the rest of what the NEW event told of it (none when it was first seen otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub(crate) struct ExeSeen {
    /// The file's device, as the kernel encodes it (major << 20 | minor).
    pub(crate) dev: u32,
    pub(crate) ino: u64,
    /// `mm->start_code`: the executable's load bias plus its lowest executable p_vaddr.
    pub(crate) start_code: u64,
    pub(crate) facts: Option<crate::facts::Facts>,
}

impl ExeSeen {
    fn file(&self) -> Option<(u32, u32, u64)> {
        (self.ino != 0 && self.start_code != 0).then_some((
            self.dev >> 20,
            self.dev & 0xf_ffff,
            self.ino,
        ))
    }
}

struct Layout {
    exe: crate::procfs::Text,
    mappings: Vec<Mapping>,
    start_code: u64,
}

impl Layout {
    fn bytes(&self) -> usize {
        self.exe.len()
            + self
                .mappings
                .iter()
                .map(|m| 64 + m.path.len())
                .sum::<usize>()
    }
}

/// Executable layouts by file (device, inode), bounded in bytes.
#[derive(Default)]
pub(crate) struct Layouts {
    by_file: HashMap<(u32, u32, u64), Layout>,
    order: VecDeque<(u32, u32, u64)>,
    bytes: usize,
}

impl Layouts {
    /// Keeps where `record`'s executable lies, if it was read whole and its executable
    /// mappings are the file BPF saw and hold the code BPF saw (a process that moved its
    /// own code is not learned from).
    pub(crate) fn learn(&mut self, seen: ExeSeen, record: &ProcessRecord) {
        let Some(file) = seen.file() else { return };
        if !record.complete || record.exe.is_empty() {
            return;
        }
        let of_file = |m: &&Mapping| (m.dev_major, m.dev_minor, m.inode) == file;
        let mappings: Vec<Mapping> = record.mappings.iter().filter(of_file).cloned().collect();
        let holds_code = mappings
            .iter()
            .any(|m| m.start <= seen.start_code && seen.start_code < m.end);
        if !holds_code || mappings.iter().any(|m| m.cut) {
            return;
        }
        let layout = Layout {
            exe: record.exe.clone(),
            mappings,
            start_code: seen.start_code,
        };
        if let Some(old) = self.by_file.remove(&file) {
            self.bytes -= old.bytes();
            self.order.retain(|f| *f != file);
        }
        self.bytes += layout.bytes();
        self.by_file.insert(file, layout);
        self.order.push_back(file);
        while self.bytes > MAX_BYTES {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(l) = self.by_file.remove(&old) {
                self.bytes -= l.bytes();
            }
        }
    }

    /// Gives a placeholder record (a process /proc no longer shows as it ran) the
    /// executable and its mappings, from another process of the same file. Counted.
    pub(crate) fn describe(&self, seen: ExeSeen, record: &mut ProcessRecord, c: &Counters) {
        let Some(l) = seen.file().and_then(|f| self.by_file.get(&f)) else {
            bump(&c.processes_gone_undescribed);
            return;
        };
        let shift = |a: u64| {
            a.checked_add(seen.start_code)?
                .checked_sub(l.start_code)
                .filter(|&a| a <= USER_END)
        };
        let moved: Option<Vec<Mapping>> = l
            .mappings
            .iter()
            .map(|m| {
                Some(Mapping {
                    start: shift(m.start)?,
                    end: shift(m.end)?,
                    ..m.clone()
                })
            })
            .collect();
        let Some(mappings) = moved else {
            bump(&c.processes_gone_undescribed);
            return;
        };
        record.exe = l.exe.clone();
        record.mappings = mappings;
        bump(&c.processes_gone_described);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_file.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(start: u64, end: u64, ino: u64) -> Mapping {
        Mapping {
            start,
            end,
            offset: 0x1000,
            dev_major: 8,
            dev_minor: 1,
            inode: ino,
            path: b"/usr/bin/tool"[..].into(),
            cut: false,
        }
    }

    fn read(maps: Vec<Mapping>) -> ProcessRecord {
        ProcessRecord {
            pid: 10,
            exe: b"/usr/bin/tool"[..].into(),
            mappings: maps,
            complete: true,
            ..Default::default()
        }
    }

    const DEV: u32 = (8 << 20) | 1;

    #[test]
    fn a_gone_process_gets_its_executable_where_its_loader_put_it() {
        let c = Counters::default();
        let mut l = Layouts::default();
        let lib = Mapping {
            inode: 99,
            path: b"/usr/lib/libc.so.6"[..].into(),
            ..mapping(0x7f00_0000_0000, 0x7f00_0010_0000, 99)
        };
        let seen = |start_code| ExeSeen {
            dev: DEV,
            ino: 5,
            start_code,
            facts: None,
        };
        l.learn(
            seen(0x5555_0000_1000),
            &read(vec![mapping(0x5555_0000_1000, 0x5555_0000_9000, 5), lib]),
        );
        let mut gone = ProcessRecord::default();
        l.describe(seen(0x6000_0000_1000), &mut gone, &c);
        assert_eq!(&*gone.exe, b"/usr/bin/tool");
        assert!(!gone.complete, "still a record of what BPF saw");
        assert_eq!(
            gone.mappings.len(),
            1,
            "libraries are not moved by the same bias"
        );
        assert_eq!(
            (
                gone.mappings[0].start,
                gone.mappings[0].end,
                gone.mappings[0].offset
            ),
            (0x6000_0000_1000, 0x6000_0000_9000, 0x1000)
        );
        // Another file, a device of the same inode, or no code seen: nothing is given.
        for other in [
            ExeSeen {
                ino: 6,
                ..seen(0x6000_0000_1000)
            },
            ExeSeen {
                dev: DEV + 1,
                ..seen(0x6000_0000_1000)
            },
            seen(0),
        ] {
            let mut gone = ProcessRecord::default();
            l.describe(other, &mut gone, &c);
            assert!(gone.exe.is_empty() && gone.mappings.is_empty());
        }
        assert_eq!(
            (
                c.processes_gone_described.get(),
                c.processes_gone_undescribed.get()
            ),
            (1, 3)
        );
        // A shift past user space is refused.
        let mut gone = ProcessRecord::default();
        l.describe(seen(USER_END), &mut gone, &c);
        assert!(gone.mappings.is_empty());
    }

    #[test]
    fn a_process_that_moved_its_code_or_was_cut_teaches_nothing_and_the_bound_holds() {
        let mut l = Layouts::default();
        let seen = ExeSeen {
            dev: DEV,
            ino: 5,
            start_code: 0x9999_0000_0000,
            facts: None,
        };
        l.learn(
            seen,
            &read(vec![mapping(0x5555_0000_1000, 0x5555_0000_9000, 5)]),
        );
        let cut = Mapping {
            cut: true,
            ..mapping(0x5555_0000_1000, 0x5555_0000_9000, 5)
        };
        l.learn(
            ExeSeen {
                start_code: 0x5555_0000_1000,
                ..seen
            },
            &read(vec![cut]),
        );
        assert_eq!(l.len(), 0);
        for ino in 1..=20_000u64 {
            let start_code = 0x5555_0000_1000;
            l.learn(
                ExeSeen {
                    ino,
                    start_code,
                    ..seen
                },
                &read(vec![mapping(start_code, start_code + 0x8000, ino)]),
            );
        }
        assert!(l.bytes <= MAX_BYTES && l.len() < 20_000 && l.len() > 500);
        assert_eq!(l.order.len(), l.len());
    }
}

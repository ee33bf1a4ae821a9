//! The BPF program's process events: a ring buffer of NEW (first sample of a process),
//! EXEC (a sampled process exec'd), EXIT (a sampled process ended), CGROUP (a seen
//! process sampled in another cgroup than its last sample's) and REMAP (a seen process
//! ran code its record's mappings do not hold). They let the
//! sampler read a process's /proc entry within milliseconds of its first sample, so a
//! process that lives 20 ms is still there to be read.

use std::cell::{Cell, RefCell};
use std::os::fd::RawFd;
use std::rc::Rc;

use firn_sampler_bpf::types::{firn_event, firn_event_kind};
use libbpf_rs::{MapCore, RingBuffer, RingBufferBuilder};

use crate::layouts::ExeSeen;
use crate::processes::ProcKey;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    New,
    Exec,
    Exit,
    Cgroup,
    Remap,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcEvent {
    pub(crate) kind: EventKind,
    pub(crate) key: ProcKey,
    /// Comm of the thread that triggered it (NUL-padded).
    pub(crate) comm: [u8; firn_sampler_bpf::COMM_LEN],
    /// NEW: the executable the process ran at that sample (0s: unknown).
    pub(crate) exe: ExeSeen,
    /// NEW, CGROUP: the cgroup v2 id the sample was taken in.
    pub(crate) cgroup_id: u64,
}

pub(crate) const EVENT_SIZE: usize = std::mem::size_of::<firn_event>();
/// `FIRN_EVF_KTHREAD` (profile.bpf.h): a kernel thread.
const FIRN_EVF_KTHREAD: u32 = 1;

/// A ring buffer record as the program writes it; `None` for any other size or kind.
pub(crate) fn parse(b: &[u8]) -> Option<ProcEvent> {
    if b.len() != EVENT_SIZE {
        return None;
    }
    // SAFETY: `b` holds exactly size_of::<firn_event>() bytes, read unaligned; the type
    // is plain integers and bytes (generated from the program's BTF).
    let e: firn_event = unsafe { std::ptr::read_unaligned(b.as_ptr().cast()) };
    let kind = match firn_event_kind(e.kind) {
        firn_event_kind::FIRN_EV_NEW => EventKind::New,
        firn_event_kind::FIRN_EV_EXEC => EventKind::Exec,
        firn_event_kind::FIRN_EV_EXIT => EventKind::Exit,
        firn_event_kind::FIRN_EV_CGROUP => EventKind::Cgroup,
        firn_event_kind::FIRN_EV_REMAP => EventKind::Remap,
        _ => return None,
    };
    Some(ProcEvent {
        kind,
        key: ProcKey {
            tgid: e.tgid,
            start_ns: e.start_ns,
            exec_id: e.exec_id,
        },
        comm: e.comm.map(|c| c as u8),
        exe: ExeSeen {
            dev: e.exe_dev,
            ino: e.exe_ino,
            start_code: e.start_code,
            facts: (kind == EventKind::New).then(|| crate::facts::Facts {
                ppid: e.ppid,
                euid: e.euid,
                kernel_thread: e.flags & FIRN_EVF_KTHREAD != 0,
                comm: e.leader_comm.map(|c| c as u8),
            }),
        },
        cgroup_id: e.cgroup_id,
    })
}

/// The consumer side of the `events` ring buffer.
pub(crate) struct Events {
    ring: RingBuffer<'static>,
    queue: Rc<RefCell<Vec<ProcEvent>>>,
    malformed: Rc<Cell<u64>>,
}

impl Events {
    /// Set up while privileged: maps the ring buffer and creates its epoll instance.
    pub(crate) fn new(map: &dyn MapCore) -> Result<Self, libbpf_rs::Error> {
        let queue = Rc::new(RefCell::new(Vec::new()));
        let malformed = Rc::new(Cell::new(0));
        let (q, bad) = (queue.clone(), malformed.clone());
        let mut b = RingBufferBuilder::new();
        b.add(map, move |bytes: &[u8]| {
            match parse(bytes) {
                Some(e) => q.borrow_mut().push(e),
                None => bad.set(bad.get() + 1),
            }
            0
        })?;
        Ok(Self {
            ring: b.build()?,
            queue,
            malformed,
        })
    }

    /// Readable when events wait (an epoll fd the event loop watches).
    pub(crate) fn fd(&self) -> RawFd {
        self.ring.epoll_fd()
    }

    /// The events written so far (reads shared memory only: no syscall), and how many
    /// records were malformed since the last call.
    pub(crate) fn take(&self) -> (Vec<ProcEvent>, u64) {
        // An error here is only a callback's negative return, which ours never gives.
        let _ = self.ring.consume();
        (
            std::mem::take(&mut *self.queue.borrow_mut()),
            self.malformed.replace(0),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(kind: u32) -> Vec<u8> {
        let mut comm = [0i8; 16];
        comm[0] = b'x' as i8;
        let e = firn_event {
            kind,
            tgid: 7,
            start_ns: 9,
            exec_id: 3,
            exe_dev: 17,
            comm,
            exe_ino: 11,
            cgroup_id: 13,
            start_code: 19,
            ppid: 23,
            euid: 29,
            flags: 1,
            reserved: 0,
            leader_comm: comm,
        };
        // SAFETY: firn_event is plain data; viewing it as bytes is sound.
        unsafe { std::slice::from_raw_parts((&raw const e).cast::<u8>(), EVENT_SIZE) }.to_vec()
    }

    #[test]
    fn events_parse_and_odd_records_do_not() {
        let e = parse(&raw(2)).unwrap();
        assert_eq!(e.kind, EventKind::Exec);
        assert_eq!(
            e.key,
            ProcKey {
                tgid: 7,
                start_ns: 9,
                exec_id: 3
            }
        );
        assert_eq!((e.comm[0], e.exe.ino, e.cgroup_id), (b'x', 11, 13));
        assert_eq!((e.exe.dev, e.exe.start_code), (17, 19));
        assert!(e.exe.facts.is_none(), "only a NEW event tells facts");
        let f = parse(&raw(1)).unwrap().exe.facts.expect("NEW facts");
        assert_eq!(
            (f.ppid, f.euid, f.kernel_thread, f.comm[0]),
            (23, 29, true, b'x')
        );
        assert_eq!(parse(&raw(4)).unwrap().kind, EventKind::Cgroup);
        assert_eq!(parse(&raw(5)).unwrap().kind, EventKind::Remap);
        assert!(parse(&raw(9)).is_none(), "unknown kind");
        assert!(parse(&raw(1)[..EVENT_SIZE - 1]).is_none(), "short");
    }
}

//! Loads the BPF program and attaches it to a cpu-clock perf event on every online CPU.

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, FromRawFd, OwnedFd, RawFd};
use std::rc::Rc;

use crate::counters::Counters;
use crate::cpus::possible_cpus;
use crate::unwind::epoch::ProcEpoch;
use crate::unwind::{Limits, Unwind};

use firn_sampler_bpf::types::bss as Globals;
use firn_sampler_bpf::{ProfileSkel, ProfileSkelBuilder};
use libbpf_rs::libbpf_sys;
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore};

// The globals every sample reads lie on the first cache line of .bss, whose value is
// page-aligned (profile.bpf.c declares them together, first).
const _: () = {
    assert!(std::mem::offset_of!(Globals, cgroup_epoch) < 64);
    assert!(std::mem::offset_of!(Globals, proc_epoch) < 64);
    assert!(std::mem::offset_of!(Globals, active_set) < 64);
    assert!(std::mem::offset_of!(Globals, set_epoch) < 64);
    assert!(std::mem::offset_of!(Globals, task_epoch) < 64);
    assert!(std::mem::offset_of!(Globals, hash_seed) + 8 <= 64);
};

#[derive(Debug, thiserror::Error)]
pub(crate) enum AttachError {
    #[error(
        "loading the BPF program failed: {0}. firn needs a kernel with BTF \
         (/sys/kernel/btf/vmlinux) and CAP_BPF + CAP_PERFMON (or root)"
    )]
    Load(#[source] libbpf_rs::Error),
    #[error("reading the CPU list /sys/devices/system/cpu/{0}: {1}")]
    CpuList(&'static str, std::io::Error),
    #[error(
        "perf_event_open(cpu-clock, cpu {cpu}) was refused ({errno}); \
         kernel.perf_event_paranoid is {paranoid}: run as root or grant CAP_PERFMON"
    )]
    PerfDenied {
        cpu: u32,
        errno: nix::errno::Errno,
        paranoid: String,
    },
    #[error("perf_event_open(cpu-clock, cpu {cpu}) failed: {errno}")]
    PerfOpen { cpu: u32, errno: nix::errno::Errno },
    #[error("attaching the BPF program to cpu {cpu}: {source}")]
    Attach { cpu: u32, source: libbpf_rs::Error },
    #[error(
        "attaching to the {what} tracepoint: {source}. firn needs raw tracepoints \
         (Linux 4.17+) and CAP_BPF + CAP_PERFMON (or root)"
    )]
    Tracepoint {
        what: &'static str,
        source: libbpf_rs::Error,
    },
    #[error("setting up the process event ring buffer ({kib} KiB): {source}")]
    Events { kib: u32, source: libbpf_rs::Error },
    #[error("the program's globals (.bss) are not mapped{}", .0.as_ref().map(|e| format!(": {e}")).unwrap_or_default())]
    Globals(Option<crate::unwind::epoch::EpochError>),
    #[error("no randomness for the user-stack hash seed: {0}")]
    Seed(std::io::Error),
    #[error("sizing the unwind row pool ({rows} rows): {source}")]
    Rows { rows: u32, source: libbpf_rs::Error },
    #[error("keeping the unwinder's map fds: {0}")]
    MapFd(std::io::Error),
    #[error(
        "--off-cpu: attaching to the scheduler's {what} failed: {source}. It needs BTF \
         tracepoints and task storage (Linux 5.11+)"
    )]
    OffCpu {
        what: &'static str,
        source: libbpf_rs::Error,
    },
}

/// Off-CPU timing (`--off-cpu`): one voluntary switch in N is timed (and counted N
/// times), N at least `every` and raised per CPU to keep to `rate` a second; waits under
/// `min_ns` are skipped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OffCpu {
    pub(crate) min_ns: u64,
    pub(crate) every: u32,
    pub(crate) rate: u32,
}

/// The loaded program, its maps and one link per CPU. Dropping it detaches everything.
pub(crate) struct Sampling {
    pub(crate) skel: ProfileSkel<'static>,
    links: Vec<Link>,
    cpus: Vec<u32>,
    /// The exec, exit and cgroup-move hooks.
    _hooks: [Link; 3],
    /// The scheduler hooks of --off-cpu (none without it).
    _off_cpu: Vec<Link>,
    pub(crate) events: crate::events::Events,
    /// The unwinder's tables and process mappings (shared with the server).
    pub(crate) unwind: Rc<RefCell<Unwind>>,
    /// The program's count of Python code objects copied, when `pycode` was last
    /// drained: unmoved, there is nothing to take (a node without Python never walks it).
    py_code_copied: Option<u64>,
    /// The sample log (none when not one page a CPU fits its bound).
    log: Option<crate::sample_log::SampleLog>,
    /// The online CPU list, kept open for each round's check.
    online: crate::cpus::OnlineCpus,
    counters: Rc<Counters>,
}

impl crate::rounds::MapSets for Sampling {
    fn activate(&mut self, set: u32) {
        if let Some(bss) = self.skel.maps.bss_data.as_deref_mut() {
            // The flip's count first: a wait whose stacks go to the old set after it
            // is still told apart from one in the new set.
            let epoch = bss.set_epoch.wrapping_add(1);
            // SAFETY: the .bss map is mmapped for the skeleton's lifetime; the program
            // reads the field with a plain load, so a volatile store is all it takes.
            unsafe { std::ptr::write_volatile(&mut bss.set_epoch, epoch) };
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile(&mut bss.active_set, set) };
        }
    }

    fn drain(&mut self, set: u32) -> Result<crate::drain::Drained, crate::drain::DrainError> {
        let maps = &self.skel.maps;
        let (counts, off, stacks, ustacks) = if set == 0 {
            (
                maps.counts_0.as_fd(),
                maps.offcounts_0.as_fd(),
                maps.kstacks_0.as_fd(),
                maps.ustacks_0.as_fd(),
            )
        } else {
            (
                maps.counts_1.as_fd(),
                maps.offcounts_1.as_fd(),
                maps.kstacks_1.as_fd(),
                maps.ustacks_1.as_fd(),
            )
        };
        let mut d = crate::drain::drain((self.log.as_ref(), set), [counts, off], stacks, ustacks)?;
        use firn_sampler_bpf::types::firn_counter as K;
        // Read before the drain: a code object copied after the read moves the count
        // again, and the next round takes it.
        let copied = crate::drain::percpu_sum(&maps.counters, K::FIRN_CTR_PY_CODE_COPIED.0);
        if copied.is_none() || copied != self.py_code_copied {
            crate::drain::take_python_code(maps.pycode.as_fd(), &mut d);
            self.py_code_copied = copied;
        }
        Ok(d)
    }

    fn counter(&self, slot: firn_sampler_bpf::types::firn_counter) -> Option<u64> {
        crate::drain::percpu_sum(&self.skel.maps.counters, slot.0)
    }

    fn all_counters(&self) -> Vec<Option<u64>> {
        use firn_sampler_bpf::types::firn_counter as K;
        let slots = K::FIRN_CTR_MAX.0;
        match crate::drain::percpu_sums(self.skel.maps.counters.as_fd(), slots) {
            Ok(all) => all.into_iter().map(Some).collect(),
            Err(e) => {
                // One lookup a counter, as before the batch: the same numbers, more calls.
                crate::counters::bump(&self.counters.counter_batch_failures);
                tracing::debug!(error = %e, "counters read one by one");
                (0..slots).map(|s| self.counter(K(s))).collect()
            }
        }
    }

    fn cpus(&self) -> &[u32] {
        &self.cpus
    }

    fn forget_announced(&mut self, keys: &[crate::processes::ProcKey]) {
        use libbpf_rs::MapCore;
        for k in keys {
            let id = firn_sampler_bpf::types::firn_proc_id {
                tgid: k.tgid,
                exec_id: k.exec_id,
                start_ns: k.start_ns,
            };
            // SAFETY: firn_proc_id is plain integers without padding (4 + 4 + 8 bytes);
            // viewing it as bytes is sound.
            let bytes = unsafe {
                std::slice::from_raw_parts((&raw const id).cast::<u8>(), std::mem::size_of_val(&id))
            };
            // Absent already (evicted by the LRU, or ended): nothing to undo.
            let _ = self.skel.maps.seen.delete(bytes);
        }
        if !keys.is_empty() {
            // After the deletes: a CPU that remembers one of these as announced
            // looks it up again, and announces it anew.
            self.unwind.borrow().processes_changed();
        }
    }

    fn set_mappings(
        &mut self,
        fresh: &[(crate::processes::ProcKey, Rc<crate::procfs::ProcessRecord>)],
    ) {
        let mut u = self.unwind.borrow_mut();
        for (key, rec) in fresh {
            u.set_process(*key, rec);
        }
        // Once for the batch, not per process: two map calls each under churn.
        if !fresh.is_empty() {
            u.processes_changed();
        }
    }

    fn forget_mappings(&mut self, keys: &[crate::processes::ProcKey]) {
        let mut u = self.unwind.borrow_mut();
        for key in keys {
            u.forget_process(*key);
        }
        if !keys.is_empty() {
            u.processes_changed();
            u.shrink_after_storm();
        }
    }
}

impl Sampling {
    pub(crate) fn links(&self) -> usize {
        self.links.len()
    }

    /// Online CPUs the program is attached to.
    pub(crate) fn cpus(&self) -> &[u32] {
        &self.cpus
    }

    /// The online CPU list now; `None` (counted, logged the first time) if it could not
    /// be read.
    pub(crate) fn online_now(&mut self) -> Option<Vec<u32>> {
        match self.online.read() {
            Ok(list) => Some(list),
            Err(error) => {
                if self.counters.online_cpus_unread.get() == 0 {
                    tracing::warn!(%error, "the online CPU list could not be read; CPU hotplug is not checked while it cannot");
                }
                crate::counters::bump(&self.counters.online_cpus_unread);
                None
            }
        }
    }
}

/// 8 random bytes from the kernel.
fn random_seed() -> Result<u64, std::io::Error> {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 8 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(u64::from_ne_bytes(b))
}

/// Entries of a per-round map that takes up to `per_cpu_second` entries a second on each
/// CPU: room for twice what one round brings (a round may run long), a power of two
/// within `[min, max]`. Sized from use, not fixed: the maps are preallocated, and the
/// round's drain walks every bucket, so an idle or slow-sampling node pays for what it
/// samples (99 Hz, 2 CPUs, 10 s rounds: 4,096 instead of 16,384).
pub(crate) fn round_entries(
    per_cpu_second: u32,
    cpus: usize,
    round_seconds: u32,
    (min, max): (u32, u32),
) -> u32 {
    let want = u64::from(per_cpu_second)
        .saturating_mul(cpus as u64)
        .saturating_mul(u64::from(round_seconds))
        .saturating_mul(2);
    let want = u32::try_from(want).unwrap_or(u32::MAX).clamp(min, max);
    want.checked_next_power_of_two().unwrap_or(max).min(max)
}

/// Bytes an event takes in the ring: `firn_event` and the ring's 8-byte header.
const EVENT_RING_BYTES: u64 = crate::events::EVENT_SIZE as u64 + 8;

/// The event ring's size in KiB when `--events-buffer-kib` is not given: room for half a
/// second of the most events the program can make (a NEW and an EXIT or EXEC for each
/// sampled process, at most one new process a sample) while the sampler is busy with a
/// round: it reads the ring at each NEW's wakeup. A power of two within 64–256 KiB (256
/// was the fixed size: a large node is never given more); off-CPU samples with no bound
/// on their rate (`off_cpu_rate` 0) get the most. The ring is mapped twice into the
/// sampler, so each KiB saved is two of its RSS (and one of kernel memory).
pub(crate) fn events_kib_for(frequency: u32, off_cpu_rate: Option<u32>, cpus: usize) -> u32 {
    const MIN_KIB: u64 = 64;
    const MAX_KIB: u64 = 256;
    let per_cpu = match off_cpu_rate {
        Some(0) => return MAX_KIB as u32,
        Some(r) => u64::from(frequency) + u64::from(r),
        None => u64::from(frequency),
    };
    // Two events a sample for half a second: one sample's worth of events a second.
    let bytes = per_cpu
        .saturating_mul(cpus as u64)
        .saturating_mul(EVENT_RING_BYTES);
    let kib = bytes.div_ceil(1024).clamp(MIN_KIB, MAX_KIB);
    kib.checked_next_power_of_two()
        .unwrap_or(MAX_KIB)
        .min(MAX_KIB) as u32
}

/// Loads the program with a process event ring buffer of `events_kib` KiB (a power of
/// two, at least one page; `None`: [`events_kib_for`] the node) and attaches it to every online CPU and to exec and exit;
/// the per-round maps sized for `frequency` and rounds of `round_seconds`.
pub(crate) fn load_and_attach(
    (frequency, round_seconds, events_kib): (u32, u32, Option<u32>),
    log_slots: Option<u32>,
    limits: Limits,
    off_cpu: Option<OffCpu>,
    counters: Rc<Counters>,
) -> Result<Sampling, AttachError> {
    // The skeleton borrows its object storage for its whole life; the sampler keeps the
    // program until exit, so the storage lives as long as the process.
    let storage: &'static mut MaybeUninit<libbpf_rs::OpenObject> =
        Box::leak(Box::new(MaybeUninit::uninit()));
    let mut open = ProfileSkelBuilder::default()
        .open(storage)
        .map_err(AttachError::Load)?;
    // CPUs that may come online later are not sampled (the sampler exits then).
    let mut online_list =
        crate::cpus::OnlineCpus::open().map_err(|e| AttachError::CpuList("online", e))?;
    let online = online_list
        .read()
        .map_err(|e| AttachError::CpuList("online", e))?;
    let ncpus = online.len().max(1);
    // The log has a run for each CPU id up to the highest online one: a VM may name far
    // more possible CPUs than it has, and a CPU that comes online later samples into the
    // counts map (the sampler exits to be restarted then anyway).
    let log_cpus = online.iter().max().map_or(1, |&c| c + 1);
    let events_kib =
        events_kib.unwrap_or_else(|| events_kib_for(frequency, off_cpu.map(|o| o.rate), ncpus));
    open.maps
        .events
        .set_max_entries(events_kib.saturating_mul(1024))
        .map_err(|source| AttachError::Events {
            kib: events_kib,
            source,
        })?;
    // An array needs one entry; with --unwind-rows 0 it stays unused.
    let pool = limits.pool_rows.max(1);
    open.maps
        .rows
        .set_max_entries(pool)
        .map_err(|source| AttachError::Rows { rows: pool, source })?;
    // The stack hashes' seed: unknown to any local user, so none can craft frames whose
    // stack takes the key of another process's stack. In .bss, beside the globals every
    // sample reads (one cache line); no program writes it.
    open.maps
        .bss_data
        .as_deref_mut()
        .ok_or(AttachError::Globals(None))?
        .hash_seed = random_seed().map_err(AttachError::Seed)?;
    // One walk state per possible CPU, indexed by CPU number.
    let possible = possible_cpus().map_err(|e| AttachError::CpuList("possible", e))?;
    open.maps
        .scratch
        .set_max_entries(possible)
        .map_err(AttachError::Load)?;
    // The sample log: a run of slots per CPU and set.
    let log_slots = crate::sample_log::run_slots(
        log_slots.unwrap_or_else(|| crate::sample_log::round_samples(frequency, round_seconds)),
        log_cpus,
    );
    open.maps
        .samples
        .set_max_entries((2 * log_cpus * log_slots).max(1))
        .map_err(AttachError::Load)?;
    if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
        ro.log_slots = log_slots;
        ro.log_cpus = log_cpus;
        if let Some(o) = off_cpu {
            ro.off_cpu_min_ns = o.min_ns;
            ro.off_cpu_every = o.every.max(1);
            ro.off_cpu_rate = o.rate;
            ro.off_cpu_self_tgid = std::process::id();
        }
    }
    let off_rate = off_cpu.map_or(0, |o| o.rate);
    let counts = round_entries(frequency, ncpus, round_seconds, (1024, 65_536));
    for m in [&mut open.maps.counts_0, &mut open.maps.counts_1] {
        m.set_max_entries(counts).map_err(AttachError::Load)?;
    }
    if off_cpu.is_none() {
        // Not loaded at all: a kernel without task storage still samples on CPU.
        open.progs.firn_switch.set_autoload(false);
        for m in [&mut open.maps.offcounts_0, &mut open.maps.offcounts_1] {
            m.set_max_entries(1).map_err(AttachError::Load)?;
        }
    } else {
        let off = round_entries(off_rate, ncpus, round_seconds, (1024, 65_536));
        for m in [&mut open.maps.offcounts_0, &mut open.maps.offcounts_1] {
            m.set_max_entries(off).map_err(AttachError::Load)?;
        }
    }
    tracing::debug!(
        counts,
        events_kib,
        "per-round maps and the event ring sized"
    );
    let skel = open.load().map_err(AttachError::Load)?;
    // Duplicated now: the server writes these maps after confinement, apart from the
    // skeleton the round loop holds.
    let dup = |m: &libbpf_rs::Map<'_>| m.as_fd().try_clone_to_owned().map_err(AttachError::MapFd);
    let unwind = Unwind::new(
        (
            dup(&skel.maps.rows)?,
            dup(&skel.maps.tables)?,
            dup(&skel.maps.procmaps)?,
        ),
        (
            dup(&skel.maps.pyprocs)?,
            dup(&skel.maps.pyseen)?,
            dup(&skel.maps.pyepoch)?,
        ),
        ProcEpoch::map(
            skel.maps.bss.as_fd(),
            skel.maps.bss.value_size() as usize,
            std::mem::offset_of!(Globals, proc_epoch),
        )
        .map_err(|e| AttachError::Globals(Some(e)))?,
        limits,
        counters.clone(),
    );
    let log = if log_slots > 0 {
        Some(crate::sample_log::SampleLog::new(
            dup(&skel.maps.samples)?,
            log_cpus,
            log_slots,
        ))
    } else {
        None
    };
    let hooks = [
        skel.progs
            .firn_exec
            .attach()
            .map_err(|source| AttachError::Tracepoint {
                what: "sched_process_exec",
                source,
            })?,
        skel.progs
            .firn_exit
            .attach()
            .map_err(|source| AttachError::Tracepoint {
                what: "sched_process_exit",
                source,
            })?,
        // Before the sampling program, as the two above: a thread memo made before its
        // hooks ran could outlive a move or an exit they would have seen.
        skel.progs
            .firn_cgroup_move
            .attach()
            .map_err(|source| AttachError::Tracepoint {
                what: "cgroup_attach_task",
                source,
            })?,
    ];
    let off_cpu_links = if off_cpu.is_some() {
        attach_off_cpu(&skel)?
    } else {
        Vec::new()
    };
    let events =
        crate::events::Events::new(&skel.maps.events).map_err(|source| AttachError::Events {
            kib: events_kib,
            source,
        })?;

    // Attach to the list the per-round maps and the log were sized by.
    let mut links = Vec::with_capacity(online.len());
    for &cpu in &online {
        let fd = open_cpu_clock(cpu, frequency)?;
        // libbpf owns the perf event fd from here and closes it with the link.
        let link = skel
            .progs
            .firn_sample
            .attach_perf_event(fd)
            .map_err(|source| {
                // SAFETY: attach failed, so libbpf did not take the fd; close it here.
                drop(unsafe { OwnedFd::from_raw_fd(fd) });
                AttachError::Attach { cpu, source }
            })?;
        links.push(link);
    }
    Ok(Sampling {
        skel,
        links,
        cpus: online,
        _hooks: hooks,
        _off_cpu: off_cpu_links,
        events,
        unwind: Rc::new(RefCell::new(unwind)),
        py_code_copied: None,
        log,
        online: online_list,
        counters,
    })
}

/// The sched_switch BTF tracepoint (both ends of every wait).
fn attach_off_cpu(skel: &ProfileSkel<'static>) -> Result<Vec<Link>, AttachError> {
    let link = skel
        .progs
        .firn_switch
        .attach()
        .map_err(|source| AttachError::OffCpu {
            what: "sched_switch tracepoint",
            source,
        })?;
    Ok(vec![link])
}

fn open_cpu_clock(cpu: u32, frequency: u32) -> Result<RawFd, AttachError> {
    // SAFETY: perf_event_attr is plain data; all-zero is its documented default.
    let mut attr: libbpf_sys::perf_event_attr = unsafe { std::mem::zeroed() };
    attr.type_ = libbpf_sys::PERF_TYPE_SOFTWARE;
    attr.size = std::mem::size_of::<libbpf_sys::perf_event_attr>() as u32;
    attr.config = u64::from(libbpf_sys::PERF_COUNT_SW_CPU_CLOCK);
    attr.__bindgen_anon_1.sample_freq = u64::from(frequency);
    attr.set_freq(1);
    // SAFETY: attr is a valid, fully initialised perf_event_attr for the call's lifetime.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const libbpf_sys::perf_event_attr,
            -1 as libc::pid_t,
            cpu as libc::c_int,
            -1 as libc::c_int,
            libbpf_sys::PERF_FLAG_FD_CLOEXEC as libc::c_ulong,
        )
    };
    if ret < 0 {
        let errno = nix::errno::Errno::last();
        return Err(match errno {
            nix::errno::Errno::EACCES | nix::errno::Errno::EPERM => AttachError::PerfDenied {
                cpu,
                errno,
                paranoid: std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
                    .map(|s| s.trim().to_string())
                    .unwrap_or_else(|_| "unknown".into()),
            },
            _ => AttachError::PerfOpen { cpu, errno },
        });
    }
    Ok(ret as RawFd)
}

#[cfg(test)]
mod tests {
    #[test]
    fn per_round_maps_follow_the_sampling_rate() {
        use super::round_entries as r;
        assert_eq!(r(99, 2, 10, (1024, 65_536)), 4096);
        assert_eq!(r(19, 2, 10, (1024, 65_536)), 1024);
        assert_eq!(r(99, 2, 1, (1024, 65_536)), 1024);
        assert_eq!(r(999, 64, 600, (1024, 65_536)), 65_536);
        assert_eq!(r(u32::MAX, usize::MAX, u32::MAX, (2048, 16_384)), 16_384);
        assert_eq!(r(0, 0, 0, (2048, 16_384)), 2048);
    }

    #[test]
    fn the_event_ring_follows_the_sampling_rate() {
        use super::events_kib_for as e;
        // 2 CPUs at 99 Hz make at most ~400 events a second: the floor, 630 events.
        assert_eq!(e(99, None, 2), 64);
        assert_eq!(e(19, None, 1), 64);
        // 2 × 2 × (99 + 250) × 104 B / 2 = 71 KiB.
        assert_eq!(e(99, Some(250), 2), 128);
        assert_eq!(e(999, None, 2), 256);
        // Never more than the fixed size it replaces; no bound on the rate: the most.
        assert_eq!(e(99, None, 64), 256);
        assert_eq!(e(19, Some(0), 1), 256);
        assert_eq!(e(u32::MAX, Some(u32::MAX), usize::MAX), 256);
        assert_eq!(e(0, None, 0), 64);
    }
}

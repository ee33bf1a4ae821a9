//! The round loop's logic, apart from the event loop that times it: retire the map set
//! the program writes, drain it after the grace period, read the BPF-side counters,
//! notice CPUs that left or came back, assemble the round and forget exited processes.
//! The BPF maps sit behind [`MapSets`], so the logic is tested without a kernel.

use std::cell::Cell;

use firn_sampler_bpf::types::firn_counter;

use std::rc::Rc;

use crate::assemble::{self, Issued, RoundData};
use crate::counters::{add, bump, Counters};
use crate::drain::{DrainError, Drained};
use crate::events::{EventKind, ProcEvent};
use crate::kallsyms::Kallsyms;
use crate::processes::{Ending, ProcKey, ProcessTable};

/// The two map sets the BPF program writes, one at a time.
pub(crate) trait MapSets {
    /// Makes `set` (0 or 1) the one the program writes.
    fn activate(&mut self, set: u32);
    /// Reads and empties `set`.
    fn drain(&mut self, set: u32) -> Result<Drained, DrainError>;
    /// A per-CPU counter of the program, summed over CPUs (cumulative).
    fn counter(&self, slot: firn_counter) -> Option<u64>;
    /// Every counter of the program by slot, as [`MapSets::counter`] reads each. The
    /// program's maps read them all at once.
    fn all_counters(&self) -> Vec<Option<u64>> {
        (0..firn_counter::FIRN_CTR_MAX.0)
            .map(|slot| self.counter(firn_counter(slot)))
            .collect()
    }
    /// CPUs the program is attached to.
    fn cpus(&self) -> &[u32];
    /// Tells the program that these processes are no longer known, so that it announces
    /// them again if they are sampled again.
    fn forget_announced(&mut self, keys: &[ProcKey]);
    /// Gives the unwinder the executable mappings of processes just read.
    fn set_mappings(&mut self, fresh: &[(ProcKey, std::rc::Rc<crate::procfs::ProcessRecord>)]);
    /// The unwinder forgets the mappings of these processes.
    fn forget_mappings(&mut self, keys: &[ProcKey]);
}

/// The run loop ended because a CPU can no longer be sampled.
#[derive(Debug, thiserror::Error)]
#[error(
    "CPU {0} is online but not sampled (it went offline and came back, or came online \
     after setup); a confined sampler cannot attach to it, so it exits for its \
     supervisor to restart it (systemd: Restart=on-failure)"
)]
pub(crate) struct CpuHotplug(pub u32);

/// A set retired by [`Rounds::flip`], to be drained once no program run writes it.
#[must_use]
pub(crate) struct Retired {
    set: u32,
    end_ns: u64,
}

/// What a round produced.
pub(crate) struct Round {
    pub(crate) data: RoundData,
    /// Process ids forgotten this round (exited and idle).
    pub(crate) forgotten: Vec<u64>,
}

/// State carried from round to round.
pub(crate) struct Rounds {
    table: ProcessTable,
    active: u32,
    round: u64,
    start_ns: u64,
    /// CPUs seen offline since setup.
    offline: Vec<u32>,
}

/// The program's counters, the sampler's cell for each, and whether a rise is a loss.
fn bpf_counters(c: &Counters) -> Vec<(firn_counter, &Cell<u64>, Option<&'static str>)> {
    type K = firn_counter;
    let ends = crate::unwind::ends::ALL
        .iter()
        .map(|&(reason, _, cell)| (crate::unwind::ends::slot(reason), cell(c), None));
    let mut all = vec![
        (K::FIRN_CTR_SAMPLES, &c.bpf_samples, None),
        (K::FIRN_CTR_IDLE, &c.bpf_idle_samples, None),
        (
            K::FIRN_CTR_USER_STACK_FULL,
            &c.bpf_user_stack_lost,
            Some("bpf_user_stack_lost"),
        ),
        (
            K::FIRN_CTR_KERN_STACK_FULL,
            &c.bpf_kernel_stack_lost,
            Some("bpf_kernel_stack_lost"),
        ),
        (
            K::FIRN_CTR_USER_STACK_ERR,
            &c.bpf_user_stack_errors,
            Some("bpf_user_stack_errors"),
        ),
        (
            K::FIRN_CTR_KERN_STACK_ERR,
            &c.bpf_kernel_stack_errors,
            Some("bpf_kernel_stack_errors"),
        ),
        (
            K::FIRN_CTR_COUNTS_FULL,
            &c.bpf_counts_map_full,
            Some("bpf_counts_map_full"),
        ),
        (K::FIRN_CTR_LOG_FULL, &c.bpf_sample_log_full, None),
        (K::FIRN_CTR_EVENTS, &c.bpf_events, None),
        (
            K::FIRN_CTR_EVENTS_LOST,
            &c.bpf_events_lost,
            Some("bpf_events_lost"),
        ),
        (K::FIRN_CTR_TABLE_FRAMES, &c.bpf_unwind_table_frames, None),
        (K::FIRN_CTR_FP_FRAMES, &c.bpf_unwind_fp_frames, None),
        (K::FIRN_CTR_STACK_WINDOWS, &c.bpf_unwind_stack_windows, None),
        (K::FIRN_CTR_ROW_MEMO_HITS, &c.bpf_unwind_row_memo_hits, None),
        (K::FIRN_CTR_PY_FRAMES, &c.bpf_python_frames, None),
        (K::FIRN_CTR_PY_NO_THREAD, &c.bpf_python_no_thread, None),
        (
            K::FIRN_CTR_PY_READ_FAULT,
            &c.bpf_python_read_faults,
            Some("bpf_python_read_faults"),
        ),
        (K::FIRN_CTR_PY_NOT_CODE, &c.bpf_python_not_code, None),
        (K::FIRN_CTR_PY_BAD_TYPES, &c.bpf_python_bad_types, None),
        (K::FIRN_CTR_PY_CODE_COPIED, &c.bpf_python_code_copied, None),
        (
            K::FIRN_CTR_PY_CODE_FULL,
            &c.bpf_python_code_full,
            Some("bpf_python_code_full"),
        ),
        (K::FIRN_CTR_LOOP_BUDGET, &c.bpf_unwind_step_budget, None),
        (K::FIRN_CTR_OFF_WAITS, &c.bpf_off_cpu_waits, None),
        (K::FIRN_CTR_OFF_SHORT, &c.bpf_off_cpu_short, None),
        (K::FIRN_CTR_OFF_UNSAMPLED, &c.bpf_off_cpu_unsampled, None),
        (
            K::FIRN_CTR_OFF_NO_STORAGE,
            &c.bpf_off_cpu_untimed,
            Some("bpf_off_cpu_untimed"),
        ),
        (K::FIRN_CTR_OFF_NS, &c.bpf_off_cpu_ns, None),
        (K::FIRN_CTR_OFF_CROSSED, &c.bpf_off_cpu_crossed, None),
        (K::FIRN_CTR_OFF_WEIGHT, &c.bpf_off_cpu_weight, None),
    ];
    all.extend(ends);
    all
}

impl Rounds {
    /// Rounds starting at `start_ns` (Unix ns), with set 0 active.
    pub(crate) fn new(table: ProcessTable, start_ns: u64) -> Self {
        Self {
            table,
            active: 0,
            round: 0,
            start_ns,
            offline: Vec::new(),
        }
    }

    #[cfg(test)]
    pub(crate) fn known_processes(&self) -> usize {
        self.table.len()
    }

    /// Handles the program's process events, while the round after the last finished
    /// one is in progress: new processes are read from /proc now.
    pub(crate) fn on_events(&mut self, events: &[ProcEvent], c: &Counters) {
        let in_progress = self.round + 1;
        let seen_ns = firn_schema::boot_ns();
        for e in events {
            match e.kind {
                EventKind::New => {
                    bump(&c.events_new);
                    self.table.discover(
                        e.key,
                        (&e.comm, e.exe, e.cgroup_id),
                        (in_progress, seen_ns),
                        c,
                    );
                }
                EventKind::Exec => {
                    bump(&c.events_exec);
                    self.table.ended(e.key, Ending::Exec, in_progress);
                }
                EventKind::Exit => {
                    bump(&c.events_exit);
                    self.table.ended(e.key, Ending::Exit, in_progress);
                }
                EventKind::Cgroup => self.table.moved(e.key, e.cgroup_id, c),
                EventKind::Remap => self.table.remap(e.key, (in_progress, seen_ns), c),
            }
        }
    }

    /// Hands what the process table read or forgot to the unwinder's maps, then walks
    /// to the files of the records read (for binary handles). Returns the records read,
    /// as issued, for subscribers to hear of before the round ends.
    pub(crate) fn sync_mappings(&mut self, maps: &mut impl MapSets, c: &Counters) -> Vec<Issued> {
        let fresh = self.table.take_fresh();
        if !fresh.is_empty() {
            maps.set_mappings(&fresh);
        }
        let dropped = self.table.take_dropped();
        if !dropped.is_empty() {
            maps.forget_mappings(&dropped);
        }
        self.table.take_handles(c);
        fresh
            .iter()
            .filter_map(|(key, record)| {
                let k = self.table.get(*key)?;
                // A record read twice since the last call is announced once, newest.
                Rc::ptr_eq(&k.record, record).then(|| Issued {
                    id: k.id,
                    version: k.version,
                    record: record.clone(),
                })
            })
            .collect()
    }

    /// Ends the current round at `now_ns`: the program switches to the other set.
    pub(crate) fn flip(&mut self, maps: &mut impl MapSets, now_ns: u64) -> Retired {
        let retired = Retired {
            set: self.active,
            end_ns: now_ns,
        };
        self.active ^= 1;
        maps.activate(self.active);
        retired
    }

    /// Drains the retired set (after the grace period) and makes the round. `online` is
    /// the online CPU list, if it could be read. `Ok(None)`: the drain failed (counted);
    /// the next round starts where this one ended.
    pub(crate) fn finish(
        &mut self,
        maps: &mut impl MapSets,
        retired: Retired,
        online: Option<&[u32]>,
        kallsyms: &Kallsyms,
        c: &Counters,
    ) -> Result<Option<Round>, CpuHotplug> {
        // A chunk buffer kept through a table wave goes back before the round's own
        // transient memory (drain, assembly, batch): none stays between rounds or adds
        // to a round's peak.
        crate::alloc::release();
        self.round += 1;
        let span = (self.start_ns, retired.end_ns);
        self.start_ns = retired.end_ns;
        let drained = match maps.drain(retired.set) {
            Ok(d) => d,
            Err(e) => {
                bump(&c.drain_errors);
                tracing::warn!(round = self.round, error = %e, "draining the maps failed");
                return Ok(None);
            }
        };
        add(&c.stack_lookup_failures, drained.stack_lookup_failures);
        add(&c.python_code_drain_failures, drained.python_code_failures);
        add(&c.sample_log_failures, drained.sample_log_failures);
        add(&c.python_code_forwarded, drained.python_code.len() as u64);
        if drained.stack_lookup_failures > 0 {
            tracing::warn!(
                round = self.round,
                stacks = drained.stack_lookup_failures,
                "stacks missing from the stack map; their samples are sent without them"
            );
        }
        self.read_counters(maps, c);
        if let Some(online) = online {
            self.check_cpus(maps.cpus(), online, c)?;
        }
        // Cgroup reads the rate bound held back, before the round names their ids.
        self.table.cgroups.retry(c);
        let data = assemble::assemble(drained, kallsyms, &mut self.table, self.round, span, c);
        let forgotten = self.table.sweep(self.round, c);
        maps.forget_announced(&self.table.take_unseen());
        // Records read while assembling go in this round's batch.
        let _ = self.sync_mappings(maps, c);
        self.table.begin_round(self.round, c);
        c.heap_blocks_reused.set(crate::alloc::reused());
        let (used, free) = crate::trim::heap_bytes();
        c.heap_used_bytes.set(used);
        c.heap_free_bytes.set(free);
        c.processes_known.set(self.table.len() as u64);
        bump(&c.rounds);
        tracing::debug!(
            round = self.round,
            samples = data.samples.len(),
            processes = data.processes.len(),
            known_processes = self.table.len(),
            "round done"
        );
        Ok(Some(Round { data, forgotten }))
    }

    fn read_counters(&self, maps: &impl MapSets, c: &Counters) {
        let all = maps.all_counters();
        for (slot, cell, loss) in bpf_counters(c) {
            let Some(&Some(v)) = all.get(slot.0 as usize) else {
                continue;
            };
            let before = cell.replace(v);
            if let Some(name) = loss.filter(|_| v > before) {
                tracing::warn!(
                    counter = name,
                    lost = v - before,
                    "samples or stacks lost in the BPF program this round"
                );
            }
        }
    }

    /// A CPU that went offline ends its perf event for good; sampling goes on on the
    /// others. One online again (or new since setup) cannot be attached once confined.
    fn check_cpus(
        &mut self,
        sampled: &[u32],
        online: &[u32],
        c: &Counters,
    ) -> Result<(), CpuHotplug> {
        for &cpu in sampled {
            if !online.contains(&cpu) && !self.offline.contains(&cpu) {
                tracing::warn!(cpu, "CPU went offline; sampling goes on on the others");
                self.offline.push(cpu);
            }
        }
        if let Some(cpu) = crate::cpus::unsampled_cpu(sampled, online, &self.offline) {
            bump(&c.cpus_unsampled);
            // Logged once, by main, as the reason for exiting.
            return Err(CpuHotplug(cpu));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::{RawSample, StackRef, UserRef};
    use std::collections::{HashMap, VecDeque};

    #[derive(Default)]
    struct FakeMaps {
        active: Vec<u32>,
        drains: VecDeque<Result<Drained, DrainError>>,
        drained_sets: Vec<u32>,
        counters: HashMap<u32, u64>,
        cpus: Vec<u32>,
        forgotten: Vec<ProcKey>,
        mapped: Vec<ProcKey>,
        unmapped: Vec<ProcKey>,
    }

    impl MapSets for FakeMaps {
        fn activate(&mut self, set: u32) {
            self.active.push(set);
        }
        fn drain(&mut self, set: u32) -> Result<Drained, DrainError> {
            self.drained_sets.push(set);
            self.drains
                .pop_front()
                .unwrap_or_else(|| Ok(Drained::default()))
        }
        fn counter(&self, slot: firn_counter) -> Option<u64> {
            self.counters.get(&slot.0).copied()
        }
        fn cpus(&self) -> &[u32] {
            &self.cpus
        }
        fn forget_announced(&mut self, keys: &[ProcKey]) {
            self.forgotten.extend_from_slice(keys);
        }
        fn set_mappings(&mut self, fresh: &[(ProcKey, std::rc::Rc<crate::procfs::ProcessRecord>)]) {
            self.mapped.extend(fresh.iter().map(|(k, _)| *k));
        }
        fn forget_mappings(&mut self, keys: &[ProcKey]) {
            self.unmapped.extend_from_slice(keys);
        }
    }

    /// A sample of a pid that does not exist: recorded with what BPF saw.
    fn sample(tgid: u32, user: UserRef, count: u64) -> RawSample {
        let mut comm = [0u8; firn_sampler_bpf::COMM_LEN];
        comm[..4].copy_from_slice(b"test");
        RawSample {
            tgid,
            tid: tgid,
            start_ns: 1,
            exec_id: 0,
            comm,
            user,
            kernel: StackRef::Err(-libc::EFAULT),
            unwind_end: 0,
            cgroup_id: 0,
            off_cpu: false,
            count,
        }
    }

    fn run(
        r: &mut Rounds,
        m: &mut FakeMaps,
        now: u64,
        online: &[u32],
        c: &Counters,
    ) -> Result<Option<Round>, CpuHotplug> {
        let retired = r.flip(m, now);
        r.finish(m, retired, Some(online), &Kallsyms::empty(), c)
    }

    #[test]
    fn sets_alternate_and_time_spans_chain() {
        let c = Counters::default();
        let mut m = FakeMaps {
            cpus: vec![0, 1],
            ..Default::default()
        };
        let mut r = Rounds::new(ProcessTable::default(), 100);
        let mut spans = Vec::new();
        for now in [200, 300, 400] {
            let round = run(&mut r, &mut m, now, &[0, 1], &c).unwrap().unwrap();
            spans.push((
                round.data.round,
                round.data.start_time_ns,
                round.data.end_time_ns,
            ));
        }
        assert_eq!(m.active, vec![1, 0, 1]);
        assert_eq!(m.drained_sets, vec![0, 1, 0]);
        assert_eq!(spans, vec![(1, 100, 200), (2, 200, 300), (3, 300, 400)]);
        assert_eq!(c.rounds.get(), 3);
    }

    #[test]
    fn a_failed_drain_is_counted_and_the_next_round_starts_where_it_ended() {
        let c = Counters::default();
        let mut m = FakeMaps {
            cpus: vec![0],
            ..Default::default()
        };
        m.drains.push_back(Err(DrainError::KeySize { got: 1 }));
        let mut r = Rounds::new(ProcessTable::default(), 0);
        assert!(run(&mut r, &mut m, 10, &[0], &c).unwrap().is_none());
        assert_eq!(c.drain_errors.get(), 1);
        let round = run(&mut r, &mut m, 20, &[0], &c).unwrap().unwrap();
        assert_eq!((round.data.round, round.data.start_time_ns), (2, 10));
        assert_eq!(c.rounds.get(), 1);
    }

    #[test]
    fn samples_become_a_round_with_counters() {
        let c = Counters::default();
        let mut m = FakeMaps {
            cpus: vec![0],
            ..Default::default()
        };
        let mut stacks = HashMap::new();
        stacks.insert(7, vec![0x401000, 0x402000]);
        m.drains.push_back(Ok(Drained {
            samples: vec![
                sample(u32::MAX - 1, UserRef::Hash(7), 3),
                sample(u32::MAX - 1, UserRef::Hash(8), 1),
            ],
            user_stacks: stacks,
            stacks: HashMap::new(),
            stack_lookup_failures: 1,
            ..Drained::default()
        }));
        m.counters.insert(firn_counter::FIRN_CTR_SAMPLES.0, 4);
        m.counters.insert(firn_counter::FIRN_CTR_COUNTS_FULL.0, 2);
        let mut r = Rounds::new(ProcessTable::default(), 0);
        let round = run(&mut r, &mut m, 10, &[0], &c).unwrap().unwrap();
        let d = &round.data;
        assert_eq!(d.samples.len(), 2);
        assert_eq!(&*d.samples[0].user, &[0x401000, 0x402000]);
        assert_eq!(d.samples[1].user_status, assemble::StackStatus::Lost);
        // One record, for the process both samples belong to: what BPF saw of it.
        assert_eq!(d.processes.len(), 1);
        assert!(!d.processes[0].record.complete);
        assert_eq!(d.processes[0].record.comm, b"test");
        assert_eq!(c.stack_lookup_failures.get(), 1);
        assert_eq!(c.bpf_samples.get(), 4);
        assert_eq!(c.bpf_counts_map_full.get(), 2);
        assert_eq!(c.processes_gone.get(), 1);
        assert_eq!(r.known_processes(), 1);
    }

    #[test]
    fn a_cpu_back_from_offline_ends_the_loop() {
        let c = Counters::default();
        let mut m = FakeMaps {
            cpus: vec![0, 1],
            ..Default::default()
        };
        let mut r = Rounds::new(ProcessTable::default(), 0);
        assert!(run(&mut r, &mut m, 1, &[0], &c).unwrap().is_some());
        assert!(run(&mut r, &mut m, 2, &[0], &c).unwrap().is_some());
        assert!(matches!(
            run(&mut r, &mut m, 3, &[0, 1], &c),
            Err(CpuHotplug(1))
        ));
        assert_eq!(c.cpus_unsampled.get(), 1);
        // A CPU new since setup, too.
        let mut r = Rounds::new(ProcessTable::default(), 0);
        assert!(matches!(
            run(&mut r, &mut m, 1, &[0, 1, 2], &c),
            Err(CpuHotplug(2))
        ));
    }
    #[test]
    fn an_announced_process_is_read_at_once_and_leaves_after_its_exit_rounds() {
        let c = Counters::default();
        let mut m = FakeMaps {
            cpus: vec![0],
            ..Default::default()
        };
        let mut r = Rounds::new(ProcessTable::default(), 0);
        // This test's own process, announced by its first sample.
        let me = std::process::id();
        let key = ProcKey {
            tgid: me,
            start_ns: crate::procfs::start_ns_of(me).expect("own start time"),
            exec_id: 0,
        };
        let event = |kind| ProcEvent {
            kind,
            key,
            comm: [0; firn_sampler_bpf::COMM_LEN],
            exe: crate::layouts::ExeSeen::default(),
            cgroup_id: 0,
        };
        r.on_events(&[event(EventKind::New)], &c);
        assert_eq!(
            (c.processes_read_early.get(), c.processes_read.get()),
            (1, 1)
        );
        // Its samples, drained at the round's end, find the record: no second read.
        let mut s = sample(me, UserRef::Err(-libc::EFAULT), 2);
        s.start_ns = key.start_ns;
        m.drains.push_back(Ok(Drained {
            samples: vec![s],
            ..Default::default()
        }));
        let round = run(&mut r, &mut m, 1, &[0], &c).unwrap().unwrap();
        assert!(round.data.processes[0].record.complete);
        assert_eq!(c.processes_read.get(), 1);
        assert_eq!(
            m.mapped,
            vec![key],
            "its mappings went to the unwinder once"
        );
        let id = round.data.processes[0].id;
        // It exits during round 2: kept through round 3, forgotten at round 4's end,
        // without a delete from `seen` (the program forgot it on exit).
        r.on_events(&[event(EventKind::Exit)], &c);
        for now in [2, 3] {
            let round = run(&mut r, &mut m, now, &[0], &c).unwrap().unwrap();
            assert!(round.forgotten.is_empty(), "forgotten too early");
        }
        let round = run(&mut r, &mut m, 4, &[0], &c).unwrap().unwrap();
        assert_eq!(round.forgotten, vec![id]);
        assert!(m.forgotten.is_empty());
        assert_eq!(m.unmapped, vec![key], "and left it when it was forgotten");
        assert_eq!(c.events_exit.get(), 1);
    }
}

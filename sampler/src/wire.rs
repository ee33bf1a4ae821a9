//! Writing a round into a Cap'n Proto `Batch` for one subscriber.

use firn_schema::firn_capnp::{batch, batch_sink, counter, process, sample, StackStatus as Wire};

use crate::assemble::{Issued, RoundData, StackStatus};
use crate::hub::Outgoing;

pub(crate) struct BatchMeta<'a> {
    pub(crate) session_id: u64,
    pub(crate) frequency_hz: u32,
    pub(crate) dropped_batches: u64,
    pub(crate) tables_evicted: u64,
    pub(crate) counters: &'a [(&'static str, u64)],
    pub(crate) off_cpu: bool,
}

fn wire(s: StackStatus) -> Wire {
    match s {
        StackStatus::Ok => Wire::Ok,
        StackStatus::Absent => Wire::Absent,
        StackStatus::Lost => Wire::Lost,
        StackStatus::Error => Wire::Error,
    }
}

fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

pub(crate) fn fill_counters(
    mut list: capnp::struct_list::Builder<'_, counter::Owned>,
    counters: &[(&'static str, u64)],
) {
    for (i, (name, value)) in counters.iter().enumerate() {
        let mut c = list.reborrow().get(len32(i));
        c.set_name(*name);
        c.set_value(*value);
    }
}

/// The record bytes (as `wire_bytes` counts them) one message carries, so that it fits
/// the first segment of an outgoing message (`rpc::guard`, 128 KiB) with room for the
/// call's own words.
pub(crate) const MAX_MESSAGE_RECORD_BYTES: usize = 96 << 10;

/// Takes from `records` every share of at most `max` bytes but the last, in order, each
/// at least one record; the last share stays in `records` for its own message. Nothing
/// is taken when all fit in one.
pub(crate) fn records_ahead(records: &mut Vec<Issued>, max: usize) -> Vec<Vec<Issued>> {
    let mut shares: Vec<Vec<Issued>> = Vec::new();
    let mut used = 0;
    for p in records.drain(..) {
        let n = p.record.wire_bytes();
        match shares.last_mut() {
            Some(last) if used + n <= max => last.push(p),
            _ => {
                shares.push(vec![p]);
                used = 0;
            }
        }
        used += n;
    }
    *records = shares.pop().unwrap_or_default();
    shares
}

/// An announcement: process records alone.
pub(crate) fn fill_processes(b: batch_sink::announce_params::Builder<'_>, processes: &[Issued]) {
    let mut procs = b.init_processes(len32(processes.len()));
    for (i, p) in processes.iter().enumerate() {
        fill_process(procs.reborrow().get(len32(i)), p);
    }
}

/// The batch of `out` (its round, the records and forgotten ids for this subscriber, and
/// code blobs carried from dropped batches).
pub(crate) fn fill_batch(
    mut b: batch::Builder<'_>,
    round: &RoundData,
    out: &Outgoing,
    meta: &BatchMeta<'_>,
) {
    let (processes, forgotten) = (&out.processes, &out.forgotten);
    let carried_code = &out.python_code;
    let mut f = b
        .reborrow()
        .init_forgotten_processes(len32(forgotten.len()));
    for (i, id) in forgotten.iter().enumerate() {
        f.set(len32(i), *id);
    }
    b.set_session_id(meta.session_id);
    b.set_round(round.round);
    b.set_start_time_ns(round.start_time_ns);
    b.set_end_time_ns(round.end_time_ns);
    b.set_frequency_hz(meta.frequency_hz);
    b.set_dropped_batches(meta.dropped_batches);
    b.set_unwind_tables_evicted(meta.tables_evicted);
    b.set_off_cpu(meta.off_cpu);
    fill_counters(
        b.reborrow().init_counters(len32(meta.counters.len())),
        meta.counters,
    );
    let mut syms = b
        .reborrow()
        .init_kernel_symbols(len32(round.kernel_symbols.len()));
    for (i, s) in round.kernel_symbols.iter().enumerate() {
        // Kernel symbol names are ASCII; anything else is replaced rather than sent raw.
        syms.set(len32(i), String::from_utf8_lossy(s).as_ref());
    }
    let mut procs = b.reborrow().init_processes(len32(processes.len()));
    for (i, p) in processes.iter().enumerate() {
        fill_process(procs.reborrow().get(len32(i)), p);
    }
    let blobs = carried_code.len() + round.python_code.len();
    let mut code = b.reborrow().init_python_code(len32(blobs));
    for (i, blob) in carried_code.iter().chain(&round.python_code).enumerate() {
        code.set(len32(i), blob);
    }
    let mut cg = b.reborrow().init_cgroups(len32(round.cgroups.len()));
    for (i, (id, path)) in round.cgroups.iter().enumerate() {
        let mut w = cg.reborrow().get(len32(i));
        w.set_id(*id);
        w.set_path(path);
    }
    let mut samples = b.init_samples(len32(round.samples.len()));
    for (i, s) in round.samples.iter().enumerate() {
        let mut w: sample::Builder<'_> = samples.reborrow().get(len32(i));
        w.set_process_id(s.process_id);
        w.set_pid(s.pid);
        w.set_tid(s.tid);
        let comm_len = s.comm.iter().position(|&c| c == 0).unwrap_or(s.comm.len());
        w.set_comm(&s.comm[..comm_len]);
        if s.off_cpu {
            w.set_off_cpu_ns(s.count);
        } else {
            w.set_count(s.count);
        }
        w.set_cgroup_id(s.cgroup_id);
        w.set_user_stack(wire(s.user_status));
        w.set_kernel_stack(wire(s.kernel_status));
        w.set_user_stack_end(crate::unwind::ends::wire(s.unwind_end));
        let mut u = w.reborrow().init_user_frames(len32(s.user.len()));
        for (j, &a) in s.user.iter().enumerate() {
            u.set(len32(j), a);
        }
        let mut k = w.init_kernel_frames(len32(s.kernel.len()));
        for (j, &idx) in s.kernel.iter().enumerate() {
            k.set(len32(j), idx);
        }
    }
}

fn fill_process(mut w: process::Builder<'_>, p: &Issued) {
    let r = &p.record;
    w.set_process_id(p.id);
    w.set_pid(r.pid);
    w.set_start_time_ns(r.start_ns);
    w.set_ppid(r.ppid);
    w.set_uid(r.uid);
    w.set_comm(&r.comm);
    w.set_exe(&r.exe);
    w.set_cgroup(&r.cgroup);
    w.set_mappings_version(p.version);
    w.set_complete(r.complete);
    w.set_first_sample_ns(r.first_sample_ns);
    let mut args = w.reborrow().init_cmdline(len32(r.args().count()));
    for (i, a) in r.args().enumerate() {
        args.set(len32(i), a);
    }
    let mut maps = w.init_mappings(len32(r.mappings.len()));
    for (i, m) in r.mappings.iter().enumerate() {
        let mut mw = maps.reborrow().get(len32(i));
        mw.set_start(m.start);
        mw.set_end(m.end);
        mw.set_file_offset(m.offset);
        mw.set_dev_major(m.dev_major);
        mw.set_dev_minor(m.dev_minor);
        mw.set_inode(m.inode);
        mw.set_path(&m.path);
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;
    use crate::procfs::{Mapping, ProcessRecord};

    fn issued(id: u64) -> Issued {
        let mapping = Mapping {
            path: vec![b'p'; 100].into(),
            ..Default::default()
        };
        Issued {
            id,
            version: 1,
            record: Rc::new(ProcessRecord {
                pid: id as u32,
                mappings: vec![mapping; 3],
                ..Default::default()
            }),
        }
    }

    fn ids(v: &[Issued]) -> Vec<u64> {
        v.iter().map(|p| p.id).collect()
    }

    #[test]
    fn records_that_fit_one_message_stay_in_it() {
        let mut records: Vec<Issued> = (1..=3).map(issued).collect();
        let each = records[0].record.wire_bytes();
        assert!(records_ahead(&mut records, 3 * each).is_empty());
        assert_eq!(ids(&records), [1, 2, 3]);
        let mut none = Vec::new();
        assert!(records_ahead(&mut none, 0).is_empty());
    }

    #[test]
    fn more_records_go_ahead_in_order_in_shares_within_the_bound() {
        let mut records: Vec<Issued> = (1..=7).map(issued).collect();
        let each = records[0].record.wire_bytes();
        let ahead = records_ahead(&mut records, 2 * each + each / 2);
        let shares: Vec<Vec<u64>> = ahead.iter().map(|s| ids(s)).collect();
        assert_eq!(shares, [vec![1, 2], vec![3, 4], vec![5, 6]]);
        assert_eq!(
            ids(&records),
            [7],
            "the last share stays for the message itself"
        );
    }

    #[test]
    fn a_record_larger_than_the_bound_still_goes_alone() {
        let mut records: Vec<Issued> = (1..=3).map(issued).collect();
        let ahead = records_ahead(&mut records, 1);
        let shares: Vec<Vec<u64>> = ahead.iter().map(|s| ids(s)).collect();
        assert_eq!(shares, [vec![1], vec![2]]);
        assert_eq!(ids(&records), [3]);
    }
}

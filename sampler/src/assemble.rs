//! Turning one drained map set into a round: stacks attached to samples, kernel frames
//! named from kallsyms (never sent as addresses), processes identified.

use std::collections::HashMap;
use std::rc::Rc;

use firn_sampler_bpf::COMM_LEN;

use crate::counters::{add, bump, Counters};
use crate::drain::{Drained, StackRef, UserRef};
use crate::kallsyms::Kallsyms;
use crate::processes::ProcessTable;
use crate::procfs::ProcessRecord;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StackStatus {
    Ok,
    Absent,
    Lost,
    Error,
}

pub(crate) struct Sample {
    pub(crate) process_id: u64,
    pub(crate) pid: u32,
    pub(crate) tid: u32,
    pub(crate) comm: [u8; COMM_LEN],
    pub(crate) count: u64,
    pub(crate) user: Rc<[u64]>,
    pub(crate) kernel: Vec<u32>,
    pub(crate) user_status: StackStatus,
    pub(crate) kernel_status: StackStatus,
    /// Why the unwinder stopped (`enum firn_unwind_end`).
    pub(crate) unwind_end: u32,
    /// The cgroup v2 id the sample was taken in.
    pub(crate) cgroup_id: u64,
    /// `count` is nanoseconds off CPU.
    pub(crate) off_cpu: bool,
}

/// A process record as issued to subscribers: its session id and mapping version.
#[derive(Clone)]
pub(crate) struct Issued {
    pub(crate) id: u64,
    pub(crate) version: u32,
    pub(crate) record: Rc<ProcessRecord>,
}

pub(crate) struct RoundData {
    pub(crate) round: u64,
    pub(crate) start_time_ns: u64,
    pub(crate) end_time_ns: u64,
    pub(crate) samples: Vec<Sample>,
    pub(crate) kernel_symbols: Vec<Rc<[u8]>>,
    /// Every process the samples refer to, as of this round.
    pub(crate) processes: Vec<Issued>,
    /// Python code objects' names, as the walk copied them (opaque here).
    pub(crate) python_code: Vec<Rc<[u8]>>,
    /// The path of each cgroup id the samples name, where known.
    pub(crate) cgroups: Vec<(u64, Rc<[u8]>)>,
}

const UNKNOWN_KERNEL: &[u8] = b"[unknown]";

/// First address above user space. The kernel's frame-pointer walk of a user stack
/// built without frame pointers reads arbitrary stack words; a "return address" at or
/// above this is such garbage, and the stack is cut there (it also keeps anything that
/// looks like a kernel address off the wire).
#[cfg(target_arch = "x86_64")]
const USER_SPACE_END: u64 = 1 << 47;
#[cfg(not(target_arch = "x86_64"))]
const USER_SPACE_END: u64 = 1 << 52;

/// The plausible prefix of a user stack: user addresses and the walk's Python frames.
fn user_prefix(frames: &[u64]) -> &[u64] {
    use firn_schema::python_code::frame::is_python;
    let n = frames
        .iter()
        .position(|&a| a == 0 || (a >= USER_SPACE_END && !is_python(a)))
        .unwrap_or(frames.len());
    &frames[..n]
}

fn user_status(r: UserRef, drained: &Drained) -> StackStatus {
    match r {
        UserRef::Hash(h) if drained.user_stacks.contains_key(&h) => StackStatus::Ok,
        UserRef::Hash(_) => StackStatus::Lost,
        UserRef::Err(e) if e == -libc::EFAULT => StackStatus::Absent,
        UserRef::Err(e) if e == -libc::ENOMEM => StackStatus::Lost,
        UserRef::Err(_) => StackStatus::Error,
    }
}

fn status(r: StackRef, drained: &Drained) -> StackStatus {
    match r {
        StackRef::Id(id) if drained.stacks.contains_key(&id) => StackStatus::Ok,
        StackRef::Id(_) => StackStatus::Lost,
        StackRef::Err(e) if e == -libc::EFAULT => StackStatus::Absent,
        StackRef::Err(e) if e == -libc::EEXIST || e == -libc::ENOMEM => StackStatus::Lost,
        StackRef::Err(_) => StackStatus::Error,
    }
}

pub(crate) fn assemble(
    drained: Drained,
    kallsyms: &Kallsyms,
    table: &mut ProcessTable,
    round: u64,
    (start_time_ns, end_time_ns): (u64, u64),
    counters: &Counters,
) -> RoundData {
    let mut stacks = Stacks {
        kallsyms,
        counters,
        symbols: Vec::new(),
        symbol_index: HashMap::new(),
        user: HashMap::new(),
        kernel: HashMap::new(),
        empty: Rc::from(Vec::new()),
    };
    let mut processes: HashMap<u64, Issued> = HashMap::new();
    let mut cgroups: HashMap<u64, Option<Rc<[u8]>>> = HashMap::new();
    let mut samples = Vec::with_capacity(drained.samples.len());
    for raw in &drained.samples {
        let user = stacks.user(raw.user, &drained);
        let kernel = stacks.kernel(raw.kernel, &drained);
        let key = crate::processes::ProcKey {
            tgid: raw.tgid,
            start_ns: raw.start_ns,
            exec_id: raw.exec_id,
        };
        let left_code = crate::unwind::ends::outside_mappings(raw.unwind_end);
        let process_id = table.observe(key, &raw.comm, (&user, left_code), round, counters);
        if let Some(k) = table.get(key) {
            processes.insert(
                process_id,
                Issued {
                    id: k.id,
                    version: k.version,
                    record: k.record.clone(),
                },
            );
        }
        samples.push(Sample {
            process_id,
            pid: raw.tgid,
            tid: raw.tid,
            comm: raw.comm,
            count: raw.count,
            user,
            kernel,
            user_status: user_status(raw.user, &drained),
            kernel_status: status(raw.kernel, &drained),
            unwind_end: raw.unwind_end,
            cgroup_id: raw.cgroup_id,
            off_cpu: raw.off_cpu,
        });
        if let std::collections::hash_map::Entry::Vacant(v) = cgroups.entry(raw.cgroup_id) {
            v.insert(table.cgroups.get(raw.cgroup_id));
        }
    }
    add(&counters.samples_sent, samples.len() as u64);
    RoundData {
        round,
        start_time_ns,
        end_time_ns,
        samples,
        kernel_symbols: stacks.symbols,
        processes: processes.into_values().collect(),
        python_code: drained.python_code.into_iter().map(Rc::from).collect(),
        cgroups: cgroups
            .into_iter()
            .filter_map(|(id, text)| Some((id, text?)))
            .collect(),
    }
}

/// The round's stacks, each made once however many samples share it, and the kernel
/// symbol names they index.
struct Stacks<'a> {
    kallsyms: &'a Kallsyms,
    counters: &'a Counters,
    symbols: Vec<Rc<[u8]>>,
    symbol_index: HashMap<Option<u32>, u32>,
    user: HashMap<u64, Rc<[u64]>>,
    kernel: HashMap<u64, Vec<u32>>,
    empty: Rc<[u64]>,
}

impl Stacks<'_> {
    /// A sample's user frames, up to the first address that is not user code.
    fn user(&mut self, r: UserRef, drained: &Drained) -> Rc<[u64]> {
        let Some(id) = r.key() else {
            return self.empty.clone();
        };
        let Some(frames) = drained.user_stacks.get(&id) else {
            return self.empty.clone();
        };
        let counters = self.counters;
        self.user
            .entry(id)
            .or_insert_with(|| {
                let kept = user_prefix(frames);
                if kept.len() < frames.len() {
                    bump(&counters.user_stacks_truncated);
                }
                Rc::from(kept)
            })
            .clone()
    }

    /// A sample's kernel frames as indices into the round's symbol names.
    fn kernel(&mut self, r: StackRef, drained: &Drained) -> Vec<u32> {
        let Some(id) = r.key() else {
            return Vec::new();
        };
        let Some(frames) = drained.stacks.get(&id) else {
            return Vec::new();
        };
        if let Some(k) = self.kernel.get(&id) {
            return k.clone();
        }
        let names: Vec<u32> = frames.iter().map(|&addr| self.symbol(addr)).collect();
        self.kernel.insert(id, names.clone());
        names
    }

    fn symbol(&mut self, addr: u64) -> u32 {
        let sym = self.kallsyms.lookup(addr);
        if sym.is_none() {
            bump(&self.counters.kernel_frames_unresolved);
        }
        let (kallsyms, symbols) = (self.kallsyms, &mut self.symbols);
        *self.symbol_index.entry(sym).or_insert_with(|| {
            let name: Rc<[u8]> = match sym {
                Some(i) => Rc::from(kallsyms.name(i)),
                None => Rc::from(UNKNOWN_KERNEL),
            };
            symbols.push(name);
            (symbols.len() - 1) as u32
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn user_stacks_end_at_impossible_addresses() {
        assert_eq!(
            super::user_prefix(&[0x401000, 0x402000]),
            &[0x401000, 0x402000]
        );
        assert_eq!(
            super::user_prefix(&[0x401000, 0xffff_ffff_ffff_ffff, 0x402000]),
            &[0x401000]
        );
        assert_eq!(super::user_prefix(&[0x401000, 0, 0x402000]), &[0x401000]);
    }
}

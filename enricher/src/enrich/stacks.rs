//! The round's stacks: user frames symbolized per binary, then every sample's frames
//! (kernel names, named or bare user frames, the unwinder's marker) with its process's
//! label set.

use std::collections::HashMap;
use std::sync::Arc;

use super::Enricher;
use crate::batch::{Batch, Sample, Stack};
use crate::labels::Extra;
use crate::metrics::Metrics;
use crate::model::{BinaryId, Frame, LabelSet, Lines, MappingSpec, StackSample};
use crate::processes::{Binary, Entry};
use crate::symbolize::hex;

/// What the symbolizer named: (binary, file offset) → lines (None: no symbol).
pub(super) type Resolved = HashMap<(BinaryId, u64), Option<Lines>>;

/// Mapping paths and build ids shared between the mappings of every process and round:
/// the `/pprof/cpu` window holds many rounds, and under churn each short-lived
/// process's mappings would otherwise carry copies of the same few texts.
#[derive(Default)]
pub(crate) struct Names(std::cell::RefCell<NameSet>);

#[derive(Default)]
struct NameSet {
    set: std::collections::HashSet<Arc<str>>,
    bytes: usize,
}

/// Bytes of text [`Names`] keeps at most (paths come from processes, up to 4 KiB each);
/// past it, it starts again (copies already shared stay valid).
const MAX_NAME_BYTES: usize = 1 << 20;

impl Names {
    pub(crate) fn get(&self, text: &str) -> Arc<str> {
        let mut n = self.0.borrow_mut();
        if let Some(t) = n.set.get(text) {
            return t.clone();
        }
        if n.bytes + text.len() > MAX_NAME_BYTES {
            n.set.clear();
            n.bytes = 0;
        }
        n.bytes += text.len();
        let t: Arc<str> = Arc::from(text);
        n.set.insert(t.clone());
        t
    }
}

impl Enricher {
    /// Build id (hex) and strippedness of the process's main executable, once its
    /// binary is loaded.
    fn exe_facts(&self, e: &Entry) -> (Option<String>, Option<bool>) {
        let exe = e.record.exe.as_str();
        let id = e
            .record
            .mappings
            .iter()
            .position(|m| m.path == exe)
            .and_then(|i| match &e.binaries[i] {
                Binary::Known(id) => Some(id),
                _ => None,
            });
        match id {
            Some(id) => (
                self.symbolizer.build_id(id).map(hex),
                self.symbolizer.stripped(id),
            ),
            None => (None, None),
        }
    }

    /// Every user frame the cache can name, named: (binary, file offset) → lines.
    pub(super) fn symbolize(&mut self, batch: &Batch) -> Resolved {
        let mut wanted: HashMap<BinaryId, Vec<u64>> = HashMap::new();
        for s in &batch.samples {
            let Some(e) = self.processes.get(s.process_id) else {
                continue;
            };
            for (i, &addr) in s.user_frames.iter().enumerate() {
                if let Some((idx, mp)) = e.mapping_of(addr) {
                    if let Binary::Known(id) = &e.binaries[idx] {
                        wanted
                            .entry(id.clone())
                            .or_default()
                            .push(sym_offset(addr, mp, i));
                    }
                }
            }
        }
        let mut resolved: HashMap<(BinaryId, u64), Option<Lines>> = HashMap::new();
        self.symbolizer.asked(wanted.keys());
        for (id, offsets) in wanted {
            let lines = self.symbolizer.symbolize(&id, &offsets);
            for (o, l) in offsets.into_iter().zip(lines) {
                resolved.insert((id.clone(), o), l);
            }
        }

        resolved
    }

    /// A process whose main thread renamed itself since its record was read: its comm
    /// as the main thread's samples show it (for this round and later ones).
    fn note_comms(&mut self, batch: &Batch) {
        for s in batch
            .samples
            .iter()
            .filter(|s| s.tid == s.pid && !s.comm.is_empty())
        {
            let Some(e) = self.processes.get(s.process_id) else {
                continue;
            };
            if e.record.comm == s.comm {
                self.main_comms.remove(&s.process_id);
            } else if self.main_comms.get(&s.process_id) != Some(&s.comm) {
                Metrics::inc(&self.metrics.process_comm_changes);
                self.main_comms.insert(s.process_id, s.comm.clone());
            }
        }
        for id in &batch.forgotten_processes {
            self.main_comms.remove(id);
        }
    }

    /// The round's stacks: frames named from `resolved`, labels per process.
    pub(super) fn stacks(&mut self, batch: &Batch, resolved: &Resolved) -> Vec<StackSample> {
        self.note_comms(batch);
        let m = self.metrics.clone();
        let mut label_sets: HashMap<(u64, u64), Option<Arc<LabelSet>>> = HashMap::new();
        // Each batch names the paths of its own samples' cgroups: nothing kept between rounds.
        let cgroups: HashMap<u64, &str> = batch
            .cgroups
            .iter()
            .map(|(id, p)| (*id, p.as_str()))
            .collect();
        let mut mappings: HashMap<(u64, usize), Arc<MappingSpec>> = HashMap::new();
        let kernel_names: Vec<Arc<str>> = batch
            .kernel_symbols
            .iter()
            .map(|s| Arc::from(s.as_str()))
            .collect();
        let mut stacks = Vec::with_capacity(batch.samples.len());
        for s in &batch.samples {
            Metrics::add(&m.samples_received, s.count);
            Metrics::add(&m.off_cpu_ns_received, s.off_cpu_ns);
            if self.processes.get(s.process_id).is_none() {
                Metrics::add(&m.samples_without_process, s.count);
            }
            let Some(labels) = self.labels_of(s, &cgroups, &mut label_sets) else {
                Metrics::add(&m.samples_dropped_by_relabel, s.count);
                continue;
            };
            let mut frames: Vec<Frame> = s
                .kernel_frames
                .iter()
                .map(|&k| Frame::Kernel(kernel_names[k as usize].clone()))
                .collect();
            let entry = self.processes.get(s.process_id);
            for (i, &addr) in s.user_frames.iter().enumerate() {
                let f = self.user_frame((s.process_id, entry), addr, i, resolved, &mut mappings);
                frames.push(f);
            }
            if let Some(marker) = s.user_end {
                Metrics::inc(&m.user_stacks_incomplete);
                frames.push(Frame::Kernel(Arc::from(marker)));
            }
            if frames.is_empty() {
                // Neither stack could be read: keep the sample's weight on its process.
                let why = match (s.user_stack, s.kernel_stack) {
                    (Stack::Lost, _) | (_, Stack::Lost) => "[stack lost]",
                    _ => "[no stack]",
                };
                frames.push(Frame::Kernel(Arc::from(why)));
            }
            stacks.push(StackSample {
                process_id: s.process_id,
                labels,
                frames: frames.into(),
                count: s.count,
                off_cpu_ns: s.off_cpu_ns,
            });
        }
        stacks
    }

    /// The label set of a sample's process in the cgroup it was taken in, computed once
    /// a round (None: a relabel rule dropped the process). A process that moved after
    /// its record was read is labelled by the cgroup of each sample.
    fn labels_of(
        &mut self,
        s: &Sample,
        cgroups: &HashMap<u64, &str>,
        label_sets: &mut HashMap<(u64, u64), Option<Arc<LabelSet>>>,
    ) -> Option<Arc<LabelSet>> {
        if let Some(l) = label_sets.get(&(s.process_id, s.cgroup_id)) {
            return l.clone();
        }
        let entry = self.processes.get(s.process_id);
        let moved = entry.and_then(|e| {
            let path = cgroups
                .get(&s.cgroup_id)
                .and_then(|line| with_unified_line(&e.record.cgroup, line))
                .filter(|p| *p != e.record.cgroup);
            let comm = self.main_comms.get(&s.process_id);
            if path.is_none() && comm.is_none() {
                return None;
            }
            let mut r = (*e.record).clone();
            if let Some(path) = path {
                Metrics::inc(&self.metrics.samples_in_moved_cgroups);
                r.cgroup = path;
            }
            if let Some(comm) = comm {
                r.comm = comm.clone();
            }
            Some(r)
        });
        if entry.is_none() {
            tracing::info!(
                pid = s.pid,
                "samples of a process with no record; encoded with comm only"
            );
        }
        let (build_id, stripped) = entry.map_or((None, None), |e| self.exe_facts(e));
        let extra = Extra {
            comm: &s.comm,
            executable_build_id: build_id,
            executable_stripped: stripped,
        };
        let record = moved.as_ref().or(entry.map(|e| &*e.record));
        let l = self
            .labeler
            .labels((s.process_id, s.cgroup_id), record, s.pid, extra);
        if l.is_none() {
            Metrics::inc(&self.metrics.processes_dropped_by_relabel);
            tracing::debug!(pid = s.pid, "process dropped by a relabel rule");
        }
        label_sets.insert((s.process_id, s.cgroup_id), l.clone());
        l
    }

    /// User frame `i` of a stack of process `process_id` (its entry), named from `resolved`, with its
    /// mapping (one `MappingSpec` per process and mapping a round).
    fn user_frame(
        &self,
        (process_id, entry): (u64, Option<&Entry>),
        addr: u64,
        i: usize,
        resolved: &Resolved,
        mappings: &mut HashMap<(u64, usize), Arc<MappingSpec>>,
    ) -> Frame {
        let m = &self.metrics;
        if firn_schema::python_code::frame::is_python(addr) {
            return self.python_frame(addr);
        }
        let found = entry.and_then(|e| e.mapping_of(addr).map(|(idx, mp)| (e, idx, mp)));
        let Some((e, idx, mp)) = found else {
            Metrics::inc(&m.frames_unsymbolized_no_mapping);
            return Frame::User {
                mapping: None,
                address: addr,
                lines: None,
            };
        };
        let known = match &e.binaries[idx] {
            Binary::Known(id) => Some(id),
            _ => None,
        };
        let lines = known.and_then(|id| {
            resolved
                .get(&(id.clone(), sym_offset(addr, mp, i)))
                .cloned()
                .flatten()
        });
        match (&known, &lines) {
            (None, _) => Metrics::inc(&m.frames_unsymbolized_no_binary),
            (Some(_), None) => Metrics::inc(&m.frames_unsymbolized_no_symbol),
            (Some(_), Some(_)) => Metrics::inc(&m.frames_symbolized),
        }
        let spec = mappings
            .entry((process_id, idx))
            .or_insert_with(|| {
                let build_id = known
                    .and_then(|id| self.symbolizer.build_id(id))
                    .map(hex)
                    .unwrap_or_default();
                Arc::new(MappingSpec {
                    start: mp.start,
                    limit: mp.end,
                    offset: mp.file_offset,
                    file: self.names.get(&mp.path),
                    build_id: self.names.get(&build_id),
                    symbolized: known.is_some(),
                })
            })
            .clone();
        Frame::User {
            mapping: Some(spec),
            address: addr,
            lines,
        }
    }
}

impl Enricher {
    /// A Python frame: its function, file and line from the code object's names.
    fn python_frame(&self, entry: u64) -> Frame {
        let m = &self.metrics;
        let line = match self.python.names.line(entry) {
            Some(l) => {
                Metrics::inc(&m.python_frames_named);
                l
            }
            None => {
                Metrics::inc(&m.python_frames_unnamed);
                crate::model::Line {
                    function: Arc::from("[python: unknown code]"),
                    file: Arc::from(""),
                    line: 0,
                }
            }
        };
        Frame::User {
            mapping: Some(self.python.mapping()),
            address: entry,
            lines: Some(Arc::from([line])),
        }
    }
}

/// The file offset to symbolize for frame `i`: callers' return addresses point after
/// the call, so one byte back lands inside the call instruction (and its line).
fn sym_offset(addr: u64, m: &crate::batch::Mapping, i: usize) -> u64 {
    let off = addr - m.start + m.file_offset;
    if i > 0 {
        off.saturating_sub(1)
    } else {
        off
    }
}

/// A process's cgroup file `text` with its cgroup v2 line (`0::…`) replaced by `line`
/// (the sampler sends that line alone: v1 lines differ between processes of one v2
/// cgroup). `None` for a text with no v2 line (a v1-only host) that is not empty.
fn with_unified_line(text: &str, line: &str) -> Option<String> {
    if text.is_empty() {
        return Some(line.to_string());
    }
    let mut found = false;
    let out: Vec<&str> = text
        .split_inclusive('\n')
        .map(|l| {
            if l.starts_with("0::") {
                found = true;
                line
            } else {
                l
            }
        })
        .collect();
    found.then(|| out.concat())
}

#[cfg(test)]
mod cgroup_line_tests {
    #[test]
    fn the_v2_line_is_replaced_and_the_v1_lines_kept() {
        use super::with_unified_line as w;
        assert_eq!(
            w("12:cpu:/a\n0::/old\n", "0::/new\n").as_deref(),
            Some("12:cpu:/a\n0::/new\n")
        );
        assert_eq!(w("0::/old\n", "0::/new\n").as_deref(), Some("0::/new\n"));
        assert_eq!(w("", "0::/new\n").as_deref(), Some("0::/new\n"));
        assert_eq!(w("1:name=systemd:/\n", "0::/new\n"), None);
    }
}

#[cfg(test)]
mod names_tests {
    use super::{Names, MAX_NAME_BYTES};

    #[test]
    fn one_copy_per_text_and_a_bounded_set() {
        let names = Names::default();
        let a = names.get("/usr/lib/x86_64-linux-gnu/libc.so.6");
        let b = names.get("/usr/lib/x86_64-linux-gnu/libc.so.6");
        assert!(std::sync::Arc::ptr_eq(&a, &b));
        let long = "x".repeat(4096);
        for i in 0..(2 * MAX_NAME_BYTES / 4096) {
            names.get(&format!("{long}{i}"));
        }
        assert!(names.0.borrow().bytes <= MAX_NAME_BYTES);
        // A copy handed out before the set started again stays whole.
        assert_eq!(&*a, "/usr/lib/x86_64-linux-gnu/libc.so.6");
    }
}

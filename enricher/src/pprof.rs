//! Symbolized samples and their pprof encoding (`google/pprof/proto/profile.proto`, via
//! the types the `pprof` crate generates, so the tree has one prost).

use std::collections::HashMap;
use std::sync::Arc;

use crate::model::{Frame, LabelSet, MappingSpec, StackSample};

use pprof::protos::{Function, Label, Line, Location, Mapping, Profile, Sample, ValueType};
use prost::Message;

const KERNEL_MAPPING: &str = "[kernel.kallsyms]";

/// What a profile's samples measure: its sample types, period type and which stacks
/// it takes. One encoder serves the local files and every backend's dialect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleTypes {
    /// `samples`/`count` and `cpu`/`nanoseconds`, period `cpu`/`nanoseconds` (1e9 / Hz):
    /// on-CPU stacks only.
    OnCpu,
    /// [`SampleTypes::OnCpu`] and a third type, `off_cpu`/`nanoseconds` (`go tool pprof
    /// -sample_index=off_cpu`), as the OpenTelemetry profiler names it: every stack.
    OnAndOffCpu,
    /// `wallclock`/`nanoseconds` alone, period `samples`/`count` and 1: off-CPU stacks
    /// only, as Parca Agent writes off-CPU time (its normalizer gives every sample type
    /// of a pprof the one period type, so off-CPU cannot share a pprof with cpu there).
    OffCpuWallclock,
}

/// Builds one pprof profile, deduplicating strings, mappings, functions, locations and
/// samples (equal stacks with equal labels are summed).
pub struct Builder {
    p: Profile,
    strings: HashMap<Arc<str>, i64>,
    mappings: HashMap<Arc<MappingSpec>, u64>,
    /// The mapping of the previous user frame: most frames of a stack share it, and
    /// comparing pointers is far cheaper than hashing the spec.
    last_mapping: Option<(Arc<MappingSpec>, u64)>,
    kernel_mapping: Option<u64>,
    functions: HashMap<(i64, i64), u64>,
    user_locations: HashMap<(u64, u64), u64>,
    kernel_locations: HashMap<Arc<str>, u64>,
    samples: HashMap<(Vec<u64>, Arc<LabelSet>), usize>,
    period: i64,
    types: SampleTypes,
}

impl Builder {
    /// An on-CPU profile: `frequency` in Hz; `start_ns`/`end_ns` the wall-clock span.
    pub fn new(frequency: u32, start_ns: u64, end_ns: u64) -> Self {
        Self::of(SampleTypes::OnCpu, frequency, start_ns, end_ns)
    }

    /// A profile of `types`.
    pub fn of(types: SampleTypes, frequency: u32, start_ns: u64, end_ns: u64) -> Self {
        let period = 1_000_000_000 / i64::from(frequency.max(1));
        let mut b = Self {
            p: Profile::default(),
            strings: HashMap::new(),
            mappings: HashMap::new(),
            last_mapping: None,
            kernel_mapping: None,
            functions: HashMap::new(),
            user_locations: HashMap::new(),
            kernel_locations: HashMap::new(),
            samples: HashMap::new(),
            period,
            types,
        };
        b.string("");
        // The string order of the on-CPU types is the one profiles always had.
        let vt = |ty, unit| ValueType { ty, unit };
        match types {
            SampleTypes::OnCpu | SampleTypes::OnAndOffCpu => {
                let samples = b.string("samples");
                let count = b.string("count");
                let cpu = b.string("cpu");
                let ns = b.string("nanoseconds");
                b.p.sample_type = vec![vt(samples, count), vt(cpu, ns)];
                if types == SampleTypes::OnAndOffCpu {
                    let off = b.string("off_cpu");
                    b.p.sample_type.push(vt(off, ns));
                }
                b.p.period_type = Some(vt(cpu, ns));
                b.p.period = period;
                // An index into the string table, not into sample_type.
                b.p.default_sample_type = cpu;
            }
            SampleTypes::OffCpuWallclock => {
                let wall = b.string("wallclock");
                let ns = b.string("nanoseconds");
                let samples = b.string("samples");
                let count = b.string("count");
                b.p.sample_type = vec![vt(wall, ns)];
                b.p.period_type = Some(vt(samples, count));
                b.p.period = 1;
                b.p.default_sample_type = wall;
            }
        }
        b.p.time_nanos = start_ns as i64;
        b.p.duration_nanos = end_ns.saturating_sub(start_ns) as i64;
        b
    }

    pub(crate) fn comment(&mut self, text: &str) {
        let s = self.string(text);
        self.p.comment.push(s);
    }

    fn string(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.strings.get(s) {
            return i;
        }
        let i = self.p.string_table.len() as i64;
        self.p.string_table.push(s.to_string());
        self.strings.insert(Arc::from(s), i);
        i
    }

    fn function(&mut self, name: &str, file: &str) -> u64 {
        let key = (self.string(name), self.string(file));
        if let Some(&id) = self.functions.get(&key) {
            return id;
        }
        let id = self.p.function.len() as u64 + 1;
        self.p.function.push(Function {
            id,
            name: key.0,
            system_name: key.0,
            filename: key.1,
            start_line: 0,
        });
        self.functions.insert(key, id);
        id
    }

    fn mapping(&mut self, m: &Arc<MappingSpec>) -> u64 {
        if let Some((last, id)) = &self.last_mapping {
            if Arc::ptr_eq(last, m) {
                return *id;
            }
        }
        if let Some(&id) = self.mappings.get(m) {
            self.last_mapping = Some((m.clone(), id));
            return id;
        }
        let id = self.p.mapping.len() as u64 + 1;
        let filename = self.string(&m.file);
        let build_id = self.string(&m.build_id);
        self.p.mapping.push(Mapping {
            id,
            memory_start: m.start,
            memory_limit: m.limit,
            file_offset: m.offset,
            filename,
            build_id,
            has_functions: m.symbolized,
            has_filenames: m.symbolized,
            has_line_numbers: m.symbolized,
            has_inline_frames: m.symbolized,
        });
        self.mappings.insert(m.clone(), id);
        id
    }

    fn location(&mut self, f: &Frame) -> u64 {
        match f {
            Frame::Kernel(name) => {
                if let Some(&id) = self.kernel_locations.get(name) {
                    return id;
                }
                let mapping_id = match self.kernel_mapping {
                    Some(id) => id,
                    None => {
                        let id = self.mapping(&Arc::new(MappingSpec {
                            start: 0,
                            limit: 0,
                            offset: 0,
                            file: Arc::from(KERNEL_MAPPING),
                            build_id: Arc::from(""),
                            symbolized: true,
                        }));
                        self.kernel_mapping = Some(id);
                        id
                    }
                };
                let function_id = self.function(name, "");
                let id = self.p.location.len() as u64 + 1;
                self.p.location.push(Location {
                    id,
                    mapping_id,
                    address: 0,
                    line: vec![Line {
                        function_id,
                        line: 0,
                    }],
                    is_folded: false,
                });
                self.kernel_locations.insert(name.clone(), id);
                id
            }
            Frame::User {
                mapping,
                address,
                lines,
            } => {
                let mapping_id = mapping.as_ref().map_or(0, |m| self.mapping(m));
                if let Some(&id) = self.user_locations.get(&(mapping_id, *address)) {
                    return id;
                }
                let line = lines
                    .iter()
                    .flat_map(|ls| ls.iter())
                    .map(|l| Line {
                        function_id: self.function(&l.function, &l.file),
                        line: i64::from(l.line),
                    })
                    .collect();
                let id = self.p.location.len() as u64 + 1;
                self.p.location.push(Location {
                    id,
                    mapping_id,
                    address: *address,
                    line,
                    is_folded: false,
                });
                self.user_locations.insert((mapping_id, *address), id);
                id
            }
        }
    }

    /// The values `s` adds in this profile's sample types; None: not one of its stacks.
    fn values(&self, s: &StackSample) -> Option<([i64; 3], usize)> {
        // Counts come off the wire: saturate rather than wrap (found by fuzzing).
        let count = i64::try_from(s.count).unwrap_or(i64::MAX);
        let off = i64::try_from(s.off_cpu_ns).unwrap_or(i64::MAX);
        match self.types {
            // Off-CPU time where no type holds it (a round of another session, or
            // the on-CPU half of a backend's pair) is left out, not shown as samples.
            SampleTypes::OnCpu if off > 0 => None,
            SampleTypes::OnCpu => Some(([count, count.saturating_mul(self.period), 0], 2)),
            SampleTypes::OnAndOffCpu => Some(([count, count.saturating_mul(self.period), off], 3)),
            SampleTypes::OffCpuWallclock if off == 0 => None,
            SampleTypes::OffCpuWallclock => Some(([off, 0, 0], 1)),
        }
    }

    pub fn add(&mut self, s: &StackSample) {
        let Some((values, n)) = self.values(s) else {
            return;
        };
        let locs: Vec<u64> = s.frames.iter().map(|f| self.location(f)).collect();
        let key = (locs, s.labels.clone());
        if let Some(&i) = self.samples.get(&key) {
            for (v, add) in self.p.sample[i].value.iter_mut().zip(values) {
                *v = v.saturating_add(add);
            }
            return;
        }
        let label = s
            .labels
            .iter()
            .map(|(k, v)| Label {
                key: self.string(k),
                str: self.string(v),
                num: 0,
                num_unit: 0,
            })
            .collect();
        self.samples.insert(key.clone(), self.p.sample.len());
        self.p.sample.push(Sample {
            location_id: key.0,
            value: values[..n].to_vec(),
            label,
        });
    }

    pub fn finish(self) -> Profile {
        self.p
    }
}

/// pprof bytes, gzip-compressed (what `go tool pprof` and Parca read).
pub fn encode_gz(p: &Profile) -> std::io::Result<Vec<u8>> {
    crate::gzip::compress(&p.encode_to_vec())
}

/// Total samples (first value) of a profile.
pub(crate) fn sample_count(p: &Profile) -> i64 {
    p.sample
        .iter()
        .map(|s| s.value.first().copied().unwrap_or(0))
        .fold(0i64, i64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(count: u64, off_cpu_ns: u64) -> StackSample {
        StackSample {
            process_id: 1,
            labels: Arc::new(vec![("pid".into(), "1".into())]),
            frames: Arc::from(vec![Frame::Kernel(Arc::from("schedule"))]),
            count,
            off_cpu_ns,
        }
    }

    #[test]
    fn off_cpu_time_is_a_third_sample_type_only_when_measured() {
        let mut b = Builder::of(SampleTypes::OnAndOffCpu, 100, 0, 1);
        b.add(&stack(2, 0));
        b.add(&stack(0, 5_000));
        b.add(&stack(0, 7_000));
        let p = b.finish();
        let name = |i: i64| p.string_table[i as usize].clone();
        let types: Vec<_> = p
            .sample_type
            .iter()
            .map(|t| (name(t.ty), name(t.unit)))
            .collect();
        assert_eq!(types[2], ("off_cpu".to_string(), "nanoseconds".to_string()));
        assert_eq!(
            p.sample.len(),
            1,
            "equal stacks and labels sum into one sample"
        );
        assert_eq!(p.sample[0].value, vec![2, 20_000_000, 12_000]);
        // Without the type, off-CPU time is left out rather than shown as samples.
        let mut b = Builder::new(100, 0, 1);
        b.add(&stack(0, 5_000));
        b.add(&stack(1, 0));
        let p = b.finish();
        assert_eq!(p.sample_type.len(), 2);
        assert_eq!(
            p.sample.iter().map(|s| s.value.clone()).collect::<Vec<_>>(),
            vec![vec![1, 10_000_000]]
        );
    }
}

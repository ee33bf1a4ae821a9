//! A round as one OTLP `ExportProfilesServiceRequest`: every profile of the round
//! sharing one dictionary.

use std::collections::HashMap;
use std::sync::Arc;

use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::profiles::v1development::{
    Function, KeyValueAndUnit, Line, Link, Location, Mapping, Profile, ProfilesDictionary,
    ResourceProfiles, Sample, ScopeProfiles, Stack, ValueType,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use prost14::Message;

use crate::model::{Frame, LabelSet, MappingSpec, Round};
use crate::output::group::Groups;

const KERNEL_MAPPING: &str = "[kernel.kallsyms]";

/// firn label → semantic-convention resource attribute; labels not listed here are
/// sent as `firn.<label>`.
const SEMCONV: &[(&str, &str)] = &[
    ("node", "host.name"),
    ("pid", "process.pid"),
    ("executable", "process.executable.name"),
    ("container_id", "container.id"),
    ("pod", "k8s.pod.name"),
    ("namespace", "k8s.namespace.name"),
    ("container", "k8s.container.name"),
    ("thread_id", "thread.id"),
    ("thread_name", "thread.name"),
];
const INT_ATTRIBUTES: &[&str] = &["process.pid", "thread.id"];

fn string_value(s: &str) -> AnyValue {
    AnyValue {
        value: Some(any_value::Value::StringValue(s.to_string())),
    }
}

/// Resource attributes of one label set.
pub(crate) fn resource_attributes(labels: &LabelSet) -> Vec<KeyValue> {
    let get = |k: &str| labels.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let mut out: Vec<KeyValue> = Vec::with_capacity(labels.len() + 2);
    let mut push = |key: String, value: AnyValue| {
        out.push(KeyValue {
            key,
            value: Some(value),
            key_strindex: 0,
        })
    };
    for (k, v) in labels {
        let key = SEMCONV
            .iter()
            .find(|(l, _)| *l == k)
            .map_or_else(|| format!("firn.{k}"), |(_, a)| a.to_string());
        let value = match INT_ATTRIBUTES.contains(&key.as_str()) {
            true => match v.parse::<i64>() {
                Ok(n) => AnyValue {
                    value: Some(any_value::Value::IntValue(n)),
                },
                Err(_) => string_value(v),
            },
            false => string_value(v),
        };
        push(key, value);
    }
    if get("pod").is_some() {
        if let Some(node) = get("node") {
            push("k8s.node.name".into(), string_value(node));
        }
    }
    // The service: the Kubernetes container, else the systemd unit, else the program.
    let service = get("container")
        .map(str::to_string)
        .or_else(|| get("systemd_unit").map(|u| u.trim_end_matches(".service").to_string()))
        .or_else(|| get("executable").map(str::to_string));
    if let Some(s) = service.filter(|s| !s.is_empty()) {
        push("service.name".into(), string_value(&s));
    }
    out
}

/// The shared dictionary of one request; every table starts with its zero value.
struct Dictionary {
    d: ProfilesDictionary,
    strings: HashMap<Arc<str>, i32>,
    mappings: HashMap<Arc<MappingSpec>, i32>,
    kernel_mapping: i32,
    functions: HashMap<(i32, i32), i32>,
    user_locations: HashMap<(i32, u64), i32>,
    kernel_locations: HashMap<Arc<str>, i32>,
    stacks: HashMap<Vec<i32>, i32>,
    build_id_key: i32,
    /// `profile.frame.type` attributes, by FrameKind (0: not made yet).
    frame_types: [i32; 3],
}

impl Dictionary {
    fn new() -> Self {
        let mut d = Self {
            d: ProfilesDictionary {
                mapping_table: vec![Mapping::default()],
                location_table: vec![Location::default()],
                function_table: vec![Function::default()],
                link_table: vec![Link::default()],
                string_table: Vec::new(),
                attribute_table: vec![KeyValueAndUnit::default()],
                stack_table: vec![Stack::default()],
            },
            strings: HashMap::new(),
            mappings: HashMap::new(),
            kernel_mapping: 0,
            functions: HashMap::new(),
            user_locations: HashMap::new(),
            kernel_locations: HashMap::new(),
            stacks: HashMap::new(),
            build_id_key: 0,
            frame_types: [0; 3],
        };
        d.string("");
        d.build_id_key = d.string("process.executable.build_id.gnu");
        d
    }

    fn string(&mut self, s: &str) -> i32 {
        if let Some(&i) = self.strings.get(s) {
            return i;
        }
        let i = self.d.string_table.len() as i32;
        self.d.string_table.push(s.to_string());
        self.strings.insert(Arc::from(s), i);
        i
    }

    fn mapping(&mut self, m: &Arc<MappingSpec>) -> i32 {
        if let Some(&i) = self.mappings.get(m) {
            return i;
        }
        let filename_strindex = self.string(&m.file);
        let mut attribute_indices = Vec::new();
        if !m.build_id.is_empty() {
            let i = self.d.attribute_table.len() as i32;
            self.d.attribute_table.push(KeyValueAndUnit {
                key_strindex: self.build_id_key,
                value: Some(string_value(&m.build_id)),
                unit_strindex: 0,
            });
            attribute_indices.push(i);
        }
        let i = self.d.mapping_table.len() as i32;
        self.d.mapping_table.push(Mapping {
            memory_start: m.start,
            memory_limit: m.limit,
            file_offset: m.offset,
            filename_strindex,
            attribute_indices,
        });
        self.mappings.insert(m.clone(), i);
        i
    }

    fn function(&mut self, name: &str, file: &str) -> i32 {
        let key = (self.string(name), self.string(file));
        if let Some(&i) = self.functions.get(&key) {
            return i;
        }
        let i = self.d.function_table.len() as i32;
        self.d.function_table.push(Function {
            name_strindex: key.0,
            system_name_strindex: key.0,
            filename_strindex: key.1,
            start_line: 0,
        });
        self.functions.insert(key, i);
        i
    }

    /// The `profile.frame.type` attribute of a frame (OpenTelemetry's semantic
    /// conventions: kernel, native, cpython).
    fn frame_type(&mut self, f: &Frame) -> i32 {
        use crate::model::FrameKind;
        let kind = f.kind();
        if self.frame_types[kind as usize] == 0 {
            let key_strindex = self.string("profile.frame.type");
            let value = match kind {
                FrameKind::Native => "native",
                FrameKind::Kernel => "kernel",
                FrameKind::Python => "cpython",
            };
            self.frame_types[kind as usize] = self.d.attribute_table.len() as i32;
            self.d.attribute_table.push(KeyValueAndUnit {
                key_strindex,
                value: Some(string_value(value)),
                unit_strindex: 0,
            });
        }
        self.frame_types[kind as usize]
    }

    fn location(&mut self, f: &Frame) -> i32 {
        let frame_type = self.frame_type(f);
        match f {
            Frame::Kernel(name) => {
                if let Some(&i) = self.kernel_locations.get(name) {
                    return i;
                }
                if self.kernel_mapping == 0 {
                    let filename_strindex = self.string(KERNEL_MAPPING);
                    self.kernel_mapping = self.d.mapping_table.len() as i32;
                    self.d.mapping_table.push(Mapping {
                        filename_strindex,
                        ..Default::default()
                    });
                }
                let function_index = self.function(name, "");
                let i = self.d.location_table.len() as i32;
                self.d.location_table.push(Location {
                    mapping_index: self.kernel_mapping,
                    address: 0,
                    lines: vec![Line {
                        function_index,
                        line: 0,
                        column: 0,
                    }],
                    attribute_indices: vec![frame_type],
                });
                self.kernel_locations.insert(name.clone(), i);
                i
            }
            Frame::User {
                mapping,
                address,
                lines,
            } => {
                let mapping_index = mapping.as_ref().map_or(0, |m| self.mapping(m));
                if let Some(&i) = self.user_locations.get(&(mapping_index, *address)) {
                    return i;
                }
                let lines = lines
                    .iter()
                    .flat_map(|ls| ls.iter())
                    .map(|l| Line {
                        function_index: self.function(&l.function, &l.file),
                        line: i64::from(l.line),
                        column: 0,
                    })
                    .collect();
                let i = self.d.location_table.len() as i32;
                self.d.location_table.push(Location {
                    mapping_index,
                    address: *address,
                    lines,
                    attribute_indices: vec![frame_type],
                });
                self.user_locations.insert((mapping_index, *address), i);
                i
            }
        }
    }

    fn stack(&mut self, frames: &[Frame]) -> i32 {
        let locs: Vec<i32> = frames.iter().map(|f| self.location(f)).collect();
        if let Some(&i) = self.stacks.get(&locs) {
            return i;
        }
        let i = self.d.stack_table.len() as i32;
        self.d.stack_table.push(Stack {
            location_indices: locs.clone(),
        });
        self.stacks.insert(locs, i);
        i
    }
}

/// Values per stack of one profile, in the order the stacks first came.
#[derive(Default)]
struct Summed {
    values: HashMap<i32, i64>,
    order: Vec<i32>,
}

impl Summed {
    fn add(&mut self, stack: i32, v: i64) {
        let e = self.values.entry(stack).or_insert_with(|| {
            self.order.push(stack);
            0
        });
        *e = e.saturating_add(v);
    }
}

/// A stable id for one profile of one round: a backend may deduplicate a request that
/// arrives twice (sent, then the enricher died before it knew). `process` is the group's
/// ([`crate::output::group::Group::process`]): per process, two groups of a round can
/// carry equal labels, and must not share an id.
fn profile_id(round: &Round, labels: &LabelSet, process: u64, kind: &str) -> Vec<u8> {
    let mut ctx = md5::Context::new();
    ctx.consume(round.session_id.to_le_bytes());
    ctx.consume(round.round.to_le_bytes());
    ctx.consume(round.end_ns.to_le_bytes());
    ctx.consume(process.to_le_bytes());
    for (k, v) in labels {
        ctx.consume(k.as_bytes());
        ctx.consume([0]);
        ctx.consume(v.as_bytes());
        ctx.consume([0]);
    }
    ctx.consume(kind.as_bytes());
    ctx.compute().0.to_vec()
}

/// The round as one encoded `ExportProfilesServiceRequest` (None: no samples).
pub fn encode(round: &Round, groups: &Groups) -> Option<Vec<u8>> {
    if groups.is_empty() {
        return None;
    }
    let period = 1_000_000_000 / i64::from(round.frequency_hz.max(1));
    let mut dict = Dictionary::new();
    let samples_t = dict.string("samples");
    let count_t = dict.string("count");
    let cpu_t = dict.string("cpu");
    let ns_t = dict.string("nanoseconds");
    let scope = InstrumentationScope {
        name: "firn".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        attributes: Vec::new(),
        dropped_attributes_count: 0,
    };
    let off_cpu_t = round.off_cpu.then(|| dict.string("off_cpu"));
    let mut resource_profiles = Vec::with_capacity(groups.len());
    for group in groups {
        let (labels, idx, process) = (&group.labels, &group.stacks, group.process);
        // Equal stacks of the group sum into one sample: on-CPU samples and off-CPU
        // nanoseconds apart (a stack has one or the other).
        let (mut on, mut off) = (Summed::default(), Summed::default());
        for &i in idx {
            let s = &round.stacks[i];
            let (sum, v) = match (s.count, s.off_cpu_ns) {
                (0, ns) if ns > 0 && round.off_cpu => (&mut off, ns),
                (0, _) => continue,
                (n, _) => (&mut on, n),
            };
            sum.add(dict.stack(&s.frames), i64::try_from(v).unwrap_or(i64::MAX));
        }
        let profile = |sum: &Summed, ty: i32, unit: i32, scale: i64, kind: &str| Profile {
            sample_type: Some(ValueType {
                type_strindex: ty,
                unit_strindex: unit,
            }),
            samples: sum
                .order
                .iter()
                .map(|st| Sample {
                    stack_index: *st,
                    attribute_indices: Vec::new(),
                    link_index: 0,
                    values: vec![sum.values[st].saturating_mul(scale)],
                    timestamps_unix_nano: Vec::new(),
                })
                .collect(),
            time_unix_nano: round.start_ns,
            duration_nano: round.end_ns.saturating_sub(round.start_ns),
            period_type: Some(ValueType {
                type_strindex: cpu_t,
                unit_strindex: ns_t,
            }),
            period,
            profile_id: profile_id(round, labels, process, kind),
            dropped_attributes_count: 0,
            original_payload_format: String::new(),
            original_payload: Vec::new(),
            attribute_indices: Vec::new(),
        };
        let mut profiles = vec![
            profile(&on, samples_t, count_t, 1, "samples"),
            profile(&on, cpu_t, ns_t, period, "cpu"),
        ];
        if let Some(t) = off_cpu_t {
            // Measured time, not a count of periods: no period type, as the
            // OpenTelemetry profiler's off-CPU profiles.
            profiles.push(Profile {
                period_type: None,
                period: 0,
                ..profile(&off, t, ns_t, 1, "off_cpu")
            });
        }
        resource_profiles.push(ResourceProfiles {
            resource: Some(Resource {
                attributes: resource_attributes(labels),
                dropped_attributes_count: 0,
                entity_refs: Vec::new(),
            }),
            scope_profiles: vec![ScopeProfiles {
                scope: Some(scope.clone()),
                profiles,
                schema_url: String::new(),
            }],
            schema_url: "https://opentelemetry.io/schemas/1.34.0".into(),
        });
    }
    let req = ExportProfilesServiceRequest {
        resource_profiles,
        dictionary: Some(dict.d),
    };
    Some(req.encode_to_vec())
}

#[cfg(test)]
#[path = "encode_tests.rs"]
mod tests;

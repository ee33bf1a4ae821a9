//! Tests of the OTLP encoding (`encode.rs`).

use super::*;
use crate::model::StackSample;

#[test]
fn a_round_resolves_through_the_dictionary() {
    let map = Arc::new(MappingSpec {
        start: 0x1000,
        limit: 0x2000,
        offset: 0,
        file: Arc::from("/bin/x"),
        build_id: Arc::from("abcd"),
        symbolized: false,
    });
    let labels: Arc<LabelSet> = Arc::new(vec![
        ("comm".into(), "x".into()),
        ("node".into(), "n1".into()),
        ("pid".into(), "42".into()),
    ]);
    let frames: Arc<[Frame]> = Arc::from(vec![
        Frame::User {
            mapping: Some(map),
            address: 0x1234,
            lines: None,
        },
        Frame::Kernel(Arc::from("do_syscall_64")),
        Frame::User {
            mapping: Some(Arc::new(MappingSpec {
                start: 1 << 63,
                limit: u64::MAX,
                offset: 0,
                file: Arc::from(crate::model::PYTHON_MAPPING),
                build_id: Arc::from(""),
                symbolized: true,
            })),
            address: (1 << 63) | 5,
            lines: Some(Arc::from(vec![crate::model::Line {
                function: Arc::from("K.method"),
                file: Arc::from("/srv/app.py"),
                line: 7,
            }])),
        },
    ]);
    let stack = StackSample {
        process_id: 1,
        labels,
        frames,
        count: 3,
        off_cpu_ns: 0,
    };
    let round = Round {
        session_id: 1,
        round: 2,
        start_ns: 10,
        end_ns: 20,
        frequency_hz: 100,
        off_cpu: false,
        stacks: vec![stack.clone(), stack],
    };
    let groups = crate::output::group::groups(&round, crate::settings::ProfileBy::Process);
    let bytes = encode(&round, &groups).unwrap();
    let req = ExportProfilesServiceRequest::decode(bytes.as_slice()).unwrap();
    let d = req.dictionary.unwrap();
    assert_eq!(d.string_table[0], "");
    assert_eq!(req.resource_profiles.len(), 1);
    let rp = &req.resource_profiles[0];
    let attrs = &rp.resource.as_ref().unwrap().attributes;
    assert!(attrs.iter().any(|a| a.key == "process.pid"
        && a.value.as_ref().unwrap().value == Some(any_value::Value::IntValue(42))));
    assert!(attrs.iter().any(|a| a.key == "host.name"));
    assert!(attrs.iter().any(|a| a.key == "firn.comm"));
    let profiles = &rp.scope_profiles[0].profiles;
    assert_eq!(profiles.len(), 2);
    assert_eq!(profiles[0].samples.len(), 1);
    assert_eq!(profiles[0].samples[0].values, vec![6]);
    assert_eq!(profiles[1].samples[0].values, vec![6 * 10_000_000]);
    let stack = &d.stack_table[profiles[0].samples[0].stack_index as usize];
    let leaf = &d.location_table[stack.location_indices[0] as usize];
    assert_eq!(leaf.address, 0x1234);
    let m = &d.mapping_table[leaf.mapping_index as usize];
    let a = &d.attribute_table[m.attribute_indices[0] as usize];
    assert_eq!(
        d.string_table[a.key_strindex as usize],
        "process.executable.build_id.gnu"
    );
    let k = &d.location_table[stack.location_indices[1] as usize];
    let f = &d.function_table[k.lines[0].function_index as usize];
    assert_eq!(d.string_table[f.name_strindex as usize], "do_syscall_64");
    assert_ne!(profiles[0].profile_id, profiles[1].profile_id);
    // Another process with the same labels (a program that exec'd itself): a
    // resource of its own, whose profiles' ids are not the first's.
    let twice = Round {
        stacks: vec![
            round.stacks[0].clone(),
            StackSample {
                process_id: 2,
                ..round.stacks[0].clone()
            },
        ],
        ..round
    };
    let groups = crate::output::group::groups(&twice, crate::settings::ProfileBy::Process);
    let req =
        ExportProfilesServiceRequest::decode(encode(&twice, &groups).unwrap().as_slice()).unwrap();
    let ids: std::collections::HashSet<_> = req
        .resource_profiles
        .iter()
        .flat_map(|r| &r.scope_profiles)
        .flat_map(|s| &s.profiles)
        .map(|p| p.profile_id.clone())
        .collect();
    assert_eq!((req.resource_profiles.len(), ids.len()), (2, 4));
    // Each location says what ran it (profile.frame.type).
    let kind = |l: &Location| {
        let a = &d.attribute_table[l.attribute_indices[0] as usize];
        assert_eq!(
            d.string_table[a.key_strindex as usize],
            "profile.frame.type"
        );
        a.value.clone().and_then(|v| v.value)
    };
    let s = |v: &str| Some(any_value::Value::StringValue(v.into()));
    assert_eq!(kind(leaf), s("native"));
    assert_eq!(kind(k), s("kernel"));
    let py = &d.location_table[stack.location_indices[2] as usize];
    assert_eq!(kind(py), s("cpython"));
    assert_eq!(py.lines[0].line, 7);
}

/// A round with off-CPU time: a third profile per resource, `off_cpu`/`nanoseconds`
/// without a period type, holding the off-CPU stacks only; the on-CPU two as before.
#[test]
fn off_cpu_time_is_a_third_profile() {
    let labels: Arc<LabelSet> = Arc::new(vec![("pid".into(), "7".into())]);
    let stack = |leaf: &str, count: u64, off_cpu_ns: u64| StackSample {
        process_id: 7,
        labels: labels.clone(),
        frames: Arc::from(vec![Frame::Kernel(Arc::from(leaf))]),
        count,
        off_cpu_ns,
    };
    let mut round = Round {
        session_id: 1,
        round: 2,
        start_ns: 10,
        end_ns: 20,
        frequency_hz: 100,
        off_cpu: true,
        stacks: vec![
            stack("run", 2, 0),
            stack("pipe_read", 0, 5_000),
            stack("pipe_read", 0, 6_000),
            stack("do_nanosleep", 0, 9_000),
        ],
    };
    let decode = |round: &Round| {
        let groups = crate::output::group::groups(round, crate::settings::ProfileBy::Process);
        let bytes = encode(round, &groups).unwrap();
        ExportProfilesServiceRequest::decode(bytes.as_slice()).unwrap()
    };
    let req = decode(&round);
    let d = req.dictionary.as_ref().unwrap();
    let s = |i: i32| d.string_table[i as usize].as_str();
    let profiles = &req.resource_profiles[0].scope_profiles[0].profiles;
    let types: Vec<(&str, &str)> = profiles
        .iter()
        .map(|p| {
            let t = p.sample_type.as_ref().unwrap();
            (s(t.type_strindex), s(t.unit_strindex))
        })
        .collect();
    assert_eq!(
        types,
        [
            ("samples", "count"),
            ("cpu", "nanoseconds"),
            ("off_cpu", "nanoseconds")
        ]
    );
    assert_eq!(profiles[0].samples.len(), 1);
    assert_eq!(profiles[1].samples[0].values, vec![2 * 10_000_000]);
    let off = &profiles[2];
    assert!(off.period_type.is_none());
    assert_eq!(off.period, 0);
    let leaf = |smp: &Sample| {
        let st = &d.stack_table[smp.stack_index as usize];
        let loc = &d.location_table[st.location_indices[0] as usize];
        s(d.function_table[loc.lines[0].function_index as usize].name_strindex)
    };
    let got: Vec<(&str, Vec<i64>)> = off
        .samples
        .iter()
        .map(|x| (leaf(x), x.values.clone()))
        .collect();
    assert_eq!(
        got,
        [("pipe_read", vec![11_000]), ("do_nanosleep", vec![9_000])]
    );
    assert_ne!(off.profile_id, profiles[1].profile_id);
    // Not measured: the two on-CPU profiles alone, and stray off-CPU values ignored.
    round.off_cpu = false;
    let req = decode(&round);
    let profiles = &req.resource_profiles[0].scope_profiles[0].profiles;
    assert_eq!(profiles.len(), 2);
    assert_eq!(profiles[0].samples.len(), 1);
}

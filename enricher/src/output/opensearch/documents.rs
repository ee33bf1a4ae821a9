//! The documents of a round: a profile document per profile and a stack document per
//! distinct stack, as `_bulk` NDJSON, and the index template that maps them.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::model::{frame_names, Round};
use crate::output::delivery::request_id;
use crate::output::group::Groups;
use crate::output::layout::{self, RoundLayout};

/// Functions listed in a profile document, by samples at the leaf.
const TOP_FUNCTIONS: usize = 10;
/// Frames kept per stack document (the leaf end; deeper callers are cut).
const MAX_FRAMES: usize = 128;

/// What the documents are built with.
pub struct Format {
    pub index_prefix: String,
    pub max_stacks: usize,
    /// Bytes of a round's request past which no more stack documents are added.
    pub max_bytes: usize,
    /// `http://host:port` of the enricher's HTTP server, for pprof links.
    pub pprof_base: String,
}

/// The daily index of a round (UTC, by its end).
pub(crate) fn index_name(prefix: &str, end_ns: u64) -> String {
    let s = layout::utc_stamp(end_ns);
    format!("{prefix}-{}.{}.{}", &s[0..4], &s[4..6], &s[6..8])
}

fn hex_id(parts: &[&[u8]]) -> String {
    let mut ctx = md5::Context::new();
    for p in parts {
        ctx.consume(p);
        ctx.consume([0]);
    }
    format!("{:x}", ctx.compute())
}

fn millis(ns: u64) -> u64 {
    ns / 1_000_000
}

/// The labels as a JSON object of strings.
fn labels_object(labels: &[(String, String)]) -> Value {
    Value::Object(
        labels
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect::<Map<_, _>>(),
    )
}

/// What a round's encoding left out, for the counters.
#[derive(Default, Debug, PartialEq, Eq)]
pub struct Encoding {
    pub profiles: usize,
    pub stacks: usize,
    /// Distinct stacks past `max_stacks` or `max_bytes`, counted in their profiles only.
    pub stacks_left_out: usize,
}

/// The round as `_bulk` NDJSON, with links to the profiles where `layout` puts them.
/// None: no samples.
pub fn encode(
    round: &Round,
    groups: &Groups,
    layout: &RoundLayout,
    f: &Format,
) -> Option<(Vec<u8>, Encoding)> {
    if groups.is_empty() {
        return None;
    }
    let index = index_name(&f.index_prefix, round.end_ns);
    let period_ns = 1_000_000_000 / u64::from(round.frequency_hz.max(1));
    let round_key = request_id(round.end_ns, round.round);
    let mut out = Vec::new();
    let mut enc = Encoding::default();
    // Distinct stacks ranked apart, heaviest first: on-CPU by samples, off-CPU by
    // nanoseconds (which would crowd samples out in one ranking).
    let mut on_cpu: Vec<Ranked> = Vec::new();
    let mut off_cpu: Vec<Ranked> = Vec::new();
    let mut profile_ids = Vec::with_capacity(groups.len());
    let mut names = Vec::new();
    for (g, group) in groups.iter().enumerate() {
        let (labels, idx) = (&group.labels, &group.stacks);
        let mut label_key = Vec::new();
        for (k, v) in labels.iter() {
            label_key.extend_from_slice(k.as_bytes());
            label_key.push(0);
            label_key.extend_from_slice(v.as_bytes());
            label_key.push(0);
        }
        // And the process (per process only): equal labels would otherwise let one
        // document overwrite the other.
        let process = group.process.to_le_bytes();
        let profile_id = hex_id(&[round_key.as_bytes(), &label_key, &process]);
        // Per distinct stack: (samples, off-CPU ns).
        let mut stacks: HashMap<Vec<Arc<str>>, (u64, u64)> = HashMap::new();
        let mut leaf: HashMap<Arc<str>, u64> = HashMap::new();
        let mut leaf_off: HashMap<Arc<str>, u64> = HashMap::new();
        let (mut samples, mut off_ns) = (0u64, 0u64);
        for &i in idx {
            let s = &round.stacks[i];
            let off = if round.off_cpu { s.off_cpu_ns } else { 0 };
            if s.count == 0 && off == 0 {
                continue;
            }
            names.clear();
            for fr in s.frames.iter().rev() {
                frame_names(fr, &mut names);
            }
            names.reverse();
            names.truncate(MAX_FRAMES);
            samples = samples.saturating_add(s.count);
            off_ns = off_ns.saturating_add(off);
            if let Some(l) = names.first() {
                if s.count > 0 {
                    *leaf.entry(l.clone()).or_insert(0) += s.count;
                }
                if off > 0 {
                    let e = leaf_off.entry(l.clone()).or_insert(0);
                    *e = e.saturating_add(off);
                }
            }
            let e = stacks.entry(names.clone()).or_insert((0, 0));
            e.0 += s.count;
            e.1 = e.1.saturating_add(off);
        }
        let file = layout.link(g);
        let mut doc = json!({
            "doc_type": "profile",
            "@timestamp": millis(round.end_ns),
            "start": millis(round.start_ns),
            "end": millis(round.end_ns),
            "duration_ms": millis(round.end_ns.saturating_sub(round.start_ns)),
            "round": round.round,
            "session_id": round.session_id,
            "profile_id": profile_id,
            "labels": labels_object(labels),
            "samples": samples,
            "cpu_ns": samples.saturating_mul(period_ns),
            "frequency_hz": round.frequency_hz,
            "distinct_stacks": stacks.len(),
            "top_functions": top(leaf, "samples"),
            "pprof_file": file,
            "pprof_url": format!("{}/rounds/{file}", f.pprof_base),
        });
        if round.off_cpu {
            doc["off_cpu_ns"] = json!(off_ns);
            doc["off_cpu_top_functions"] = top(leaf_off, "off_cpu_ns");
        }
        add_labels_top(&mut doc, labels);
        push_pair(&mut out, &index, &profile_id, &doc);
        enc.profiles += 1;
        profile_ids.push((profile_id, labels.clone()));
        for (frames, (count, off)) in stacks {
            match count {
                0 => off_cpu.push((off, g, frames, (count, off))),
                _ => on_cpu.push((count, g, frames, (count, off))),
            }
        }
    }
    let distinct = on_cpu.len() + off_cpu.len();
    let mut key = Vec::new();
    let mut pair = Vec::new();
    for (_, g, frames, (count, off)) in alternate(on_cpu, off_cpu).take(f.max_stacks) {
        let (profile_id, labels) = &profile_ids[g];
        key.clear();
        for fr in &frames {
            key.extend_from_slice(fr.as_bytes());
            key.push(0);
        }
        let id = hex_id(&[profile_id.as_bytes(), &key]);
        let mut doc = json!({
            "doc_type": "stack",
            "@timestamp": millis(round.end_ns),
            "start": millis(round.start_ns),
            "end": millis(round.end_ns),
            "round": round.round,
            "profile_id": profile_id,
            "labels": labels_object(labels),
            "frames": frames.iter().map(|s| s.as_ref()).collect::<Vec<_>>(),
            "leaf": frames.first().map_or("", |s| s.as_ref()),
            "depth": frames.len(),
            "samples": count,
            "cpu_ns": count.saturating_mul(period_ns),
        });
        if round.off_cpu {
            doc["off_cpu_ns"] = json!(off);
        }
        add_labels_top(&mut doc, labels);
        pair.clear();
        push_pair(&mut pair, &index, &id, &doc);
        if out.len() + pair.len() > f.max_bytes {
            // Heaviest first: what is left out is the lightest.
            break;
        }
        out.extend_from_slice(&pair);
        enc.stacks += 1;
    }
    enc.stacks_left_out = distinct - enc.stacks;
    Some((out, enc))
}

/// A distinct stack: (its rank's weight, profile index, frames leaf first, (samples,
/// off-CPU ns)).
type Ranked = (u64, usize, Vec<Arc<str>>, (u64, u64));

/// Both rankings sorted heaviest first and taken in turns, so that the stack and byte
/// bounds leave out the lightest of each.
fn alternate(mut a: Vec<Ranked>, mut b: Vec<Ranked>) -> impl Iterator<Item = Ranked> {
    for v in [&mut a, &mut b] {
        v.sort_by(|x, y| y.0.cmp(&x.0).then_with(|| x.2.cmp(&y.2)));
    }
    let (mut a, mut b) = (a.into_iter(), b.into_iter());
    let mut turn = false;
    std::iter::from_fn(move || {
        turn = !turn;
        match turn {
            true => a.next().or_else(|| b.next()),
            false => b.next().or_else(|| a.next()),
        }
    })
}

/// The heaviest leaf functions as `[{function, <unit>}]`.
fn top(leaf: HashMap<Arc<str>, u64>, unit: &str) -> Value {
    let mut top: Vec<(Arc<str>, u64)> = leaf.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    top.truncate(TOP_FUNCTIONS);
    top.iter()
        .map(|(n, c)| json!({"function": n.as_ref(), unit: c}))
        .collect()
}

/// The labels Dashboards charts split by most, also at the top level (`comm`,
/// `executable`, …), so that a visualization needs no nested field names.
fn add_labels_top(doc: &mut Value, labels: &[(String, String)]) {
    for (k, v) in labels {
        if TOP_LEVEL_LABELS.contains(&k.as_str()) {
            doc[k.as_str()] = Value::String(v.clone());
        }
    }
}

const TOP_LEVEL_LABELS: &[&str] = &[
    "node",
    "comm",
    "executable",
    "pid",
    "container_id",
    "systemd_unit",
    "namespace",
    "pod",
    "container",
];

fn push_pair(out: &mut Vec<u8>, index: &str, id: &str, doc: &Value) {
    let action = json!({"index": {"_index": index, "_id": id}});
    // Serializing a Value cannot fail; a line of JSON has no newline inside.
    let _ = serde_json::to_writer(&mut *out, &action);
    out.push(b'\n');
    let _ = serde_json::to_writer(&mut *out, doc);
    out.push(b'\n');
}

/// The version of the template's mappings, in its `_meta.mapping`: bumped when a field
/// is added, so that an upgraded enricher knows an installed template (and the indices
/// made from it) need the new fields. 1 (no `mapping` key): before off-CPU time.
pub(crate) const MAPPING_VERSION: u64 = 2;

/// The index template: explicit mappings for every field the documents carry; labels
/// are keywords whatever their names (a dynamic template, not dynamic mapping's
/// guesses), and anything else is refused (`dynamic: strict`).
pub(crate) fn template(prefix: &str) -> Value {
    let kw = json!({"type": "keyword", "ignore_above": 1024});
    let date = json!({"type": "date", "format": "epoch_millis"});
    let long = json!({"type": "long"});
    let mut props = json!({
        "doc_type": kw, "@timestamp": date, "start": date, "end": date,
        "duration_ms": long, "round": long, "session_id": long, "profile_id": kw,
        "labels": {"type": "object", "dynamic": true},
        "samples": long, "cpu_ns": long, "frequency_hz": long, "distinct_stacks": long,
        "top_functions": {"properties": {"function": kw, "samples": long}},
        "off_cpu_ns": long,
        "off_cpu_top_functions": {"properties": {"function": kw, "off_cpu_ns": long}},
        "pprof_file": kw, "pprof_url": kw,
        "frames": kw, "leaf": kw, "depth": long,
    });
    for l in TOP_LEVEL_LABELS {
        props[*l] = kw.clone();
    }
    json!({
        "index_patterns": [format!("{prefix}-*")],
        "priority": 100,
        "_meta": {
            "created_by": "firn-enricher",
            "version": env!("CARGO_PKG_VERSION"),
            "mapping": MAPPING_VERSION,
        },
        "template": {
            "settings": {"number_of_shards": 1, "refresh_interval": "10s"},
            "mappings": {
                "dynamic": "strict",
                "dynamic_templates": [{
                    "labels_as_keywords": {
                        "path_match": "labels.*",
                        "mapping": {"type": "keyword", "ignore_above": 1024}
                    }
                }],
                "properties": props
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(fns: &[&str], count: u64) -> crate::model::StackSample {
        use crate::model::Frame;
        let frames: Vec<Frame> = fns
            .iter()
            .map(|f| Frame::User {
                mapping: None,
                address: 1,
                lines: Some(Arc::from(vec![crate::model::Line {
                    function: Arc::from(*f),
                    file: Arc::from(""),
                    line: 0,
                }])),
            })
            .collect();
        crate::model::StackSample {
            process_id: 1,
            labels: Arc::new(vec![
                ("comm".into(), "w".into()),
                ("pid".into(), "7".into()),
            ]),
            frames: Arc::from(frames),
            count,
            off_cpu_ns: 0,
        }
    }

    /// Round 3 of session 1, ten seconds at 100 Hz.
    fn round_of(off_cpu: bool, stacks: Vec<crate::model::StackSample>) -> Round {
        Round {
            session_id: 1,
            round: 3,
            start_ns: 1_796_100_600_000_000_000,
            end_ns: 1_796_100_610_000_000_000,
            frequency_hz: 100,
            off_cpu,
            stacks,
        }
    }

    fn format() -> Format {
        Format {
            index_prefix: "p".into(),
            max_stacks: 10,
            max_bytes: 1 << 20,
            pprof_base: "http://h:1".into(),
        }
    }

    /// Documents: one profile, one per distinct stack (leaf first), heaviest first, and
    /// the stack and byte bounds leave out the lightest, counted.
    #[test]
    fn documents_and_their_bounds() {
        let round = round_of(
            false,
            vec![
                stack(&["leaf", "mid", "main"], 5),
                stack(&["leaf", "mid", "main"], 2),
                stack(&["other", "main"], 1),
                stack(&["third", "main"], 3),
            ],
        );
        let groups = crate::output::group::groups(&round, crate::settings::ProfileBy::Process);
        let layout = RoundLayout::new(&round, &groups);
        let mut f = format();
        let (body, enc) = encode(&round, &groups, &layout, &f).unwrap();
        assert_eq!((enc.profiles, enc.stacks, enc.stacks_left_out), (1, 3, 0));
        let lines: Vec<Value> = body
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        assert_eq!(lines[0]["index"]["_index"], "p-2026.12.01");
        let p = &lines[1];
        assert_eq!(
            (p["samples"].as_u64(), p["cpu_ns"].as_u64()),
            (Some(11), Some(110_000_000))
        );
        assert_eq!(p["top_functions"][0]["function"], "leaf");
        assert!(p.get("off_cpu_ns").is_none(), "not measured: no field");
        assert_eq!(
            p["pprof_url"],
            "http://h:1/rounds/20261201T045000Z-r000003/pid-7.pb.gz"
        );
        assert_eq!(lines[3]["frames"], json!(["leaf", "mid", "main"]));
        assert_eq!(lines[3]["samples"], 7);
        assert_eq!(lines[5]["leaf"], "third");
        // The same round encodes to the same ids: a resend overwrites.
        let (again, _) = encode(&round, &groups, &layout, &f).unwrap();
        assert_eq!(again, body);
        f.max_stacks = 2;
        let (_, enc) = encode(&round, &groups, &layout, &f).unwrap();
        assert_eq!((enc.stacks, enc.stacks_left_out), (2, 1));
        f.max_stacks = 10;
        f.max_bytes = body.len() - 10;
        let (small, enc) = encode(&round, &groups, &layout, &f).unwrap();
        assert_eq!((enc.stacks, enc.stacks_left_out), (2, 1));
        assert!(small.len() <= f.max_bytes);
    }

    /// Two processes of a round with equal labels (a program that exec'd itself): a
    /// profile document each, none overwriting the other, and their stacks apart.
    #[test]
    fn equal_labels_of_two_processes_keep_two_documents() {
        let round = round_of(
            false,
            vec![
                stack(&["leaf", "main"], 5),
                crate::model::StackSample {
                    process_id: 2,
                    ..stack(&["leaf", "main"], 1)
                },
            ],
        );
        let groups = crate::output::group::groups(&round, crate::settings::ProfileBy::Process);
        assert_eq!(groups.len(), 2);
        let layout = RoundLayout::new(&round, &groups);
        let f = format();
        let (body, enc) = encode(&round, &groups, &layout, &f).unwrap();
        assert_eq!((enc.profiles, enc.stacks), (2, 2));
        let lines: Vec<Value> = body
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        let ids: std::collections::HashSet<&str> = lines
            .iter()
            .filter_map(|l| l["index"]["_id"].as_str())
            .collect();
        assert_eq!(ids.len(), 4, "an id each: {lines:#?}");
        let mut samples: Vec<u64> = lines
            .iter()
            .filter(|l| l["doc_type"] == "profile")
            .filter_map(|l| l["samples"].as_u64())
            .collect();
        samples.sort();
        assert_eq!(samples, [1, 5]);
    }

    /// Off-CPU time: fields of its own on both documents, and its stacks ranked apart
    /// from the on-CPU ones, so that nanoseconds do not crowd samples out of the bound.
    #[test]
    fn off_cpu_fields_and_ranking() {
        let off = |fns: &[&str], ns: u64| crate::model::StackSample {
            off_cpu_ns: ns,
            ..stack(fns, 0)
        };
        let round = round_of(
            true,
            vec![
                stack(&["leaf", "main"], 5),
                stack(&["other", "main"], 1),
                off(&["pipe_read", "wait_pipe", "main"], 7_000_000_000),
                off(&["pipe_read", "wait_pipe", "main"], 1_000_000_000),
                off(&["do_nanosleep", "wait_sleep", "main"], 3_000_000_000),
            ],
        );
        let groups = crate::output::group::groups(&round, crate::settings::ProfileBy::Process);
        let layout = RoundLayout::new(&round, &groups);
        let mut f = format();
        let docs = |f: &Format| -> (Vec<Value>, Encoding) {
            let (body, enc) = encode(&round, &groups, &layout, f).unwrap();
            let v = body
                .split(|&b| b == b'\n')
                .filter(|l| !l.is_empty())
                .map(|l| serde_json::from_slice(l).unwrap())
                .skip(1)
                .step_by(2)
                .collect();
            (v, enc)
        };
        let (d, enc) = docs(&f);
        assert_eq!((enc.stacks, enc.stacks_left_out), (4, 0));
        let p = &d[0];
        assert_eq!(p["samples"], 6);
        assert_eq!(p["off_cpu_ns"], 11_000_000_000u64);
        assert_eq!(p["top_functions"][0]["function"], "leaf");
        assert_eq!(
            p["off_cpu_top_functions"],
            json!([
                {"function": "pipe_read", "off_cpu_ns": 8_000_000_000u64},
                {"function": "do_nanosleep", "off_cpu_ns": 3_000_000_000u64}
            ])
        );
        let leaves: Vec<&str> = d[1..].iter().map(|s| s["leaf"].as_str().unwrap()).collect();
        assert_eq!(leaves, ["leaf", "pipe_read", "other", "do_nanosleep"]);
        assert_eq!(
            (d[2]["samples"].as_u64(), d[2]["off_cpu_ns"].as_u64()),
            (Some(0), Some(8_000_000_000))
        );
        assert_eq!(d[1]["off_cpu_ns"], 0);
        // Two stacks a round: the heaviest of each kind, not the two of most weight.
        f.max_stacks = 2;
        let (d, enc) = docs(&f);
        assert_eq!((enc.stacks, enc.stacks_left_out), (2, 2));
        assert_eq!(
            (d[1]["leaf"].as_str(), d[2]["leaf"].as_str()),
            (Some("leaf"), Some("pipe_read"))
        );
    }

    #[test]
    fn daily_index_names() {
        // 2026-12-01T04:50:00Z
        assert_eq!(
            index_name("firn-profiles", 1_796_100_600_000_000_000),
            "firn-profiles-2026.12.01"
        );
    }

    #[test]
    fn template_maps_every_field_the_documents_carry() {
        let t = template("p");
        let props = t["template"]["mappings"]["properties"].as_object().unwrap();
        for f in [
            "doc_type",
            "@timestamp",
            "labels",
            "samples",
            "cpu_ns",
            "off_cpu_ns",
            "off_cpu_top_functions",
            "frames",
            "leaf",
            "top_functions",
            "pprof_url",
            "comm",
            "container_id",
        ] {
            assert!(props.contains_key(f), "{f} unmapped");
        }
        assert_eq!(t["template"]["mappings"]["dynamic"], "strict");
        assert_eq!(t["index_patterns"][0], "p-*");
    }
}

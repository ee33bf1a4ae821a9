//! The answer to one `/api/view` query: one pass over the window's stacks (the call tree,
//! flat and cumulative weights, weight per label set), then the lists the page shows.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::tree::{freeze, remap, IdMap, Names, Tree};
use super::{
    label, path, Function, Mode, Process, Query, Series, Summing, View, CHOICES, FILTERS,
    PROCESSES, PRUNE, SERIES, TOP_FUNCTIONS,
};
use crate::model::{LabelSet, Round, StackSample};

/// The view of `rounds` (the window, oldest first) for `q`; `shortened`: rounds of the
/// window were dropped for the stack bound.
pub fn build(rounds: &[Arc<Round>], q: &Query, from_ns: u64, to_ns: u64, shortened: bool) -> View {
    let period_ns = rounds
        .first()
        .map_or(0, |r| 1_000_000_000 / u64::from(r.frequency_hz.max(1)));
    let mut calls = Calls::new();
    let mut sets = Sets::default();
    for r in rounds {
        let period = 1_000_000_000 / u64::from(r.frequency_hz.max(1));
        for s in &r.stacks {
            let (w, off) = q.mode.weigh(s, period, r.off_cpu);
            if w > 0 && sets.keep(r.end_ns, s, w, q) {
                calls.add(s, w, off);
            }
        }
    }
    let (node, choices) = node_and_choices(&sets);
    let (processes, series) = processes_and_series(&sets, q);
    let mut folded = 0;
    let min = (calls.total / PRUNE).max(1);
    let mut tree = freeze(&calls.tree, min, calls.other, &mut folded);
    let mut names = Vec::new();
    remap(
        &mut tree,
        &mut IdMap::default(),
        &mut names,
        &calls.names.list,
    );
    View {
        minutes: q.minutes,
        from_ns,
        to_ns,
        rounds: rounds.len(),
        stacks: calls.stacks,
        shortened,
        node,
        mode: q.mode,
        unit: match q.mode {
            Mode::Cpu => "samples",
            Mode::Off | Mode::Wall => "nanoseconds",
        },
        off_cpu: rounds.iter().any(|r| r.off_cpu),
        total: calls.total,
        off_total: calls.tree.off[0],
        period_ns,
        kinds: names
            .iter()
            .map(|n| {
                calls
                    .names
                    .index
                    .get(n.as_str())
                    .and_then(|&i| calls.kinds.get(i as usize).copied())
                    .unwrap_or(0)
            })
            .collect(),
        names,
        tree,
        folded_nodes: folded,
        cut_short: calls.cut_short,
        top: calls.top(),
        // Samples are periods of CPU; the other modes count nanoseconds already.
        series: chart(
            series,
            rounds,
            if q.mode == Mode::Cpu { period_ns } else { 1 },
        ),
        processes,
        choices,
    }
}

/// Adds without wrapping: weights come off the wire (nanoseconds add up fast).
fn sat(to: &mut u64, w: u64) {
    *to = to.saturating_add(w);
}

/// The call tree and the per-function counts of the stacks the filter keeps.
struct Calls {
    names: Names,
    tree: Tree,
    /// The name of folded nodes.
    other: u32,
    flat: IdMap<u32, u64>,
    cum: IdMap<u32, u64>,
    /// The last stack (by number) each name was counted in, for cumulative counts.
    counted_in: Vec<u64>,
    stacks: usize,
    total: u64,
    cut_short: u64,
    names_buf: Vec<Arc<str>>,
    kinds_buf: Vec<u8>,
    /// By name id: the kind of the frame it was first seen in.
    kinds: Vec<u8>,
    ids: Vec<u32>,
}

impl Calls {
    fn new() -> Self {
        let mut names = Names {
            by_ptr: IdMap::default(),
            index: HashMap::new(),
            list: Vec::new(),
        };
        let root_name = names.id(&Arc::from("all"));
        let other = names.id(&Arc::from("[…]"));
        Self {
            names,
            tree: Tree::new(root_name),
            other,
            flat: IdMap::default(),
            cum: IdMap::default(),
            counted_in: Vec::new(),
            stacks: 0,
            total: 0,
            cut_short: 0,
            names_buf: Vec::new(),
            kinds_buf: Vec::new(),
            kinds: Vec::new(),
            ids: Vec::new(),
        }
    }

    /// Adds stack `s` of weight `w`, `off` of it off CPU.
    fn add(&mut self, s: &StackSample, w: u64, off: u64) {
        self.stacks += 1;
        self.total = self.total.saturating_add(w);
        path(s, &mut self.names_buf, &mut self.kinds_buf);
        self.ids.clear();
        for (n, &k) in self.names_buf.iter().zip(&self.kinds_buf) {
            let id = self.names.id(n);
            if self.kinds.len() <= id as usize {
                self.kinds.resize(id as usize + 1, k);
            }
            self.ids.push(id);
        }
        let mut at = 0u32;
        sat(&mut self.tree.value[0], w);
        sat(&mut self.tree.off[0], off);
        for &id in &self.ids {
            let Some(next) = self.tree.child(at, id) else {
                self.cut_short += 1;
                break;
            };
            at = next;
            sat(&mut self.tree.value[at as usize], w);
            sat(&mut self.tree.off[at as usize], off);
        }
        // The comm level is not a function.
        if let Some(&leaf) = self.ids.last().filter(|_| self.ids.len() > 1) {
            sat(self.flat.entry(leaf).or_insert(0), w);
        }
        let stamp = self.stacks as u64;
        for &id in self.ids.iter().skip(1) {
            let i = id as usize;
            if self.counted_in.len() <= i {
                self.counted_in.resize(i + 1, 0);
            }
            if self.counted_in[i] != stamp {
                self.counted_in[i] = stamp;
                sat(self.cum.entry(id).or_insert(0), w);
            }
        }
    }

    /// The busiest functions, by flat then cumulative weight.
    fn top(&self) -> Vec<Function> {
        let mut top: Vec<Function> = self
            .cum
            .iter()
            .map(|(&id, &c)| Function {
                name: self.names.list[id as usize].clone(),
                flat: self.flat.get(&id).copied().unwrap_or(0),
                cum: c,
            })
            .collect();
        top.sort_by(|a, b| {
            b.flat
                .cmp(&a.flat)
                .then(b.cum.cmp(&a.cum))
                .then(a.name.cmp(&b.name))
        });
        top.truncate(TOP_FUNCTIONS);
        top
    }
}

/// Label work is per distinct label set (processes share one `Arc`), not per stack:
/// the weight of each set in the whole window, and per round for the kept ones.
#[derive(Default)]
struct Sets {
    all: IdMap<usize, (Arc<LabelSet>, u64)>,
    kept: IdMap<usize, (bool, BTreeMap<u64, u64>)>,
    kept_labels: IdMap<usize, Arc<LabelSet>>,
}

impl Sets {
    /// Counts a stack of weight `w` of the round ending at `end_ns`; whether the filter
    /// keeps it.
    fn keep(&mut self, end_ns: u64, s: &StackSample, w: u64, q: &Query) -> bool {
        let key = Arc::as_ptr(&s.labels) as *const u8 as usize;
        sat(
            &mut self
                .all
                .entry(key)
                .or_insert_with(|| (s.labels.clone(), 0))
                .1,
            w,
        );
        let (keep, per_round) = self.kept.entry(key).or_insert_with(|| {
            let keep = q
                .filters
                .iter()
                .all(|(k, v)| label(&s.labels, k) == Some(v.as_str()));
            (keep, BTreeMap::new())
        });
        if !*keep {
            return false;
        }
        sat(per_round.entry(end_ns).or_insert(0), w);
        self.kept_labels
            .entry(key)
            .or_insert_with(|| s.labels.clone());
        true
    }
}

fn get(l: &LabelSet, k: &str) -> Option<String> {
    label(l, k).map(str::to_string)
}

/// The window's `node` label and the filter choices, from every set (kept or not).
fn node_and_choices(sets: &Sets) -> (String, BTreeMap<String, Vec<(String, u64)>>) {
    let mut node = String::new();
    let mut choices: HashMap<&'static str, HashMap<String, u64>> = HashMap::new();
    for (labels, count) in sets.all.values() {
        if node.is_empty() {
            node = get(labels, "node").unwrap_or_default();
        }
        for k in FILTERS {
            if let Some(v) = get(labels, k) {
                sat(choices.entry(k).or_default().entry(v).or_insert(0), *count);
            }
        }
    }
    let choices = choices
        .into_iter()
        .map(|(k, m)| {
            let mut v: Vec<(String, u64)> = m.into_iter().collect();
            v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            v.truncate(CHOICES);
            (k.to_string(), v)
        })
        .collect();
    (node, choices)
}

/// The kept sets' processes (busiest first) and their weight per round, summed by
/// process or container.
fn processes_and_series(sets: &Sets, q: &Query) -> (Vec<Process>, HashMap<String, Summing>) {
    let mut procs: HashMap<(String, String), Process> = HashMap::new();
    let mut series: HashMap<String, Summing> = HashMap::new();
    for (key, labels) in &sets.kept_labels {
        let Some((_, per_round)) = sets.kept.get(key) else {
            continue;
        };
        let weight = per_round.values().fold(0u64, |a, &b| a.saturating_add(b));
        let pid = get(labels, "pid").unwrap_or_default();
        let comm = get(labels, "comm").unwrap_or_else(|| "?".into());
        let p = procs
            .entry((pid.clone(), comm.clone()))
            .or_insert_with(|| Process {
                pid: pid.clone(),
                comm: comm.clone(),
                executable: get(labels, "executable").unwrap_or_default(),
                container_id: get(labels, "container_id").unwrap_or_default(),
                value: 0,
            });
        sat(&mut p.value, weight);
        let (key, filter) = if q.by_container {
            match get(labels, "container_id") {
                Some(c) => (
                    c.chars().take(12).collect(),
                    Some(("container_id".to_string(), c)),
                ),
                None => ("host".to_string(), None),
            }
        } else if pid.is_empty() {
            (comm.clone(), Some(("comm".to_string(), comm.clone())))
        } else {
            (
                format!("{comm} ({pid})"),
                Some(("pid".to_string(), pid.clone())),
            )
        };
        let entry = series
            .entry(key)
            .or_insert_with(|| (filter, BTreeMap::new()));
        for (t, n) in per_round {
            sat(entry.1.entry(*t).or_insert(0), *n);
        }
    }
    let mut processes: Vec<Process> = procs.into_values().collect();
    processes.sort_by(|a, b| b.value.cmp(&a.value).then(a.pid.cmp(&b.pid)));
    processes.truncate(PROCESSES);
    (processes, series)
}

/// The chart: the busiest series and "others", as ms per second of each round (weight
/// × `ns_per_unit` over the round's length).
fn chart(series: HashMap<String, Summing>, rounds: &[Arc<Round>], ns_per_unit: u64) -> Vec<Series> {
    let spans: Vec<(u64, u64)> = rounds
        .iter()
        .map(|r| (r.end_ns, r.end_ns.saturating_sub(r.start_ns).max(1)))
        .collect();
    let mut ranked: Vec<(String, Summing)> = series.into_iter().collect();
    ranked.sort_by(|a, b| {
        let sa: u64 = a.1 .1.values().sum();
        let sb: u64 = b.1 .1.values().sum();
        sb.cmp(&sa).then(a.0.cmp(&b.0))
    });
    let mut out = Vec::new();
    let mut others: BTreeMap<u64, u64> = BTreeMap::new();
    for (i, (key, (filter, points))) in ranked.into_iter().enumerate() {
        if i < SERIES {
            out.push((key, filter, points));
        } else {
            for (t, n) in points {
                sat(others.entry(t).or_insert(0), n);
            }
        }
    }
    if !others.is_empty() {
        out.push(("others".into(), None, others));
    }
    out.into_iter()
        .map(|(key, filter, points)| Series {
            key,
            filter,
            points: spans
                .iter()
                .map(|&(end, len)| {
                    let n = points.get(&end).copied().unwrap_or(0);
                    (
                        end,
                        n.saturating_mul(ns_per_unit) as f64 / len as f64 * 1000.0,
                    )
                })
                .collect(),
        })
        .collect()
}

//! The local web view: a page at `/` (HTML, script and style embedded in the binary, so
//! it works offline) and the one JSON query it makes, `/api/view`, answered from the
//! bounded window `/pprof/cpu` keeps (the last hour, at most 20,000 stacks).
//!
//! `/api/view?minutes=N[&label=value…]` gives, for the window and the filter: the
//! merged call tree (flame graph; nodes under 1/5,000 of the total fold into their
//! parent's `[…]` child), the top functions (flat and cumulative), CPU per round for the
//! busiest processes or containers, the processes, and the filter choices.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::Serialize;

mod build;
mod tree;

pub use build::build;

use crate::model::StackSample;

pub(crate) const PAGE: &str = include_str!("page.html");
pub(crate) const SCRIPT: &str = include_str!("app.js");
pub(crate) const STYLE: &str = include_str!("style.css");

/// Windows the page offers, in minutes; anything else is refused.
pub(crate) const WINDOWS: [u64; 4] = [1, 5, 15, 60];
/// Labels the page filters by.
pub(crate) const FILTERS: [&str; 6] = [
    "comm",
    "executable",
    "container_id",
    "systemd_unit",
    "pod",
    "pid",
];
/// A node whose samples are below total / this is folded.
const PRUNE: u64 = 5_000;
const TOP_FUNCTIONS: usize = 100;
const SERIES: usize = 8;
const PROCESSES: usize = 100;
const CHOICES: usize = 200;
/// Tree nodes built at most per query: the query's memory bound (~40 bytes a node).
/// Past it, a stack's remaining frames count in the deepest node already there, and
/// the answer says how many stacks were cut short.
const MAX_NODES: usize = 400_000;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ViewError {
    #[error("minutes must be one of 1, 5, 15 or 60 (the enricher keeps the last hour, at most 20,000 stacks); got {0:?}")]
    Window(String),
    #[error(
        "unknown filter {0:?}: filter by comm, executable, container_id, systemd_unit, pod or pid"
    )]
    Filter(String),
}

/// What the page asked for.
pub struct Query {
    pub(crate) minutes: u64,
    pub(crate) filters: Vec<(String, String)>,
    /// Group the CPU chart by `process` (default) or `container`.
    pub(crate) by_container: bool,
}

impl Query {
    pub fn parse(q: &HashMap<String, String>) -> Result<Query, ViewError> {
        let minutes = match q.get("minutes") {
            None => 5,
            Some(m) => match m.parse::<u64>() {
                Ok(n) if WINDOWS.contains(&n) => n,
                _ => return Err(ViewError::Window(m.clone())),
            },
        };
        let mut filters = Vec::new();
        for (k, v) in q {
            if k == "minutes" || k == "by" || k == "token" || v.is_empty() {
                continue;
            }
            if !FILTERS.contains(&k.as_str()) {
                return Err(ViewError::Filter(k.clone()));
            }
            filters.push((k.clone(), v.clone()));
        }
        filters.sort();
        Ok(Query {
            minutes,
            filters,
            by_container: q.get("by").is_some_and(|b| b == "container"),
        })
    }
}

/// One node of the call tree: `[name index, samples, children]`.
#[derive(Serialize)]
pub(crate) struct Node(u32, u64, Vec<Node>);

#[derive(Serialize)]
pub(crate) struct Function {
    pub(crate) name: String,
    pub(crate) flat: u64,
    pub(crate) cum: u64,
}

#[derive(Serialize)]
pub(crate) struct Series {
    pub(crate) key: String,
    /// The filter a click on it applies.
    pub(crate) filter: Option<(String, String)>,
    /// (round end, ms of CPU per second) per round of the window.
    pub(crate) points: Vec<(u64, f64)>,
}

#[derive(Serialize)]
pub(crate) struct Process {
    pub(crate) pid: String,
    pub(crate) comm: String,
    pub(crate) executable: String,
    pub(crate) container_id: String,
    pub(crate) samples: u64,
}

#[derive(Serialize)]
pub struct View {
    pub(crate) minutes: u64,
    /// The `node` label of the window's stacks.
    pub(crate) node: String,
    pub(crate) from_ns: u64,
    pub(crate) to_ns: u64,
    pub(crate) rounds: usize,
    pub(crate) stacks: usize,
    /// The window reaches back less than asked (the stack bound dropped older rounds).
    pub(crate) shortened: bool,
    pub(crate) total: u64,
    pub(crate) period_ns: u64,
    pub(crate) names: Vec<String>,
    /// What ran each name (`FrameKind`: 0 native, 1 kernel, 2 Python), for colours.
    pub(crate) kinds: Vec<u8>,
    pub(crate) tree: Node,
    pub folded_nodes: u64,
    /// Stacks whose deepest frames were not placed: the tree reached its node bound.
    pub cut_short: u64,
    pub(crate) top: Vec<Function>,
    pub(crate) series: Vec<Series>,
    pub(crate) processes: Vec<Process>,
    /// Filter name → its values in the window, busiest first.
    pub(crate) choices: BTreeMap<String, Vec<(String, u64)>>,
}

/// A chart series being summed: the filter a click applies, samples per round end.
type Summing = (Option<(String, String)>, BTreeMap<u64, u64>);

/// The value of label `k` in a label set.
fn label<'a>(l: &'a crate::model::LabelSet, k: &str) -> Option<&'a str> {
    l.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
}

/// Names of a stack from the root to the leaf: the process's comm, then the frames
/// (inline frames expanded, callers first).
/// The names of a stack, root (its comm) first, and the kind of each.
fn path(s: &StackSample, out: &mut Vec<Arc<str>>, kinds: &mut Vec<u8>) {
    out.clear();
    kinds.clear();
    out.push(Arc::from(label(&s.labels, "comm").unwrap_or("?")));
    kinds.push(crate::model::FrameKind::Native as u8);
    for f in s.frames.iter().rev() {
        crate::model::frame_names(f, out);
        kinds.resize(out.len(), f.kind() as u8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Line;
    use crate::model::{Frame, LabelSet, Round};

    fn stack(pid: &str, comm: &str, fns: &[&str], count: u64) -> StackSample {
        let labels: Arc<LabelSet> = Arc::new(vec![
            ("comm".into(), comm.into()),
            ("pid".into(), pid.into()),
        ]);
        let frames: Vec<Frame> = fns
            .iter()
            .map(|f| Frame::User {
                mapping: None,
                address: 1,
                lines: Some(Arc::from(vec![Line {
                    function: Arc::from(*f),
                    file: Arc::from(""),
                    line: 0,
                }])),
            })
            .collect();
        StackSample {
            process_id: 1,
            labels,
            frames: Arc::from(frames),
            count,
            off_cpu_ns: 0,
        }
    }

    fn q(pairs: &[(&str, &str)]) -> Result<Query, ViewError> {
        Query::parse(
            &pairs
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        )
    }

    #[test]
    fn tree_top_and_filters() {
        let round = Arc::new(Round {
            session_id: 1,
            round: 1,
            start_ns: 0,
            end_ns: 1_000_000_000,
            frequency_hz: 100,
            off_cpu: false,
            stacks: vec![
                stack("1", "a", &["leaf", "mid", "main"], 3),
                stack("1", "a", &["mid", "main"], 1),
                stack("2", "b", &["other", "main"], 2),
            ],
        });
        let v = build(
            std::slice::from_ref(&round),
            &q(&[]).unwrap(),
            0,
            1_000_000_000,
            false,
        );
        assert_eq!(v.total, 6);
        assert_eq!(v.tree.1, 6);
        let name = |i: u32| v.names[i as usize].as_str();
        let comms: Vec<&str> = v.tree.2.iter().map(|n| name(n.0)).collect();
        assert_eq!(comms, ["a", "b"]);
        let leaf = v.top.iter().find(|f| f.name == "leaf").unwrap();
        assert_eq!((leaf.flat, leaf.cum), (3, 3));
        let main = v.top.iter().find(|f| f.name == "main").unwrap();
        assert_eq!((main.flat, main.cum), (0, 6));
        assert_eq!(v.series[0].key, "a (1)");
        // 4 samples × 10 ms over 1 s = 40 ms/s.
        assert!((v.series[0].points[0].1 - 40.0).abs() < 1e-9);
        let only_b = build(&[round], &q(&[("pid", "2")]).unwrap(), 0, 1, false);
        assert_eq!(only_b.total, 2);
        assert_eq!(
            only_b.choices["pid"].len(),
            2,
            "choices come from the whole window"
        );
        assert!(q(&[("minutes", "120")]).is_err());
        assert!(q(&[("minutes", "x")]).is_err());
        assert!(q(&[("cmdline", "x")]).is_err());
        assert_eq!(q(&[("minutes", "60")]).unwrap().minutes, 60);
    }
}

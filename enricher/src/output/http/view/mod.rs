//! The local web view: a page at `/` (HTML, script and style embedded in the binary, so
//! it works offline) and the one JSON query it makes, `/api/view`, answered from the
//! bounded window `/pprof/cpu` keeps (the last hour, at most 20,000 stacks and 8 MiB).
//!
//! `/api/view?minutes=N[&mode=cpu|off|wall][&label=value…]` gives, for the window and
//! the filter: the merged call tree (flame graph; nodes under 1/5,000 of the total fold
//! into their parent's `[…]` child), the top functions (flat and cumulative), time per
//! round for the busiest processes or containers, the processes, and the filter
//! choices. `mode` weighs each stack: on-CPU samples (`cpu`, the default), off-CPU
//! nanoseconds (`off`, the sampler's `--off-cpu`), or wall time in nanoseconds (`wall`:
//! on-CPU samples × the period, plus off-CPU time); each tree node also carries its
//! off-CPU part, so the page can colour where time was spent waiting.

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
    #[error("minutes must be one of 1, 5, 15 or 60 (the enricher keeps the last hour, at most 20,000 stacks and 8 MiB); got {0:?}")]
    Window(String),
    #[error(
        "unknown filter {0:?}: filter by comm, executable, container_id, systemd_unit, pod or pid"
    )]
    Filter(String),
    #[error(
        "mode must be cpu (on-CPU samples), off (off-CPU time) or wall (both, as time); got {0:?}"
    )]
    Mode(String),
}

/// What a stack weighs in the view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// On-CPU samples.
    Cpu,
    /// Off-CPU nanoseconds.
    Off,
    /// Nanoseconds on CPU (samples × period) and off it.
    Wall,
}

impl Mode {
    /// (weight, its off-CPU part) of `s`, in this mode's unit; `period_ns`: of its round,
    /// `off_cpu`: whether its round measured off-CPU time.
    pub(crate) fn weigh(self, s: &StackSample, period_ns: u64, off_cpu: bool) -> (u64, u64) {
        let off = if off_cpu { s.off_cpu_ns } else { 0 };
        match self {
            Mode::Cpu if off > 0 => (0, 0),
            Mode::Cpu => (s.count, 0),
            Mode::Off => (off, off),
            Mode::Wall => (s.count.saturating_mul(period_ns).saturating_add(off), off),
        }
    }
}

/// What the page asked for.
pub struct Query {
    pub(crate) minutes: u64,
    pub(crate) filters: Vec<(String, String)>,
    /// Group the CPU chart by `process` (default) or `container`.
    pub(crate) by_container: bool,
    pub(crate) mode: Mode,
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
        let mode = match q.get("mode").map(String::as_str) {
            None | Some("cpu") => Mode::Cpu,
            Some("off") => Mode::Off,
            Some("wall") => Mode::Wall,
            Some(m) => return Err(ViewError::Mode(m.to_string())),
        };
        let mut filters = Vec::new();
        for (k, v) in q {
            if ["minutes", "by", "token", "mode"].contains(&k.as_str()) || v.is_empty() {
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
            mode,
        })
    }
}

/// One node of the call tree: `[name index, weight, children, off-CPU part of weight]`.
#[derive(Serialize)]
pub(crate) struct Node(u32, u64, Vec<Node>, u64);

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
    /// (round end, ms per second: of CPU, off it, or both, by the mode) per round.
    pub(crate) points: Vec<(u64, f64)>,
}

#[derive(Serialize)]
pub(crate) struct Process {
    pub(crate) pid: String,
    pub(crate) comm: String,
    pub(crate) executable: String,
    pub(crate) container_id: String,
    /// Its weight in the view's mode.
    pub(crate) value: u64,
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
    pub(crate) mode: Mode,
    /// What `total`, the tree, the top functions and the processes count: `samples` or
    /// `nanoseconds`.
    pub(crate) unit: &'static str,
    /// Some round of the window measured off-CPU time (the page's switch is off if not).
    pub(crate) off_cpu: bool,
    pub(crate) total: u64,
    /// The off-CPU part of `total` (0 in the on-CPU mode).
    pub(crate) off_total: u64,
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
        assert!(
            !v.off_cpu,
            "no round measured off-CPU time: the page's switch is off"
        );
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

    /// The three modes' totals: samples on CPU; nanoseconds off it; and wall time, the
    /// samples as periods plus the off-CPU nanoseconds, with its off-CPU part per node.
    #[test]
    fn modes_weigh_on_and_off_cpu_time() {
        let wait = |pid: &str, comm: &str, fns: &[&str], ns: u64| StackSample {
            off_cpu_ns: ns,
            ..stack(pid, comm, fns, 0)
        };
        let round = Arc::new(Round {
            session_id: 1,
            round: 1,
            start_ns: 0,
            end_ns: 1_000_000_000,
            frequency_hz: 100,
            off_cpu: true,
            stacks: vec![
                stack("1", "a", &["leaf", "mid", "main"], 3),
                wait("1", "a", &["pipe_read", "wait_pipe", "main"], 50_000_000),
                stack("2", "b", &["other", "main"], 2),
            ],
        });
        let view = |mode: &str| {
            let q = q(&[("mode", mode)]).unwrap();
            build(std::slice::from_ref(&round), &q, 0, 1_000_000_000, false)
        };
        let name = |v: &View, n: &Node| v.names[n.0 as usize].clone();
        let cpu = view("cpu");
        assert_eq!((cpu.total, cpu.off_total, cpu.unit), (5, 0, "samples"));
        assert!(cpu.off_cpu, "the window measured off-CPU time");
        assert!(cpu.top.iter().all(|f| f.name != "wait_pipe"));
        let off = view("off");
        assert_eq!((off.total, off.off_total), (50_000_000, 50_000_000));
        assert_eq!(off.unit, "nanoseconds");
        let comms: Vec<String> = off.tree.2.iter().map(|n| name(&off, n)).collect();
        assert_eq!(comms, ["a"], "b never waited");
        let top = &off.top[0];
        assert_eq!((top.name.as_str(), top.flat), ("pipe_read", 50_000_000));
        assert_eq!(off.processes.len(), 1);
        assert_eq!(off.processes[0].value, 50_000_000);
        // 50 ms off CPU over a 1 s round: 50 ms/s.
        assert!((off.series[0].points[0].1 - 50.0).abs() < 1e-9);
        let wall = view("wall");
        assert_eq!(wall.total, 5 * 10_000_000 + 50_000_000);
        assert_eq!(wall.off_total, 50_000_000);
        let a = wall.tree.2.iter().find(|n| name(&wall, n) == "a").unwrap();
        assert_eq!((a.1, a.3), (3 * 10_000_000 + 50_000_000, 50_000_000));
        let main = &a.2[0];
        let waiting = main
            .2
            .iter()
            .find(|n| name(&wall, n) == "wait_pipe")
            .unwrap();
        assert_eq!((waiting.1, waiting.3), (50_000_000, 50_000_000));
        let running = main.2.iter().find(|n| name(&wall, n) == "mid").unwrap();
        assert_eq!((running.1, running.3), (30_000_000, 0));
        // 30 ms on CPU and 50 ms off it for a: 80 ms/s.
        let sa = wall.series.iter().find(|s| s.key == "a (1)").unwrap();
        assert!((sa.points[0].1 - 80.0).abs() < 1e-9);
        assert_eq!(
            q(&[("mode", "both")]).err(),
            Some(ViewError::Mode("both".into()))
        );
        assert!(q(&[("mode", "off"), ("pid", "1")]).unwrap().filters.len() == 1);
    }
}

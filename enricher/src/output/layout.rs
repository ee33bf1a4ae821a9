//! Where a round's profiles live, for every output that names them: the round's folder
//! under `--output-dir` (its UTC start and number), each profile's file, its
//! `/profiles` id and its `/rounds` link. One place, so the local sink, the HTTP
//! endpoints and OpenSearch's pprof links cannot disagree.

use super::group::Groups;
use crate::model::Round;

/// The names of one round's profiles, by group.
pub struct RoundLayout {
    round: u64,
    folder: String,
    stems: Vec<String>,
}

impl RoundLayout {
    pub fn new(round: &Round, groups: &Groups) -> Self {
        Self {
            round: round.round,
            folder: format!("{}-r{:06}", utc_stamp(round.start_ns), round.round),
            stems: file_stems(groups),
        }
    }

    /// The round's folder under `--output-dir`.
    pub(crate) fn folder(&self) -> &str {
        &self.folder
    }

    /// Group `g`'s file name within the folder.
    pub(crate) fn file(&self, g: usize) -> String {
        format!("{}.pb.gz", self.stem(g))
    }

    /// Group `g`'s id among `/profiles`.
    pub(crate) fn id(&self, g: usize) -> String {
        format!("r{}-{}", self.round, self.stem(g))
    }

    /// Group `g`'s path below `/rounds/`.
    pub(crate) fn link(&self, g: usize) -> String {
        format!("{}/{}", self.folder, self.file(g))
    }

    fn stem(&self, g: usize) -> &str {
        self.stems.get(g).map_or("set", String::as_str)
    }
}

/// The file stem of each group's profile within its round: `pid-<pid>`, or `set` when
/// the labels have no pid (`--profile-by container`), numbered when taken twice (a pid
/// reused within a round is two processes).
fn file_stems(groups: &Groups) -> Vec<String> {
    let mut taken: std::collections::HashMap<String, u32> = std::collections::HashMap::new();
    groups
        .iter()
        .map(|g| {
            let base = g
                .labels
                .iter()
                .find(|(k, _)| k == "pid")
                .map_or_else(|| "set".to_string(), |(_, v)| format!("pid-{v}"));
            let n = taken.entry(base.clone()).or_insert(0);
            *n += 1;
            if *n == 1 {
                base
            } else {
                format!("{base}-{n}")
            }
        })
        .collect()
}

/// Whether `name` is a round folder's name (`YYYYMMDDTHHMMSSZ-rNNNNNN`).
pub(crate) fn is_round_folder(name: &str) -> bool {
    name.len() <= 40
        && name.split_once("Z-r").is_some_and(|(stamp, n)| {
            stamp.len() == 15
                && stamp.as_bytes()[8] == b'T'
                && stamp
                    .bytes()
                    .enumerate()
                    .all(|(i, b)| i == 8 || b.is_ascii_digit())
                && !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit())
        })
}

/// Whether `name` is a profile file's name (`[a-z0-9-]+.pb.gz`).
pub(crate) fn is_profile_file(name: &str) -> bool {
    name.len() <= 64
        && name.strip_suffix(".pb.gz").is_some_and(|stem| {
            !stem.is_empty()
                && stem
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

/// `YYYYMMDDTHHMMSSZ` of a Unix time in ns.
pub(crate) fn utc_stamp(ns: u64) -> String {
    let secs = (ns / 1_000_000_000) as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to a civil date (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_and_names() {
        assert_eq!(utc_stamp(0), "19700101T000000Z");
        // 2026-11-29T10:56:35Z
        assert_eq!(utc_stamp(1_795_949_795_000_000_000), "20261129T105635Z");
        assert!(is_round_folder("20261129T105635Z-r000001"));
        assert!(!is_round_folder(".tmp-20261129T105635Z-r000001"));
        assert!(!is_round_folder("..%2f"));
        assert!(is_profile_file("pid-42-2.pb.gz"));
        assert!(!is_profile_file("../x.pb.gz"));
    }

    #[test]
    fn names_of_a_round() {
        let labels = |pid: &str| std::sync::Arc::new(vec![("pid".to_string(), pid.to_string())]);
        let group = |labels, process, stacks| super::super::group::Group {
            labels,
            process,
            stacks,
        };
        let groups: Groups = vec![
            group(labels("7"), 1, vec![0]),
            group(labels("7"), 2, vec![1]),
            group(std::sync::Arc::new(Vec::new()), 0, vec![2]),
        ];
        let round = Round {
            session_id: 1,
            round: 3,
            start_ns: 1_795_949_795_000_000_000,
            end_ns: 1_795_949_805_000_000_000,
            frequency_hz: 19,
            off_cpu: false,
            stacks: Vec::new(),
        };
        let l = RoundLayout::new(&round, &groups);
        assert_eq!(l.folder(), "20261129T105635Z-r000003");
        assert_eq!(l.file(0), "pid-7.pb.gz");
        assert_eq!(l.file(1), "pid-7-2.pb.gz");
        assert_eq!(l.id(2), "r3-set");
        assert_eq!(l.link(1), "20261129T105635Z-r000003/pid-7-2.pb.gz");
    }
}

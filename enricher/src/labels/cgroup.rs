//! What a process's cgroup path says about it: its container (id and runtime) and its
//! systemd unit. Works on cgroup v1 and v2 and on both the cgroupfs and the systemd
//! cgroup drivers. The text comes from /proc/<pid>/cgroup of any process on the node,
//! so it is untrusted: parsing is bounded and never panics.

/// What one cgroup path tells.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CgroupFacts {
    /// The path chosen (unified hierarchy first, else name=systemd, else the first).
    pub(crate) path: String,
    pub(crate) container_id: Option<String>,
    pub(crate) runtime: Option<&'static str>,
    /// Kubernetes pod uid from a `pod<uid>` segment, dashes restored.
    pub(crate) pod_uid: Option<String>,
    pub(crate) systemd_unit: Option<String>,
}

/// Longest /proc/<pid>/cgroup text looked at.
const MAX_TEXT: usize = 16 * 1024;

/// Picks the most telling path from /proc/<pid>/cgroup text (lines `id:controllers:path`).
pub fn pick_path(text: &str) -> Option<&str> {
    let text = &text[..floor_char_boundary(text, MAX_TEXT)];
    let mut v2 = None;
    let mut systemd = None;
    let mut first = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrl), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if id == "0" && ctrl.is_empty() {
            v2 = Some(path);
        } else if ctrl == "name=systemd" {
            systemd = Some(path);
        } else if first.is_none() {
            first = Some(path);
        }
    }
    // On hybrid hosts the unified path can be "/" while v1 holds the real placement.
    [v2, systemd, first]
        .into_iter()
        .flatten()
        .find(|p| *p != "/")
        .or(v2)
        .or(systemd)
        .or(first)
}

fn floor_char_boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    (0..=max)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0)
}

fn is_container_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Runtime prefixes of systemd-driver scope names (`<prefix><id>.scope`).
const SCOPES: &[(&str, &str)] = &[
    ("cri-containerd-", "containerd"),
    ("crio-", "cri-o"),
    ("libpod-", "podman"),
    ("docker-", "docker"),
];

/// Reads the facts of one cgroup path.
pub fn parse_path(path: &str) -> CgroupFacts {
    let mut f = CgroupFacts {
        path: path.to_string(),
        ..Default::default()
    };
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).take(64).collect();
    for (i, seg) in segments.iter().enumerate() {
        if let Some(uid) = pod_uid(seg) {
            f.pod_uid = Some(uid);
        }
        if let Some(scope) = seg.strip_suffix(".scope") {
            for (prefix, runtime) in SCOPES {
                if let Some(id) = scope.strip_prefix(prefix) {
                    // `crio-conmon-<id>` and `libpod-conmon-<id>` are the monitors, not
                    // the containers.
                    if is_container_id(id) {
                        f.container_id = Some(id.to_string());
                        f.runtime = Some(runtime);
                    }
                }
            }
        } else {
            // cgroupfs driver: /docker/<id>, /kubepods/<qos>/pod<uid>/<id>,
            // /libpod_parent/libpod-<id> (podman), /machine.slice/libpod-<id>.
            let (id, prefixed) = SCOPES
                .iter()
                .find_map(|(prefix, runtime)| {
                    seg.strip_prefix(prefix).map(|id| (id, Some(*runtime)))
                })
                .unwrap_or((seg, None));
            if is_container_id(id) {
                f.container_id = Some(id.to_string());
                f.runtime = prefixed.or(match segments.get(i.wrapping_sub(1)) {
                    Some(&"docker") => Some("docker"),
                    _ => None,
                });
            }
        }
    }
    f.systemd_unit = systemd_unit(&segments, f.pod_uid.is_some());
    f
}

/// `pod<uid>` (cgroupfs) or `kubepods-<qos>-pod<uid>.slice` (systemd, dashes as `_`).
fn pod_uid(seg: &str) -> Option<String> {
    let s = seg.strip_suffix(".slice").unwrap_or(seg);
    let at = s.rfind("pod")?;
    let uid = &s[at + 3..];
    if (at == 0 || s[..at].ends_with('-')) && uid.len() == 36 {
        let uid = uid.replace('_', "-");
        if uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
            return Some(uid);
        }
    }
    None
}

/// The innermost unit (`.service`, `.scope`, `.socket`, …) of a path under
/// `system.slice` or `user.slice`. Unit names keep their systemd escapes (`\x2d`), as
/// `systemctl` shows them. Pod cgroups have none.
fn systemd_unit(segments: &[&str], in_pod: bool) -> Option<String> {
    if in_pod {
        return None;
    }
    let top = segments.first()?;
    if *top != "system.slice" && *top != "user.slice" && *top != "machine.slice" {
        return None;
    }
    const KINDS: &[&str] = &[".service", ".scope", ".socket", ".mount", ".swap", ".timer"];
    segments
        .iter()
        .rev()
        .find(|s| KINDS.iter().any(|k| s.ends_with(k)))
        .map(|s| s.to_string())
}

/// Facts of a process from its /proc/<pid>/cgroup text.
pub fn facts(text: &str) -> CgroupFacts {
    pick_path(text).map(parse_path).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4f1a6bb2c0e1d9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4";

    struct Case {
        text: String,
        container: Option<&'static str>,
        runtime: Option<&'static str>,
        unit: Option<&'static str>,
        pod: Option<&'static str>,
    }

    fn case(
        text: &str,
        runtime: Option<&'static str>,
        unit: Option<&'static str>,
        pod: Option<&'static str>,
    ) -> Case {
        Case {
            text: text.replace("{ID}", ID),
            container: runtime.map(|_| ID).or(if text.contains("{ID}") {
                Some(ID)
            } else {
                None
            }),
            runtime,
            unit,
            pod,
        }
    }

    #[test]
    fn real_world_paths() {
        let uid = "5e2f0c8a-9b1d-4c3e-8f7a-6b5d4c3e2f1a";
        let cases = vec![
            // Docker, cgroupfs driver, v1 (hybrid host).
            case("12:cpu,cpuacct:/docker/{ID}\n1:name=systemd:/docker/{ID}\n0::/", Some("docker"), None, None),
            // podman, cgroupfs driver, hybrid host (what this machine's podman makes).
            case("9:name=systemd:/libpod_parent/libpod-{ID}\n4:memory:/libpod_parent/libpod-{ID}\n0::/libpod_parent/libpod-{ID}", Some("podman"), None, None),
            // Docker, systemd driver, v2.
            case("0::/system.slice/docker-{ID}.scope", Some("docker"), Some("docker-{ID}.scope"), None)
                .with_unit_id(),
            // containerd under Kubernetes, systemd driver, v2.
            case(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod5e2f0c8a_9b1d_4c3e_8f7a_6b5d4c3e2f1a.slice/cri-containerd-{ID}.scope",
                Some("containerd"), None, Some(uid),
            ),
            // CRI-O, systemd driver, v2; the conmon scope is not the container.
            case(
                "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod5e2f0c8a_9b1d_4c3e_8f7a_6b5d4c3e2f1a.slice/crio-{ID}.scope",
                Some("cri-o"), None, Some(uid),
            ),
            case("0::/machine.slice/libpod-{ID}.scope/container", Some("podman"), Some("libpod-{ID}.scope"), None)
                .with_unit_id(),
            // Plain kubepods (cgroupfs driver), v1.
            case(
                "11:memory:/kubepods/burstable/pod5e2f0c8a-9b1d-4c3e-8f7a-6b5d4c3e2f1a/{ID}\n1:name=systemd:/kubepods/burstable/pod5e2f0c8a-9b1d-4c3e-8f7a-6b5d4c3e2f1a/{ID}",
                None, None, Some(uid),
            ),
            // systemd services, nested slices and escapes.
            case("0::/system.slice/nginx.service", None, Some("nginx.service"), None),
            case("0::/system.slice/system-getty.slice/getty@tty1.service", None, Some("getty@tty1.service"), None),
            case(
                "0::/system.slice/system-systemd\\x2dfsck.slice/systemd-fsck@dev-disk-by\\x2duuid-1234.service",
                None, Some("systemd-fsck@dev-disk-by\\x2duuid-1234.service"), None,
            ),
            case(
                "0::/user.slice/user-1000.slice/user@1000.service/app.slice/app-firefox.scope",
                None, Some("app-firefox.scope"), None,
            ),
            case("1:name=systemd:/system.slice/cron.service\n0::/", None, Some("cron.service"), None),
            // Nothing to say.
            case("0::/", None, None, None),
            case("0::/init.scope/../weird", None, None, None),
            case("", None, None, None),
        ];
        for c in cases {
            let f = facts(&c.text);
            assert_eq!(f.container_id.as_deref(), c.container, "{}", c.text);
            assert_eq!(f.runtime, c.runtime, "{}", c.text);
            assert_eq!(
                f.systemd_unit.as_deref(),
                c.unit.map(|u| u.replace("{ID}", ID)).as_deref(),
                "{}",
                c.text
            );
            assert_eq!(f.pod_uid.as_deref(), c.pod, "{}", c.text);
        }
    }

    impl Case {
        fn with_unit_id(mut self) -> Self {
            // Leaked once per test run: the unit names embed the container id.
            self.unit = self
                .unit
                .map(|u| &*Box::leak(u.replace("{ID}", ID).into_boxed_str()));
            self
        }
    }

    #[test]
    fn conmon_and_hostile_text() {
        let f = facts(&format!("0::/machine.slice/libpod-conmon-{ID}.scope"));
        assert_eq!(f.container_id, None);
        let long = format!("0::/{}", "a/".repeat(100_000));
        let _ = facts(&long);
        let _ = facts("garbage without colons\n::\n0:");
    }
}

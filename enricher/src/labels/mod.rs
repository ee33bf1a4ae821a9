//! Labels: meta labels from the process record, the system and the cgroup path,
//! Prometheus relabeling, then the visible label set. Results are cached per process
//! (and mapping version) and recomputed when the config changes.

pub mod cgroup;
#[cfg(feature = "kubernetes")]
pub(crate) mod kubernetes;
pub mod relabel;

use std::collections::HashMap;
use std::sync::Arc;

use crate::batch::Process;
use crate::model::LabelSet;
use relabel::{Labels, Rule, RuleConfig};

/// The built-in relabel set: the visible labels users filter and sum by. A user
/// `relabel_configs` replaces it.
pub(crate) const DEFAULT_RULES: &str = r#"
- {source_labels: [__meta_process_pid], target_label: pid}
- {source_labels: [__meta_process_comm], target_label: comm}
- {source_labels: [__meta_process_executable_name], target_label: executable}
- {source_labels: [__meta_systemd_unit], target_label: systemd_unit}
- {source_labels: [__meta_container_id], target_label: container_id}
- {source_labels: [__meta_kubernetes_namespace], target_label: namespace}
- {source_labels: [__meta_kubernetes_pod_name], target_label: pod}
- {source_labels: [__meta_kubernetes_pod_container_name], target_label: container}
"#;

pub(crate) fn default_rules() -> Result<Vec<RuleConfig>, relabel::RelabelError> {
    serde_yaml::from_str(DEFAULT_RULES).map_err(|e| relabel::RelabelError::Builtin(e.to_string()))
}

/// Facts about the machine, fixed for the enricher's life.
#[derive(Debug, Clone, Default)]
pub struct System {
    pub node: String,
    pub kernel_release: String,
    pub machine: String,
}

impl System {
    pub(crate) fn detect(node: &str) -> Self {
        let (release, machine) = nix::sys::utsname::uname()
            .map(|u| {
                (
                    u.release().to_string_lossy().into_owned(),
                    u.machine().to_string_lossy().into_owned(),
                )
            })
            .unwrap_or_default();
        Self {
            node: node.to_string(),
            kernel_release: release,
            machine,
        }
    }
}

/// What the labeler needs of a process beyond its record.
pub(crate) struct Extra<'a> {
    pub(crate) comm: &'a str,
    pub(crate) executable_build_id: Option<String>,
    pub(crate) executable_stripped: Option<bool>,
}

/// (process id, cgroup id of the samples, hash of the comm and cgroup text labelled,
/// mapping version, executable's binary known).
type CacheKey = (u64, u64, u64, u32, bool);

pub struct Labeler {
    rules: Vec<Rule>,
    external: Vec<(String, String)>,
    pub(crate) system: System,
    /// Per process: its label set, and the pod index generation it was computed at when
    /// it depends on Kubernetes metadata (recomputed once the index changed).
    cache: HashMap<CacheKey, (Option<Arc<LabelSet>>, Option<u64>)>,
    /// Pods of this node, when Kubernetes metadata is on.
    #[cfg(feature = "kubernetes")]
    pods: Option<kubernetes::SharedIndex>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl Labeler {
    pub fn new(rules: Vec<Rule>, external: Vec<(String, String)>, system: System) -> Self {
        Self {
            rules,
            external,
            system,
            cache: HashMap::new(),
            #[cfg(feature = "kubernetes")]
            pods: None,
            metrics: None,
        }
    }

    /// Turns Kubernetes metadata on: containers are looked up in `pods`.
    #[cfg(feature = "kubernetes")]
    pub(crate) fn set_pods(
        &mut self,
        pods: kubernetes::SharedIndex,
        metrics: Arc<crate::metrics::Metrics>,
    ) {
        self.pods = Some(pods);
        self.metrics = Some(metrics);
        self.cache.clear();
    }

    /// The pod index's generation, when Kubernetes metadata is on.
    fn pods_generation(&self) -> Option<u64> {
        #[cfg(feature = "kubernetes")]
        return self
            .pods
            .as_ref()
            .and_then(|p| p.lock().ok().map(|i| i.generation));
        #[cfg(not(feature = "kubernetes"))]
        None
    }

    /// New rules and external labels (config reload): every cached result goes.
    pub(crate) fn reconfigure(&mut self, rules: Vec<Rule>, external: Vec<(String, String)>) {
        self.rules = rules;
        self.external = external;
        self.cache.clear();
    }

    pub(crate) fn set_node(&mut self, node: &str) {
        if self.system.node.is_empty() {
            self.system.node = node.to_string();
            self.cache.clear();
        }
    }

    pub(crate) fn forget(&mut self, process_id: u64) {
        self.cache.retain(|k, _| k.0 != process_id);
    }

    pub(crate) fn clear(&mut self) {
        self.cache.clear();
    }

    /// The final label set of a process, or None when relabeling dropped it.
    pub(crate) fn labels(
        &mut self,
        (process_id, cgroup_id): (u64, u64),
        p: Option<&Process>,
        pid: u32,
        extra: Extra<'_>,
    ) -> Option<Arc<LabelSet>> {
        let comm = p.map(|p| {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (&p.comm, &p.cgroup).hash(&mut h);
            h.finish()
        });
        let key = (
            process_id,
            cgroup_id,
            comm.unwrap_or(0),
            p.map_or(0, |p| p.mappings_version),
            extra.executable_build_id.is_some() || extra.executable_stripped.is_some(),
        );
        let generation = self.pods_generation();
        if let Some((v, at)) = self.cache.get(&key) {
            if at.is_none() || *at == generation {
                return v.clone();
            }
        }
        let (meta, complete) = self.meta(p, pid, &extra);
        let depends_on_pods = meta.contains_key("__meta_kubernetes_pod_uid");
        let out = relabel::apply(&self.rules, meta).map(|l| {
            let mut l = relabel::finish(l);
            for (k, v) in &self.external {
                l.entry(k.clone()).or_insert_with(|| v.clone());
            }
            Arc::new(l.into_iter().collect::<LabelSet>())
        });
        if !complete {
            // The container's pod is not known yet: labelled without it this round, and
            // computed again next round rather than cached.
            if let Some(m) = &self.metrics {
                crate::metrics::Metrics::inc(&m.kubernetes_pending);
            }
            return out;
        }
        if self.cache.len() > 65_536 {
            self.cache.clear();
        }
        self.cache.insert(
            key,
            (out.clone(), if depends_on_pods { generation } else { None }),
        );
        out
    }

    /// Every meta label known for a process, plus `node`; false when a container's
    /// pod is not (yet) known.
    pub(crate) fn meta(&self, p: Option<&Process>, pid: u32, extra: &Extra<'_>) -> (Labels, bool) {
        #[allow(unused_mut)] // assigned only with the kubernetes feature
        let mut complete = true;
        let mut m = Labels::new();
        let mut set = |k: &str, v: String| {
            if !v.is_empty() {
                m.insert(k.to_string(), v);
            }
        };
        set("node", self.system.node.clone());
        set(
            "__meta_system_kernel_release",
            self.system.kernel_release.clone(),
        );
        set("__meta_system_kernel_machine", self.system.machine.clone());
        set(
            "__meta_agent_revision",
            env!("CARGO_PKG_VERSION").to_string(),
        );
        set("__meta_process_pid", pid.to_string());
        set(
            "__meta_process_comm",
            p.map_or(extra.comm, |p| p.comm.as_str()).to_string(),
        );
        if let Some(p) = p {
            set("__meta_process_ppid", p.ppid.to_string());
            set("__meta_process_cmdline", p.cmdline.join(" "));
            let exe = p.exe.trim_end_matches(" (deleted)");
            set(
                "__meta_process_executable_name",
                exe.rsplit('/').next().unwrap_or(exe).to_string(),
            );
            let f = cgroup::facts(&p.cgroup);
            set("__meta_process_cgroup", f.path.clone());
            set(
                "__meta_systemd_unit",
                f.systemd_unit.clone().unwrap_or_default(),
            );
            set(
                "__meta_container_id",
                f.container_id.clone().unwrap_or_default(),
            );
            set(
                "__meta_container_runtime",
                f.runtime.unwrap_or_default().to_string(),
            );
            #[cfg(feature = "kubernetes")]
            if let (Some(id), Some(pods)) = (&f.container_id, &self.pods) {
                match pods.lock().ok().and_then(|idx| idx.lookup(id)) {
                    Some(c) => kubernetes::meta_labels(&c, &mut m),
                    // Only a container of a pod is expected in the API.
                    None => complete = f.pod_uid.is_none(),
                }
            }
        }
        if let Some(b) = &extra.executable_build_id {
            m.insert("__meta_process_executable_build_id".into(), b.clone());
        }
        if let Some(s) = extra.executable_stripped {
            m.insert("__meta_process_executable_stripped".into(), s.to_string());
        }
        (m, complete)
    }
}

#[cfg(test)]
mod tests {
    /// The built-in rules parse, compile, and are not empty.
    #[test]
    fn default_rules_are_whole() {
        let rules = super::default_rules().expect("built-in relabel rules parse");
        assert!(rules.len() >= 4);
        super::relabel::compile(&rules).expect("built-in relabel rules compile");
    }
}

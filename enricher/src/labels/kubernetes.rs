//! Kubernetes metadata for containers on this node, from the API server, with `kube`:
//! a watch of the pods whose `spec.nodeName` is this node, indexed by container id
//! (from `status.containerStatuses[].containerID`), matched against the container ids
//! the cgroup paths give. Watch errors are counted and the watch resumes with backoff;
//! meanwhile the last known metadata stays in use.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};

use crate::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub(crate) enum KubeError {
    #[error("Kubernetes client configuration: {0}")]
    Config(String),
}

/// What is known of one container of a pod on this node.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct ContainerMeta {
    pub(crate) namespace: String,
    pub(crate) pod_name: String,
    pub(crate) pod_uid: String,
    pub(crate) container_name: String,
    pub(crate) container_id: String,
    pub(crate) image: String,
    pub(crate) node_name: String,
    pub(crate) labels: BTreeMap<String, String>,
    pub(crate) annotations: BTreeMap<String, String>,
    pub(crate) controller_kind: String,
    pub(crate) controller_name: String,
}

#[derive(Default)]
pub(crate) struct PodIndex {
    /// Bumped on every change, so cached label sets of containers are recomputed.
    pub(crate) generation: u64,
    by_container: HashMap<String, Arc<ContainerMeta>>,
    by_pod: HashMap<String, Vec<String>>,
    /// Pods seen since the current (re)list began.
    relist: Option<HashSet<String>>,
}

pub(crate) type SharedIndex = Arc<Mutex<PodIndex>>;

/// `containerd://<id>`, `cri-o://<id>`, `docker://<id>` → `<id>`.
fn bare_id(id: &str) -> &str {
    id.split_once("://").map_or(id, |(_, rest)| rest)
}

impl PodIndex {
    pub(crate) fn lookup(&self, container_id: &str) -> Option<Arc<ContainerMeta>> {
        self.by_container.get(container_id).cloned()
    }

    pub(crate) fn pods(&self) -> usize {
        self.by_pod.len()
    }

    fn remove(&mut self, uid: &str) {
        self.generation += 1;
        for id in self.by_pod.remove(uid).unwrap_or_default() {
            self.by_container.remove(&id);
        }
    }

    pub(crate) fn apply(&mut self, pod: &Pod) {
        let md = &pod.metadata;
        let Some(uid) = md.uid.clone() else { return };
        self.remove(&uid);
        if let Some(seen) = self.relist.as_mut() {
            seen.insert(uid.clone());
        }
        let controller = md
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true));
        let base = ContainerMeta {
            namespace: md.namespace.clone().unwrap_or_default(),
            pod_name: md.name.clone().unwrap_or_default(),
            pod_uid: uid.clone(),
            node_name: pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default(),
            labels: md.labels.clone().unwrap_or_default(),
            annotations: md.annotations.clone().unwrap_or_default(),
            controller_kind: controller.map(|c| c.kind.clone()).unwrap_or_default(),
            controller_name: controller.map(|c| c.name.clone()).unwrap_or_default(),
            ..Default::default()
        };
        let status = pod.status.as_ref();
        let all = status.into_iter().flat_map(|s| {
            s.container_statuses
                .iter()
                .flatten()
                .chain(s.init_container_statuses.iter().flatten())
                .chain(s.ephemeral_container_statuses.iter().flatten())
        });
        let mut ids = Vec::new();
        for cs in all {
            let Some(raw) = cs.container_id.as_deref() else {
                continue;
            };
            let id = bare_id(raw).to_string();
            if id.is_empty() {
                continue;
            }
            let meta = ContainerMeta {
                container_name: cs.name.clone(),
                container_id: id.clone(),
                image: cs.image.clone(),
                ..base.clone()
            };
            self.by_container.insert(id.clone(), Arc::new(meta));
            ids.push(id);
        }
        self.by_pod.insert(uid, ids);
    }

    pub(crate) fn delete(&mut self, pod: &Pod) {
        if let Some(uid) = &pod.metadata.uid {
            self.remove(uid);
        }
    }

    fn relist_started(&mut self) {
        self.relist = Some(HashSet::new());
    }

    /// After a full list, pods not in it are gone (deleted while the watch was down).
    fn relist_done(&mut self) {
        if let Some(seen) = self.relist.take() {
            let gone: Vec<String> = self
                .by_pod
                .keys()
                .filter(|u| !seen.contains(*u))
                .cloned()
                .collect();
            for uid in gone {
                self.remove(&uid);
            }
        }
    }
}

/// A client from `--kubeconfig`, or else the usual inference (in-cluster service
/// account, then KUBECONFIG / ~/.kube/config).
pub(crate) async fn client(kubeconfig: Option<&std::path::Path>) -> Result<Client, KubeError> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| KubeError::Config(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| KubeError::Config(e.to_string()))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| KubeError::Config(e.to_string()))?,
    };
    Client::try_from(config).map_err(|e| KubeError::Config(e.to_string()))
}

/// Watches the pods of `node` forever, keeping `index` current.
pub(crate) async fn watch(client: Client, node: String, index: SharedIndex, metrics: Arc<Metrics>) {
    let api: Api<Pod> = Api::all(client);
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut stream = watcher::watcher(api, cfg).default_backoff().boxed();
    let mut failing = false;
    while let Some(ev) = stream.next().await {
        let Ok(mut idx) = index.lock() else { return };
        match ev {
            Ok(Event::Init) => idx.relist_started(),
            Ok(Event::InitApply(p)) | Ok(Event::Apply(p)) => idx.apply(&p),
            Ok(Event::InitDone) => {
                idx.relist_done();
                if failing {
                    tracing::info!(pods = idx.pods(), "Kubernetes watch resumed");
                    failing = false;
                }
            }
            Ok(Event::Delete(p)) => idx.delete(&p),
            Err(e) => {
                Metrics::inc(&metrics.kubernetes_watch_errors);
                if !failing {
                    tracing::warn!(error = %e, "Kubernetes watch failed; keeping the last known pods and retrying");
                    failing = true;
                }
            }
        }
        metrics
            .kubernetes_pods
            .store(idx.pods() as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The `__meta_kubernetes_*` labels of a container.
pub(crate) fn meta_labels(m: &ContainerMeta, out: &mut BTreeMap<String, String>) {
    let mut set = |k: String, v: &str| {
        if !v.is_empty() {
            out.insert(k, v.to_string());
        }
    };
    set("__meta_kubernetes_namespace".into(), &m.namespace);
    set("__meta_kubernetes_pod_name".into(), &m.pod_name);
    set("__meta_kubernetes_pod_uid".into(), &m.pod_uid);
    set(
        "__meta_kubernetes_pod_container_name".into(),
        &m.container_name,
    );
    set("__meta_kubernetes_pod_container_id".into(), &m.container_id);
    set("__meta_kubernetes_pod_container_image".into(), &m.image);
    set("__meta_kubernetes_node_name".into(), &m.node_name);
    set(
        "__meta_kubernetes_pod_controller_kind".into(),
        &m.controller_kind,
    );
    set(
        "__meta_kubernetes_pod_controller_name".into(),
        &m.controller_name,
    );
    for (k, v) in &m.labels {
        set(format!("__meta_kubernetes_pod_label_{}", sanitize(k)), v);
    }
    for (k, v) in &m.annotations {
        set(
            format!("__meta_kubernetes_pod_annotation_{}", sanitize(k)),
            v,
        );
    }
}

/// What the confinement must leave open for the API server (confine.rs): its ports,
/// from the in-cluster environment and the kubeconfig, and warnings.
pub(crate) struct ApiPorts {
    pub(crate) ports: Vec<u16>,
    pub(crate) notes: Vec<String>,
}

/// The ports [`client`] may connect to: the in-cluster service's (443 if unset) and
/// every cluster server and proxy the kubeconfig names. An exec credential plugin is
/// noted: it needs execve, which the confinement refuses.
pub(crate) fn api_ports(kubeconfig: Option<&std::path::Path>) -> ApiPorts {
    let mut out = ApiPorts {
        ports: vec![],
        notes: vec![],
    };
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        let port = std::env::var("KUBERNETES_SERVICE_PORT")
            .ok()
            .and_then(|p| p.parse().ok())
            .unwrap_or(443);
        out.ports.push(port);
    }
    let kc = match kubeconfig {
        Some(p) => kube::config::Kubeconfig::read_from(p).ok(),
        None => kube::config::Kubeconfig::read().ok(),
    };
    let Some(kc) = kc else { return out };
    for c in kc.clusters.iter().filter_map(|c| c.cluster.as_ref()) {
        for url in [&c.server, &c.proxy_url].into_iter().flatten() {
            if let Some(port) = crate::confine::port_of(url) {
                out.ports.push(port);
            }
        }
    }
    if kc
        .auth_infos
        .iter()
        .any(|a| a.auth_info.as_ref().is_some_and(|i| i.exec.is_some()))
    {
        out.notes.push(
            "the kubeconfig has a user whose credentials come from an exec plugin: the \
             confined enricher cannot run it (use a token, a client certificate, or \
             --unconfined)"
                .into(),
        );
    }
    out
}

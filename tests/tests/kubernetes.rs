//! Kubernetes labels end to end. No Kubernetes API server can run on these machines, so
//! this test serves the pod list and watch endpoints from a local HTTP server speaking
//! the real API's JSON (PodList, watch events), and the real enricher reaches it through
//! `kube` with a kubeconfig. Everything else is real: sampler, cgroups, workloads.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use firn_tests::*;

const SECS: Duration = Duration::from_secs(1);
const NODE: &str = "firn-test-node";

#[derive(Default)]
struct ApiState {
    /// (resourceVersion, event type, pod JSON)
    events: Vec<(u64, &'static str, Value)>,
    /// Closes open watch streams once (a dropped watch connection).
    drop_watches: bool,
    requests: Vec<String>,
}

struct FakeApi {
    state: Arc<(Mutex<ApiState>, Condvar)>,
    port: u16,
}

fn pod(name: &str, uid: &str, container_id: &str, rv: u64) -> Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name, "namespace": "shop", "uid": uid,
            "resourceVersion": rv.to_string(),
            "labels": {"app": "web", "tier.example.com/name": "front"},
            "annotations": {"owner": "team-a"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9f", "uid": "rs-1", "controller": true}]
        },
        "spec": {"nodeName": NODE, "containers": [{"name": "app", "image": "shop/web:1.2"}]},
        "status": {"containerStatuses": [{
            "name": "app", "image": "shop/web:1.2", "imageID": "sha256:00", "ready": true,
            "restartCount": 0, "containerID": format!("containerd://{container_id}")
        }]}
    })
}

impl FakeApi {
    fn start() -> FakeApi {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state: Arc<(Mutex<ApiState>, Condvar)> = Arc::default();
        let s = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let s = s.clone();
                std::thread::spawn(move || serve(conn, s));
            }
        });
        FakeApi { state, port }
    }

    fn add(&self, ty: &'static str, p: Value) {
        let (m, cv) = &*self.state;
        let mut g = m.lock().unwrap();
        let rv = g.events.len() as u64 + 1;
        let mut p = p;
        p["metadata"]["resourceVersion"] = Value::String(rv.to_string());
        g.events.push((rv, ty, p));
        cv.notify_all();
    }

    fn drop_watches(&self) {
        let (m, cv) = &*self.state;
        m.lock().unwrap().drop_watches = true;
        cv.notify_all();
    }

    fn requests(&self) -> Vec<String> {
        self.state.0.lock().unwrap().requests.clone()
    }

    fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://127.0.0.1:{}\n\
                 users:\n- name: firn\n  user:\n    token: test-token\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: firn\n\
                 current-context: fake\n",
                self.port
            ),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .unwrap();
        path
    }
}

fn serve(mut conn: TcpStream, state: Arc<(Mutex<ApiState>, Condvar)>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut first = String::new();
    if reader.read_line(&mut first).is_err() {
        return;
    }
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h == "\r\n" || h.is_empty() {
            break;
        }
    }
    let target = first.split_whitespace().nth(1).unwrap_or("").to_string();
    let (m, cv) = &*state;
    m.lock().unwrap().requests.push(target.clone());
    let query = target.split_once('?').map_or("", |q| q.1).to_string();
    let param = |k: &str| {
        query
            .split('&')
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .map(str::to_string)
    };
    if !target.starts_with("/api/v1/pods") {
        let _ = conn
            .write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        return;
    }
    if param("watch").is_some_and(|w| w == "true" || w == "1") {
        let mut since: u64 = param("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let _ = conn.write_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
        );
        let mut g = m.lock().unwrap();
        g.drop_watches = false;
        loop {
            let pending: Vec<_> = g.events.iter().filter(|e| e.0 > since).cloned().collect();
            for (rv, ty, obj) in pending {
                let line = format!("{}\n", serde_json::json!({"type": ty, "object": obj}));
                if conn
                    .write_all(format!("{:x}\r\n{line}\r\n", line.len()).as_bytes())
                    .is_err()
                {
                    return;
                }
                since = rv;
            }
            if g.drop_watches {
                // Drop the connection without the terminating chunk.
                return;
            }
            let (ng, _) = cv.wait_timeout(g, Duration::from_millis(500)).unwrap();
            g = ng;
        }
    }
    // A list: the current pods at the latest resourceVersion.
    let g = m.lock().unwrap();
    let mut pods: std::collections::BTreeMap<String, Value> = Default::default();
    for (_, ty, obj) in &g.events {
        let uid = obj["metadata"]["uid"].as_str().unwrap_or("").to_string();
        if *ty == "DELETED" {
            pods.remove(&uid);
        } else {
            pods.insert(uid, obj.clone());
        }
    }
    let body = serde_json::json!({
        "apiVersion": "v1", "kind": "PodList",
        "metadata": {"resourceVersion": g.events.len().to_string()},
        "items": pods.into_values().collect::<Vec<_>>(),
    })
    .to_string();
    let _ = conn.write_all(
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
}

/// Runs busy for `secs` in a containerd scope of pod `uid`; returns its pid.
fn busy_in_container(uid: &str, id: &str, secs: u32) -> u32 {
    let cg = Cgroup::create(&format!(
        "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{id}.scope",
        uid.replace('-', "_")
    ));
    busy_in(&cg, secs)
}

fn labels_of(f: &Firn, pid: u32, timeout: Duration) -> Value {
    let t0 = std::time::Instant::now();
    loop {
        let found = index_entries(&f.out)
            .into_iter()
            .filter(|(_, l)| l["pid"].as_str() == Some(pid.to_string().as_str()))
            .map(|(_, l)| l)
            .find(|l| l.get("pod").is_some());
        if let Some(l) = found {
            return l;
        }
        if t0.elapsed() > timeout {
            return index_entries(&f.out)
                .into_iter()
                .find(|(_, l)| l["pid"].as_str() == Some(pid.to_string().as_str()))
                .map_or(Value::Null, |(_, l)| l);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

const ID_A: &str = "aaaa000000000000000000000000000000000000000000000000000000000001";
const ID_B: &str = "bbbb000000000000000000000000000000000000000000000000000000000002";
const ID_C: &str = "cccc000000000000000000000000000000000000000000000000000000000003";

#[test]
fn pods_from_list_watch_and_resumed_watch() {
    if !can_run_bpf() {
        return;
    }
    let api = FakeApi::start();
    api.add(
        "ADDED",
        pod("web-1", "11111111-1111-1111-1111-111111111111", ID_A, 0),
    );
    let mut f = Firn::start("k8s", &["--frequency", "99", "--round", "2"]);
    f.enricher.take().map(|mut e| e.stop());
    let kubeconfig = api.kubeconfig(f.dir.path());
    let cfg = f.dir.path().join("firn.yaml");
    std::fs::write(
        &cfg,
        "relabel_configs:\n\
         - {source_labels: [__meta_process_pid], target_label: pid}\n\
         - {source_labels: [__meta_kubernetes_namespace], target_label: namespace}\n\
         - {source_labels: [__meta_kubernetes_pod_name], target_label: pod}\n\
         - {source_labels: [__meta_kubernetes_pod_container_name], target_label: container}\n\
         - {source_labels: [__meta_container_id], target_label: container_id}\n\
         - {regex: '__meta_kubernetes_pod_label_(.+)', action: labelmap}\n",
    )
    .unwrap();
    f.start_enricher(&[
        "--kubernetes",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--node",
        NODE,
        "--config",
        cfg.to_str().unwrap(),
    ]);
    // From the initial list.
    let pid = busy_in_container("11111111-1111-1111-1111-111111111111", ID_A, 4);
    let l = labels_of(&f, pid, 15 * SECS);
    assert_eq!(l["namespace"], "shop", "{l}");
    assert_eq!(l["pod"], "web-1", "{l}");
    assert_eq!(l["container"], "app", "{l}");
    assert_eq!(l["app"], "web", "mapped pod label missing: {l}");
    assert_eq!(l["tier_example_com_name"], "front", "{l}");
    assert!(
        api.requests()
            .iter()
            .any(|r| r.contains("fieldSelector=spec.nodeName%3D") && r.contains(NODE)),
        "pods were not selected by node: {:?}",
        api.requests()
    );
    // Added through the watch after start.
    api.add(
        "ADDED",
        pod("web-2", "22222222-2222-2222-2222-222222222222", ID_B, 0),
    );
    std::thread::sleep(2 * SECS);
    let pid = busy_in_container("22222222-2222-2222-2222-222222222222", ID_B, 4);
    let l = labels_of(&f, pid, 15 * SECS);
    assert_eq!(l["pod"], "web-2", "{l}");
    // A dropped watch connection: the enricher resumes and sees what came meanwhile.
    api.drop_watches();
    std::thread::sleep(SECS);
    api.add(
        "ADDED",
        pod("web-3", "33333333-3333-3333-3333-333333333333", ID_C, 0),
    );
    std::thread::sleep(4 * SECS);
    let pid = busy_in_container("33333333-3333-3333-3333-333333333333", ID_C, 4);
    let l = labels_of(&f, pid, 15 * SECS);
    assert_eq!(l["pod"], "web-3", "watch not resumed: {l}");
    let watches = api
        .requests()
        .iter()
        .filter(|r| r.contains("watch="))
        .count();
    assert!(watches >= 2, "no second watch: {:?}", api.requests());
}

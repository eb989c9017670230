//! Joining nodes to a running control plane (docs/node-facts.md, step 3): kube-scheduler
//! beside the control plane; on each node, in its network namespace, containerd, the
//! kubelet and kube-proxy, each with a client certificate from the cluster's CA and the
//! API server at the host bridge's address; then the proofs: every Node is Ready, and the
//! `kubernetes` Service answers at its Service address from inside a Pod on each node.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod};
use kube::api::{DeleteParams, LogParams, PostParams};
use kube::{Api, Client};
use serde_json::json;

use super::{Cluster, Supervisor};
use crate::kubeconfig::write_kubeconfig;
use crate::node::image::Image;
use crate::node::probe::{self, PROBE_IMAGE};
use crate::node::{Node, fabric};

/// Starts kube-scheduler and every node's processes through `cluster` (so they are
/// recorded, tied to its lifetime and stopped by it) and waits for the proofs above.
pub async fn join(cluster: &mut Cluster, nodes: &[Node]) -> Result<()> {
    let server = cluster.server.clone();
    let ca = cluster.ca_cert().to_path_buf();
    let scheduler_kc = cluster.dir.join("kube-scheduler.kubeconfig");
    let cert = cluster.issue_client("kube-scheduler", "system:kube-scheduler", None)?;
    write_kubeconfig(&scheduler_kc, &server, &ca, "system:kube-scheduler", &cert)?;
    let mut scheduler = Command::new(&nodes[0].bin.kube_scheduler);
    scheduler
        .arg(format!("--kubeconfig={}", scheduler_kc.display()))
        .arg("--leader-elect=false")
        .arg("--secure-port=0");
    cluster.spawn("kube-scheduler", scheduler)?;

    // The nodes reach the API server from their namespaces: at the host bridge's address.
    let port = server
        .rsplit_once(':')
        .map(|(_, port)| port.to_string())
        .context("the API server's port")?;
    let node_server = format!("https://{}:{port}", fabric::HOST_ADDRESS);
    let probe = probe::probe_image(&cluster.dir.join(super::NODES_DIR).join("probe"))?;
    for node in nodes {
        std::fs::copy(&ca, ca_file(node))?;
        for (part, user, group) in [
            (
                "kubelet",
                format!("system:node:{}", node.name),
                Some("system:nodes"),
            ),
            ("kube-proxy", "system:kube-proxy".to_string(), None),
        ] {
            let cert = cluster.issue_client(&node.process_name(part), &user, group)?;
            write_kubeconfig(&kubeconfig(node, part), &node_server, &ca, &user, &cert)?;
        }
        boot(cluster, node, std::slice::from_ref(&probe))?;
    }
    wait_ready(cluster, nodes).await?;
    let client = cluster.client().await?;
    let mut checks = tokio::task::JoinSet::new();
    for node in nodes {
        checks.spawn(service_from_pod(client.clone(), node.name.clone()));
    }
    while let Some(outcome) = checks.join_next().await {
        eprintln!("{}", outcome??);
    }
    Ok(())
}

fn kubeconfig(node: &Node, part: &str) -> PathBuf {
    node.dir.join(format!("{part}.kubeconfig"))
}

/// The cluster's CA as the node keeps it (the kubelet checks client certificates with it).
fn ca_file(node: &Node) -> PathBuf {
    node.dir.join("ca.crt")
}

/// Starts `node`'s containerd (and imports `images` plus the sandbox image into it), its
/// kubelet and kube-proxy, each in the node's network namespace, through `sup`. The
/// kubeconfigs and the CA are the ones [`join`] wrote into the node's folder: booting a
/// powered-off node again uses them as they are.
pub(super) fn boot(sup: &mut dyn Supervisor, node: &Node, images: &[Image]) -> Result<()> {
    let containerd = node.process_name("containerd");
    sup.spawn(&containerd, node.containerd_command()?)?;
    node.runtime
        .wait_ready(&node.bin, || sup.ensure_running(&containerd))?;
    node.import_pause()?;
    for image in images {
        node.import(image)?;
    }
    let kubelet = probe::kubelet_settings(
        node,
        Some((kubeconfig(node, "kubelet"), ca_file(node))),
        None,
    );
    let mut cmd = kubelet.command(&node.bin)?;
    node.network.enter(&mut cmd)?;
    sup.spawn(&node.process_name("kubelet"), cmd)?;
    let mut cmd = kube_proxy_command(node, &kubeconfig(node, "kube-proxy"))?;
    node.network.enter(&mut cmd)?;
    sup.spawn(&node.process_name("kube-proxy"), cmd)
}

/// Waits (up to 120 s) until every one of `nodes` is Ready and untainted; fails early, with
/// its log's tail, when one of their processes exits.
pub(super) async fn wait_ready(sup: &mut dyn Supervisor, nodes: &[Node]) -> Result<()> {
    let client = crate::kubeconfig::client_for(sup.kubeconfig()).await?;
    let api: Api<KubeNode> = Api::all(client);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut waiting: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
    loop {
        let mut still = Vec::new();
        for name in waiting {
            if !ready_and_untainted(&api, &name).await.unwrap_or(false) {
                still.push(name);
            }
        }
        waiting = still;
        if waiting.is_empty() {
            return Ok(());
        }
        for node in nodes {
            for part in crate::node::PARTS {
                sup.ensure_running(&node.process_name(part))?;
            }
        }
        if Instant::now() > deadline {
            bail!("nodes {waiting:?} not Ready and untainted after 120 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn ready_and_untainted(api: &Api<KubeNode>, name: &str) -> Result<bool> {
    let Some(n) = api.get_opt(name).await? else {
        return Ok(false);
    };
    let ready = n
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let tainted = n.spec.and_then(|s| s.taints).is_some_and(|t| !t.is_empty());
    Ok(ready && !tainted)
}

fn kube_proxy_command(node: &Node, kubeconfig: &Path) -> Result<Command> {
    let config = json!({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": kubeconfig},
        "mode": "iptables",
        "clusterCIDR": fabric::CLUSTER_CIDR,
        "hostnameOverride": node.name,
        "bindAddress": node.network.address,
        // The node's own namespace: the ports upstream uses.
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [format!("{}/32", node.network.address)],
        "oomScoreAdj": 0,
        // Leave the machine's conntrack settings alone, as k3s does.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s"
        },
        "iptables": {"localhostNodePorts": false}
    });
    let path = node.dir.join("kube-proxy-config.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&config)?)?;
    let mut cmd = Command::new(&node.bin.kube_proxy);
    cmd.arg(format!("--config={}", path.display()));
    Ok(cmd)
}

/// A Pod on node `node` connects to 10.0.0.1:443 and sends plain HTTP; the API server's
/// TLS listener answers `400 Bad Request`, which proves the path Pod → Service (the node's
/// kube-proxy) → host bridge → API server. Returns a line to print.
async fn service_from_pod(client: Client, node: String) -> Result<String> {
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let name = format!("node-check-{node}");
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "securityContext": {
                "runAsNonRoot": true,
                "seccompProfile": {"type": "RuntimeDefault"}
            },
            "containers": [{
                "name": "probe",
                "image": PROBE_IMAGE,
                "imagePullPolicy": "Never",
                "args": ["connect", fabric::KUBERNETES_SERVICE_IP, "443"],
                "resources": {"limits": {"memory": "32Mi", "cpu": "100m"}},
                "securityContext": {"allowPrivilegeEscalation": false}
            }]
        }
    }))?;
    let _ = pods.delete(&name, &DeleteParams::default()).await;
    pods.create(&PostParams::default(), &pod).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let phase = loop {
        let phase = pods
            .get(&name)
            .await?
            .status
            .and_then(|s| s.phase)
            .unwrap_or_default();
        if phase == "Succeeded" || phase == "Failed" {
            break phase;
        }
        if Instant::now() > deadline {
            bail!("the check Pod on {node} is still {phase:?} after 120 s");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let log = pods.logs(&name, &LogParams::default()).await?;
    ensure!(
        phase == "Succeeded" && log.contains("400 Bad Request"),
        "the check Pod on {node} ({phase}) did not reach the API server through the Service: {log}"
    );
    pods.delete(&name, &DeleteParams::default()).await?;
    Ok(format!("from a Pod on {node}: {}", log.trim()))
}

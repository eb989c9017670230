//! Joining the node to a running control plane (docs/node-facts.md, step 3): kube-scheduler,
//! containerd, the kubelet and kube-proxy, each with a client certificate from the
//! cluster's CA; then the proofs: the Node is Ready, the `kubernetes` Service answers at its
//! Service address from the host, and from inside a Pod's network namespace.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{Node as KubeNode, Pod};
use kube::Api;
use kube::api::{DeleteParams, LogParams, PostParams};
use serde_json::json;

use super::Cluster;
use crate::kubeconfig::write_kubeconfig;
use crate::node::probe::{self, PROBE_IMAGE};
use crate::node::{NODE_NAME, Node, network};

/// Starts the node's processes through `cluster` (so they are recorded, tied to its
/// lifetime and stopped by it) and waits for the proofs above.
pub async fn join(cluster: &mut Cluster, node: &Node) -> Result<()> {
    let dir = node.dir.clone();
    let server = cluster.server.clone();
    let ca = cluster.ca_cert().to_path_buf();
    let kubeconfig_for =
        |stem: &str, user: &str, group: Option<&str>| -> Result<std::path::PathBuf> {
            let cert = cluster.issue_client(stem, user, group)?;
            let path = dir.join(format!("{stem}.kubeconfig"));
            write_kubeconfig(&path, &server, &ca, user, &cert)?;
            Ok(path)
        };
    let scheduler_kc = kubeconfig_for("kube-scheduler", "system:kube-scheduler", None)?;
    let kubelet_kc = kubeconfig_for(
        "kubelet",
        &format!("system:node:{NODE_NAME}"),
        Some("system:nodes"),
    )?;
    let proxy_kc = kubeconfig_for("kube-proxy", "system:kube-proxy", None)?;

    let mut scheduler = Command::new(&node.bin.kube_scheduler);
    scheduler
        .arg(format!("--kubeconfig={}", scheduler_kc.display()))
        .arg("--leader-elect=false")
        .arg("--secure-port=0");
    cluster.spawn("kube-scheduler", scheduler)?;

    cluster.spawn("containerd", node.containerd_command()?)?;
    node.runtime.wait_ready(&node.bin, || {
        cluster
            .process("containerd")
            .context("containerd")?
            .ensure_running()
    })?;
    node.import_pause()?;
    node.import(&probe::probe_image(&dir.join("probe"))?)?;

    let kubelet = probe::kubelet_settings(node, Some((kubelet_kc, ca.clone())), None);
    cluster.spawn("kubelet", kubelet.command(&node.bin)?)?;
    cluster.spawn("kube-proxy", kube_proxy_command(node, &proxy_kc)?)?;

    let client = cluster.client().await?;
    let nodes: Api<KubeNode> = Api::all(client.clone());
    cluster
        .wait_until("the node to be Ready and untainted", || {
            let nodes = nodes.clone();
            async move {
                let Some(n) = nodes.get_opt(NODE_NAME).await? else {
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
        })
        .await?;
    service_from_host(cluster).await?;
    service_from_pod(cluster).await
}

fn kube_proxy_command(node: &Node, kubeconfig: &Path) -> Result<Command> {
    let metrics = crate::ports::free_port()?;
    let healthz = crate::ports::free_port()?;
    let config = json!({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": kubeconfig},
        "mode": "iptables",
        "clusterCIDR": network::POD_CIDR,
        "hostnameOverride": NODE_NAME,
        "bindAddress": network::GATEWAY,
        "healthzBindAddress": format!("127.0.0.1:{healthz}"),
        "metricsBindAddress": format!("127.0.0.1:{metrics}"),
        "nodePortAddresses": [format!("{}/32", network::GATEWAY)],
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

/// `GET /readyz` through the Service address 10.0.0.1:443 (kube-proxy's DNAT), from the
/// host, with the admin identity: the serving certificate must carry that IP.
async fn service_from_host(cluster: &Cluster) -> Result<()> {
    let mut config = crate::kubeconfig::config_for(&cluster.kubeconfig).await?;
    config.cluster_url = format!("https://{}:443", network::KUBERNETES_SERVICE_IP).parse()?;
    let client = kube::Client::try_from(config)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let req = http::Request::get("/readyz").body(Vec::new())?;
        match client.request_text(req).await {
            Ok(body) if body == "ok" => return Ok(()),
            outcome if Instant::now() > deadline => {
                bail!("the kubernetes Service did not answer from the host: {outcome:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// A Pod on the node connects to 10.0.0.1:443 and sends plain HTTP; the API server's TLS
/// listener answers `400 Bad Request`, which proves the path Pod → Service → API server.
async fn service_from_pod(cluster: &Cluster) -> Result<()> {
    let client = cluster.client().await?;
    let pods: Api<Pod> = Api::namespaced(client, "default");
    let name = "node-check-service";
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
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
                "args": ["connect", network::KUBERNETES_SERVICE_IP, "443"],
                "resources": {"limits": {"memory": "32Mi", "cpu": "100m"}},
                "securityContext": {"allowPrivilegeEscalation": false}
            }]
        }
    }))?;
    let _ = pods.delete(name, &DeleteParams::default()).await;
    pods.create(&PostParams::default(), &pod).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let phase = loop {
        let phase = pods
            .get(name)
            .await?
            .status
            .and_then(|s| s.phase)
            .unwrap_or_default();
        if phase == "Succeeded" || phase == "Failed" {
            break phase;
        }
        if Instant::now() > deadline {
            bail!("the check Pod is still {phase:?} after 120 s");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let log = pods.logs(name, &LogParams::default()).await?;
    ensure!(
        phase == "Succeeded" && log.contains("400 Bad Request"),
        "the check Pod ({phase}) did not reach the API server through the Service: {log}"
    );
    pods.delete(name, &DeleteParams::default()).await?;
    eprintln!("from a Pod: {}", log.trim());
    Ok(())
}

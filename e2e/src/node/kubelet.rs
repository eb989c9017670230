//! The kubelet's configuration and command line (the kernel settings it rewrites are
//! recorded and restored by [`super::fabric`]).
//!
//! On this machine (docs/node-facts.md): cgroup v1 needs `failCgroupV1: false`; no systemd, so the
//! `cgroupfs` driver with `cgroupRoot` inside the starting process's memory cgroup; no
//! CAP_SYS_RESOURCE, so `oomScoreAdj: 0`; swap and the host's resolv.conf are ignored; the
//! read-only port is off; image GC and disk eviction are relaxed as kind does (a shared,
//! often full disk must not evict the test's Pods). The kubelet's iptables "util chains"
//! are not made (nothing here needs them, and they would outlive the node).

use std::path::PathBuf;
use std::process::Command;

use anyhow::Result;
use serde_json::json;

use crate::binaries::NodeBinaries;

/// What one kubelet needs to know.
#[derive(Debug, Clone)]
pub struct KubeletSettings {
    /// Folder for its config, root dir, certificates and Pod logs.
    pub dir: PathBuf,
    pub node_name: String,
    pub node_ip: String,
    /// The cgroup subtree (relative to each hierarchy's root) its Pods live in.
    pub cgroup_root: String,
    pub runtime_socket: PathBuf,
    /// Static Pods folder (standalone use), if any.
    pub static_pods: Option<PathBuf>,
    /// Joined to an API server: its kubeconfig (client certificate `system:node:<name>`)
    /// and the CA that signs the API server's client certificates. `None`: standalone.
    pub api: Option<(PathBuf, PathBuf)>,
    pub pod_cidr: String,
    pub port: u16,
    pub healthz_port: u16,
}

impl KubeletSettings {
    pub fn root_dir(&self) -> PathBuf {
        self.dir.join("root")
    }

    pub fn pod_logs_dir(&self) -> PathBuf {
        self.dir.join("pod-logs")
    }

    /// Writes the KubeletConfiguration and returns the command that runs the kubelet.
    pub fn command(&self, bin: &NodeBinaries) -> Result<Command> {
        std::fs::create_dir_all(self.root_dir())?;
        std::fs::create_dir_all(self.pod_logs_dir())?;
        let (authentication, authorization) = match &self.api {
            Some((_, client_ca)) => (
                json!({
                    "anonymous": {"enabled": false},
                    "webhook": {"enabled": true},
                    "x509": {"clientCAFile": client_ca},
                }),
                json!({"mode": "Webhook"}),
            ),
            None => (
                json!({"anonymous": {"enabled": false}, "webhook": {"enabled": false}}),
                json!({"mode": "AlwaysAllow"}),
            ),
        };
        let mut config = json!({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": false,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "cgroupsPerQOS": true,
            "failSwapOn": false,
            "resolvConf": "",
            "readOnlyPort": 0,
            "address": self.node_ip,
            "port": self.port,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "containerRuntimeEndpoint": format!("unix://{}", self.runtime_socket.display()),
            "podLogsDir": self.pod_logs_dir(),
            "podCIDR": self.pod_cidr,
            "oomScoreAdj": 0,
            "makeIPTablesUtilChains": false,
            "imageGCHighThresholdPercent": 100,
            "evictionHard": {
                "nodefs.available": "0%",
                "nodefs.inodesFree": "0%",
                "imagefs.available": "0%",
                "imagefs.inodesFree": "0%",
            },
            "fileCheckFrequency": "2s",
            "authentication": authentication,
            "authorization": authorization,
            "clusterDomain": "cluster.local",
            "serializeImagePulls": false,
        });
        if let Some(dir) = &self.static_pods {
            std::fs::create_dir_all(dir)?;
            config["staticPodPath"] = json!(dir);
        }
        let path = self.dir.join("kubelet-config.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&config)?)?;
        let mut cmd = Command::new(&bin.kubelet);
        cmd.arg(format!("--config={}", path.display()))
            .arg(format!("--root-dir={}", self.root_dir().display()))
            .arg(format!(
                "--cert-dir={}",
                self.root_dir().join("pki").display()
            ))
            .arg(format!("--hostname-override={}", self.node_name))
            .arg(format!("--node-ip={}", self.node_ip))
            .arg("--v=1");
        if let Some((kubeconfig, _)) = &self.api {
            cmd.arg(format!("--kubeconfig={}", kubeconfig.display()));
        }
        Ok(cmd)
    }
}

//! The Pod network: one Linux bridge made by the cluster command, addressed as the Pod
//! range's gateway; the CNI `bridge` plugin (isGateway, hairpinMode, no masquerade) with
//! host-local IPAM whose state lies in the cluster's folder.
//!
//! Nothing here routes out of the machine: the Service range is routed onto the bridge
//! (so a Service address that kube-proxy has not translated yet never goes out of the
//! machine's interface), and a FORWARD rule drops whatever comes from the bridge for any
//! other interface. The API server's port, when it listens beyond loopback, accepts only
//! loopback and the bridge.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::json;

use crate::process::run;

/// The bridge's name (at most 15 characters).
pub const BRIDGE: &str = "mro-br0";
/// The gateway address on the bridge: also the node's address and the API server's
/// advertised address.
pub const GATEWAY: &str = "10.244.0.1";
/// The Pod range.
pub const POD_CIDR: &str = "10.244.0.0/24";
/// The Service range (the control plane's `--service-cluster-ip-range`).
pub const SERVICE_CIDR: &str = "10.0.0.0/24";
/// The first Service address: the `kubernetes` Service.
pub const KUBERNETES_SERVICE_IP: &str = "10.0.0.1";
/// The iptables chains of ours (the API server's port filter and the no-egress rule).
const INPUT_CHAIN: &str = "MRO-NODE-INPUT";
const FORWARD_CHAIN: &str = "MRO-NODE-FORWARD";

/// The CNI configuration folder under `dir` (containerd reads it) and the bridge.
#[derive(Debug, Clone)]
pub struct Network {
    pub cni_conf_dir: PathBuf,
    pub ipam_dir: PathBuf,
}

impl Network {
    pub fn new(dir: &Path) -> Network {
        Network {
            cni_conf_dir: dir.join("net.d"),
            ipam_dir: dir.join("ipam"),
        }
    }

    /// Creates the bridge with the gateway address, routes the Service range onto it,
    /// installs the filter rules, and writes the CNI config.
    pub fn create(&self, apiserver_port: Option<u16>) -> Result<()> {
        if !Path::new("/sys/class/net").join(BRIDGE).exists() {
            ip(&["link", "add", BRIDGE, "type", "bridge"])?;
        }
        ip(&["addr", "replace", &format!("{GATEWAY}/24"), "dev", BRIDGE])?;
        ip(&["link", "set", BRIDGE, "up"])?;
        ip(&[
            "route",
            "replace",
            SERVICE_CIDR,
            "dev",
            BRIDGE,
            "src",
            GATEWAY,
        ])?;
        self.filter(apiserver_port)?;
        std::fs::create_dir_all(&self.cni_conf_dir)?;
        std::fs::create_dir_all(&self.ipam_dir)?;
        let conf = json!({
            "cniVersion": "1.0.0",
            "name": "mro-pods",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": true,
                    "hairpinMode": true,
                    "ipMasq": false,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": self.ipam_dir,
                        "ranges": [[{"subnet": POD_CIDR, "gateway": GATEWAY}]],
                        "routes": [{"dst": "0.0.0.0/0"}]
                    }
                },
                {"type": "portmap", "capabilities": {"portMappings": true}}
            ]
        });
        std::fs::write(
            self.cni_conf_dir.join("10-mro-pods.conflist"),
            serde_json::to_vec_pretty(&conf)?,
        )?;
        Ok(())
    }

    fn filter(&self, apiserver_port: Option<u16>) -> Result<()> {
        remove_chains();
        iptables(&["-N", FORWARD_CHAIN])?;
        iptables(&[
            "-A",
            FORWARD_CHAIN,
            "-i",
            BRIDGE,
            "-o",
            BRIDGE,
            "-j",
            "RETURN",
        ])?;
        iptables(&["-A", FORWARD_CHAIN, "-i", BRIDGE, "-j", "DROP"])?;
        iptables(&["-I", "FORWARD", "-j", FORWARD_CHAIN])?;
        if let Some(port) = apiserver_port {
            let port = port.to_string();
            iptables(&["-N", INPUT_CHAIN])?;
            iptables(&["-A", INPUT_CHAIN, "-i", "lo", "-j", "RETURN"])?;
            iptables(&["-A", INPUT_CHAIN, "-i", BRIDGE, "-j", "RETURN"])?;
            iptables(&["-A", INPUT_CHAIN, "-j", "DROP"])?;
            iptables(&[
                "-I",
                "INPUT",
                "-p",
                "tcp",
                "--dport",
                &port,
                "-j",
                INPUT_CHAIN,
            ])?;
        }
        Ok(())
    }
}

/// Removes the bridge, the route and our iptables chains (best effort; each step is
/// idempotent). The veth ends of Pods go with their network namespaces.
pub fn remove() {
    remove_chains();
    let _ = ip(&["route", "del", SERVICE_CIDR, "dev", BRIDGE]);
    if Path::new("/sys/class/net").join(BRIDGE).exists() {
        let _ = ip(&["link", "del", BRIDGE]);
    }
}

fn remove_chains() {
    for (parent, chain) in [("INPUT", INPUT_CHAIN), ("FORWARD", FORWARD_CHAIN)] {
        remove_chain("iptables", parent, chain);
    }
    // The kubelet makes KUBE-FIREWALL (filter table, jumped to from INPUT and OUTPUT) even
    // with makeIPTablesUtilChains off, and kube-proxy --cleanup leaves it.
    for tool in ["iptables", "ip6tables"] {
        for parent in ["INPUT", "OUTPUT"] {
            remove_chain(tool, parent, "KUBE-FIREWALL");
        }
    }
}

/// Deletes every jump from `parent` to `chain`, then flushes and deletes `chain` (filter
/// table; best effort).
fn remove_chain(tool: &str, parent: &str, chain: &str) {
    let table = |args: &[&str]| run(Command::new(tool).args(["-w", "5"]).args(args), None);
    let rules = table(&["-S", parent]).unwrap_or_default();
    for rule in rules
        .lines()
        .filter(|r| r.ends_with(&format!("-j {chain}")))
    {
        let mut delete = vec!["-D"];
        delete.extend(rule.split_whitespace().skip(1));
        let _ = table(&delete);
    }
    let _ = table(&["-F", chain]);
    let _ = table(&["-X", chain]);
}

fn ip(args: &[&str]) -> Result<String> {
    run(Command::new("ip").args(args), None).with_context(|| format!("ip {}", args.join(" ")))
}

fn iptables(args: &[&str]) -> Result<String> {
    run(Command::new("iptables").args(["-w", "5"]).args(args), None)
        .with_context(|| format!("iptables {}", args.join(" ")))
}

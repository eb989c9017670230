//! One node's network: a network namespace of its own (`mro-node-<i>`), plugged into the
//! host bridge ([`super::fabric`]) by a veth pair (`mro-n<i>` on the host, `eth0` inside)
//! with the node's address `10.243.0.(10 + i)` and the host as default gateway; inside it,
//! the CNI `bridge` plugin (isGateway, hairpinMode, no masquerade) on the node's Pod range
//! `10.244.i.0/24`, with host-local IPAM whose state lies in the node's folder.
//!
//! The node's containerd, kubelet and kube-proxy run inside the namespace ([`NodeNet::enter`]),
//! so each node's iptables rules, Pod bridge and addresses are its own, as on separate
//! machines. Faults act on the namespace: [`NodeNet::partition`] drops everything that would
//! cross the node's `eth0` (the kubelet, kube-proxy and every Pod of the node are cut off
//! from the API server and the other nodes alike, and nothing on the node notices but
//! silence), [`NodeNet::heal`] lifts it; [`NodeNet::remove`] deletes the namespace, its
//! interfaces and rules with it (a powered-off node answers nothing).

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::json;

use super::fabric::{self, ip};
use crate::process::run;

/// The chain a partition jumps to (filter table of the node's namespace).
const PARTITION_CHAIN: &str = "MRO-PARTITION";

/// One node's addresses, names and CNI folders.
#[derive(Debug, Clone)]
pub struct NodeNet {
    /// The network namespace's name (`ip netns`), also the node's name.
    pub netns: String,
    /// The host's end of the veth pair.
    pub host_veth: String,
    pub address: String,
    pub pod_cidr: String,
    pub pod_gateway: String,
    pub cni_conf_dir: PathBuf,
    pub ipam_dir: PathBuf,
}

impl NodeNet {
    /// The network of node `index` (1 ..= 99), with its CNI folders under `dir`.
    pub fn new(name: &str, index: u8, dir: &Path) -> NodeNet {
        NodeNet {
            netns: name.to_string(),
            host_veth: format!("mro-n{index}"),
            address: format!("10.243.0.{}", 10 + u16::from(index)),
            pod_cidr: format!("10.244.{index}.0/24"),
            pod_gateway: format!("10.244.{index}.1"),
            cni_conf_dir: dir.join("net.d"),
            ipam_dir: dir.join("ipam"),
        }
    }

    fn netns_path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.netns)
    }

    /// Whether the namespace exists (the node is not powered off).
    pub fn exists(&self) -> bool {
        self.netns_path().exists()
    }

    /// Creates the namespace, the veth pair on the host bridge with the node's address, the
    /// default route via the host and the host's route to the Pod range, and writes the CNI
    /// config. Replaces a namespace of that name left from before.
    pub fn create(&self) -> Result<()> {
        self.remove();
        ip(&["netns", "add", &self.netns])?;
        ip(&[
            "link",
            "add",
            &self.host_veth,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &self.netns,
        ])?;
        ip(&[
            "link",
            "set",
            &self.host_veth,
            "master",
            fabric::BRIDGE,
            "up",
        ])?;
        let inside = |args: &[&str]| {
            let mut all = vec!["-n", self.netns.as_str()];
            all.extend(args);
            ip(&all)
        };
        inside(&["link", "set", "lo", "up"])?;
        inside(&[
            "addr",
            "add",
            &format!("{}/24", self.address),
            "dev",
            "eth0",
        ])?;
        inside(&["link", "set", "eth0", "up"])?;
        inside(&["route", "add", "default", "via", fabric::HOST_ADDRESS])?;
        fabric::route(&self.pod_cidr, &self.address)?;
        self.write_cni_config()
    }

    fn write_cni_config(&self) -> Result<()> {
        std::fs::create_dir_all(&self.cni_conf_dir)?;
        std::fs::create_dir_all(&self.ipam_dir)?;
        let conf = json!({
            "cniVersion": "1.0.0",
            "name": "mro-pods",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": true,
                    "hairpinMode": true,
                    "ipMasq": false,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": self.ipam_dir,
                        "ranges": [[{"subnet": self.pod_cidr, "gateway": self.pod_gateway}]],
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

    /// Makes `cmd` run inside the node's namespace (its network only: mounts, cgroups and
    /// processes stay the host's, so the node's folders and cgroups are where they are).
    pub fn enter(&self, cmd: &mut Command) -> Result<()> {
        let netns = std::fs::File::open(self.netns_path())
            .with_context(|| format!("opening {}", self.netns_path().display()))?;
        // SAFETY: setns is async-signal-safe; the closure owns the namespace's file, open
        // until the command is dropped.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// Drops every packet that would enter or leave the node through its `eth0`: to and from
    /// the API server, the other nodes and their Pods, for the node's own processes and its
    /// Pods alike. Traffic within the node goes on.
    pub fn partition(&self) -> Result<()> {
        self.heal();
        self.iptables(&["-N", PARTITION_CHAIN])?;
        for rule in [["-i", "eth0"], ["-o", "eth0"]] {
            self.iptables(&["-A", PARTITION_CHAIN, rule[0], rule[1], "-j", "DROP"])?;
        }
        for parent in ["INPUT", "OUTPUT", "FORWARD"] {
            self.iptables(&["-I", parent, "1", "-j", PARTITION_CHAIN])?;
        }
        Ok(())
    }

    /// Lifts a [`NodeNet::partition`] (nothing when there is none).
    pub fn heal(&self) {
        for parent in ["INPUT", "OUTPUT", "FORWARD"] {
            while self
                .iptables(&["-D", parent, "-j", PARTITION_CHAIN])
                .is_ok()
            {}
        }
        let _ = self.iptables(&["-F", PARTITION_CHAIN]);
        let _ = self.iptables(&["-X", PARTITION_CHAIN]);
    }

    /// Whether the node is partitioned now.
    pub fn partitioned(&self) -> bool {
        self.iptables(&["-S", "INPUT"])
            .is_ok_and(|rules| rules.contains(&format!("-j {PARTITION_CHAIN}")))
    }

    fn iptables(&self, args: &[&str]) -> Result<String> {
        run(
            Command::new("ip")
                .args(["netns", "exec", &self.netns, "iptables", "-w", "5"])
                .args(args),
            None,
        )
        .with_context(|| format!("iptables {} in {}", args.join(" "), self.netns))
    }

    /// Deletes the namespace (its interfaces, addresses and rules go with it, the host's
    /// veth end too; the host's route to the Pod range stays, leading nowhere). Best effort,
    /// idempotent; a namespace outlives this while a process still runs in it.
    pub fn remove(&self) {
        if self.exists() {
            let _ = ip(&["netns", "del", &self.netns]);
        }
        if Path::new("/sys/class/net").join(&self.host_veth).exists() {
            let _ = ip(&["link", "del", &self.host_veth]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_node_has_its_own_addresses_and_names() {
        let dir = Path::new("/c/nodes/mro-node-3/cni");
        let net = NodeNet::new("mro-node-3", 3, dir);
        assert_eq!(net.netns, "mro-node-3");
        assert_eq!(net.host_veth, "mro-n3");
        assert_eq!(net.address, "10.243.0.13");
        assert_eq!(net.pod_cidr, "10.244.3.0/24");
        assert_eq!(net.pod_gateway, "10.244.3.1");
        assert_eq!(net.cni_conf_dir, dir.join("net.d"));
        let other = NodeNet::new("mro-node-1", 1, dir);
        assert_ne!(net.address, other.address);
        assert_ne!(net.pod_cidr, other.pod_cidr);
    }
}

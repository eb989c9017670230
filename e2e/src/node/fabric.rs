//! The host's side of the nodes' network: one Linux bridge ([`BRIDGE`]) that every node's
//! network namespace is plugged into, whose address ([`HOST_ADDRESS`]) is the API server's
//! advertised address and every node's default gateway; a route to each node's Pod range
//! via that node; forwarding between the nodes.
//!
//! Nothing here routes out of the machine: the Service range and the whole Pod range are
//! routed onto the bridge (a Service address, or the Pod range of a node that is off, reached
//! from the host goes nowhere), a FORWARD rule drops whatever comes
//! from the bridge for any other interface, and the API server's port, which listens beyond
//! loopback, accepts loopback and the bridge only.
//!
//! The host's kernel settings that the nodes' parts rewrite are recorded (with the folders
//! outside the cluster's that containerd, CNI and `ip netns` create) in `fabric.json`
//! before anything changes, and restored by [`teardown`].

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::process::run;

/// The host bridge's name (at most 15 characters).
pub const BRIDGE: &str = "mro-br0";
/// The host's address on the bridge (a /24; node `i` is `10.243.0.(10 + i)`): the API
/// server's advertised address.
pub const HOST_ADDRESS: &str = "10.243.0.1";
/// Every node's Pod range lies in this (node `i` has `10.244.i.0/24`).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The Service range (the control plane's `--service-cluster-ip-range`).
pub const SERVICE_CIDR: &str = "10.0.0.0/24";
/// The first Service address: the `kubernetes` Service.
pub const KUBERNETES_SERVICE_IP: &str = "10.0.0.1";
/// Our iptables chains (the API server's port filter and the no-egress rule).
const INPUT_CHAIN: &str = "MRO-NODE-INPUT";
const FORWARD_CHAIN: &str = "MRO-NODE-FORWARD";
const RECORD: &str = "fabric.json";
/// Folders outside the cluster's that containerd, CNI or `ip netns` may create.
const OUTSIDE: &[&str] = &[
    "/run/containerd",
    "/opt/containerd",
    "/run/nri",
    "/var/lib/cni",
    "/run/netns",
    "/var/run/netns",
];
/// Host kernel settings the nodes' parts rewrite: the kubelet (`vm.overcommit_memory`,
/// `vm.panic_on_oom`, `kernel.panic`, `kernel.panic_on_oops`, the root key limits), this
/// module (IP forwarding between the nodes) and kube-proxy (bridge netfilter, where the
/// kernel keeps it global).
pub const KERNEL_SETTINGS: &[&str] = &[
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/forwarding",
    "net/bridge/bridge-nf-call-iptables",
];

/// What [`teardown`] restores, written before anything is changed.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    kernel: Vec<(String, String)>,
    absent_before: Vec<PathBuf>,
}

/// Installs iptables where missing, records what [`teardown`] restores (in `dir`), then
/// creates the bridge with the host's address, routes the Service range onto it, turns on
/// forwarding and installs the filter rules (`apiserver_port`: the API server's, when it
/// listens beyond loopback).
pub fn create(dir: &Path, apiserver_port: Option<u16>) -> Result<()> {
    crate::binaries::node_packages()?;
    std::fs::create_dir_all(dir)?;
    let record = Record {
        kernel: record_kernel_settings(),
        absent_before: OUTSIDE
            .iter()
            .map(PathBuf::from)
            .filter(|p| !p.exists())
            .collect(),
    };
    std::fs::write(dir.join(RECORD), serde_json::to_vec_pretty(&record)?)?;
    if !Path::new("/sys/class/net").join(BRIDGE).exists() {
        ip(&["link", "add", BRIDGE, "type", "bridge"])?;
    }
    ip(&[
        "addr",
        "replace",
        &format!("{HOST_ADDRESS}/24"),
        "dev",
        BRIDGE,
    ])?;
    ip(&["link", "set", BRIDGE, "up"])?;
    for range in [SERVICE_CIDR, CLUSTER_CIDR] {
        ip(&[
            "route",
            "replace",
            range,
            "dev",
            BRIDGE,
            "src",
            HOST_ADDRESS,
        ])?;
    }
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("turning on IP forwarding")?;
    filter(apiserver_port)
}

/// Routes `pod_cidr` to the node at `address`.
pub fn route(pod_cidr: &str, address: &str) -> Result<()> {
    ip(&["route", "replace", pod_cidr, "via", address, "dev", BRIDGE])?;
    Ok(())
}

fn filter(apiserver_port: Option<u16>) -> Result<()> {
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

/// Removes the bridge, the routes and our chains, restores the kernel settings and removes
/// the outside folders that were absent before (the nodes' namespaces, processes and mounts
/// must be gone already). Idempotent; returns what it could not undo.
pub fn teardown(dir: &Path) -> Result<()> {
    let record: Record = match std::fs::read(dir.join(RECORD)) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a fabric record", dir.join(RECORD).display()))?,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(err.into()),
    };
    remove_chains();
    // The bridge's routes (the Service range, every node's Pod range) go with it.
    if Path::new("/sys/class/net").join(BRIDGE).exists() {
        let _ = ip(&["link", "del", BRIDGE]);
    }
    let mut problems = restore_kernel_settings(&record.kernel)
        .into_iter()
        .map(|name| format!("kernel setting {name} not restored"))
        .collect::<Vec<_>>();
    for path in &record.absent_before {
        if path.exists() {
            let _ = super::unmount_under(path);
            if let Err(err) = std::fs::remove_dir_all(path) {
                problems.push(format!("removing {}: {err}", path.display()));
            }
        }
    }
    anyhow::ensure!(
        problems.is_empty(),
        "the nodes' network tear-down left: {}",
        problems.join("; ")
    );
    std::fs::remove_file(dir.join(RECORD))?;
    Ok(())
}

fn remove_chains() {
    for (parent, chain) in [("INPUT", INPUT_CHAIN), ("FORWARD", FORWARD_CHAIN)] {
        remove_chain(parent, chain);
    }
}

/// Deletes every jump from `parent` to `chain`, then flushes and deletes `chain` (filter
/// table; best effort).
fn remove_chain(parent: &str, chain: &str) {
    let rules = iptables(&["-S", parent]).unwrap_or_default();
    for rule in rules
        .lines()
        .filter(|r| r.ends_with(&format!("-j {chain}")))
    {
        let mut delete = vec!["-D"];
        delete.extend(rule.split_whitespace().skip(1));
        let _ = iptables(&delete);
    }
    let _ = iptables(&["-F", chain]);
    let _ = iptables(&["-X", chain]);
}

/// The current values of [`KERNEL_SETTINGS`] (those that exist), as (name, value).
fn record_kernel_settings() -> Vec<(String, String)> {
    KERNEL_SETTINGS
        .iter()
        .filter_map(|name| {
            let value = std::fs::read_to_string(Path::new("/proc/sys").join(name)).ok()?;
            Some((name.to_string(), value.trim().to_string()))
        })
        .collect()
}

/// Writes back recorded values that differ now; returns the names it could not restore.
fn restore_kernel_settings(recorded: &[(String, String)]) -> Vec<String> {
    let mut failed = Vec::new();
    for (name, value) in recorded {
        let path = Path::new("/proc/sys").join(name);
        let now = std::fs::read_to_string(&path).unwrap_or_default();
        if now.trim() != value && std::fs::write(&path, value).is_err() {
            failed.push(name.clone());
        }
    }
    failed
}

pub(super) fn ip(args: &[&str]) -> Result<String> {
    run(Command::new("ip").args(args), None).with_context(|| format!("ip {}", args.join(" ")))
}

fn iptables(args: &[&str]) -> Result<String> {
    run(Command::new("iptables").args(["-w", "5"]).args(args), None)
        .with_context(|| format!("iptables {}", args.join(" ")))
}

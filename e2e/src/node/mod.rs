//! Real nodes beside the local control plane: each with containerd and runc, the CNI
//! bridge, the kubelet and kube-proxy in a network namespace of its own (the kube-scheduler
//! that places Pods on them runs beside the control plane), so the operator runs as users
//! run it: as Pods, spread over machines that can fail one at a time.
//!
//! Parts: [`fabric`] (the host's bridge, routes and filter rules that join the nodes),
//! [`network`] (one node's namespace, Pod range and CNI config, and its partition),
//! [`cgroup`] (a node's cgroup subtree), [`runtime`] (containerd), [`image`]
//! (docker-archives written here, imported without a registry), [`kubelet`] (its config),
//! [`probe`] (the fail-fast checks of docs/node-facts.md: runc alone, the kubelet
//! standalone).
//!
//! Invariants:
//! - Everything a node writes lies under its folder (`<cluster>/nodes/<name>`), except what
//!   containerd, CNI and `ip netns` insist on writing elsewhere (`/run/containerd/s` shim
//!   sockets, `/run/netns`): such folders are removed at tear-down when they did not exist
//!   before ([`fabric`] records them).
//! - Every container runs below the starting process's own memory cgroup
//!   (`<own>/<node name>/…` in every v1 hierarchy), so this machine's memory accounting sees
//!   it; nothing is moved to cgroup v2.
//! - [`Node::prepare`] writes `node.json` (what to undo: the cgroups it made) *before* it
//!   changes anything, so [`teardown`] can undo a node that died half-way, from any process.
//! - [`power_off`] leaves the node as a pulled plug would: silent at once (its link cut),
//!   then every process of it SIGKILLed, every mount gone and its runtime state (containerd's
//!   `/run`) deleted; its disk (images, the kubelet's folder) stays, so it boots again.
//!   [`teardown`] is a power-off that also removes the cgroups and the record; idempotent.
//! - A node's own processes (containerd, kubelet, kube-proxy, named `<node>-<part>`) are
//!   started by the caller through [`crate::process`], so they die with it (PDEATHSIG) and the
//!   leftover check (processes whose binary lies in the binaries cache) sees them; the shims
//!   containerd starts are found by the socket address on their command line.
//! - No image is ever pulled: the sandbox image is built here and pinned.

pub mod cgroup;
pub mod fabric;
pub mod image;
pub mod kubelet;
pub mod network;
pub mod probe;
pub mod runtime;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::binaries::{self, NodeBinaries};
use cgroup::Subtree;
use image::{Image, ImageFile};
use network::NodeNet;
use runtime::Runtime;

const RECORD: &str = "node.json";
/// A node's processes, by part, in the order they are stopped.
pub const PARTS: &[&str] = &["kubelet", "kube-proxy", "containerd"];
/// The most nodes a cluster may have (addresses and Pod ranges are numbered by node).
pub const MAX_NODES: u8 = 9;

/// The name of node `index` (1-based): also its network namespace and cgroup subtree.
pub fn node_name(index: u8) -> String {
    format!("mro-node-{index}")
}

/// The index of the node called `name` ([`node_name`]'s inverse).
pub fn node_index(name: &str) -> Option<u8> {
    name.strip_prefix("mro-node-")?.parse().ok()
}

/// What [`teardown`] undoes, written before anything is changed.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    name: String,
    index: u8,
    cgroup: String,
    cgroups_made: Vec<PathBuf>,
    containerd_socket: PathBuf,
    ctr: PathBuf,
}

/// A node's parts: binaries at hand, its folder, runtime, network and cgroups.
#[derive(Debug)]
pub struct Node {
    pub name: String,
    pub index: u8,
    pub dir: PathBuf,
    pub bin: NodeBinaries,
    pub runtime: Runtime,
    pub network: NodeNet,
    pub cgroups: Subtree,
}

impl Node {
    /// Node `index`'s parts under `nodes_dir/<name>` (finding or building the programs);
    /// changes nothing on the machine.
    pub fn layout(nodes_dir: &Path, index: u8) -> Result<Node> {
        anyhow::ensure!(
            (1..=MAX_NODES).contains(&index),
            "node index {index} is not in 1..={MAX_NODES}"
        );
        let name = node_name(index);
        let dir = std::path::absolute(nodes_dir.join(&name))?;
        Ok(Node {
            bin: binaries::node()?,
            runtime: Runtime::new(&dir.join("containerd")),
            network: NodeNet::new(&name, index, &dir.join("cni")),
            cgroups: Subtree::under_own(&name)?,
            dir,
            index,
            name,
        })
    }

    /// [`Node::layout`], then records what tear-down must undo and makes the cgroup
    /// subtree. Changes nothing else (the network is [`NodeNet::create`]'s).
    pub fn prepare(nodes_dir: &Path, index: u8) -> Result<Node> {
        let node = Node::layout(nodes_dir, index)?;
        std::fs::create_dir_all(&node.dir)?;
        let mut record = Record {
            name: node.name.clone(),
            index,
            cgroup: node.cgroups.path.clone(),
            cgroups_made: Vec::new(),
            containerd_socket: node.runtime.socket.clone(),
            ctr: node.bin.ctr.clone(),
        };
        write_record(&node.dir, &record)?;
        let made = node.cgroups.create();
        // What was made before a failure is in the error path too: record it either way.
        record.cgroups_made = match &made {
            Ok(made) => made.clone(),
            Err(_) => Vec::new(),
        };
        write_record(&node.dir, &record)?;
        made?;
        Ok(node)
    }

    /// The name its process `part` (one of [`PARTS`]) is started under.
    pub fn process_name(&self, part: &str) -> String {
        format!("{}-{part}", self.name)
    }

    /// Writes containerd's config and returns the command that runs it, inside the node's
    /// network namespace.
    pub fn containerd_command(&self) -> Result<Command> {
        self.runtime
            .write_config(&self.bin, &self.network.cni_conf_dir)?;
        let mut cmd = self.runtime.command(&self.bin);
        self.network.enter(&mut cmd)?;
        Ok(cmd)
    }

    /// Writes `image` as a docker-archive under the node's folder and imports it.
    pub fn import(&self, image: &Image) -> Result<()> {
        import_archive(&self.dir, &self.bin.ctr, &self.runtime.socket, image)
    }

    /// The sandbox image: the static pause binary, user 65535 as upstream's.
    pub fn import_pause(&self) -> Result<()> {
        self.import(&Image {
            reference: runtime::pause_reference(),
            files: vec![ImageFile {
                path: "pause".into(),
                mode: 0o755,
                contents: std::fs::read(&self.bin.pause)?,
            }],
            entrypoint: vec!["/pause".into()],
            cmd: Vec::new(),
            user: "65535:65535".into(),
        })
    }
}

/// The folders of the nodes recorded in `nodes_dir` (running, off, or left half-way), in
/// name order.
pub fn recorded_nodes(nodes_dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(nodes_dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.join(RECORD).is_file())
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs
}

/// Imports `image` into every running node recorded in `nodes_dir`, wherever their
/// containerd was started (another process's `cluster up --nodes`); returns the archive's
/// size in bytes.
pub fn import_into(nodes_dir: &Path, image: &Image) -> Result<u64> {
    let dirs = recorded_nodes(nodes_dir);
    if dirs.is_empty() {
        bail!("no node in {} (cluster up --nodes N)", nodes_dir.display());
    }
    let mut size = 0;
    for dir in &dirs {
        let record = read_record(dir)?;
        if !record.containerd_socket.exists() {
            bail!(
                "node {} is not running (no {}): start it first",
                record.name,
                record.containerd_socket.display()
            );
        }
        import_archive(dir, &record.ctr, &record.containerd_socket, image)?;
        size = std::fs::metadata(archive_path(dir, image))?.len();
    }
    Ok(size)
}

/// The host pid of the process `program` (its first argument) running in the Pod named
/// `pod`, found by the `POD_NAME` its environment carries (the chart sets it): what a user
/// on the node would SIGKILL.
pub fn pod_process(pod: &str, program: &str) -> Result<u32> {
    let wanted = format!("POD_NAME={pod}");
    let argv0 = format!("{program}\0");
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if !cmdline.starts_with(argv0.as_bytes()) {
            continue;
        }
        let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        if environ.split(|&b| b == 0).any(|v| v == wanted.as_bytes()) {
            found.push(pid);
        }
    }
    match found.as_slice() {
        [pid] => Ok(*pid),
        other => bail!("processes {program} of Pod {pod}: {other:?}"),
    }
}

/// The Pod the Lease in `namespace` names and the host pid of its `/myresource-operator`,
/// polled for up to `within`: a holder whose process has just exited (scaled down in a
/// rollout, it released; or crashed, not yet replaced) is not struck, the next one is.
pub async fn leader_process(
    client: &kube::Client,
    namespace: &str,
    within: Duration,
) -> Result<(String, u32)> {
    crate::wait::poll("a Lease holder whose process runs", within, || async {
        let leader = crate::lease::holder(client, namespace).await?;
        let Some(leader) = leader.filter(|h| !h.is_empty()) else {
            return Ok(None);
        };
        let pid = pod_process(&leader, "/myresource-operator").ok();
        Ok(pid.map(|pid| (leader, pid)))
    })
    .await
}

/// SIGKILLs the host process `pid` (one [`pod_process`] found), as a user on the node would.
pub fn sigkill(pid: u32) -> Result<()> {
    // SAFETY: kill has no memory preconditions.
    if unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("kill -9 {pid}"));
    }
    Ok(())
}

fn archive_path(dir: &Path, image: &Image) -> PathBuf {
    dir.join("images")
        .join(format!("{}.tar", image.reference.replace(['/', ':'], "_")))
}

fn import_archive(dir: &Path, ctr: &Path, socket: &Path, image: &Image) -> Result<()> {
    let file = archive_path(dir, image);
    std::fs::create_dir_all(file.parent().expect("in images/"))?;
    image.write_docker_archive(&file)?;
    image::import(ctr, socket, &file)
}

fn write_record(dir: &Path, record: &Record) -> Result<()> {
    std::fs::write(dir.join(RECORD), serde_json::to_vec_pretty(record)?)?;
    Ok(())
}

fn read_record(dir: &Path) -> Result<Record> {
    let bytes = std::fs::read(dir.join(RECORD))
        .with_context(|| format!("no node recorded in {}", dir.display()))?;
    serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not a node record", dir.join(RECORD).display()))
}

/// Cuts the power of the node recorded in `dir` (see the module invariants). `kill` ends
/// the node's process of that name at once (SIGKILL) if it runs and waits for it: the caller
/// knows how it was started. Returns an error naming every step that left something behind.
pub fn power_off(dir: &Path, kill: &mut dyn FnMut(&str)) -> Result<()> {
    // Mount points are absolute: so must the folder be.
    let dir = &std::path::absolute(dir)?;
    let record = read_record(dir)?;
    let network = NodeNet::new(&record.name, record.index, &dir.join("cni"));
    // Silent first: nothing the node does from here on reaches anyone.
    let _ = fabric::ip(&["link", "set", &network.host_veth, "down"]);
    let cgroups = Subtree {
        path: record.cgroup.clone(),
    };
    let mut problems: Vec<String> = Vec::new();
    for part in PARTS {
        kill(&format!("{}-{part}", record.name));
    }
    let shims = kill_shims(&record.containerd_socket);
    if !shims.is_empty() {
        problems.push(format!("shims survived SIGKILL: {shims:?}"));
    }
    if let Err(err) = cgroups.kill_all() {
        problems.push(format!("{err:#}"));
    }
    // What lived in memory goes: mounts (containers' root filesystems, Pods' volumes and
    // network namespaces), the runtime's state, the node's own namespace.
    if let Err(err) = unmount_under(dir) {
        problems.push(format!("{err:#}"));
    }
    let state = Runtime::new(&dir.join("containerd")).state_dir();
    if let Err(err) = std::fs::remove_dir_all(&state)
        && err.kind() != std::io::ErrorKind::NotFound
    {
        problems.push(format!("removing {}: {err}", state.display()));
    }
    network.remove();
    if network.exists() {
        problems.push(format!("network namespace {} left", network.netns));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        bail!("powering off {} left: {}", record.name, problems.join("; "))
    }
}

/// Undoes the node recorded in `dir`: [`power_off`], then its cgroups and its record.
/// Idempotent (nothing to do without a record).
pub fn teardown(dir: &Path, kill: &mut dyn FnMut(&str)) -> Result<()> {
    if !dir.join(RECORD).is_file() {
        return Ok(());
    }
    let record = read_record(dir)?;
    let off = power_off(dir, kill);
    let cgroups = Subtree {
        path: record.cgroup.clone(),
    };
    let removed = cgroups.remove(&record.cgroups_made);
    match (off, removed) {
        (Ok(()), Ok(())) => Ok(std::fs::remove_file(dir.join(RECORD))?),
        (Err(err), Ok(())) | (Ok(()), Err(err)) => Err(err),
        (Err(off), Err(removed)) => Err(off.context(format!("{removed:#}"))),
    }
}

/// SIGKILLs every containerd shim started by the containerd on `socket` (their command line
/// names it as `-address`); returns the pids still alive after 5 s.
fn kill_shims(socket: &Path) -> Vec<u32> {
    let find = || {
        let needle = format!("\0-address\0{}\0", socket.display());
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                    let mut c = c;
                    c.insert(0, 0);
                    String::from_utf8_lossy(&c).contains(&needle)
                })
            })
            .filter(|pid| crate::process::pid_alive(*pid))
            .collect::<Vec<_>>()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let pids = find();
        if pids.is_empty() || std::time::Instant::now() > deadline {
            return pids;
        }
        for pid in pids {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Detaches every mount at or below `dir`, deepest first.
pub fn unmount_under(dir: &Path) -> Result<()> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mount_point(p)))
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    let mut failed = Vec::new();
    for point in points {
        let c = std::ffi::CString::new(point.as_os_str().as_encoded_bytes())?;
        // SAFETY: a valid NUL-terminated path; umount2 has no other preconditions.
        let rc = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINVAL) {
                failed.push(format!("{}: {err}", point.display()));
            }
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        bail!("mounts left: {}", failed.join("; "))
    }
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mount_point(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && let Ok(v) = u8::from_str_radix(s.get(i + 1..i + 4).unwrap_or(""), 8)
        {
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_and_indexes_round_trip() {
        for index in 1..=MAX_NODES {
            assert_eq!(node_index(&node_name(index)), Some(index));
        }
        assert_eq!(node_index("mro-node-x"), None);
        assert_eq!(node_index("node-1"), None);
    }
}

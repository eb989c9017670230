//! A real node beside the local control plane: containerd with runc, the CNI bridge, the
//! kubelet, kube-proxy (and the kube-scheduler that places Pods on it), so the operator can
//! run as users run it: as Pods.
//!
//! Parts: [`cgroup`] (the node's cgroup subtree), [`runtime`] (containerd), [`image`]
//! (docker-archives written here, imported without a registry), [`network`] (bridge, CNI,
//! filter rules), [`kubelet`] (its config and the kernel settings it rewrites), [`probe`]
//! (the fail-fast checks of docs/node-facts.md: runc alone, the kubelet standalone).
//!
//! Invariants:
//! - Everything the node writes lies under its folder (`<cluster>/node`), except what
//!   containerd and CNI insist on writing elsewhere (`/run/containerd/s` shim sockets and
//!   the like): such folders are removed at tear-down when they did not exist before.
//! - Every container runs below the starting process's own memory cgroup
//!   (`<own>/mro-node/…` in every v1 hierarchy), so this machine's memory accounting sees
//!   it; nothing is moved to cgroup v2.
//! - [`Node::prepare`] writes `node.json` (what to undo: the cgroups it made, the kernel
//!   settings as they were, the folders outside that were absent) *before* it changes
//!   anything, so [`teardown`] can undo a node that died half-way, from any process.
//! - [`teardown`] removes every trace: containers, shims, mounts under the folder, kube-proxy's
//!   iptables rules (`kube-proxy --cleanup`), our own rules, the bridge, the cgroups, and
//!   restores the kernel settings. It is idempotent.
//! - The node's own processes (containerd, kubelet, kube-proxy, kube-scheduler) are started
//!   by the caller through [`crate::process`], so they die with it (PDEATHSIG) and the
//!   leftover check (processes whose binary lies in the binaries cache) sees them; the shims
//!   containerd starts are found by the socket address on their command line.
//! - No image is ever pulled: the sandbox image is built here and pinned.

pub mod cgroup;
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
use network::Network;
use runtime::Runtime;

/// The node's name (and its cgroup subtree's last element).
pub const NODE_NAME: &str = "mro-node";
const RECORD: &str = "node.json";
/// Folders outside the node's own that containerd or CNI may create.
const OUTSIDE: &[&str] = &[
    "/run/containerd",
    "/opt/containerd",
    "/run/nri",
    "/var/lib/cni",
    "/run/netns",
    "/var/run/netns",
];
/// The node's processes in the order they are stopped.
pub const PROCESSES: &[&str] = &["kubelet", "kube-proxy", "kube-scheduler", "containerd"];

/// What [`teardown`] undoes, written before anything is changed.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    cgroup: String,
    cgroups_made: Vec<PathBuf>,
    kernel: Vec<(String, String)>,
    absent_before: Vec<PathBuf>,
    containerd_socket: PathBuf,
    binaries: (PathBuf, PathBuf),
}

/// A prepared node: binaries at hand, cgroups made, record written.
#[derive(Debug)]
pub struct Node {
    pub dir: PathBuf,
    pub bin: NodeBinaries,
    pub runtime: Runtime,
    pub network: Network,
    pub cgroups: Subtree,
}

impl Node {
    /// Finds or builds the node's programs, records what tear-down must restore, and makes
    /// the cgroup subtree. Changes nothing else.
    pub fn prepare(dir: &Path) -> Result<Node> {
        let bin = binaries::node()?;
        std::fs::create_dir_all(dir)?;
        let dir = dir.canonicalize()?;
        let cgroups = Subtree::under_own(NODE_NAME)?;
        let runtime = Runtime::new(&dir.join("containerd"));
        let mut record = Record {
            cgroup: cgroups.path.clone(),
            cgroups_made: Vec::new(),
            kernel: kubelet::record_kernel_settings(),
            absent_before: OUTSIDE
                .iter()
                .map(PathBuf::from)
                .filter(|p| !p.exists())
                .collect(),
            containerd_socket: runtime.socket.clone(),
            binaries: (bin.ctr.clone(), bin.kube_proxy.clone()),
        };
        write_record(&dir, &record)?;
        let made = cgroups.create();
        // What was made before a failure is in the error path too: record it either way.
        record.cgroups_made = match &made {
            Ok(made) => made.clone(),
            Err(_) => Vec::new(),
        };
        write_record(&dir, &record)?;
        made?;
        Ok(Node {
            network: Network::new(&dir.join("cni")),
            dir,
            bin,
            runtime,
            cgroups,
        })
    }

    /// Writes containerd's config and returns the command that runs it.
    pub fn containerd_command(&self) -> Result<Command> {
        self.runtime
            .write_config(&self.bin, &self.network.cni_conf_dir)?;
        Ok(self.runtime.command(&self.bin))
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

/// Imports `image` into the running node whose folder is `dir`, wherever its containerd was
/// started (another process's `cluster up --node`); returns the archive's size in bytes.
pub fn import_into(dir: &Path, image: &Image) -> Result<u64> {
    let record: Record = serde_json::from_slice(
        &std::fs::read(dir.join(RECORD))
            .with_context(|| format!("no node in {} (cluster up --node)", dir.display()))?,
    )?;
    if !record.containerd_socket.exists() {
        bail!(
            "the node in {} is not running (no {})",
            dir.display(),
            record.containerd_socket.display()
        );
    }
    import_archive(dir, &record.binaries.0, &record.containerd_socket, image)?;
    Ok(std::fs::metadata(archive_path(dir, image))?.len())
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

/// Whether `dir` holds a node's record (a node that runs, or one that died half-way).
pub fn recorded(dir: &Path) -> bool {
    dir.join(RECORD).is_file()
}

/// Undoes the node recorded in `dir` (see the module invariants). `stop` stops the named
/// process of [`PROCESSES`] if it runs (and waits for it to end): the caller knows how the
/// process was started. Returns an error naming every step that left something behind.
pub fn teardown(dir: &Path, stop: &mut dyn FnMut(&str)) -> Result<()> {
    // Mount points are absolute: so must the folder be.
    let dir = &std::path::absolute(dir)?;
    let record: Record = match std::fs::read(dir.join(RECORD)) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a node record", dir.join(RECORD).display()))?,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(err.into()),
    };
    let mut problems: Vec<String> = Vec::new();
    let cgroups = Subtree {
        path: record.cgroup.clone(),
    };
    let (ctr, kube_proxy) = &record.binaries;
    // No kubelet to restart what is stopped next.
    for name in &PROCESSES[..3] {
        stop(name);
    }
    if record.containerd_socket.exists() {
        let runtime = Runtime::new(
            record
                .containerd_socket
                .parent()
                .expect("socket in a folder"),
        );
        runtime.remove_all_containers(ctr);
    }
    if let Err(err) = cgroups.kill_all() {
        problems.push(format!("{err:#}"));
    }
    stop("containerd");
    let shims = kill_shims(&record.containerd_socket);
    if !shims.is_empty() {
        problems.push(format!("shims survived SIGKILL: {shims:?}"));
    }
    // kube-proxy removes the iptables rules it made (and says so for every mode it knows).
    if kube_proxy.is_file() {
        let _ = crate::process::run(Command::new(kube_proxy).arg("--cleanup"), None);
    }
    if let Err(err) = unmount_under(dir) {
        problems.push(format!("{err:#}"));
    }
    network::remove();
    if let Err(err) = cgroups.remove(&record.cgroups_made) {
        problems.push(format!("{err:#}"));
    }
    let failed = kubelet::restore_kernel_settings(&record.kernel);
    if !failed.is_empty() {
        problems.push(format!("kernel settings not restored: {failed:?}"));
    }
    for path in &record.absent_before {
        if path.exists() {
            let _ = unmount_under(path);
            if let Err(err) = std::fs::remove_dir_all(path) {
                problems.push(format!("removing {}: {err}", path.display()));
            }
        }
    }
    if problems.is_empty() {
        std::fs::remove_file(dir.join(RECORD))?;
        Ok(())
    } else {
        bail!("the node's tear-down left: {}", problems.join("; "))
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

//! The node's cgroups: one subtree, `<own memory cgroup>/<name>`, in every v1 hierarchy.
//!
//! This machine accounts memory per memory cgroup of the starting process (cgroup v1,
//! hybrid), so every container must live below that cgroup. The kubelet's `cgroupRoot` (and
//! the cgroup parent of probe containers) is this subtree; it is created in every mounted
//! v1 hierarchy (the kubelet checks that its root exists in each), and removed, deepest
//! first, once nothing runs in it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

const CGROUP_FS: &str = "/sys/fs/cgroup";
/// The hierarchies the kubelet and runc use: the v1 controllers, plus the named `systemd`
/// hierarchy and the controller-less cgroup2 (`unified`) where runc also makes the path.
const HIERARCHIES: &[&str] = &[
    "blkio", "cpu", "cpuacct", "cpuset", "devices", "freezer", "memory", "pids", "systemd",
    "unified",
];

/// This process's memory cgroup path (`/process_api/<id>` here), read from
/// `/proc/self/cgroup`.
pub fn own_memory_cgroup() -> Result<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup")?;
    text.lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            fields.next()?;
            Some((fields.next()?, fields.next()?))
        })
        .find(|(controllers, _)| controllers.split(',').any(|c| c == "memory"))
        .map(|(_, path)| path.to_string())
        .ok_or_else(|| {
            anyhow!("no v1 memory cgroup in /proc/self/cgroup; the node needs the cgroup v1 memory hierarchy")
        })
}

/// The node's cgroup subtree (a path relative to each hierarchy's root, like `/a/b/node`).
#[derive(Debug, Clone)]
pub struct Subtree {
    pub path: String,
}

impl Subtree {
    /// `<own memory cgroup>/<name>`.
    pub fn under_own(name: &str) -> Result<Subtree> {
        let own = own_memory_cgroup()?;
        Ok(Subtree {
            path: format!("{}/{name}", own.trim_end_matches('/')),
        })
    }

    fn dirs(&self) -> impl Iterator<Item = PathBuf> + '_ {
        HIERARCHIES
            .iter()
            .map(|h| Path::new(CGROUP_FS).join(h))
            .filter(|h| h.is_dir())
            .map(|h| h.join(self.path.trim_start_matches('/')))
    }

    /// Creates the subtree in every hierarchy; cpuset folders get their parent's cpus and
    /// mems (a new cpuset cgroup starts with none, and no task may join it then). Returns
    /// every folder it made (missing ancestors too), for [`Subtree::remove`].
    pub fn create(&self) -> Result<Vec<PathBuf>> {
        let mut made = Vec::new();
        for dir in self.dirs() {
            let cpuset = dir.starts_with(Path::new(CGROUP_FS).join("cpuset"));
            create_with_parents(&dir, cpuset, &mut made)?;
        }
        Ok(made)
    }

    /// Pids of every process in the subtree (memory hierarchy, all levels).
    pub fn pids(&self) -> Vec<u32> {
        let root = Path::new(CGROUP_FS)
            .join("memory")
            .join(self.path.trim_start_matches('/'));
        let mut pids = Vec::new();
        for dir in walk(&root) {
            if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
        }
        pids
    }

    /// SIGKILLs every process in the subtree until none is left (at most 10 s).
    pub fn kill_all(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("processes {pids:?} in cgroup {} survive SIGKILL", self.path);
            }
            for pid in pids {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGKILL);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Removes the subtree from every hierarchy, deepest folders first, then the ancestors
    /// [`Subtree::create`] made (`made`) that are empty. Fails when a folder of the subtree
    /// cannot be removed (a process still in it).
    pub fn remove(&self, made: &[PathBuf]) -> Result<()> {
        let mut failed = Vec::new();
        for dir in self.dirs() {
            let mut all = walk(&dir);
            all.reverse();
            for d in all {
                if let Err(err) = std::fs::remove_dir(&d)
                    && err.kind() != std::io::ErrorKind::NotFound
                {
                    failed.push(format!("{}: {err}", d.display()));
                }
            }
        }
        let mut made = made.to_vec();
        made.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for d in made {
            // An ancestor may hold another's cgroups by now: then it stays.
            let _ = std::fs::remove_dir(&d);
        }
        if failed.is_empty() {
            Ok(())
        } else {
            bail!("cgroups left behind: {}", failed.join("; "))
        }
    }
}

/// `dir` and every folder below it, parents before children.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    // Cgroup trees are shallow; the bound only guards against a loop.
    while let Some(d) = stack.pop() {
        if out.len() > 100_000 {
            break;
        }
        if !d.is_dir() {
            continue;
        }
        if let Ok(entries) = std::fs::read_dir(&d) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    stack.push(entry.path());
                }
            }
        }
        out.push(d);
    }
    out.sort_by_key(|p| p.components().count());
    out
}

fn create_with_parents(dir: &Path, cpuset: bool, made: &mut Vec<PathBuf>) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let parent = dir.parent().expect("a cgroup folder has a parent");
    create_with_parents(parent, cpuset, made)?;
    std::fs::create_dir(dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
    made.push(dir.to_path_buf());
    if cpuset {
        for file in ["cpuset.cpus", "cpuset.mems"] {
            let value = std::fs::read_to_string(parent.join(file))?;
            std::fs::write(dir.join(file), value.trim())
                .with_context(|| format!("writing {}", dir.join(file).display()))?;
        }
    }
    Ok(())
}

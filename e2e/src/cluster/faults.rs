//! The faults nodes meet, as operations on a running cluster: [`NodeFault::Partition`]
//! (the node's namespace cut off from the API server and the other nodes, its kubelet and
//! Pods alike), [`NodeFault::Heal`], [`NodeFault::Stop`] (a power-off: silent at once, every
//! process of the node SIGKILLed, what lived in memory gone) and [`NodeFault::Start`] (the
//! node boots again under the same name, from its disk).
//!
//! They act through a [`Supervisor`]: the [`Cluster`] this process started (tests, the
//! demo, benchmarks), or [`Recorded`], the record of a cluster another process started
//! (`cargo xtask cluster up --nodes N`, then `cargo xtask cluster node NAME stop`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Result, anyhow, bail, ensure};

use super::{Cluster, NODES_DIR, Record, read_record};
use crate::node::{self, Node};
use crate::process::{self, Lifetime, Process};

/// A node-level fault (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeFault {
    Partition,
    Heal,
    Stop,
    Start,
}

/// Starts and ends a cluster's processes by name.
pub trait Supervisor: Send {
    /// Starts `cmd` as the cluster's process `name` (logged to `DIR/<name>.log`, recorded
    /// for `cluster down`).
    fn spawn(&mut self, name: &str, cmd: Command) -> Result<()>;
    /// Ends the process `name` at once (SIGKILL) if it runs, waits for it, and forgets it.
    fn kill(&mut self, name: &str);
    /// Fails, with its log's tail, unless the process `name` runs.
    fn ensure_running(&mut self, name: &str) -> Result<()>;
    /// The cluster's folder.
    fn dir(&self) -> &Path;
    /// An admin kubeconfig.
    fn kubeconfig(&self) -> &Path;
}

impl Supervisor for Cluster {
    fn spawn(&mut self, name: &str, cmd: Command) -> Result<()> {
        Cluster::spawn(self, name, cmd)
    }

    fn kill(&mut self, name: &str) {
        if let Some(i) = self.processes.iter().position(|p| p.name == name) {
            let mut p = self.processes.remove(i);
            p.signal(libc::SIGKILL);
            p.wait_for_exit(Duration::from_secs(10));
            if let Err(err) = self.write_record() {
                eprintln!("warning: {err:#}");
            }
        }
    }

    fn ensure_running(&mut self, name: &str) -> Result<()> {
        self.process(name)
            .ok_or_else(|| anyhow!("{name} was not started"))?
            .ensure_running()
    }

    fn dir(&self) -> &Path {
        &self.dir
    }

    fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }
}

/// A cluster another process started and left running (`cluster up`), known by its record;
/// what this starts outlives this process too.
pub struct Recorded {
    dir: PathBuf,
    kubeconfig: PathBuf,
    record: Record,
}

impl Recorded {
    /// The cluster running in `dir`.
    pub fn open(dir: &Path) -> Result<Recorded> {
        let record = read_record(dir)?
            .ok_or_else(|| anyhow!("{} holds no running cluster", dir.display()))?;
        Ok(Recorded {
            dir: dir.to_path_buf(),
            kubeconfig: dir.join("kubeconfig"),
            record,
        })
    }

    fn adopt(&self, name: &str) -> Option<Process> {
        let (_, pid) = self.record.processes.iter().find(|(n, _)| n == name)?;
        Some(Process::adopt(name, *pid, self.log(name)))
    }

    fn log(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.log"))
    }

    fn save(&self) -> Result<()> {
        std::fs::write(
            self.dir.join(super::RECORD),
            serde_json::to_vec_pretty(&self.record)?,
        )?;
        Ok(())
    }
}

impl Supervisor for Recorded {
    fn spawn(&mut self, name: &str, cmd: Command) -> Result<()> {
        let p = process::spawn(name, cmd, &self.log(name), Lifetime::Detached)?;
        self.record.processes.retain(|(n, _)| n != name);
        self.record.processes.push((name.to_string(), p.pid));
        self.save()
    }

    fn kill(&mut self, name: &str) {
        if let Some(mut p) = self.adopt(name) {
            p.signal(libc::SIGKILL);
            p.wait_for_exit(Duration::from_secs(10));
            self.record.processes.retain(|(n, _)| n != name);
            if let Err(err) = self.save() {
                eprintln!("warning: {err:#}");
            }
        }
    }

    fn ensure_running(&mut self, name: &str) -> Result<()> {
        self.adopt(name)
            .ok_or_else(|| anyhow!("{name} was not started"))?
            .ensure_running()
    }

    fn dir(&self) -> &Path {
        &self.dir
    }

    fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }
}

/// The names of the nodes recorded in the cluster of `sup`.
pub fn node_names(sup: &dyn Supervisor) -> Vec<String> {
    node::recorded_nodes(&sup.dir().join(NODES_DIR))
        .iter()
        .filter_map(|d| Some(d.file_name()?.to_str()?.to_string()))
        .collect()
}

/// Applies `fault` to the node `name` of the cluster of `sup`; returns when it has taken
/// effect (for [`NodeFault::Start`]: when the node is Ready again).
pub async fn apply(sup: &mut dyn Supervisor, name: &str, fault: NodeFault) -> Result<()> {
    let names = node_names(sup);
    let index = node::node_index(name)
        .filter(|_| names.iter().any(|n| n == name))
        .ok_or_else(|| anyhow!("no node {name} in this cluster (its nodes: {names:?})"))?;
    let node = Node::layout(&sup.dir().join(NODES_DIR), index)?;
    let running = node.network.exists();
    match fault {
        NodeFault::Partition | NodeFault::Heal | NodeFault::Stop if !running => {
            bail!("node {name} is off: start it first")
        }
        NodeFault::Partition => node.network.partition(),
        NodeFault::Heal => {
            node.network.heal();
            ensure!(!node.network.partitioned(), "node {name} is still cut off");
            Ok(())
        }
        NodeFault::Stop => node::power_off(&node.dir, &mut |process| sup.kill(process)),
        NodeFault::Start => {
            ensure!(!running, "node {name} runs already");
            node.network.create()?;
            super::join::boot(sup, &node, &[])?;
            super::join::wait_ready(sup, std::slice::from_ref(&node)).await
        }
    }
}

impl Cluster {
    /// The names of this cluster's nodes (`mro-node-1` …), running or off.
    pub fn node_names(&self) -> Vec<String> {
        node_names(self)
    }

    /// Applies `fault` to node `name` (see [`apply`]).
    pub async fn node_fault(&mut self, name: &str, fault: NodeFault) -> Result<()> {
        apply(self, name, fault).await
    }
}

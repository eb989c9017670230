//! `cargo xtask demo`: the main job end to end, narrated, as users run it.
//!
//! By default ([`node`]): a local cluster with a real node, the operator's image built and
//! loaded, `helm install` of three replicas, the tutorial's example and labelled Pods, who
//! leads; then the leader Pod is deleted and the next leader's process SIGKILLed from the
//! host, each failover shown with its measured time; with `--nodes 3`, on three nodes, and
//! then the leader's node partitioned and drained, measured too. `--processes`
//! ([`processes`]) runs the replicas as processes beside a control plane without a node,
//! for machines where a node cannot run (it needs root, cgroup v1 or v2 hierarchies,
//! iptables and a bridge).

mod node;
mod processes;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Result, bail};
use e2e::cluster::Cluster;
use e2e::process::Lifetime;
use kube::{Api, Client};
use myresource_operator::resource::MyResource;

/// Runs the demo: on `nodes` nodes, or with `processes` the replicas as processes.
pub async fn run(root: &Path, keep: bool, processes: bool, nodes: u8) -> Result<()> {
    if processes {
        processes::run(root, keep).await
    } else {
        node::run(root, keep, nodes).await
    }
}

/// Fails unless every program is an executable file: everything the demo runs later is
/// checked first, so a program missing from the binaries cache fails here, by name, not
/// halfway through the demo.
pub(super) fn require_programs(programs: &[(&str, &Path)]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for (name, path) in programs {
        let executable = std::fs::metadata(path)
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
        if !executable {
            bail!(
                "the demo needs {name}, and {} is not an executable file (binaries cache: {})",
                path.display(),
                e2e::binaries::controlplane_cache().display()
            );
        }
    }
    Ok(())
}

/// The cluster's lifetime: it outlives the demo with `--keep`.
pub(super) fn lifetime(keep: bool) -> Lifetime {
    if keep {
        Lifetime::Detached
    } else {
        Lifetime::TiedToThisProcess
    }
}

/// What `--keep` prints once the demo succeeded: how to reach the cluster, `tries` (commands
/// to run) and how to stop it.
pub(super) fn left_running(cluster: &Cluster, tries: &[String]) {
    println!("\nLeft running. Try:");
    println!("  export KUBECONFIG={}", cluster.kubeconfig.display());
    for line in tries {
        println!("  {line}");
    }
    println!(
        "Stop it all: cargo xtask cluster down --dir {}",
        cluster.dir.display()
    );
}

pub(super) fn step(text: &str) {
    println!("==> {text}");
}

/// kubectl against one cluster.
pub(super) struct Kubectl {
    path: PathBuf,
    kubeconfig: PathBuf,
}

impl Kubectl {
    pub(super) fn new(path: &Path, cluster: &Cluster) -> Kubectl {
        Kubectl {
            path: path.to_path_buf(),
            kubeconfig: cluster.kubeconfig.clone(),
        }
    }

    pub(super) fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.path);
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .args(args);
        cmd
    }

    /// Runs quietly; fails with kubectl's stderr.
    pub(super) fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<()> {
        e2e::process::run(&mut self.command(args), stdin).map(|_| ())
    }

    /// Runs with its output shown, indented.
    pub(super) fn show(&self, args: &[&str]) -> Result<()> {
        for line in e2e::process::run(&mut self.command(args), None)?.lines() {
            println!("    {line}");
        }
        Ok(())
    }

    /// The example's ConfigMap data.
    pub(super) fn show_configmap(&self) -> Result<()> {
        self.show(&[
            "get",
            "configmap",
            "example-myresource",
            "-o",
            "jsonpath={.data}{\"\\n\"}",
        ])
    }
}

pub(super) async fn wait_for(
    client: &Client,
    limit: Duration,
    done: impl Fn(&MyResource) -> bool,
) -> Result<()> {
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), "default");
    e2e::wait::poll("the example to be reconciled", limit, || {
        let mrs = mrs.clone();
        let done = &done;
        async move {
            Ok(mrs
                .get_opt("example-myresource")
                .await?
                .filter(|m| done(m))
                .map(|_| ()))
        }
    })
    .await
}

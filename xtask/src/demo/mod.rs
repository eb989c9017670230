//! `cargo xtask demo`: the main job end to end, narrated, as users run it.
//!
//! By default ([`node`]): a local cluster with a real node, the operator's image built and
//! loaded, `helm install` of three replicas, the tutorial's example and labelled Pods, who
//! leads; then the leader Pod is deleted and the next leader's process SIGKILLed from the
//! host, each failover shown with its measured time. `--processes` ([`processes`]) runs the
//! replicas as processes beside a control plane without a node, for machines where a node
//! cannot run (it needs root, cgroup v1 or v2 hierarchies, iptables and a bridge).

mod node;
mod processes;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Result, bail};
use kube::{Api, Client};
use myresource_operator::resource::MyResource;

/// Runs the demo: on a node, or with `processes` the replicas as processes.
pub async fn run(root: &Path, keep: bool, processes: bool) -> Result<()> {
    if processes {
        processes::run(root, keep).await
    } else {
        node::run(root, keep).await
    }
}

/// Fails unless `path` is an executable file.
pub(super) fn require_program(name: &str, path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let executable =
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if !executable {
        bail!(
            "the demo needs {name}, and {} is not an executable file (binaries cache: {})",
            path.display(),
            e2e::binaries::controlplane_cache().display()
        );
    }
    Ok(())
}

pub(super) fn step(text: &str) {
    println!("==> {text}");
}

pub(super) struct Kubectl {
    pub(super) path: PathBuf,
    pub(super) kubeconfig: PathBuf,
}

impl Kubectl {
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

//! The operators compared, and one replica of any of them as a process.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use e2e::lease::DEFAULT_TIMINGS;
use e2e::operator::Operator;
use e2e::process::{Lifetime, Process};

use super::super::Bench;
use super::build::PeerBinaries;

/// Every replica reconciles this many objects at once: the operator's default (4 shards ×
/// 2 workers) and the ceiling's concurrency. controller-runtime's default is 1 and
/// kube-runtime's unbounded; a careful user sets it for thousands of objects.
pub(super) const CONCURRENCY: usize = 8;

/// One of the operators compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Peer {
    Ours,
    ControllerRuntime,
    ControllerRuntimeWarmup,
    KubeRuntime,
    /// The same kube-runtime `Controller` under this workspace's kube-leasehold.
    KubeRuntimeLeasehold,
}

pub(super) const PEERS: [Peer; 5] = [
    Peer::Ours,
    Peer::ControllerRuntime,
    Peer::ControllerRuntimeWarmup,
    Peer::KubeRuntime,
    Peer::KubeRuntimeLeasehold,
];

impl Peer {
    /// The key in report.json, and the prefix of namespaces and identities.
    pub(super) fn key(self) -> &'static str {
        match self {
            Peer::Ours => "ours",
            Peer::ControllerRuntime => "cr",
            Peer::ControllerRuntimeWarmup => "cr-warmup",
            Peer::KubeRuntime => "kube-runtime",
            Peer::KubeRuntimeLeasehold => "kube-runtime-leasehold",
        }
    }

    /// The column heading of the report's table.
    pub(super) fn title(self) -> &'static str {
        match self {
            Peer::Ours => "myresource-operator",
            Peer::ControllerRuntime => "controller-runtime v0.25.3",
            Peer::ControllerRuntimeWarmup => "controller-runtime v0.25.3, EnableWarmup",
            Peer::KubeRuntime => "kube-runtime 5.0.0 + kube-lease-manager 0.13.1",
            Peer::KubeRuntimeLeasehold => "kube-runtime 5.0.0 + kube-leasehold 0.1.0",
        }
    }
}

/// A running replica of any peer.
pub(super) struct Replica {
    pub(super) identity: String,
    handle: Handle,
}

enum Handle {
    Ours(Box<Operator>),
    Peer(Process),
}

impl Replica {
    fn process(&mut self) -> &mut Process {
        match &mut self.handle {
            Handle::Ours(op) => &mut op.process,
            Handle::Peer(p) => p,
        }
    }

    pub(super) fn rss_bytes(&mut self) -> u64 {
        e2e::process::rss_bytes(self.process().pid).unwrap_or(0)
    }

    /// SIGTERM, SIGKILL after 10 s; returns once it has exited.
    pub(super) fn stop(&mut self) {
        self.process().stop(Duration::from_secs(10));
    }

    /// SIGKILL; returns once it has exited.
    pub(super) fn kill(&mut self) {
        let process = self.process();
        process.signal(libc::SIGKILL);
        process.wait_for_exit(Duration::from_secs(10));
    }

    /// Whether it has logged that it acquired the Lease (ours and the kube-runtime peers:
    /// "acquired the Lease: leading"; controller-runtime: "Successfully acquired lease").
    pub(super) fn has_led(&mut self) -> bool {
        let log = std::fs::read_to_string(&self.process().log).unwrap_or_default();
        log.contains("acquired the Lease: leading") || log.contains("Successfully acquired lease")
    }

    /// Fails with the log's tail unless it still runs.
    pub(super) fn ensure_running(&mut self) -> Result<()> {
        self.process().ensure_running()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        // The operator's own handle kills it on drop; a peer's process is ended here.
        if let Handle::Peer(p) = &mut self.handle {
            p.signal(libc::SIGKILL);
            p.wait_for_exit(Duration::from_secs(5));
        }
    }
}

impl Bench {
    /// Starts a replica of `peer` named `identity` that watches `ns` and keeps its Lease
    /// there, with the Lease timings 15 s / 10 s / 2 s.
    pub(super) fn start_peer(
        &self,
        peer: Peer,
        binaries: &PeerBinaries,
        ns: &str,
        identity: &str,
    ) -> Result<Replica> {
        let log_dir = self.root.join("target/bench/peers/logs");
        std::fs::create_dir_all(&log_dir)?;
        let (lease, renew, retry) = DEFAULT_TIMINGS.as_secs();
        let mut cmd;
        match peer {
            Peer::Ours => {
                let config = self.replica_config(ns, identity, &DEFAULT_TIMINGS);
                let config = e2e::operator::OperatorConfig { log_dir, ..config };
                return Ok(Replica {
                    identity: identity.into(),
                    handle: Handle::Ours(Box::new(Operator::start(config)?)),
                });
            }
            Peer::ControllerRuntime | Peer::ControllerRuntimeWarmup => {
                let port = || e2e::ports::free_port().map(|p| format!("127.0.0.1:{p}"));
                cmd = Command::new(&binaries.controller_runtime);
                cmd.env("KUBECONFIG", &self.cluster.kubeconfig)
                    .arg(format!("--identity={identity}"))
                    .arg(format!("--namespace={ns}"))
                    .arg(format!("--metrics-bind-address={}", port()?))
                    .arg(format!("--health-probe-bind-address={}", port()?))
                    .arg(format!("--lease-duration={lease}s"))
                    .arg(format!("--renew-deadline={renew}s"))
                    .arg(format!("--retry-period={retry}s"))
                    .arg(format!("--max-concurrent-reconciles={CONCURRENCY}"));
                if peer == Peer::ControllerRuntimeWarmup {
                    cmd.arg("--warmup");
                }
            }
            Peer::KubeRuntime | Peer::KubeRuntimeLeasehold => {
                // One binary and controller, two elections. kube-lease-manager has a duration
                // and a grace (renew this long before expiry): 15 s with renewals every 2 s,
                // as the others renew. kube-leasehold has client-go's three timings, and its
                // grace is how long a term's controller may take to stop at shutdown.
                cmd = Command::new(&binaries.kube_runtime);
                cmd.arg(format!(
                    "--kubeconfig={}",
                    self.cluster.kubeconfig.display()
                ))
                .arg(format!("--identity={identity}"))
                .arg(format!("--namespace={ns}"))
                .arg(format!("--lease-duration={lease}"))
                .arg(format!("--concurrency={CONCURRENCY}"));
                if peer == Peer::KubeRuntime {
                    cmd.arg(format!("--grace={}", lease - retry));
                } else {
                    cmd.arg("--election=leasehold")
                        .arg(format!("--renew-deadline={renew}"))
                        .arg(format!("--retry-period={retry}"))
                        .arg("--grace=5");
                }
            }
        }
        let log: PathBuf = log_dir.join(format!("{identity}.log"));
        let process = e2e::process::spawn(identity, cmd, &log, Lifetime::TiedToThisProcess)?;
        Ok(Replica {
            identity: identity.into(),
            handle: Handle::Peer(process),
        })
    }
}

//! One local control plane: etcd, kube-apiserver and kube-controller-manager on free loopback
//! ports, with everything (PKI, kubeconfigs, audit log, component logs, etcd data) in one
//! folder.
//!
//! Invariants:
//! - [`Cluster::start`] returns only when `/readyz` is ok, the `default` namespace exists and
//!   the controller-manager has created the `default` ServiceAccount (so its controllers run);
//!   on any failure it stops what it started and reports the failing component's log tail.
//! - The folder holds `cluster.json` while the cluster runs; a second start on that folder is
//!   refused as long as any process named there is alive.
//! - [`Cluster::stop`] ends every process it started and removes the folder.

pub mod faults;
mod join;

pub use faults::{NodeFault, Recorded, Supervisor};

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::PostParams;
use kube::{Api, Client};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::binaries::{self, Binaries};
use crate::kubeconfig::{client_for, write_kubeconfig};
use crate::pki::Pki;
use crate::ports::free_port;
use crate::process::{self, Lifetime, Process};

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Folder for everything the cluster writes; created, and removed by [`Cluster::stop`].
    pub dir: PathBuf,
    /// OTLP gRPC endpoint (`host:port`) for the apiserver's traces, when tracing is wanted.
    pub otlp_endpoint: Option<String>,
    /// Whether the processes outlive this one.
    pub lifetime: Lifetime,
    /// CRDs to establish before the controller-manager starts, so its garbage collector
    /// knows their kinds at once instead of after its 30 s discovery refresh.
    pub crds: Vec<CustomResourceDefinition>,
    /// Whether kube-apiserver serves `shardSelector` on lists and watches (KEP-5866,
    /// alpha feature gate `ShardedListAndWatch`); scale-out replicas use it when served.
    pub shard_selector: bool,
}

/// The record in `DIR/cluster.json` that `cluster down` and refusals read.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    server: String,
    processes: Vec<(String, u32)>,
}

/// A running local control plane.
#[derive(Debug)]
pub struct Cluster {
    pub dir: PathBuf,
    /// `https://127.0.0.1:PORT`
    pub server: String,
    /// Admin (group `system:masters`).
    pub kubeconfig: PathBuf,
    /// A user with no group and no RBAC grants.
    pub user_kubeconfig: PathBuf,
    pub audit_log: PathBuf,
    lifetime: Lifetime,
    pki: Pki,
    processes: Vec<Process>,
    /// How each component was started, for [`Cluster::restart`].
    commands: std::collections::HashMap<String, (std::ffi::OsString, Vec<std::ffi::OsString>)>,
    /// The real nodes' folder and how many there are ([`Cluster::start_with_nodes`]).
    nodes: Option<(PathBuf, u8)>,
}

const RECORD: &str = "cluster.json";
const CONTROLLERS: &str = "garbage-collector-controller,deployment-controller,\
replicaset-controller,namespace-controller,serviceaccount-controller";
/// With real nodes, also: the node lifecycle (the not-ready taint lifted, a silent node
/// declared lost and tainted), evicting the Pods of a tainted node once their tolerations
/// run out, `kube-root-ca.crt` in every namespace, EndpointSlices for Services, and
/// PodDisruptionBudgets.
const NODE_CONTROLLERS: &str = ",node-lifecycle-controller,taint-eviction-controller,\
root-ca-certificate-publisher-controller,endpointslice-controller,disruption-controller";
/// The folder of a cluster's nodes (and of their network's record), below the cluster's.
pub const NODES_DIR: &str = "nodes";

impl Cluster {
    /// Starts etcd, kube-apiserver and kube-controller-manager; see the module invariants.
    pub async fn start(config: ClusterConfig) -> Result<Cluster> {
        Cluster::start_inner(config, 0).await
    }

    /// As [`Cluster::start`], plus `count` real nodes ([`crate::node`]): the API server
    /// advertises the host bridge's address (listening on every address, filtered to
    /// loopback and the bridge), serves the `kubernetes` Service with endpoints, authorises
    /// with Node,RBAC and admits ServiceAccounts; kube-scheduler runs beside it, and each
    /// node's containerd, kubelet and kube-proxy join from the node's network namespace.
    /// Returns when every node is Ready and the `kubernetes` Service answers from a Pod on
    /// each.
    pub async fn start_with_nodes(config: ClusterConfig, count: u8) -> Result<Cluster> {
        anyhow::ensure!(
            (1..=crate::node::MAX_NODES).contains(&count),
            "a cluster has 1 to {} nodes, not {count}",
            crate::node::MAX_NODES
        );
        Cluster::start_inner(config, count).await
    }

    async fn start_inner(config: ClusterConfig, nodes: u8) -> Result<Cluster> {
        refuse_if_in_use(&config.dir)?;
        let binaries = binaries::ensure()?;
        std::fs::create_dir_all(&config.dir)
            .with_context(|| format!("creating {}", config.dir.display()))?;
        let dir = config.dir.canonicalize()?;
        let pki = if nodes > 0 {
            let ips = [
                crate::node::fabric::HOST_ADDRESS.parse()?,
                crate::node::fabric::KUBERNETES_SERVICE_IP.parse()?,
            ];
            Pki::create_with_sans(
                &dir.join("pki"),
                &ips,
                &[
                    "kubernetes",
                    "kubernetes.default",
                    "kubernetes.default.svc",
                    "kubernetes.default.svc.cluster.local",
                ],
            )?
        } else {
            Pki::create(&dir.join("pki"))?
        };
        let apiserver_port = free_port()?;
        let nodes = (nodes > 0).then(|| (dir.join(NODES_DIR), nodes));
        let server = format!("https://127.0.0.1:{apiserver_port}");
        let mut cluster = Cluster {
            kubeconfig: dir.join("kubeconfig"),
            user_kubeconfig: dir.join("user.kubeconfig"),
            audit_log: dir.join("audit.log"),
            dir,
            server,
            lifetime: config.lifetime,
            pki,
            processes: Vec::new(),
            commands: Default::default(),
            nodes,
        };
        match cluster.boot(&config, &binaries, apiserver_port).await {
            Ok(()) => Ok(cluster),
            Err(err) => {
                cluster.stop();
                Err(err)
            }
        }
    }

    async fn boot(&mut self, config: &ClusterConfig, bin: &Binaries, port: u16) -> Result<()> {
        let admin = self.pki.client("admin", "admin", Some("system:masters"))?;
        write_kubeconfig(
            &self.kubeconfig,
            &self.server,
            &self.pki.ca_cert,
            "admin",
            &admin,
        )?;
        let user = self.pki.client("user", "myresource-user", None)?;
        write_kubeconfig(
            &self.user_kubeconfig,
            &self.server,
            &self.pki.ca_cert,
            "myresource-user",
            &user,
        )?;

        // The host bridge carries the API server's advertised address: it comes first.
        let mut nodes = Vec::new();
        if let Some((dir, count)) = &self.nodes {
            crate::node::fabric::create(dir, Some(port))?;
            for index in 1..=*count {
                let node = crate::node::Node::prepare(dir, index)?;
                node.network.create()?;
                nodes.push(node);
            }
        }
        let etcd_url = self.start_etcd(bin)?;
        self.start_apiserver(bin, config, port, &etcd_url)?;
        let client = self.wait_for_apiserver().await?;
        for crd in &config.crds {
            establish_crd(&client, crd).await?;
        }
        self.start_controller_manager(bin)?;
        self.wait_until(
            "the default ServiceAccount (serviceaccount controller)",
            || {
                let api: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
                async move { Ok(api.get_opt("default").await?.is_some()) }
            },
        )
        .await?;
        if !nodes.is_empty() {
            join::join(self, &nodes).await?;
        }
        Ok(())
    }

    fn start_etcd(&mut self, bin: &Binaries) -> Result<String> {
        let client_url = format!("http://127.0.0.1:{}", free_port()?);
        let peer_url = format!("http://127.0.0.1:{}", free_port()?);
        let mut cmd = Command::new(&bin.etcd);
        cmd.arg("--name=etcd0")
            .arg(format!(
                "--data-dir={}",
                self.dir.join("etcd-data").display()
            ))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=etcd0={peer_url}"))
            .arg("--unsafe-no-fsync=true")
            // Room beyond etcd's default 2 GiB for `cargo xtask bench --curve` at 100,000
            // objects: several sets of MyResources, Pods, ConfigMaps and Events, and their
            // history until the API server compacts it (every 5 minutes).
            .arg("--quota-backend-bytes=8589934592")
            .arg("--log-level=warn");
        self.spawn("etcd", cmd)?;
        let addr: SocketAddr = client_url.trim_start_matches("http://").parse()?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while !etcd_healthy(addr) {
            self.processes.last_mut().expect("etcd").ensure_running()?;
            if Instant::now() > deadline {
                bail!("etcd not healthy after 60 s:\n{}", self.tail("etcd"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(client_url)
    }

    fn start_apiserver(
        &mut self,
        bin: &Binaries,
        config: &ClusterConfig,
        port: u16,
        etcd_url: &str,
    ) -> Result<()> {
        let policy = self.dir.join("audit-policy.json");
        std::fs::write(&policy, serde_json::to_vec_pretty(&audit_policy())?)?;
        let pki = &self.pki;
        let mut cmd = Command::new(&bin.kube_apiserver);
        cmd.arg(format!("--etcd-servers={etcd_url}"))
            .arg(format!("--secure-port={port}"));
        if self.nodes.is_some() {
            // Nodes and Pods reach it at the host bridge's address (the `kubernetes`
            // Service's endpoint); fabric.rs drops this port on every interface but loopback
            // and the bridge.
            let kubelet_client = pki.client(
                "apiserver-kubelet-client",
                "kube-apiserver-kubelet-client",
                Some("system:masters"),
            )?;
            cmd.arg("--bind-address=0.0.0.0")
                .arg(format!(
                    "--advertise-address={}",
                    crate::node::fabric::HOST_ADDRESS
                ))
                .arg("--authorization-mode=Node,RBAC")
                .arg(format!(
                    "--kubelet-client-certificate={}",
                    kubelet_client.cert.display()
                ))
                .arg(format!(
                    "--kubelet-client-key={}",
                    kubelet_client.key.display()
                ))
                .arg("--kubelet-preferred-address-types=InternalIP");
        } else {
            cmd.arg("--bind-address=127.0.0.1")
                .arg("--advertise-address=127.0.0.1")
                .arg("--endpoint-reconciler-type=none")
                .arg("--authorization-mode=RBAC")
                // No token controller runs and nothing mounts tokens; Pods need no
                // ServiceAccount.
                .arg("--disable-admission-plugins=ServiceAccount");
        }
        cmd.arg(format!("--cert-dir={}", self.dir.join("pki").display()))
            .arg(format!("--tls-cert-file={}", pki.serving_cert.display()))
            .arg(format!(
                "--tls-private-key-file={}",
                pki.serving_key.display()
            ))
            .arg(format!("--client-ca-file={}", pki.ca_cert.display()))
            .arg("--service-cluster-ip-range=10.0.0.0/24")
            .arg("--allow-privileged=true")
            .arg(format!("--service-account-issuer={}/", self.server))
            .arg(format!(
                "--service-account-key-file={}",
                pki.service_account_public_key.display()
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                pki.service_account_key.display()
            ))
            .arg(format!("--audit-log-path={}", self.audit_log.display()))
            .arg(format!("--audit-policy-file={}", policy.display()))
            .arg("--audit-log-mode=blocking")
            // Rotation keeps every file (no age or count limit) and `audit::read` reads
            // them all; a bigger file means fewer of them.
            .arg("--audit-log-maxsize=1024");
        if config.shard_selector {
            cmd.arg("--feature-gates=ShardedListAndWatch=true");
        }
        if let Some(endpoint) = &config.otlp_endpoint {
            let tracing = self.dir.join("tracing-config.json");
            let doc = json!({
                "apiVersion": "apiserver.config.k8s.io/v1",
                "kind": "TracingConfiguration",
                "endpoint": endpoint,
                "samplingRatePerMillion": 0,
            });
            std::fs::write(&tracing, serde_json::to_vec_pretty(&doc)?)?;
            cmd.arg(format!("--tracing-config-file={}", tracing.display()));
        }
        self.spawn("kube-apiserver", cmd)
    }

    async fn wait_for_apiserver(&mut self) -> Result<Client> {
        let client = self.client().await?;
        self.wait_until("kube-apiserver /readyz", || {
            let client = client.clone();
            async move {
                let req = http::Request::get("/readyz").body(Vec::new())?;
                Ok(client
                    .request_text(req)
                    .await
                    .is_ok_and(|body| body == "ok"))
            }
        })
        .await?;
        self.wait_until("the default namespace", || {
            let api: Api<Namespace> = Api::all(client.clone());
            async move { Ok(api.get_opt("default").await?.is_some()) }
        })
        .await?;
        Ok(client)
    }

    fn start_controller_manager(&mut self, bin: &Binaries) -> Result<()> {
        let mut cmd = Command::new(&bin.kube_controller_manager);
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .arg("--leader-elect=false")
            .arg("--secure-port=0")
            .arg("--kube-api-qps=200")
            .arg("--kube-api-burst=400");
        if self.nodes.is_some() {
            cmd.arg(format!("--controllers={CONTROLLERS}{NODE_CONTROLLERS}"))
                .arg(format!("--root-ca-file={}", self.pki.ca_cert.display()))
                // A node without a heartbeat is declared lost after 20 s (50 s upstream),
                // so node-fault tests see its Pods move within their time; the kubelet
                // renews its node Lease every 10 s.
                .arg("--node-monitor-grace-period=20s");
        } else {
            cmd.arg(format!("--controllers={CONTROLLERS}"));
        }
        self.spawn("kube-controller-manager", cmd)
    }

    /// Starts a process that belongs to this cluster: it logs to `DIR/<name>.log`, is
    /// recorded for `cluster down`, and is stopped (before the control plane) by
    /// [`Cluster::stop`].
    pub fn spawn(&mut self, name: &str, cmd: Command) -> Result<()> {
        let log = self.dir.join(format!("{name}.log"));
        let program = cmd.get_program().to_os_string();
        let args: Vec<_> = cmd.get_args().map(|a| a.to_os_string()).collect();
        self.commands.insert(name.to_string(), (program, args));
        let process = process::spawn(name, cmd, &log, self.lifetime)?;
        match self.processes.iter_mut().find(|p| p.name == name) {
            Some(slot) => *slot = process,
            None => self.processes.push(process),
        }
        self.write_record()
    }

    /// Restarts the component `name` with the command line it was started with (a chaos
    /// fault: `kube-apiserver` restarted), waiting for the API server to be ready again.
    pub async fn restart(&mut self, name: &str) -> Result<()> {
        let (program, args) = self
            .commands
            .get(name)
            .cloned()
            .ok_or_else(|| anyhow!("no component {name}"))?;
        if let Some(p) = self.process(name) {
            p.stop(Duration::from_secs(10));
        }
        let mut cmd = Command::new(program);
        cmd.args(args);
        self.spawn(name, cmd)?;
        if name == "kube-apiserver" {
            self.wait_for_apiserver().await?;
        }
        Ok(())
    }

    /// The address kube-apiserver reaches etcd at (from its `--etcd-servers`).
    pub fn etcd_addr(&self) -> Result<std::net::SocketAddr> {
        let (_, args) = self
            .commands
            .get("kube-apiserver")
            .ok_or_else(|| anyhow!("no kube-apiserver"))?;
        let url = args
            .iter()
            .find_map(|a| a.to_str()?.strip_prefix("--etcd-servers=http://"))
            .ok_or_else(|| anyhow!("kube-apiserver has no --etcd-servers"))?;
        Ok(url.parse()?)
    }

    /// Restarts kube-apiserver reaching etcd at `addr` instead (a [`crate::proxy::Proxy`]
    /// in front of it, say).
    pub async fn reroute_etcd(&mut self, addr: std::net::SocketAddr) -> Result<()> {
        let (_, args) = self
            .commands
            .get_mut("kube-apiserver")
            .ok_or_else(|| anyhow!("no kube-apiserver"))?;
        for arg in args.iter_mut() {
            if arg
                .to_str()
                .is_some_and(|a| a.starts_with("--etcd-servers="))
            {
                *arg = format!("--etcd-servers=http://{addr}").into();
            }
        }
        self.restart("kube-apiserver").await
    }

    fn write_record(&self) -> Result<()> {
        let record = Record {
            server: self.server.clone(),
            processes: self
                .processes
                .iter()
                .map(|p| (p.name.clone(), p.pid))
                .collect(),
        };
        std::fs::write(self.dir.join(RECORD), serde_json::to_vec_pretty(&record)?)?;
        Ok(())
    }

    /// The CA that signs every certificate of this cluster.
    pub fn ca_cert(&self) -> &Path {
        &self.pki.ca_cert
    }

    /// Issues a client certificate from the cluster's CA (see [`Pki::client`]).
    pub fn issue_client(
        &self,
        file_stem: &str,
        user: &str,
        group: Option<&str>,
    ) -> Result<crate::pki::ClientCert> {
        self.pki.client(file_stem, user, group)
    }

    /// Polls `check` every 100 ms for up to 120 s; fails early, with the log tail, when a
    /// component exits.
    pub(crate) async fn wait_until<F, Fut>(&mut self, what: &str, mut check: F) -> Result<()>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<bool>>,
    {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut last_error = None;
        loop {
            match check().await {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(err) => last_error = Some(err),
            }
            for p in &mut self.processes {
                p.ensure_running()?;
            }
            if Instant::now() > deadline {
                let logs: Vec<String> = self
                    .processes
                    .iter()
                    .map(|p| format!("--- {} ---\n{}", p.name, p.log_tail(15)))
                    .collect();
                bail!(
                    "timed out waiting for {what} (last error: {last_error:?})\n{}",
                    logs.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn tail(&self, name: &str) -> String {
        process::log_tail(&self.dir.join(format!("{name}.log")), 30)
    }

    /// An admin client. Create one per tokio runtime: a client's connections belong to the
    /// runtime it was made on.
    pub async fn client(&self) -> Result<Client> {
        client_for(&self.kubeconfig).await
    }

    /// The running component called `name` (`etcd`, `kube-apiserver`, `kube-controller-manager`).
    pub fn process(&mut self, name: &str) -> Option<&mut Process> {
        self.processes.iter_mut().find(|p| p.name == name)
    }

    /// Stops every component (controller-manager first, etcd last) and removes the folder.
    /// The nodes go first, with every trace they left ([`crate::node::teardown`]).
    pub fn stop(&mut self) {
        if let Some((dir, _)) = self.nodes.take() {
            let processes = &mut self.processes;
            let outcome = teardown_nodes(&dir, &mut |name| {
                if let Some(p) = processes.iter_mut().find(|p| p.name == name) {
                    p.stop(Duration::from_secs(10));
                }
            });
            if let Err(err) = outcome {
                eprintln!("warning: {err:#}");
            }
        }
        while let Some(mut p) = self.processes.pop() {
            p.stop(Duration::from_secs(10));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Stops the cluster recorded in `dir` by another invocation (`cargo xtask cluster down`).
pub fn stop_recorded(dir: &Path) -> Result<()> {
    let record = read_record(dir)?.ok_or_else(|| {
        anyhow!(
            "{} holds no running cluster ({RECORD} missing)",
            dir.display()
        )
    })?;
    teardown_recorded_nodes(dir, &record)?;
    for (name, pid) in record.processes.into_iter().rev() {
        Process::adopt(&name, pid, dir.join(format!("{name}.log"))).stop(Duration::from_secs(10));
    }
    std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))
}

/// Tears down the nodes recorded below `dir`, if any, stopping their processes by pid.
fn teardown_recorded_nodes(dir: &Path, record: &Record) -> Result<()> {
    teardown_nodes(&dir.join(NODES_DIR), &mut |name| {
        if let Some((_, pid)) = record.processes.iter().find(|(n, _)| n == name) {
            Process::adopt(name, *pid, dir.join(format!("{name}.log")))
                .stop(Duration::from_secs(10));
        }
    })
}

/// Tears down every node recorded in `nodes_dir`, then their network; names every step
/// that left something behind.
fn teardown_nodes(nodes_dir: &Path, stop: &mut dyn FnMut(&str)) -> Result<()> {
    let mut problems = Vec::new();
    for node in crate::node::recorded_nodes(nodes_dir) {
        if let Err(err) = crate::node::teardown(&node, stop) {
            problems.push(format!("{err:#}"));
        }
    }
    if let Err(err) = crate::node::fabric::teardown(nodes_dir) {
        problems.push(format!("{err:#}"));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        bail!("{}", problems.join("; "))
    }
}

fn read_record(dir: &Path) -> Result<Option<Record>> {
    match std::fs::read(dir.join(RECORD)) {
        Ok(bytes) => Ok(Some(serde_json::from_slice(&bytes).with_context(|| {
            format!("{} is not a cluster record", dir.join(RECORD).display())
        })?)),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(err.into()),
    }
}

fn refuse_if_in_use(dir: &Path) -> Result<()> {
    let Some(record) = read_record(dir)? else {
        return Ok(());
    };
    let alive: Vec<String> = record
        .processes
        .iter()
        .filter(|(_, pid)| process::pid_alive(*pid))
        .map(|(name, pid)| format!("{name} (pid {pid})"))
        .collect();
    if alive.is_empty() {
        // A cluster that died without `down`: its leftovers are ours to replace (a node's
        // containers, mounts, bridge and cgroups first).
        teardown_recorded_nodes(dir, &record)?;
        std::fs::remove_dir_all(dir)?;
        return Ok(());
    }
    bail!(
        "{} is in use by a running cluster at {}: {}; stop it with `cargo xtask cluster down \
         --dir {}` or choose another --dir",
        dir.display(),
        record.server,
        alive.join(", "),
        dir.display()
    )
}

/// Creates a namespace.
pub async fn create_namespace(client: &Client, name: &str) -> Result<()> {
    let ns = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    Ok(())
}

async fn establish_crd(client: &Client, crd: &CustomResourceDefinition) -> Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd.metadata.name.clone().unwrap_or_default();
    api.create(&PostParams::default(), crd).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = api.get(&name).await?;
        let established = got
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        if established {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("CRD {name} not established after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The audit policy: writes, lists and watches of the resources the operator touches, at
/// Metadata level (user, user agent, verb, object, response code, timestamps); Lease writes
/// at Request level, so the log tells who each write names as holder.
fn audit_policy() -> serde_json::Value {
    let writes = ["create", "update", "patch", "delete", "deletecollection"];
    json!({
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        // The answers are read for their resourceVersion (when a write took effect) and
        // owners; their managed fields are noise.
        "omitManagedFields": true,
        "rules": [
            {
                // Writes of what the operator writes (Leases, MyResources, ConfigMaps,
                // Events) and of what the checks date them by (MyResource creates):
                // request and answer.
                "level": "RequestResponse",
                "verbs": writes,
                "resources": [
                    {"group": "coordination.k8s.io", "resources": ["leases"]},
                    {"group": "trstringer.com", "resources": ["myresources", "myresources/status"]},
                    {"group": "", "resources": ["configmaps", "events"]},
                    {"group": "events.k8s.io", "resources": ["events"]}
                ]
            },
            {
                "level": "Metadata",
                "verbs": ["get", "list", "watch"],
                "resources": [
                    {"group": "trstringer.com", "resources": ["myresources"]},
                    {"group": "", "resources": ["configmaps", "pods", "events"]},
                    {"group": "events.k8s.io", "resources": ["events"]},
                    {"group": "coordination.k8s.io", "resources": ["leases"]}
                ]
            },
            // Any other write, by anyone: the fencing check judges a replica's write of
            // any resource.
            {"level": "Metadata", "verbs": writes},
            {"level": "None"}
        ]
    })
}

fn etcd_healthy(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.contains("\"health\":\"true\"")
}

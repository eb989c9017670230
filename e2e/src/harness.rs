//! The per-test-binary control plane.
//!
//! The first test that asks starts one cluster (or, with `USE_EXISTING_CLUSTER=true`, uses
//! the one in `KUBECONFIG`); every test gets its own namespace and its own client. The cluster
//! is stopped and its folder removed when the process exits (an `atexit` hook, which also runs
//! after a panicking test); if the process is killed outright, the components die with it
//! (see [`crate::process`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

use anyhow::{Result, anyhow};
use kube::Client;

use crate::cluster::{Cluster, ClusterConfig};
use crate::jaeger::{Jaeger, JaegerApi};
use crate::kubeconfig::{client_for, write_kubeconfig_via};
use crate::operator::{Operator, OperatorConfig};
use crate::process::Lifetime;

/// How long [`TestEnv::assert_fenced`] waits for the writes it needs to appear in the audit
/// log.
pub const AUDIT_SETTLE: std::time::Duration = std::time::Duration::from_secs(10);

/// What the shared cluster gives a test: where it is and what it wrote.
#[derive(Debug, Clone)]
pub struct Shared {
    pub kubeconfig: PathBuf,
    /// `None` for an existing cluster, whose audit log we cannot read.
    pub audit_log: Option<PathBuf>,
    pub server: String,
    /// The Jaeger that the API server (and traced operators) send spans to, when the test
    /// binary asked for tracing with [`setup_traced`].
    pub jaeger: Option<JaegerEndpoints>,
    /// The real node's folder (`nodes/`, one node), when the test binary asked for one with
    /// [`setup_with_node`].
    pub nodes_dir: Option<PathBuf>,
}

/// Where a Jaeger listens.
#[derive(Debug, Clone, Copy)]
pub struct JaegerEndpoints {
    pub otlp_grpc: std::net::SocketAddr,
    pub api: JaegerApi,
}

/// One test's view: a fresh namespace and a client on the test's own runtime.
pub struct TestEnv {
    pub client: Client,
    pub namespace: String,
    pub shared: Shared,
}

impl TestEnv {
    /// Creates the ServiceAccount `name` in this test's namespace and returns a token for
    /// it ([`crate::access::service_account_token`]).
    pub async fn service_account_token(&self, name: &str) -> Result<String> {
        crate::access::service_account_token(&self.client, &self.namespace, name).await
    }

    /// The ClusterRole this test creates for reading `/metrics` (the chart's
    /// metrics-reader, for replicas run without the chart).
    pub fn metrics_reader(&self) -> String {
        format!("{}-metrics-reader", self.namespace)
    }

    /// A token of the ServiceAccount `account`, which [`TestEnv::metrics_reader`] (created
    /// here) admits to `/metrics`; the binding is in force on return (a 403 would be cached
    /// by a replica for a while).
    pub async fn metrics_scraper(&self, account: &str) -> Result<String> {
        let reader = self.metrics_reader();
        crate::access::create_metrics_reader(&self.client, &reader).await?;
        let token = self.service_account_token(account).await?;
        self.bind_cluster_role(&reader, account, "/metrics").await?;
        Ok(token)
    }

    /// Binds the ClusterRole `role` to the ServiceAccount `account` of this test's
    /// namespace, and waits until the API server allows that account `get` on `path` (a
    /// non-resource URL).
    pub async fn bind_cluster_role(&self, role: &str, account: &str, path: &str) -> Result<()> {
        crate::access::bind_cluster_role(&self.client, &self.namespace, role, account).await?;
        crate::access::wait_allowed(&self.client, &self.namespace, account, path).await
    }

    /// Starts one operator replica (admin credentials) watching this test's namespace and
    /// waits until its caches are synced.
    pub async fn start_operator(&self, identity: &str, extra_args: &[&str]) -> Result<Operator> {
        let mut op = Operator::start(self.operator_config(identity, extra_args))?;
        op.wait_ready().await?;
        Ok(op)
    }

    /// The shared cluster's audit log, read across rotations (fails for an existing cluster,
    /// whose log we cannot read).
    pub fn audit_log(&self) -> Result<crate::audit::Log> {
        let path = self
            .shared
            .audit_log
            .as_ref()
            .ok_or_else(|| anyhow!("the audit log of a local cluster"))?;
        crate::audit::read(path)
    }

    /// The fencing check ([`crate::audit::fencing`]) on this test's Lease group (`fences`, or
    /// the single Lease when `None`): fails on any finding, or when fewer than `min_writes`
    /// writes or `min_terms` terms were examined after [`AUDIT_SETTLE`] of polling (a write
    /// the test did not wait for, such as the status after the ConfigMap it polled, may land
    /// in the log a moment later).
    pub async fn assert_fenced(
        &self,
        fences: Option<crate::audit::Fences>,
        min_writes: usize,
        min_terms: usize,
    ) -> Result<()> {
        let fences = fences
            .unwrap_or_else(|| crate::audit::Fences::lease(&self.namespace, crate::lease::NAME));
        let deadline = std::time::Instant::now() + AUDIT_SETTLE;
        loop {
            let log = self.audit_log()?;
            let verdict = crate::audit::check(&log, &fences);
            let enough = verdict.examined_at_least(min_writes, min_terms);
            if enough || !verdict.clean() || std::time::Instant::now() >= deadline {
                eprintln!(
                    "fencing check: {} writes and {} terms examined, {} without effect",
                    verdict.writes_examined,
                    verdict.terms_examined(),
                    verdict.writes_without_effect
                );
                return verdict.ensure(min_writes, min_terms);
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    }

    /// A copy of the admin kubeconfig whose server is `addr` (a [`crate::proxy::Proxy`]).
    pub fn kubeconfig_via(&self, addr: std::net::SocketAddr, name: &str) -> Result<PathBuf> {
        let path = self
            .shared
            .kubeconfig
            .with_file_name(format!("{}-{name}.kubeconfig", self.namespace));
        write_kubeconfig_via(&self.shared.kubeconfig, addr, &path)?;
        Ok(path)
    }

    /// A copy of the admin kubeconfig whose context's namespace is this test's: for programs
    /// that take their namespace from the kubeconfig, such as the crate's examples.
    pub fn kubeconfig_in_namespace(&self) -> Result<PathBuf> {
        let mut doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&self.shared.kubeconfig)?)?;
        doc["contexts"][0]["context"]["namespace"] = self.namespace.clone().into();
        let path = self
            .shared
            .kubeconfig
            .with_file_name(format!("{}.kubeconfig", self.namespace));
        std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)?;
        Ok(path)
    }

    /// Where this test binary's replica logs go (`target/e2e-logs/<pid>`).
    pub fn log_dir(&self) -> PathBuf {
        crate::operator::workspace_root()
            .join("target/e2e-logs")
            .join(std::process::id().to_string())
    }

    /// `kubectl apply` of the tutorial's example, unchanged, into this test's namespace.
    pub fn apply_tutorial_example(&self) -> Result<()> {
        let kubeconfig = format!("--kubeconfig={}", self.shared.kubeconfig.display());
        let mut kubectl = std::process::Command::new(crate::binaries::kubectl()?);
        kubectl.args([&kubeconfig, "-n", &self.namespace, "apply", "-f", "-"]);
        crate::process::run(&mut kubectl, Some(crate::TUTORIAL_EXAMPLE))?;
        Ok(())
    }

    /// The holder of this test's Lease ("" when released, None when absent).
    pub async fn lease_holder(&self) -> Result<Option<String>> {
        crate::lease::holder(&self.client, &self.namespace).await
    }

    /// The configuration [`TestEnv::start_operator`] uses, for tests that adjust it: the
    /// Lease lives in the test's namespace, with the short test timings
    /// ([`crate::lease::TEST_TIMINGS`], 4 s / 3 s / 1 s) unless `extra_args` sets them.
    pub fn operator_config(&self, identity: &str, extra_args: &[&str]) -> OperatorConfig {
        OperatorConfig::in_namespace(
            format!("{}-{identity}", self.namespace),
            self.shared.kubeconfig.clone(),
            &self.namespace,
            self.log_dir(),
            &crate::lease::TEST_TIMINGS,
        )
        .with_args(extra_args)
    }
}

static CLUSTER: Mutex<Option<Cluster>> = Mutex::new(None);
static JAEGER: Mutex<Option<Jaeger>> = Mutex::new(None);
static TRACED: AtomicBool = AtomicBool::new(false);
static WITH_NODE: AtomicBool = AtomicBool::new(false);
static UNGATED: AtomicBool = AtomicBool::new(false);

/// Like [`setup`], but the shared control plane (if this call starts it) does not serve
/// `shardSelector` (feature gate `ShardedListAndWatch` off, as on most servers today).
/// Every test of a binary that needs this must use it.
pub async fn setup_ungated(prefix: &str) -> Result<TestEnv> {
    UNGATED.store(true, Ordering::SeqCst);
    setup(prefix).await
}

/// Like [`setup`], but the shared control plane (if this call starts it) has a real node
/// ([`crate::node`]), so Pods run. Every test of a binary that needs the node must use this.
pub async fn setup_with_node(prefix: &str) -> Result<TestEnv> {
    WITH_NODE.store(true, Ordering::SeqCst);
    let env = setup(prefix).await?;
    anyhow::ensure!(
        env.shared.nodes_dir.is_some(),
        "the shared cluster was started without a node"
    );
    Ok(env)
}

/// Like [`setup`], but the shared control plane (if this call starts it) comes with a Jaeger
/// that kube-apiserver sends its spans to. Every test of a binary that needs tracing must
/// use this, so whichever runs first starts the traced cluster.
pub async fn setup_traced(prefix: &str) -> Result<TestEnv> {
    TRACED.store(true, Ordering::SeqCst);
    let env = setup(prefix).await?;
    anyhow::ensure!(
        env.shared.jaeger.is_some(),
        "the shared cluster was started without tracing"
    );
    Ok(env)
}
static SHARED: OnceLock<Result<Shared, String>> = OnceLock::new();

/// Starts (once) the shared cluster and gives the test a namespace `<prefix>-<n>`.
pub async fn setup(prefix: &str) -> Result<TestEnv> {
    let shared = shared()?;
    let client = client_for(&shared.kubeconfig).await?;
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let namespace = format!(
        "{prefix}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    crate::cluster::create_namespace(&client, &namespace).await?;
    Ok(TestEnv {
        client,
        namespace,
        shared,
    })
}

/// The shared cluster, started on first use. Fails (every time) when it cannot start:
/// there is no fallback.
pub fn shared() -> Result<Shared> {
    SHARED
        .get_or_init(|| start().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!("the shared control plane could not start: {e}"))
}

fn start() -> Result<Shared> {
    if std::env::var("USE_EXISTING_CLUSTER").is_ok_and(|v| v == "true") {
        let kubeconfig = std::env::var_os("KUBECONFIG")
            .map(PathBuf::from)
            .ok_or_else(|| anyhow!("USE_EXISTING_CLUSTER=true needs KUBECONFIG"))?;
        return Ok(Shared {
            kubeconfig,
            audit_log: None,
            server: String::new(),
            jaeger: None,
            nodes_dir: None,
        });
    }
    let dir = std::env::temp_dir().join(format!("myresource-e2e-{}", std::process::id()));
    let traced = TRACED.load(Ordering::SeqCst);
    let with_node = WITH_NODE.load(Ordering::SeqCst);
    let jaeger_dir = dir.with_extension("jaeger");
    let config = ClusterConfig {
        dir,
        otlp_endpoint: None,
        lifetime: Lifetime::TiedToThisProcess,
        // Established before the controller-manager starts, so its garbage collector knows
        // MyResource owners at once.
        crds: vec![myresource_operator::resource::crd()],
        shard_selector: !UNGATED.load(Ordering::SeqCst),
    };
    // The cluster must not belong to any one test's runtime: start it on a thread of its own.
    let (cluster, jaeger) = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(async move {
                let mut config = config;
                let jaeger = if traced {
                    let jaeger = Jaeger::start(&jaeger_dir, Lifetime::TiedToThisProcess).await?;
                    config.otlp_endpoint = Some(jaeger.otlp_grpc.to_string());
                    Some(jaeger)
                } else {
                    None
                };
                let cluster = if with_node {
                    Cluster::start_with_nodes(config, 1).await?
                } else {
                    Cluster::start(config).await?
                };
                anyhow::Ok((cluster, jaeger))
            })
    })
    .join()
    .map_err(|_| anyhow!("cluster start panicked"))??;
    let shared = Shared {
        kubeconfig: cluster.kubeconfig.clone(),
        audit_log: Some(cluster.audit_log.clone()),
        server: cluster.server.clone(),
        jaeger: jaeger.as_ref().map(|j| JaegerEndpoints {
            otlp_grpc: j.otlp_grpc,
            api: j.api,
        }),
        nodes_dir: with_node.then(|| cluster.dir.join(crate::cluster::NODES_DIR)),
    };
    *CLUSTER.lock().expect("cluster lock") = Some(cluster);
    *JAEGER.lock().expect("jaeger lock") = jaeger;
    // SAFETY: registering a plain extern "C" function has no preconditions.
    unsafe {
        libc::atexit(stop_at_exit);
    }
    Ok(shared)
}

/// Stops this binary's kube-apiserver (an outage: connections are refused until
/// [`start_apiserver`]). Only for test binaries whose every test expects it.
pub fn stop_apiserver() -> Result<()> {
    let mut guard = CLUSTER.lock().expect("cluster lock");
    let cluster = guard
        .as_mut()
        .ok_or_else(|| anyhow!("no local cluster in this test binary"))?;
    let apiserver = cluster
        .process("kube-apiserver")
        .ok_or_else(|| anyhow!("no kube-apiserver"))?;
    apiserver.stop(std::time::Duration::from_secs(10));
    Ok(())
}

/// Starts this binary's kube-apiserver again and waits until it is ready.
pub async fn start_apiserver() -> Result<()> {
    // Out of the lock while awaiting; back in afterwards (also on failure).
    let mut cluster = CLUSTER
        .lock()
        .expect("cluster lock")
        .take()
        .ok_or_else(|| anyhow!("no local cluster in this test binary"))?;
    let result = cluster.restart("kube-apiserver").await;
    *CLUSTER.lock().expect("cluster lock") = Some(cluster);
    result
}

extern "C" fn stop_at_exit() {
    let cluster = match CLUSTER.lock() {
        Ok(mut guard) => guard.take(),
        Err(poisoned) => poisoned.into_inner().take(),
    };
    if let Some(mut cluster) = cluster {
        cluster.stop();
    }
    let jaeger = match JAEGER.lock() {
        Ok(mut guard) => guard.take(),
        Err(poisoned) => poisoned.into_inner().take(),
    };
    if let Some(mut jaeger) = jaeger {
        jaeger.process.stop(std::time::Duration::from_secs(5));
    }
}

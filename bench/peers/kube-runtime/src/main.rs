//! The kube-runtime peers of `cargo xtask bench --peers`: the operator's job (see
//! src/control/reconcile.rs) written the way kube's documentation and examples teach: a
//! `kube::runtime::Controller` for MyResource with reflector stores of the owned ConfigMaps
//! and the labelled Pods (shared streams: `owns_shared_stream` and `watches_shared_stream`)
//! creates or repairs the ConfigMap, writes the status when it changed, and publishes Events
//! with kube's `Recorder`. The same controller runs under one of two elections
//! (`--election`):
//! - `lease-manager`: a `kube_lease_manager::LeaseManager` (its `watch()` channel, as in the
//!   crate's `jobs_logger` example); the controller and its reflectors start when this
//!   replica leads;
//! - `leasehold`: a `kube_leasehold::Candidate` (this workspace's crate): the reflectors run
//!   on every replica from the start (`kube_leasehold::warm::Warm`), the controller runs
//!   under each term on those warm stores, and writes go through the term's fenced client.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, CustomResource, Resource, ResourceExt};
use kube_lease_manager::LeaseManagerBuilder;
use kube_leasehold::warm::Warm;
use kube_leasehold::{Candidate, Fence, KubeLeases, Timings, fence::fenced_client};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

const POD_LABEL: &str = "trstringer.com/myresource";
const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
const MANAGED_BY: &str = "myresource-operator";
const FIELD_MANAGER: &str = "myresource-operator";
const LEASE_NAME: &str = "myresource-operator";

#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, JsonSchema)]
#[kube(
    group = "trstringer.com",
    version = "v1",
    kind = "MyResource",
    namespaced,
    status = "MyResourceStatus"
)]
#[serde(rename_all = "camelCase")]
pub struct MyResourceSpec {
    message: String,
    some_value: i32,
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MyResourceStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    config_map_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pods: Option<PodCounts>,
}

#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, JsonSchema)]
pub struct PodCounts {
    total: i32,
    ready: i32,
}

/// Which election runs the controller.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Election {
    LeaseManager,
    Leasehold,
}

/// Command line: `--kubeconfig=F --identity=I --namespace=NS --lease-duration=S --grace=S
/// --renew-deadline=S --retry-period=S --concurrency=N --election=lease-manager|leasehold`
/// (kube-lease-manager has a duration and a grace; kube-leasehold client-go's three).
struct Args {
    kubeconfig: Option<String>,
    identity: String,
    namespace: String,
    lease_duration: u64,
    grace: u64,
    renew_deadline: u64,
    retry_period: u64,
    concurrency: u16,
    election: Election,
}

impl Args {
    fn parse() -> anyhow::Result<Args> {
        let mut args = Args {
            kubeconfig: None,
            identity: "kube-runtime-peer".into(),
            namespace: "default".into(),
            lease_duration: 15,
            grace: 5,
            renew_deadline: 10,
            retry_period: 2,
            concurrency: 0,
            election: Election::LeaseManager,
        };
        for arg in std::env::args().skip(1) {
            let (flag, value) = arg
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("expected --flag=value, got {arg}"))?;
            match flag {
                "--kubeconfig" => args.kubeconfig = Some(value.into()),
                "--identity" => args.identity = value.into(),
                "--namespace" => args.namespace = value.into(),
                "--lease-duration" => args.lease_duration = value.parse()?,
                "--grace" => args.grace = value.parse()?,
                "--concurrency" => args.concurrency = value.parse()?,
                "--renew-deadline" => args.renew_deadline = value.parse()?,
                "--retry-period" => args.retry_period = value.parse()?,
                "--election" => {
                    args.election = match value {
                        "lease-manager" => Election::LeaseManager,
                        "leasehold" => Election::Leasehold,
                        _ => anyhow::bail!("--election is lease-manager or leasehold, not {value}"),
                    }
                }
                _ => anyhow::bail!("unknown flag {flag}"),
            }
        }
        Ok(args)
    }
}

struct Context {
    client: Client,
    recorder: Recorder,
    configmaps: Store<ConfigMap>,
    pods: Store<Pod>,
}

#[derive(Debug)]
struct Error(kube::Error);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Error {}

impl From<kube::Error> for Error {
    fn from(err: kube::Error) -> Self {
        Error(err)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .json()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse()?;
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let user_agent = format!(
        "kube-runtime-peer/{} ({})",
        env!("CARGO_PKG_VERSION"),
        args.identity
    );
    config
        .headers
        .push((http::header::USER_AGENT, user_agent.parse()?));
    let client = Client::try_from(config.clone())?;
    match args.election {
        Election::LeaseManager => with_lease_manager(client, &args).await,
        Election::Leasehold => with_leasehold(client, config, &args).await,
    }
}

/// Resolves at SIGTERM or SIGINT.
async fn stopped() -> anyhow::Result<()> {
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    Ok(())
}

/// kube-lease-manager elects; the controller and its reflectors start when this replica
/// leads and are aborted when it stops leading.
async fn with_lease_manager(client: Client, args: &Args) -> anyhow::Result<()> {
    let leases = LeaseManagerBuilder::new(client.clone(), LEASE_NAME)
        .with_namespace(&args.namespace)
        .with_identity(&args.identity)
        .with_duration(args.lease_duration)
        .with_grace(args.grace)
        .build()
        .await?;
    let (mut leading, lease_task) = leases.watch().await;
    let stop = stopped();
    tokio::pin!(stop);
    let mut controller: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        let is_leader = *leading.borrow_and_update();
        if is_leader && controller.is_none() {
            info!("acquired the Lease: leading");
            controller = Some(tokio::spawn(run_controller(
                client.clone(),
                args.namespace.clone(),
                args.identity.clone(),
                args.concurrency,
            )));
        } else if !is_leader && let Some(task) = controller.take() {
            info!("lost the Lease: stopping the controller");
            task.abort();
        }
        tokio::select! {
            changed = leading.changed() => {
                if changed.is_err() {
                    anyhow::bail!("the lease manager stopped");
                }
            }
            _ = &mut stop => break,
        }
    }
    info!("shutting down: releasing the Lease");
    if let Some(task) = controller.take() {
        task.abort();
    }
    // Closing the channel makes the manager release the Lease and return.
    drop(leading);
    lease_task.await??;
    Ok(())
}

/// The controller, for as long as this replica leads (kube-lease-manager): its reflectors
/// start with it, so each term lists everything first.
async fn run_controller(client: Client, ns: String, identity: String, concurrency: u16) {
    let mrs: Api<MyResource> = Api::namespaced(client.clone(), &ns);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);

    // Shared streams, as the docs of `owns_shared_stream` show: each reflector is driven
    // here, its store read by the reconciler, its subscriber a trigger of the Controller.
    let (configmaps, cm_writer) = reflector::store_shared(1024);
    let cm_trigger = cm_writer.subscribe().expect("a shared store");
    let cm_stream = watcher(cms, configmaps_config())
        .default_backoff()
        .reflect_shared(cm_writer)
        .for_each(|_| futures::future::ready(()));
    let (pod_store, pod_writer) = reflector::store_shared(1024);
    let pod_trigger = pod_writer.subscribe().expect("a shared store");
    let pod_stream = watcher(pods, pods_config())
        .default_backoff()
        .reflect_shared(pod_writer)
        .for_each(|_| futures::future::ready(()));

    let controller = async {
        // Reconciles read these stores: start once they hold the full state.
        if configmaps.wait_until_ready().await.is_err()
            || pod_store.wait_until_ready().await.is_err()
        {
            return;
        }
        let context = Arc::new(Context {
            recorder: recorder(client.clone(), identity),
            client,
            configmaps,
            pods: pod_store,
        });
        Controller::new(mrs, watcher::Config::default())
            .with_config(kube::runtime::controller::Config::default().concurrency(concurrency))
            .owns_shared_stream(cm_trigger)
            .watches_shared_stream(pod_trigger, pod_owner)
            .run(reconcile, error_policy, context)
            .for_each(log_failure)
            .await;
    };
    tokio::select! {
        _ = cm_stream => {},
        _ = pod_stream => {},
        _ = controller => {},
    }
}

/// kube-leasehold elects; the reflectors run on every replica from the start, and each term
/// runs the controller on their warm stores with the term's fenced client.
async fn with_leasehold(client: Client, config: kube::Config, args: &Args) -> anyhow::Result<()> {
    let ns = &args.namespace;
    let mrs = Arc::new(Warm::start(
        Api::<MyResource>::namespaced(client.clone(), ns),
        watcher::Config::default(),
    ));
    let cms = Arc::new(Warm::start(
        Api::<ConfigMap>::namespaced(client.clone(), ns),
        configmaps_config(),
    ));
    let pods = Arc::new(Warm::start(
        Api::<Pod>::namespaced(client.clone(), ns),
        pods_config(),
    ));
    let timings = Timings::new(
        Duration::from_secs(args.lease_duration),
        Duration::from_secs(args.renew_deadline),
        Duration::from_secs(args.retry_period),
    )
    .map_err(anyhow::Error::msg)?;
    let fence = Fence::default();
    let fenced = fenced_client(&config, fence.clone())?;
    let leases = KubeLeases::new(Api::namespaced(client, ns));
    let campaign =
        Candidate::new(&args.identity, LEASE_NAME, ns.clone(), timings).spawn(leases, fence);
    let (identity, concurrency) = (args.identity.clone(), args.concurrency);
    let term = move |ended: CancellationToken| {
        let (mrs, cms, pods) = (mrs.clone(), cms.clone(), pods.clone());
        let (client, identity) = (fenced.clone(), identity.clone());
        async move {
            let ready = async {
                mrs.store().wait_until_ready().await.is_ok()
                    && cms.store().wait_until_ready().await.is_ok()
                    && pods.store().wait_until_ready().await.is_ok()
            };
            tokio::select! {
                _ = ended.cancelled() => return,
                ready = ready => if !ready { return },
            }
            let context = Arc::new(Context {
                recorder: recorder(client.clone(), identity),
                client,
                configmaps: cms.store(),
                pods: pods.store(),
            });
            Controller::for_shared_stream(mrs.trigger(), mrs.store())
                .with_config(kube::runtime::controller::Config::default().concurrency(concurrency))
                .owns_shared_stream(cms.trigger())
                .watches_shared_stream(pods.trigger(), pod_owner)
                .graceful_shutdown_on(async move { ended.cancelled().await })
                .run(reconcile, error_policy, context)
                .for_each(log_failure)
                .await;
        }
    };
    let stop = async {
        if let Err(err) = stopped().await {
            warn!(error = %err, "cannot wait for signals; stopping");
        }
    };
    campaign
        .run(Duration::from_secs(args.grace), stop, term)
        .await;
    Ok(())
}

fn configmaps_config() -> watcher::Config {
    watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY}"))
}

fn pods_config() -> watcher::Config {
    watcher::Config::default().labels(POD_LABEL)
}

fn recorder(client: Client, identity: String) -> Recorder {
    Recorder::new(
        client,
        Reporter {
            controller: "myresource-operator".into(),
            instance: Some(identity),
        },
    )
}

/// The MyResource a labelled Pod belongs to.
fn pod_owner(pod: Arc<Pod>) -> Option<ObjectRef<MyResource>> {
    let owner = pod.labels().get(POD_LABEL)?.clone();
    Some(ObjectRef::new(&owner).within(&pod.namespace()?))
}

fn log_failure<T, E: std::fmt::Display>(result: Result<T, E>) -> futures::future::Ready<()> {
    if let Err(err) = result {
        warn!(error = %err, "reconcile failed");
    }
    futures::future::ready(())
}

fn error_policy(_mr: Arc<MyResource>, _err: &Error, _ctx: Arc<Context>) -> Action {
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(mr: Arc<MyResource>, ctx: Arc<Context>) -> Result<Action, Error> {
    if mr.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ns = mr.namespace().unwrap_or_default();
    let name = mr.name_any();
    let desired = desired_configmap(&mr);
    let cms: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    let cached = ctx.configmaps.get(&ObjectRef::new(&name).within(&ns));
    let change = match cached {
        None => {
            let params = PostParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..Default::default()
            };
            cms.create(&params, &desired).await?;
            Some(("ConfigMapCreated", "created"))
        }
        Some(cm) if cm.data != desired.data || cm.labels() != desired.labels() => {
            cms.patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&desired),
            )
            .await?;
            Some(("ConfigMapUpdated", "updated"))
        }
        Some(_) => None,
    };
    if let Some((reason, verb)) = change {
        let event = Event {
            type_: EventType::Normal,
            reason: reason.into(),
            note: Some(format!("ConfigMap {name} {verb}")),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(err) = ctx.recorder.publish(&event, &mr.object_ref(&())).await {
            warn!(error = %err, "could not publish event");
        }
    }

    let mut counts = PodCounts::default();
    for pod in ctx.pods.state() {
        if pod.namespace().as_deref() == Some(&ns) && pod.labels().get(POD_LABEL) == Some(&name) {
            counts.total += 1;
            let ready = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
            if ready.is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True")) {
                counts.ready += 1;
            }
        }
    }
    let status = desired_status(&mr, counts);
    if mr.status.as_ref() != Some(&status) {
        let mrs: Api<MyResource> = Api::namespaced(ctx.client.clone(), &ns);
        // Server-side apply, as kube's controller example writes status.
        let patch = json!({
            "apiVersion": "trstringer.com/v1",
            "kind": "MyResource",
            "status": status,
        });
        mrs.patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await?;
    }
    Ok(Action::await_change())
}

fn desired_configmap(mr: &MyResource) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(mr.name_any()),
            namespace: mr.namespace(),
            labels: Some(BTreeMap::from([(
                MANAGED_BY_LABEL.to_string(),
                MANAGED_BY.to_string(),
            )])),
            owner_references: mr.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        data: Some(BTreeMap::from([
            ("message".to_string(), mr.spec.message.clone()),
            ("someValue".to_string(), mr.spec.some_value.to_string()),
        ])),
        ..Default::default()
    }
}

/// The Ready condition keeps its `lastTransitionTime` while its status stays the same, so
/// an unchanged world gives an equal status and no write.
fn desired_status(mr: &MyResource, pods: PodCounts) -> MyResourceStatus {
    let generation = mr.metadata.generation;
    let name = mr.name_any();
    let previous = mr
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
    let last_transition_time = match previous {
        Some(c) if c.status == "True" => c.last_transition_time.clone(),
        _ => Time(Timestamp::now()),
    };
    MyResourceStatus {
        observed_generation: generation,
        conditions: vec![Condition {
            type_: "Ready".into(),
            status: "True".into(),
            reason: "Reconciled".into(),
            message: format!(
                "ConfigMap {name} holds the spec of generation {}; {} of {} labelled Pods are Ready",
                generation.unwrap_or_default(),
                pods.ready,
                pods.total
            ),
            observed_generation: generation,
            last_transition_time,
        }],
        config_map_name: Some(name),
        pods: Some(pods),
    }
}

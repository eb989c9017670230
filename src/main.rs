use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Result;
use clap::Parser;
use kube::Api;
use kube_leasehold::fence::Fence;
use kube_leasehold::replicas::exit::{TERMINATION_LOG, announce_instance};
use kube_leasehold::replicas::{Replicas, this_pod};
use kube_leasehold::scaleout::ShardKey;
use kube_leasehold::{Candidate, KubeLeases};
use myresource_operator::cache;
use myresource_operator::control::controller::Controller;
use myresource_operator::control::echo::{EchoFilter, Echoes};
use myresource_operator::control::events::{Publisher, counted};
use myresource_operator::control::partition::Shards;
use myresource_operator::control::queue::Backoff;
use myresource_operator::control::reconcile::Context;
use myresource_operator::infra::access::Authoriser;
use myresource_operator::infra::cli::{Cli, Command, RunArgs};
use myresource_operator::infra::endpoints::{self, Health};
use myresource_operator::infra::metrics::{Metrics, State};
use myresource_operator::infra::{kubeclient, telemetry, tls};
use myresource_operator::resource;
use myresource_operator::scaleout::{self, ScaleOut};
use tokio::signal::unix::{SignalKind, signal};
use tracing::{error, info, warn};

/// After stopping for its Pod's deletion, the longest wait for the kubelet's SIGTERM (the
/// chart's termination grace period).
const SIGTERM_WITHIN: std::time::Duration = std::time::Duration::from_secs(30);

fn main() -> ExitCode {
    let cli = Cli::parse();
    let args = match cli.command {
        Command::Crd => {
            print!("{}", resource::crd_yaml());
            return ExitCode::SUCCESS;
        }
        Command::Run(args) => *args,
    };
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    runtime.block_on(async {
        let identity = args.identity();
        let telemetry = match telemetry::init(
            &args.log_level,
            args.log_format,
            telemetry::Identity { replica: &identity },
        ) {
            Ok(telemetry) => telemetry,
            Err(err) => {
                eprintln!("error: {err:#}");
                return ExitCode::FAILURE;
            }
        };
        let result = run(args, identity).await;
        if let Err(err) = &result {
            error!("{err:#}");
        }
        telemetry.shutdown();
        if result.is_ok() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    })
}

async fn run(args: RunArgs, identity: String) -> Result<()> {
    let timings = args.timings().map_err(anyhow::Error::msg)?;
    let config = kubeclient::config(args.kubeconfig.as_deref(), &identity).await?;
    let lease_namespace = args.lease_namespace(&config.default_namespace);
    let pod = this_pod::this_pod()
        .map_err(anyhow::Error::msg)?
        .map(|pod| this_pod::PodInfo {
            instance: announce_instance(TERMINATION_LOG)
                .inspect_err(|error| {
                    warn!(%error, "cannot name this process in its termination message: after a crash, followers wait for the lease")
                })
                .ok(),
            ..pod
        });
    let fence = Fence::default();
    let metrics = Arc::new(Metrics::new());
    let clients = kubeclient::clients(config, fence.clone(), metrics.clone())?;
    info!(
        %identity,
        namespaces = ?args.namespaces,
        lease = %format!("{lease_namespace}/{}", args.lease_name),
        ?timings,
        in_pod = pod.is_some(),
        shards = args.shards,
        shard_leases = args.shard_leases,
        workers_per_shard = args.workers_per_shard,
        "starting"
    );

    // Scale-out mode: one queue per shard Lease, keys routed by their MyResource's uid.
    let shard_key = (args.shard_leases > 0).then(|| ShardKey::new(args.shard_leases.into()));
    let queues = shard_key.map_or(args.shards.into(), |k| k.shards());

    // The event flow: caches → echo filter → controller.
    let controller = Arc::new(Controller::new(
        Shards::new(queues, Backoff::default()),
        metrics.clone(),
    ));
    let echoes = Arc::new(Echoes::default());
    let sink = Arc::new(EchoFilter::new(echoes.clone(), controller.clone()));
    let caches = cache::start(
        clients.reconcile.clone(),
        &args.namespaces,
        sink,
        &clients.reachability,
        shard_key.is_some(),
    );
    if let Some(key) = shard_key {
        controller.route_by_uid(key, caches.clone());
    }
    metrics.observe_state({
        let (controller, caches) = (controller.clone(), caches.clone());
        move || State {
            queues: controller.queue_state(),
            cached: caches.counts(),
            synced: caches.synced(),
        }
    });
    let scrape = Arc::new(endpoints::Metrics(metrics.clone()));
    let secure = args
        .metrics_secure
        .then(|| -> Result<endpoints::Secure> {
            // A self-signed certificate is trusted by no one anyway (scrapers skip its
            // verification, as with controller-runtime's): it names only localhost.
            let names = vec!["localhost".to_string()];
            let tls = tls::server_config(args.metrics_cert_dir.as_deref(), names)?;
            Ok(endpoints::Secure {
                tls: tokio_rustls::TlsAcceptor::from(Arc::new(tls)),
                access: Arc::new(Authoriser::new(clients.reviews.clone(), "/metrics")),
            })
        })
        .transpose()?;
    endpoints::serve_with(
        args.metrics_addr,
        "metrics",
        scrape,
        secure,
        endpoints::Limits::default(),
    )
    .await?;
    let ready = caches.clone();
    endpoints::serve(
        args.health_addr,
        "health",
        Arc::new(Health {
            ready: move || ready.synced(),
        }),
    )
    .await?;

    // The operator's own Pods, watched from the start so that they are known before this
    // replica campaigns.
    let replicas = pod.as_ref().map(|pod| {
        Replicas::start(
            Api::namespaced(clients.election.clone(), &pod.namespace),
            &pod.name,
            args.replica_selector.clone(),
            &clients.reachability,
        )
    });
    let mut terminate = signal(SignalKind::terminate())?;
    // Campaign only with synced caches: a leader must find every object in its stores (in
    // scale-out mode each shard waits for its own; here only the replica-wide ones).
    tokio::select! {
        _ = caches.wait_synced() => {}
        _ = terminate.recv() => return Ok(()),
        _ = tokio::signal::ctrl_c() => return Ok(()),
    }

    // Whether this replica stopped because its Pod is being deleted.
    let deleted = std::cell::Cell::new(false);
    let stop = async {
        let deleting = async {
            match &replicas {
                Some(replicas) => replicas.deleting().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = terminate.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
            _ = deleting => {
                info!("this replica's Pod is being deleted: stopping now, before the kubelet's SIGTERM");
                deleted.set(true);
            }
        }
    };
    match shard_key {
        None => {
            let ctx = Arc::new(Context {
                client: clients.reconcile.clone(),
                caches: caches.clone(),
                echoes,
                events: Publisher::new(clients.reconcile, "myresource-operator", &identity)
                    .on_fate(counted(&metrics)),
                fence: fence.clone(),
                shard: None,
            });
            let leases = KubeLeases::new(Api::namespaced(clients.election, &lease_namespace));
            let workers = args.workers_per_shard.into();
            let lease = args.lease_name.clone();
            Candidate::new(&identity, &args.lease_name, &lease_namespace, timings)
                .in_pod(pod)
                .replicas(replicas.clone())
                .observer(metrics)
                .spawn(leases, fence)
                .run(args.shutdown_grace, stop, move |cancel| {
                    let (controller, ctx, lease) = (controller.clone(), ctx.clone(), lease.clone());
                    async move { controller.lead(ctx, workers, None, &lease, cancel).await }
                })
                .await;
        }
        Some(key) => {
            scaleout::run(
                ScaleOut {
                    key,
                    standbys: args.shard_standbys.into(),
                    namespaces: args.namespaces.to_vec(),
                    identity: identity.clone(),
                    group: args.lease_name.clone(),
                    lease_namespace,
                    timings,
                    pod,
                    replicas: replicas.clone(),
                    clients,
                    caches,
                    controller,
                    echoes,
                    metrics,
                    workers_per_shard: args.workers_per_shard.into(),
                    grace: args.shutdown_grace,
                },
                stop,
            )
            .await?;
        }
    }
    if deleted.get() {
        // A container that exits before the kubelet has seen its Pod's deletion is
        // restarted (measured: a whole new process, LISTs included, at the moment of the
        // handover); the kubelet's SIGTERM says it has.
        info!("stopped; exiting at the kubelet's SIGTERM");
        tokio::select! {
            _ = terminate.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
            _ = tokio::time::sleep(SIGTERM_WITHIN) => {}
        }
    }
    info!("stopped");
    Ok(())
}

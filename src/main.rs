use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Result;
use clap::Parser;
use kube::Api;
use myresource_operator::cli::{Cli, Command, RunArgs};
use myresource_operator::controller::{Controller, StateCollector};
use myresource_operator::election::{Driver, Elector, Role};
use myresource_operator::endpoints::{self, Health};
use myresource_operator::events::Publisher;
use myresource_operator::fence::Fence;
use myresource_operator::queue::Backoff;
use myresource_operator::reconcile::Context;
use myresource_operator::shard::Shards;
use myresource_operator::{cache, kubeclient, metrics, resource, telemetry};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

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
    let client = kubeclient::client(config.clone())?;
    // The election's client must not retry 429/503/504 on its own: a renew may never hang
    // past the renew deadline.
    let mut election_config = config;
    election_config.default_retry = false;
    let election_client = kubeclient::client(election_config)?;
    info!(
        %identity,
        namespaces = ?args.namespaces,
        lease = %format!("{lease_namespace}/{}", args.lease_name),
        ?timings,
        shards = args.shards,
        workers_per_shard = args.workers_per_shard,
        "starting"
    );

    let controller = Arc::new(Controller::new(Shards::new(
        args.shards.into(),
        Backoff::default(),
    )));
    let caches = cache::start(client.clone(), &args.namespaces, controller.clone());
    metrics::get().init_series();
    metrics::get().register_collector(Box::new(StateCollector {
        controller: controller.clone(),
        caches: caches.clone(),
    }));
    endpoints::serve(args.metrics_addr, "metrics", Arc::new(endpoints::Metrics)).await?;
    let ready = caches.clone();
    endpoints::serve(
        args.health_addr,
        "health",
        Arc::new(Health {
            ready: move || ready.synced(),
        }),
    )
    .await?;

    let fence = Fence::closed();
    let ctx = Arc::new(Context {
        client: client.clone(),
        caches: caches.clone(),
        events: Publisher::new(client, "myresource-operator", &identity),
        fence: fence.clone(),
    });

    let mut terminate = signal(SignalKind::terminate())?;
    // Campaign only with synced caches: a leader must find every object in its stores.
    tokio::select! {
        _ = caches.wait_synced() => {}
        _ = terminate.recv() => return Ok(()),
        _ = tokio::signal::ctrl_c() => return Ok(()),
    }

    let (role_tx, mut role) = watch::channel(Role::Follower);
    let stop_election = CancellationToken::new();
    let election = tokio::spawn(
        Driver {
            api: Api::namespaced(election_client, &lease_namespace),
            elector: Elector::new(&identity, &args.lease_name, &lease_namespace, timings),
            fence: fence.clone(),
            role: role_tx,
        }
        .run(stop_election.clone()),
    );

    let mut term: Option<(CancellationToken, tokio::task::JoinHandle<()>)> = None;
    loop {
        tokio::select! {
            changed = role.changed() => {
                if changed.is_err() {
                    break;
                }
                let now = *role.borrow_and_update();
                match (now, term.is_some()) {
                    (Role::Leader, false) => {
                        let cancel = CancellationToken::new();
                        let (controller, ctx) = (controller.clone(), ctx.clone());
                        let workers = args.workers_per_shard.into();
                        let token = cancel.clone();
                        term = Some((cancel, tokio::spawn(async move { controller.lead(ctx, workers, token).await })));
                    }
                    (Role::Follower, true) => {
                        let (cancel, handle) = term.take().expect("checked");
                        cancel.cancel();
                        let _ = handle.await;
                    }
                    _ => {}
                }
            }
            _ = terminate.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }

    info!("shutting down: stopping workers, then releasing the Lease");
    fence.revoke();
    if let Some((cancel, handle)) = term.take() {
        cancel.cancel();
        if tokio::time::timeout(args.shutdown_grace, handle)
            .await
            .is_err()
        {
            warn!(grace = ?args.shutdown_grace, "workers did not stop within the grace period");
        }
    }
    stop_election.cancel();
    election.await?;
    info!("stopped");
    Ok(())
}

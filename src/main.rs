use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context as _, Result};
use clap::Parser;
use kube::Client;
use kube::runtime::events::{Recorder, Reporter};
use myresource_operator::cli::{Cli, Command, RunArgs};
use myresource_operator::controller::Controller;
use myresource_operator::endpoints::{self, Health};
use myresource_operator::fence::Fence;
use myresource_operator::queue::Backoff;
use myresource_operator::reconcile::Context;
use myresource_operator::shard::Shards;
use myresource_operator::{cache, resource, telemetry};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Crd => {
            print!("{}", resource::crd_yaml());
            ExitCode::SUCCESS
        }
        Command::Run(args) => {
            if let Err(err) = telemetry::init(&args.log_level, args.log_format) {
                eprintln!("error: {err:#}");
                return ExitCode::FAILURE;
            }
            let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
            match runtime.block_on(run(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => {
                    error!("{err:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

async fn client(args: &RunArgs, identity: &str) -> Result<Client> {
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await.context(
            "no Kubernetes configuration (flag, KUBECONFIG, ~/.kube/config or in-cluster)",
        )?,
    };
    let user_agent = format!(
        "myresource-operator/{} ({identity})",
        env!("CARGO_PKG_VERSION")
    );
    config.headers.push((
        http::header::USER_AGENT,
        user_agent
            .parse()
            .context("identity is not a valid header value")?,
    ));
    Ok(Client::try_from(config)?)
}

async fn run(args: RunArgs) -> Result<()> {
    let identity = args.identity();
    let client = client(&args, &identity).await?;
    info!(%identity, namespaces = ?args.namespaces, shards = args.shards, workers_per_shard = args.workers_per_shard, "starting");

    let controller = Arc::new(Controller::new(Shards::new(
        args.shards.into(),
        Backoff::default(),
    )));
    let caches = cache::start(client.clone(), &args.namespaces, controller.clone());
    let ready = caches.clone();
    endpoints::serve(
        args.health_addr,
        "health",
        Arc::new(Health {
            ready: move || ready.synced(),
        }),
    )
    .await?;

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "myresource-operator".into(),
            instance: Some(identity.clone()),
        },
    );
    let ctx = Arc::new(Context {
        client,
        caches: caches.clone(),
        recorder,
        fence: Fence::unfenced(),
    });
    caches.wait_synced().await;

    let cancel = CancellationToken::new();
    let term = {
        let (controller, cancel) = (controller.clone(), cancel.clone());
        tokio::spawn(async move {
            controller
                .lead(ctx, args.workers_per_shard.into(), cancel)
                .await
        })
    };
    shutdown_signal().await?;
    info!("shutting down");
    cancel.cancel();
    term.await?;
    Ok(())
}

async fn shutdown_signal() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

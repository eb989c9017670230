//! The kube-leasehold crate as a kube-rs user runs it: its examples, built from
//! `leasehold/examples/`, against the real control plane.
//!
//! - `only_while_leading`: one process leads and writes through the fenced client;
//! - `kube_runtime_controller`: two replicas of kube-runtime's own `Controller` under a
//!   term with warm stores; the leader reconciles; after a SIGKILL of the leader the other
//!   takes over (by expiry: outside a Pod there is no crash proof) and reconciles what was
//!   created meanwhile, from its warm store, without rewriting what needed nothing. (The
//!   fencing of these writes is the operator's: its tests audit it, on the same crate.)

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Result, bail};
use e2e::harness::{self, TestEnv};
use e2e::operator::built;
use e2e::process::{self, Lifetime, Process};
use e2e::wait::poll;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, ResourceExt};

/// Starts the example `identity` with its log in the test binary's log folder.
fn start(env: &TestEnv, example: &Path, identity: &str, kubeconfig: &Path) -> Result<Process> {
    let mut command = Command::new(example);
    command
        .env("IDENTITY", identity)
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "info");
    let dir = env.log_dir();
    std::fs::create_dir_all(&dir)?;
    let log = dir.join(format!("{}-{identity}.log", env.namespace));
    process::spawn(identity, command, &log, Lifetime::TiedToThisProcess)
}

/// The Lease's holder, `None` when absent or released.
async fn holder(env: &TestEnv, name: &str) -> Result<Option<String>> {
    let holder = e2e::lease::holder_of(&env.client, &env.namespace, name).await?;
    Ok(holder.filter(|h| !h.is_empty()))
}

#[tokio::test]
async fn the_minimal_example_writes_only_while_leading() -> Result<()> {
    let env = harness::setup("lib-min").await?;
    let kubeconfig = env.kubeconfig_in_namespace()?;
    let example = built(&[
        "--package",
        "kube-leasehold",
        "--example",
        "only_while_leading",
    ])?;
    let mut a = start(&env, &example, "a", &kubeconfig)?;
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    poll(
        "the leader's ConfigMap",
        Duration::from_secs(30),
        || async {
            let leader = cms
                .get_opt("leader")
                .await?
                .and_then(|cm| cm.data?.remove("leader"));
            Ok((leader.as_deref() == Some("a")).then_some(()))
        },
    )
    .await?;
    a.ensure_running()?;
    // SIGTERM: the example stops at Ctrl-C's signal only; SIGINT is its stop.
    a.signal(libc::SIGINT);
    if !a.wait_for_exit(Duration::from_secs(15)) {
        bail!("the example did not stop on SIGINT:\n{}", a.log_tail(20));
    }
    // It released the Lease on the way out.
    let released = holder(&env, "only-while-leading").await?;
    if released.is_some() {
        bail!("the Lease still names {released:?} after a clean stop");
    }
    Ok(())
}

fn watched(name: &str, keys: usize) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some([("leasehold-example".to_string(), "watched".to_string())].into()),
            ..Default::default()
        },
        data: Some(
            (0..keys)
                .map(|i| (format!("k{i}"), i.to_string()))
                .collect(),
        ),
        ..Default::default()
    }
}

async fn annotated(cms: &Api<ConfigMap>, name: &str, keys: usize) -> Result<()> {
    let what = format!("{name} annotated with {keys} keys");
    poll(&what, Duration::from_secs(30), || async {
        let cm = cms.get(name).await?;
        let seen = cm.annotations().get("leasehold-example/data-keys").cloned();
        Ok((seen == Some(keys.to_string())).then_some(()))
    })
    .await
}

#[tokio::test]
async fn kube_runtimes_controller_takes_over_under_a_term() -> Result<()> {
    let env = harness::setup("lib-ctl").await?;
    let kubeconfig = env.kubeconfig_in_namespace()?;
    let example = built(&[
        "--package",
        "kube-leasehold",
        "--example",
        "kube_runtime_controller",
    ])?;
    let mut replicas = vec![
        start(&env, &example, "a", &kubeconfig)?,
        start(&env, &example, "b", &kubeconfig)?,
    ];
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    cms.create(&PostParams::default(), &watched("one", 2))
        .await?;
    annotated(&cms, "one", 2).await?;
    let lease = "kube-runtime-controller-example";
    let leader = holder(&env, lease).await?.unwrap_or_default();
    let Some(index) = replicas.iter().position(|p| p.name == leader) else {
        bail!("the Lease names {leader:?}, not a replica");
    };
    let mut dead = replicas.remove(index);
    dead.signal(libc::SIGKILL);
    dead.wait_for_exit(Duration::from_secs(5));
    cms.create(&PostParams::default(), &watched("two", 3))
        .await?;
    annotated(&cms, "two", 3).await?;
    let next = holder(&env, lease).await?.unwrap_or_default();
    let survivor = &mut replicas[0];
    if next != survivor.name {
        bail!(
            "after the kill the Lease names {next:?}, not {}",
            survivor.name
        );
    }
    survivor.ensure_running()?;
    // The survivor's term found the store warm: it reconciled `two`, and `one` needed no write.
    let log = std::fs::read_to_string(&survivor.log)?;
    if log.contains("annotated one") {
        bail!("the new leader rewrote an object that needed nothing:\n{log}");
    }
    Ok(())
}

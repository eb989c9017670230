//! The operator's namespace scope from `WATCH_NAMESPACES`: empty means every namespace (what
//! a template renders for an empty list), and a name that is not a namespace name stops the
//! operator at start with a message naming it.
//!
//! A test binary of its own: an operator that watches every namespace would reconcile the
//! other tests' objects next to their own replicas.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use e2e::harness;
use e2e::operator::{Operator, binary};
use e2e::wait::poll;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use myresource_operator::resource::MyResource;

#[tokio::test]
async fn an_empty_watch_namespaces_reconciles_every_namespace() -> Result<()> {
    let env = harness::setup("allns").await?;
    let mut config = env.operator_config("op", &[]);
    config.namespaces.clear();
    config.env.push(("WATCH_NAMESPACES".into(), String::new()));
    let mut op = Operator::start(config)?;
    op.wait_ready().await?;

    env.apply_tutorial_example()?;
    let mrs: Api<MyResource> = Api::namespaced(env.client.clone(), &env.namespace);
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    poll(
        "the example's ConfigMap and Ready status",
        Duration::from_secs(30),
        || async {
            let ready = mrs
                .get("example-myresource")
                .await?
                .status
                .is_some_and(|s| {
                    s.conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
                });
            let configmap = cms.get_opt("example-myresource").await?.is_some();
            Ok((ready && configmap).then_some(()))
        },
    )
    .await?;
    op.process.ensure_running()?;
    Ok(())
}

#[test]
fn an_invalid_namespace_name_stops_the_operator_with_a_message() -> Result<()> {
    let shared = harness::shared()?;
    // A kubeconfig that works and free addresses: nothing else can make it stop.
    let mut child = Command::new(binary()?)
        .arg("run")
        .arg(format!("--kubeconfig={}", shared.kubeconfig.display()))
        .args(["--health-addr=127.0.0.1:0", "--metrics-addr=127.0.0.1:0"])
        .env("WATCH_NAMESPACES", "default,Not_A_Namespace")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            child.kill()?;
            child.wait()?;
            bail!("the operator was still running 20 s after start");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("piped")
        .read_to_string(&mut stderr)?;
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("\"Not_A_Namespace\"") && stderr.contains("WATCH_NAMESPACES"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    Ok(())
}

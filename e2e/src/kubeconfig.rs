//! Kubeconfig files: written for a user with a client certificate or pointed at a proxy,
//! and read into a client.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Result;
use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::json;

/// A client from a kubeconfig file.
pub async fn client_for(kubeconfig: &Path) -> Result<Client> {
    Ok(Client::try_from(config_for(kubeconfig).await?)?)
}

/// The client configuration of a kubeconfig file, for callers that adjust it (user agent …).
pub async fn config_for(kubeconfig: &Path) -> Result<kube::Config> {
    let kubeconfig = Kubeconfig::read_from(kubeconfig)?;
    Ok(kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?)
}

/// Writes to `path` a copy of `kubeconfig` whose server is `addr` (a proxy in front of the
/// API server, such as [`crate::proxy::Proxy`]).
pub fn write_kubeconfig_via(kubeconfig: &Path, addr: SocketAddr, path: &Path) -> Result<()> {
    let mut doc: serde_json::Value = serde_json::from_slice(&std::fs::read(kubeconfig)?)?;
    doc["clusters"][0]["cluster"]["server"] = format!("https://{addr}").into();
    std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
    Ok(())
}

/// Writes a kubeconfig for `user` with a client certificate.
pub fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca: &Path,
    user: &str,
    cert: &crate::pki::ClientCert,
) -> Result<()> {
    // JSON is YAML: kubectl and kube-rs read it as a kubeconfig.
    let doc = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": user, "user": {"client-certificate": cert.cert, "client-key": cert.key}}],
        "contexts": [{"name": format!("{user}@local"), "context": {"cluster": "local", "user": user}}],
        "current-context": format!("{user}@local"),
    });
    std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
    Ok(())
}

//! The metrics endpoint's TLS: a certificate mounted from a Secret (`tls.crt` and `tls.key`
//! in `--metrics-cert-dir`, as cert-manager writes them), reloaded when the files change,
//! or else a self-signed one made at start.
//!
//! Invariants: a mounted pair that cannot be read or does not match at start stops the
//! operator with a message (a silent fall-back to a self-signed certificate would hide the
//! mistake); a rotation that cannot be read later keeps the last good pair and says so in
//! the log; only TLS 1.2 and 1.3, with rustls's safe defaults.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use rustls::crypto::ring::sign::any_supported_type;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tracing::{info, warn};

/// How often a mounted pair is checked for a rotation.
const RELOAD_EVERY: Duration = Duration::from_secs(10);

/// The server configuration for `names` (the self-signed certificate's subject
/// alternative names), or the pair in `cert_dir`; spawns the reloader of a mounted pair.
pub fn server_config(cert_dir: Option<&Path>, names: Vec<String>) -> Result<rustls::ServerConfig> {
    let resolver = match cert_dir {
        Some(dir) => {
            let pair = Pair::new(dir);
            let key = pair.load().with_context(|| {
                format!("loading the metrics certificate from {}", dir.display())
            })?;
            info!(dir = %dir.display(), "metrics endpoint: serving the mounted certificate");
            let resolver = Arc::new(Reloading {
                current: RwLock::new(Arc::new(key)),
            });
            tokio::spawn(reload(pair, resolver.clone()));
            resolver
        }
        None => {
            let key = self_signed(names)?;
            info!("metrics endpoint: serving a self-signed certificate made at start");
            Arc::new(Reloading {
                current: RwLock::new(Arc::new(key)),
            })
        }
    };
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_cert_resolver(resolver);
    Ok(config)
}

/// A self-signed certificate for `names`.
fn self_signed(names: Vec<String>) -> Result<CertifiedKey> {
    let made =
        rcgen::generate_simple_self_signed(names).context("making a self-signed certificate")?;
    let key = PrivateKeyDer::try_from(made.signing_key.serialize_der())
        .map_err(|e| anyhow::anyhow!("the self-signed key: {e}"))?;
    certified(vec![made.cert.der().clone()], key)
}

fn certified(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<CertifiedKey> {
    let signing = any_supported_type(&key).context("an unsupported private key")?;
    let certified = CertifiedKey::new(certs, signing);
    certified
        .keys_match()
        .context("the certificate does not match the private key")?;
    Ok(certified)
}

/// `tls.crt` and `tls.key` in a folder.
struct Pair {
    cert: PathBuf,
    key: PathBuf,
}

impl Pair {
    fn new(dir: &Path) -> Pair {
        Pair {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
        }
    }

    fn load(&self) -> Result<CertifiedKey> {
        let certs = CertificateDer::pem_file_iter(&self.cert)
            .with_context(|| format!("reading {}", self.cert.display()))?
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("parsing {}", self.cert.display()))?;
        anyhow::ensure!(
            !certs.is_empty(),
            "no certificate in {}",
            self.cert.display()
        );
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .with_context(|| format!("reading {}", self.key.display()))?;
        certified(certs, key)
    }

    /// When either file last changed (a Secret volume swaps a symlink: both change).
    fn changed(&self) -> Option<(SystemTime, SystemTime)> {
        let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        Some((modified(&self.cert)?, modified(&self.key)?))
    }
}

/// The pair served, swapped whole on a rotation.
#[derive(Debug)]
struct Reloading {
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().expect("certificate lock").clone())
    }
}

/// Checks the mounted pair every [`RELOAD_EVERY`]; serves a changed pair once it loads.
async fn reload(pair: Pair, resolver: Arc<Reloading>) {
    let mut seen = pair.changed();
    loop {
        tokio::time::sleep(RELOAD_EVERY).await;
        let now = pair.changed();
        if now == seen {
            continue;
        }
        match pair.load() {
            Ok(key) => {
                *resolver.current.write().expect("certificate lock") = Arc::new(key);
                seen = now;
                info!("metrics endpoint: serving the rotated certificate");
            }
            Err(err) => {
                warn!(error = %format!("{err:#}"), "metrics endpoint: the rotated certificate does not load; serving the last good one")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_mounted_pair_is_served_and_a_broken_one_refused() {
        let dir = std::env::temp_dir().join(format!("tls-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        std::fs::write(dir.join("tls.crt"), made.cert.pem()).unwrap();
        std::fs::write(dir.join("tls.key"), made.signing_key.serialize_pem()).unwrap();
        assert!(server_config(Some(&dir), vec![]).is_ok());
        let other = rcgen::generate_simple_self_signed(vec!["other".into()]).unwrap();
        std::fs::write(dir.join("tls.key"), other.signing_key.serialize_pem()).unwrap();
        let err = format!("{:#}", server_config(Some(&dir), vec![]).unwrap_err());
        assert!(err.contains("does not match"), "{err}");
        std::fs::remove_file(dir.join("tls.key")).unwrap();
        let err = format!("{:#}", server_config(Some(&dir), vec![]).unwrap_err());
        assert!(err.contains("tls.key"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(server_config(None, vec!["localhost".into()]).is_ok());
    }
}

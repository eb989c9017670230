//! The operator as a real process: built once per test binary with cargo, started with its
//! own kubeconfig, ports and log file, tied to the test process's lifetime.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::lease::Timings;
use crate::ports::free_port;
use crate::process::{Lifetime, Process, spawn};
use crate::wait::poll;

/// The workspace root (the e2e crate lives directly under it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e lives in the workspace")
        .to_path_buf()
}

/// Builds the operator binary (debug profile) once per process and returns its path.
pub fn binary() -> Result<PathBuf> {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BINARY
        .get_or_init(|| built_with("dev").map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!("building the operator: {e}"))
}

/// Builds the operator binary with a cargo profile (`release` for benchmarks, `profiling`
/// for perf) and returns its path.
pub fn built_with(profile: &str) -> Result<PathBuf> {
    built(&[
        "--package",
        "myresource-operator",
        "--bin",
        "myresource-operator",
        "--profile",
        profile,
    ])
}

/// Builds one executable of the workspace (`args`: which, e.g. `--example NAME`) and
/// returns its path.
pub fn built(args: &[&str]) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(workspace_root())
        .args(["build", "--quiet", "--message-format=json"])
        .args(args)
        .output()
        .context("running cargo build")?;
    if !out.status.success() {
        bail!(
            "cargo build failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find_map(|msg| msg["executable"].as_str().map(PathBuf::from))
        .ok_or_else(|| anyhow!("cargo build reported no executable"))
}

/// How to start one replica.
#[derive(Debug, Clone)]
pub struct OperatorConfig {
    pub identity: String,
    pub kubeconfig: PathBuf,
    /// Namespaces to watch (empty: all).
    pub namespaces: Vec<String>,
    /// Folder for the log file.
    pub log_dir: PathBuf,
    /// More flags, e.g. lease timings.
    pub extra_args: Vec<String>,
    /// The binary to run; the debug build when `None`.
    pub binary: Option<PathBuf>,
    /// Extra environment (OTEL_* …).
    pub env: Vec<(String, String)>,
}

impl OperatorConfig {
    /// A replica that watches `namespace` only and keeps its Lease there, with Lease
    /// `timings`: the debug build, no extra environment. The test harness, `cargo xtask
    /// chaos` and `cargo xtask bench` start from this and adjust what they need.
    pub fn in_namespace(
        identity: impl Into<String>,
        kubeconfig: PathBuf,
        namespace: &str,
        log_dir: PathBuf,
        timings: &Timings,
    ) -> OperatorConfig {
        // Local use: metrics over plain HTTP (a test that wants them secured says so).
        let mut extra_args = vec![
            format!("--lease-namespace={namespace}"),
            "--metrics-secure=false".to_string(),
        ];
        extra_args.extend(timings.args());
        OperatorConfig {
            identity: identity.into(),
            kubeconfig,
            namespaces: vec![namespace.into()],
            log_dir,
            extra_args,
            binary: None,
            env: Vec::new(),
        }
    }

    /// Adds the flags `args`; one that sets a flag already there replaces it
    /// (`--retry-period=2s` replaces `--retry-period=1s`).
    pub fn with_args(mut self, args: &[&str]) -> OperatorConfig {
        let flag = |arg: &str| arg.split('=').next().unwrap_or_default().to_string();
        self.extra_args
            .retain(|have| !args.iter().any(|new| flag(new) == flag(have)));
        self.extra_args.extend(args.iter().map(|s| s.to_string()));
        self
    }
}

/// A running replica.
#[derive(Debug)]
pub struct Operator {
    pub config: OperatorConfig,
    pub health: SocketAddr,
    pub metrics: SocketAddr,
    pub process: Process,
}

impl Operator {
    /// Starts a replica (does not wait for readiness; see [`Operator::wait_ready`]).
    pub fn start(config: OperatorConfig) -> Result<Operator> {
        let health: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        std::fs::create_dir_all(&config.log_dir)?;
        let log = config.log_dir.join(format!("{}.log", config.identity));
        let binary = match &config.binary {
            Some(path) => path.clone(),
            None => binary()?,
        };
        let mut cmd = Command::new(binary);
        cmd.arg("run")
            .arg(format!("--kubeconfig={}", config.kubeconfig.display()))
            .arg(format!("--identity={}", config.identity))
            .arg(format!("--health-addr={health}"))
            .arg(format!("--metrics-addr={metrics}"))
            .arg("--log-format=json")
            .args(&config.extra_args)
            .env_remove("RUST_LOG")
            .env("LOG_LEVEL", "info,myresource_operator=debug")
            .envs(config.env.iter().map(|(k, v)| (k, v)));
        if !config.namespaces.is_empty() {
            cmd.arg(format!("--namespaces={}", config.namespaces.join(",")));
        }
        let process = spawn(&config.identity, cmd, &log, Lifetime::TiedToThisProcess)?;
        Ok(Operator {
            config,
            health,
            metrics,
            process,
        })
    }

    /// Waits up to 30 s until `/readyz` answers 200 (caches synced).
    pub async fn wait_ready(&mut self) -> Result<()> {
        self.wait_ready_within(Duration::from_secs(30)).await
    }

    /// Waits up to `limit` until `/readyz` answers 200: a replica with many objects to list
    /// needs longer than [`Operator::wait_ready`] gives.
    pub async fn wait_ready_within(&mut self, limit: Duration) -> Result<()> {
        let addr = self.health;
        let deadline = std::time::Instant::now() + limit;
        loop {
            if http_get(addr, "/readyz")
                .await
                .is_ok_and(|(code, _)| code == 200)
            {
                return Ok(());
            }
            self.process.ensure_running()?;
            if std::time::Instant::now() > deadline {
                bail!(
                    "{} not ready after {limit:?}:\n{}",
                    self.config.identity,
                    self.process.log_tail(20)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.process.log).unwrap_or_default()
    }

    /// The log's JSON lines.
    pub fn log_lines(&self) -> Vec<serde_json::Value> {
        self.log()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The user agent this replica sends (and the audit log records).
    pub fn user_agent(&self) -> String {
        format!("myresource-operator/0.1.0 ({})", self.config.identity)
    }

    /// Resident memory in bytes (VmRSS).
    pub fn rss_bytes(&self) -> Option<u64> {
        crate::process::rss_bytes(self.process.pid)
    }

    /// SIGTERM, SIGKILL after 10 s; returns once it has exited.
    pub fn stop(&mut self) {
        self.process.stop(Duration::from_secs(10));
    }

    /// SIGKILL; returns once it has exited.
    pub fn kill(&mut self) {
        self.process.signal(libc::SIGKILL);
        self.process.wait_for_exit(Duration::from_secs(10));
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.process.signal(libc::SIGCONT);
        self.process.signal(libc::SIGKILL);
        self.process.wait_for_exit(Duration::from_secs(5));
    }
}

/// A plain HTTP/1.0 GET on loopback: (status code, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    http_get_accept(addr, path, "*/*").await
}

/// [`http_get`] with an Accept header.
pub async fn http_get_accept(addr: SocketAddr, path: &str, accept: &str) -> Result<(u16, String)> {
    let request = async {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        exchange(stream, &get_request(addr, path, accept, None)).await
    };
    parse_response(&tokio::time::timeout(Duration::from_secs(5), request).await??)
}

/// A GET over HTTPS of `path` on `addr`, with `Authorization: Bearer <token>` if given;
/// the server's certificate verified against `trusted` (PEM) for the name `localhost`, or
/// not at all without it (a self-signed certificate made at start, which Prometheus is
/// told to accept the same way).
pub async fn https_get(
    addr: SocketAddr,
    path: &str,
    trusted: Option<&str>,
    token: Option<&str>,
) -> Result<(u16, String)> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let config = match trusted {
        Some(trusted) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(trusted.as_bytes()) {
                roots.add(cert?)?;
            }
            builder.with_root_certificates(roots)
        }
        None => builder
            .dangerous()
            .with_custom_certificate_verifier(std::sync::Arc::new(Unverified(provider))),
    }
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let request = async {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        let stream = connector
            .connect(ServerName::try_from("localhost")?, stream)
            .await?;
        exchange(stream, &get_request(addr, path, "*/*", token)).await
    };
    parse_response(&tokio::time::timeout(Duration::from_secs(10), request).await??)
}

/// The operator's metrics at `addr`: over HTTPS with `token` (the default), or over plain
/// HTTP when the TLS handshake fails (a release from before metrics were secured, in a
/// mixed-version run).
pub async fn metrics_of(addr: SocketAddr, token: &str) -> Result<(u16, String)> {
    match https_get(addr, "/metrics", None, Some(token)).await {
        Ok(answer) => Ok(answer),
        Err(secure) => http_get(addr, "/metrics")
            .await
            .with_context(|| format!("neither HTTPS ({secure:#}) nor HTTP")),
    }
}

/// Accepts any server certificate (but still checks its signatures over the handshake).
#[derive(Debug)]
struct Unverified(std::sync::Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn get_request(addr: SocketAddr, path: &str, accept: &str, token: Option<&str>) -> String {
    let authorization = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept: {accept}\r\n{authorization}\r\n")
}

/// Sends `request` and reads the answer until the server closes the connection.
async fn exchange<S>(mut stream: S, request: &str) -> Result<String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    // A TLS server may close without a close_notify once it answered HTTP/1.0.
    if let Err(err) = stream.read_to_end(&mut response).await
        && (response.is_empty() || err.kind() != std::io::ErrorKind::UnexpectedEof)
    {
        return Err(err.into());
    }
    Ok(String::from_utf8_lossy(&response).into_owned())
}

/// The status and body of an HTTP/1 response.
fn parse_response(response: &str) -> Result<(u16, String)> {
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("no HTTP status in {response:?}"))?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// Polls the operator log until a JSON line satisfies `pred`.
pub async fn wait_for_log(
    op: &Operator,
    what: &str,
    limit: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> Result<serde_json::Value> {
    poll(what, limit, || {
        let found = op.log_lines().into_iter().find(|l| pred(l));
        async move { Ok(found) }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::TEST_TIMINGS;

    #[test]
    fn a_replica_in_a_namespace_with_a_flag_replaced() {
        let config = OperatorConfig::in_namespace(
            "ns-a",
            PathBuf::from("admin.kubeconfig"),
            "ns",
            PathBuf::from("logs"),
            &TEST_TIMINGS,
        )
        .with_args(&["--retry-period=2s", "--namespaces=other"]);
        assert_eq!(config.identity, "ns-a");
        assert_eq!(config.namespaces, ["ns"]);
        assert_eq!(
            config.extra_args,
            [
                "--lease-namespace=ns",
                "--metrics-secure=false",
                "--lease-duration=4s",
                "--renew-deadline=3s",
                "--retry-period=2s",
                "--namespaces=other",
            ]
        );
        assert_eq!(config.binary, None);
    }
}

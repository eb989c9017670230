//! Command line: every flag of `run` can also come from an environment variable.

use std::net::SocketAddr;
use std::ops::Deref;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::infra::telemetry::LogFormat;

#[derive(Parser, Debug)]
#[command(
    name = "myresource-operator",
    version,
    about = "A high-availability Kubernetes operator for MyResource (trstringer.com/v1)"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Print the MyResource CustomResourceDefinition (YAML) and exit.
    Crd,
    /// Run the operator.
    Run(Box<RunArgs>),
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Kubeconfig file. Without it: $KUBECONFIG, ~/.kube/config, then the in-cluster
    /// service account.
    #[arg(long, env = "MYRESOURCE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Namespaces to watch, comma-separated. Empty (the default, or an empty value) watches
    /// all namespaces; empty entries are ignored.
    #[arg(
        long = "namespaces",
        env = "WATCH_NAMESPACES",
        value_name = "NAMESPACES",
        default_value = "",
        hide_default_value = true,
        value_parser = parse_namespaces
    )]
    pub namespaces: Namespaces,

    /// This replica's name in Events and the user agent. Default: $POD_NAME, else the
    /// hostname plus a random suffix.
    #[arg(long, env = "OPERATOR_IDENTITY")]
    pub identity: Option<String>,

    /// In a Pod: the label selector of this operator's Pods in its namespace (the chart
    /// sets its selector labels). A releasing leader names a successor among them, and
    /// followers watch the holder's among them for a crash. Default: this Pod's own labels
    /// without `pod-template-hash` and the like.
    #[arg(long, env = "REPLICA_SELECTOR")]
    pub replica_selector: Option<String>,

    /// Where /metrics is served.
    #[arg(long, env = "METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,

    /// Serve /metrics over TLS, to scrapers whose bearer token the API server
    /// authenticates and whose user may `get` the non-resource URL /metrics (a
    /// TokenReview and a SubjectAccessReview, cached briefly). Needs `create` on
    /// tokenreviews and subjectaccessreviews. `--metrics-secure=false`: plain HTTP to
    /// anyone, for local use.
    #[arg(long, env = "METRICS_SECURE", default_value_t = true, num_args = 0..=1,
          default_missing_value = "true", action = clap::ArgAction::Set)]
    pub metrics_secure: bool,

    /// With --metrics-secure: the folder holding `tls.crt` and `tls.key` (a mounted
    /// Secret, e.g. cert-manager's; reloaded when they change). Default: a self-signed
    /// certificate made at start.
    #[arg(long, env = "METRICS_CERT_DIR", requires = "metrics_secure")]
    pub metrics_cert_dir: Option<std::path::PathBuf>,

    /// Where /healthz and /readyz are served.
    #[arg(long, env = "HEALTH_ADDR", default_value = "0.0.0.0:8081")]
    pub health_addr: SocketAddr,

    /// Number of shards: each has its own queue and workers; a key's shard is a stable hash
    /// of namespace/name. Ignored in scale-out mode, where each shard Lease has one queue.
    #[arg(long, env = "SHARDS", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub shards: u16,

    /// Workers per shard (concurrent reconciles per shard; one key never runs twice at once).
    #[arg(long, env = "WORKERS_PER_SHARD", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub workers_per_shard: u16,

    /// Scale-out mode: the number of shard Leases (`<lease-name>-<shard>`), divided fairly
    /// among the live replicas, each of which caches only the shards it leads or stands by
    /// for. 0 (the default) keeps one leader for everything.
    #[arg(long, env = "SHARD_LEASES", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=256))]
    pub shard_leases: u16,

    /// Scale-out mode: replicas that cache each shard warm besides its leader, so that a
    /// takeover needs no LIST.
    #[arg(long, env = "SHARD_STANDBYS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=8))]
    pub shard_standbys: u8,

    /// Name of the Lease that elects the leader (in scale-out mode, the shard Leases'
    /// prefix and the group's name).
    #[arg(long, env = "LEASE_NAME", default_value = "myresource-operator")]
    pub lease_name: String,

    /// Namespace of the Lease. Default: $POD_NAMESPACE, else the in-cluster service account's
    /// namespace, else the kubeconfig context's namespace.
    #[arg(long, env = "LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,

    /// How long followers wait after the last observed change of the Lease before taking it
    /// over (whole seconds). Must exceed --renew-deadline.
    #[arg(long, env = "LEASE_DURATION", default_value = "15s", value_parser = parse_duration)]
    pub lease_duration: Duration,

    /// How long the leader keeps leading without a successful renew; it stops writing and
    /// steps down then. Must exceed --retry-period.
    #[arg(long, env = "RENEW_DEADLINE", default_value = "10s", value_parser = parse_duration)]
    pub renew_deadline: Duration,

    /// How often the leader renews and followers retry.
    #[arg(long, env = "RETRY_PERIOD", default_value = "2s", value_parser = parse_duration)]
    pub retry_period: Duration,

    /// On SIGTERM the fence closes and in-flight reconciles are cancelled at once (they are
    /// idempotent; the next leader redoes them); this bounds the wait for the workers to
    /// stop before the Lease is released anyway.
    #[arg(long, env = "SHUTDOWN_GRACE", default_value = "5s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// Log filter (tracing EnvFilter syntax, e.g. `info` or `myresource_operator=debug`).
    /// RUST_LOG, when set, wins.
    #[arg(long, env = "LOG_LEVEL", default_value = "info")]
    pub log_level: String,

    /// Log format. Default: text on a terminal, JSON lines otherwise.
    #[arg(long, env = "LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
}

/// The watched namespaces: empty means all namespaces. Each name is a valid namespace name,
/// none is empty and none repeats.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Namespaces(Vec<String>);

impl Deref for Namespaces {
    type Target = [String];

    fn deref(&self) -> &[String] {
        &self.0
    }
}

impl std::fmt::Debug for Namespaces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Parses a comma-separated list of namespaces (`--namespaces`, `WATCH_NAMESPACES`).
///
/// An empty value, empty entries (`a,,b`) and blanks around names are dropped, so
/// `WATCH_NAMESPACES=""` (what a template emits for an empty list) means all namespaces
/// rather than one namespace named "", in which nothing can ever be found. Every other
/// entry must be a namespace name: an RFC 1123 label.
pub fn parse_namespaces(text: &str) -> Result<Namespaces, String> {
    let mut names: Vec<String> = Vec::new();
    for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if let Some(why) = dns_label_error(name) {
            return Err(format!(
                "{name:?} (from --namespaces or WATCH_NAMESPACES) is not a namespace name: {why}; \
                 a namespace name is at most 63 lowercase letters, digits and '-', starting \
                 and ending with a letter or digit (RFC 1123 label)"
            ));
        }
        if !names.iter().any(|n| n == name) {
            names.push(name.to_string());
        }
    }
    Ok(Namespaces(names))
}

/// Why `name` is not an RFC 1123 label, or `None` when it is one.
fn dns_label_error(name: &str) -> Option<String> {
    if name.len() > 63 {
        return Some(format!("{} characters, more than 63", name.len()));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return Some(format!("it contains {c:?}"));
    }
    if name.starts_with('-') || name.ends_with('-') {
        return Some("it starts or ends with '-'".into());
    }
    None
}

/// Parses `1500ms`, `15s`, `2m` (a bare number means seconds).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (examples: 500ms, 15s, 2m)"))?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" => value * 60.0,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (use ms, s or m)")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("{text:?}: {e}"))
}

impl RunArgs {
    /// The election timings, checked for consistency.
    pub fn timings(&self) -> Result<kube_leasehold::election::Timings, String> {
        kube_leasehold::election::Timings::new(
            self.lease_duration,
            self.renew_deadline,
            self.retry_period,
        )
    }

    /// The Lease namespace: the flag, $POD_NAMESPACE, the service account's namespace, or
    /// `fallback` (the kubeconfig's).
    pub fn lease_namespace(&self, fallback: &str) -> String {
        const SA_NAMESPACE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";
        self.lease_namespace
            .clone()
            .or_else(|| std::env::var("POD_NAMESPACE").ok())
            .or_else(|| {
                std::fs::read_to_string(SA_NAMESPACE)
                    .ok()
                    .map(|s| s.trim().to_string())
            })
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| fallback.to_string())
    }

    /// The identity: the flag, else $POD_NAME, else hostname plus a random suffix.
    pub fn identity(&self) -> String {
        if let Some(id) = self.identity.clone().filter(|s| !s.is_empty()) {
            return id;
        }
        if let Ok(pod) = std::env::var("POD_NAME")
            && !pod.is_empty()
        {
            return pod;
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "myresource-operator".into());
        // RandomState is seeded from the OS: a cheap random suffix without a rand crate.
        use std::hash::BuildHasher;
        let suffix = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
        format!("{host}-{:06x}", suffix & 0xff_ffff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn namespaces_split_on_commas_and_bad_numbers_are_refused() {
        let cli =
            Cli::try_parse_from(["myresource-operator", "run", "--namespaces", "a,b"]).unwrap();
        let Command::Run(args) = cli.command else {
            panic!("run expected")
        };
        assert_eq!(*args.namespaces, ["a", "b"]);
        assert_eq!(args.shards, 4);
        let err = Cli::try_parse_from(["myresource-operator", "run", "--shards", "0"]).unwrap_err();
        assert!(err.to_string().contains("--shards"), "{err}");
    }

    fn namespaces(args: &[&str]) -> Result<Namespaces, clap::Error> {
        let cli = Cli::try_parse_from(["myresource-operator", "run"].iter().chain(args))?;
        let Command::Run(run) = cli.command else {
            panic!("run expected")
        };
        Ok(run.namespaces)
    }

    #[test]
    fn empty_namespace_entries_mean_all_namespaces() {
        // What a template renders for an empty list: all namespaces, not one named "".
        assert!(namespaces(&["--namespaces="]).unwrap().is_empty());
        assert!(namespaces(&["--namespaces", " , ,"]).unwrap().is_empty());
        assert_eq!(parse_namespaces(""), Ok(Namespaces::default()));
        assert_eq!(*parse_namespaces("a,,b").unwrap(), ["a", "b"]);
        assert_eq!(*parse_namespaces(" a , b ,").unwrap(), ["a", "b"]);
        assert_eq!(*parse_namespaces("a,b,a").unwrap(), ["a", "b"]);
    }

    #[test]
    fn bad_namespace_names_are_refused_with_the_value_and_the_flag() {
        let long = "a".repeat(64);
        for bad in ["Default", "my_ns", "-a", "a-", "a.b", "é", long.as_str()] {
            let err = parse_namespaces(&format!("good,{bad}")).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
            assert!(err.contains("--namespaces") && err.contains("WATCH_NAMESPACES"));
        }
        assert!(parse_namespaces(&"a".repeat(63)).is_ok());
        assert!(parse_namespaces("kube-system,a1,0").is_ok());
        // Through clap: an error (exit code 2 with this message), never a panic.
        let err = namespaces(&["--namespaces", "ok,Not_OK"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        assert!(err.to_string().contains("\"Not_OK\""), "{err}");
        assert_eq!(err.exit_code(), 2);
    }

    #[test]
    fn durations_parse_and_bad_ones_say_why() {
        assert_eq!(parse_duration("15s"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert!(
            parse_duration("soon")
                .unwrap_err()
                .contains("not a duration")
        );
        assert!(parse_duration("3h").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn inconsistent_lease_timings_are_refused_with_the_flag_names() {
        let cli = Cli::try_parse_from([
            "x",
            "run",
            "--lease-duration",
            "10s",
            "--renew-deadline",
            "10s",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("run expected")
        };
        assert!(args.timings().unwrap_err().contains("--lease-duration"));
    }
}

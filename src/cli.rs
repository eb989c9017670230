//! Command line: every flag of `run` can also come from an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

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
    Run(RunArgs),
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Kubeconfig file. Without it: $KUBECONFIG, ~/.kube/config, then the in-cluster
    /// service account.
    #[arg(long, env = "MYRESOURCE_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Namespaces to watch, comma-separated. Empty (the default) watches all namespaces.
    #[arg(long = "namespaces", env = "WATCH_NAMESPACES", value_delimiter = ',')]
    pub namespaces: Vec<String>,

    /// This replica's name in Events and the user agent. Default: $POD_NAME, else the
    /// hostname plus a random suffix.
    #[arg(long, env = "OPERATOR_IDENTITY")]
    pub identity: Option<String>,

    /// Where /metrics is served.
    #[arg(long, env = "METRICS_ADDR", default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,

    /// Where /healthz and /readyz are served.
    #[arg(long, env = "HEALTH_ADDR", default_value = "0.0.0.0:8081")]
    pub health_addr: SocketAddr,

    /// Number of shards: each has its own queue and workers; a key's shard is a stable hash
    /// of namespace/name.
    #[arg(long, env = "SHARDS", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub shards: u16,

    /// Workers per shard (concurrent reconciles per shard; one key never runs twice at once).
    #[arg(long, env = "WORKERS_PER_SHARD", default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub workers_per_shard: u16,

    /// Log filter (tracing EnvFilter syntax, e.g. `info` or `myresource_operator=debug`).
    /// RUST_LOG, when set, wins.
    #[arg(long, env = "LOG_LEVEL", default_value = "info")]
    pub log_level: String,

    /// Log format. Default: text on a terminal, JSON lines otherwise.
    #[arg(long, env = "LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Json,
    Text,
}

impl RunArgs {
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
        assert_eq!(args.namespaces, vec!["a", "b"]);
        assert_eq!(args.shards, 4);
        let err = Cli::try_parse_from(["myresource-operator", "run", "--shards", "0"]).unwrap_err();
        assert!(err.to_string().contains("--shards"), "{err}");
    }
}

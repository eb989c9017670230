//! `cargo xtask bench`: measurements that print numbers and write a report
//! (`target/bench/report.json`, `target/bench/report.md`), all in one run on one local
//! control plane. Timed assertions live nowhere: this only measures.
//!
//! Sections: event-to-status latency at idle; cold start with N MyResources and N labelled
//! Pods; resident memory of leader and followers; SIGKILL failover and SIGTERM handover at
//! two timing sets; takeover time with N objects cached.
//!
//! - [`throughput`]: the operator's cold start against the API server's write ceiling
//!   ([`ceiling`]), followed by the latency and takeover sections on the same objects;
//! - [`latency`]: event → reconcile start and create → Ready status;
//! - [`schedstat`]: where the leader's threads spent an idle stall (ran, waited for a CPU,
//!   or slept);
//! - [`takeover`]: a follower taking over with N objects cached;
//! - [`memory`]: a follower's memory per cached Pod;
//! - [`telemetry`]: the cost of the OTLP exporter;
//! - [`failover`]: SIGKILL failover and SIGTERM handover;
//! - [`pods`] (`--pods N`, on its own): failover of the chart's Pods on a real node;
//! - [`nodes`] (`--pods N --nodes 3`, on its own): the node faults on three nodes;
//! - [`peers`] (`--peers [N]`, on its own): ours beside controller-runtime and kube-runtime;
//! - [`scaleout`] (`--shard-leases [S]`, on its own): scale-out mode with 1 to 4 replicas
//!   against the single leader;
//! - [`scrapes`] (`--scrapes [N]`, on its own): the cost of secured metrics;
//! - [`curve`] (`--curve N1,N2,…`, on its own): the cold start, memory, takeover and latency
//!   sections at each N, plotted against N ([`plot`]);
//! - [`cpu`]: CPU per process over a phase; [`objects`]: the objects measured;
//! - [`report`]: the report, as printed lines, `report.md` and `report.json`.

mod ceiling;
mod cpu;
mod curve;
mod failover;
mod latency;
mod memory;
mod nodes;
mod objects;
mod peers;
mod plot;
mod pods;
mod report;
mod scaleout;
mod schedstat;
mod scrapes;
mod takeover;
mod telemetry;
mod throughput;

use std::path::{Path, PathBuf};

use anyhow::Result;
use e2e::cluster::{Cluster, ClusterConfig};
use e2e::lease::{DEFAULT_TIMINGS, TEST_TIMINGS, Timings};
use e2e::operator::{Operator, OperatorConfig};
use e2e::process::Lifetime;
use kube::Client;

use report::Report;

/// What to measure and how much.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Objects: MyResources and as many labelled Pods for throughput, takeover and memory.
    #[arg(long, default_value_t = 10_000)]
    pub objects: usize,
    /// SIGKILL failover and SIGTERM handover runs per timing set (15/10/2 s and 4/3/1 s);
    /// 0 skips them.
    #[arg(long, default_value_t = 5)]
    pub failover_runs: usize,
    /// Objects created one by one for the idle latency section.
    #[arg(long, default_value_t = 200)]
    pub latency_objects: usize,
    /// Objects per mode in the telemetry section (exporter off, then on at 100 % sampling);
    /// 0 skips it.
    #[arg(long, default_value_t = 500)]
    pub telemetry_objects: usize,
    /// The cargo profile the operator is built with: `release`, or `profiling` (release with
    /// symbols) to run perf against the replicas.
    #[arg(long, default_value = "release")]
    pub profile: String,
    /// Instead of everything else: failover of the chart's Pods on a real node, N container
    /// SIGKILLs and N leader Pod deletions (writes target/bench/pods/report.{json,md}).
    #[arg(long, value_name = "N")]
    pub pods: Option<usize>,
    /// With `--pods`: nodes in the cluster; with 3 (or more), N rounds of the node faults
    /// instead (the leader's node partitioned, powered off, its kubelet stopped, drained;
    /// writes target/bench/nodes/report.{json,md}).
    #[arg(
        long,
        value_name = "NODES",
        default_value_t = 1,
        requires = "pods",
        value_parser = crate::fault_nodes
    )]
    pub nodes: u8,
    /// Instead of everything else: ours side by side with controller-runtime (warm-up off
    /// and on) and kube-runtime, N MyResources and N Pods each (default 2000), with
    /// `--latency-objects` and `--failover-runs` (writes target/bench/peers/report.{json,md}).
    #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "2000")]
    pub peers: Option<usize>,
    /// With `--peers`: only these peers (repeatable; `ours`, `cr`, `cr-warmup`,
    /// `kube-runtime`, `kube-runtime-leasehold`); every peer when none is given.
    #[arg(long = "peer", value_name = "KEY", value_parser = peers::parse_key)]
    pub only_peers: Vec<&'static str>,
    /// Instead of everything else: scale-out mode with S shard Leases (default 12) and
    /// 1 to 4 replicas against the single leader, `--objects` MyResources, and
    /// `--failover-runs` rounds of kill, join and leave with three replicas (writes
    /// target/bench/scaleout/report.{json,md}).
    #[arg(long, value_name = "S", num_args = 0..=1, default_missing_value = "12")]
    pub shard_leases: Option<usize>,
    /// With `--shard-leases`: the replica counts measured against the single leader (the
    /// kill, join and leave rounds run at 3); at 100,000 objects each row takes minutes.
    #[arg(
        long,
        value_name = "R1,R2,…",
        value_delimiter = ',',
        default_value = "1,2,3,4"
    )]
    pub scale_replicas: Vec<usize>,
    /// Instead of everything else: the cost of secured metrics, N scrapes (default 1000)
    /// of a secured replica and of a plain one (writes target/bench/scrapes/report.{json,md}).
    #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "1000")]
    pub scrapes: Option<usize>,
    /// Instead of everything else: the cold start, memory, SIGTERM and SIGKILL takeovers and
    /// latency at each of these object counts, one after another on one control plane, with
    /// `--latency-objects`; plotted against N (writes target/bench/curve/report.{json,md}
    /// and one SVG per quantity).
    #[arg(long, value_name = "N1,N2,…", value_delimiter = ',')]
    pub curve: Vec<usize>,
}

struct Bench {
    root: PathBuf,
    /// Appended to every namespace and logs folder: one curve point's objects and replicas
    /// apart from another's.
    suffix: String,
    cluster: Cluster,
    client: Client,
    binary: PathBuf,
    report: Report,
}

pub async fn run(root: &Path, args: BenchArgs) -> Result<()> {
    match (args.pods, args.nodes) {
        (Some(runs), 1) => return pods::run(root, runs).await,
        (Some(runs), nodes) => return nodes::run(root, runs, nodes).await,
        (None, _) => {}
    }
    eprintln!(
        "==> building the operator ({} profile) and starting a local control plane",
        args.profile
    );
    let binary = e2e::operator::built_with(&args.profile)?;
    let peers = match args.peers {
        Some(_) => Some(peers::build_peers(root)?),
        None => None,
    };
    // Replica logs are appended to; an earlier run's lines must not be read as this run's.
    let _ = std::fs::remove_dir_all(root.join("target/bench/logs"));
    let cluster = Cluster::start(ClusterConfig {
        dir: root.join("target/bench/cluster"),
        otlp_endpoint: None,
        lifetime: Lifetime::TiedToThisProcess,
        crds: vec![myresource_operator::resource::crd()],
        shard_selector: true,
    })
    .await?;
    let client = cluster.client().await?;
    let mut bench = Bench {
        root: root.to_path_buf(),
        suffix: String::new(),
        cluster,
        client,
        binary,
        report: Report::new(),
    };
    let (result, out) = match (&peers, args.peers, args.shard_leases) {
        (Some(binaries), Some(n), _) => {
            bench.report = Report::titled("Side by side with controller-runtime and kube-runtime");
            let runs = (args.latency_objects, args.failover_runs);
            let result = bench
                .peers(binaries, n, runs.0, runs.1, &args.only_peers)
                .await;
            (result, root.join("target/bench/peers"))
        }
        (_, _, _) if !args.curve.is_empty() => {
            bench.report = Report::titled("Cost against the number of objects");
            let out = root.join("target/bench/curve");
            (
                bench.curve(&args.curve, args.latency_objects, &out).await,
                out,
            )
        }
        (_, _, _) if args.scrapes.is_some() => {
            bench.report = Report::titled("The cost of secured metrics");
            let result = bench.scrapes(args.scrapes.unwrap_or(1000)).await;
            (result, root.join("target/bench/scrapes"))
        }
        (_, _, Some(shards)) => {
            bench.report = Report::titled("Scale-out mode against the single leader");
            let result = bench
                .scale_out(
                    args.objects,
                    shards,
                    &args.scale_replicas,
                    args.failover_runs.max(1),
                )
                .await;
            (result, root.join("target/bench/scaleout"))
        }
        _ => (bench.all(&args).await, root.join("target/bench")),
    };
    bench.cluster.stop();
    result?;
    bench.report.write(&out)
}

impl Bench {
    async fn all(&mut self, args: &BenchArgs) -> Result<()> {
        self.throughput_and_takeover(args.objects, args.latency_objects)
            .await?;
        self.memory_per_pod(args.objects).await?;
        if args.telemetry_objects > 0 {
            self.telemetry(args.telemetry_objects, 100).await?;
        }
        if args.failover_runs > 0 {
            for timings in [DEFAULT_TIMINGS, TEST_TIMINGS] {
                self.failover(args.failover_runs, timings, false).await?;
            }
            self.failover(args.failover_runs, DEFAULT_TIMINGS, true)
                .await?;
        }
        Ok(())
    }

    async fn namespace(&self, name: &str) -> Result<String> {
        let name = format!("{name}{}", self.suffix);
        e2e::cluster::create_namespace(&self.client, &name).await?;
        Ok(name)
    }

    fn replica(&self, ns: &str, identity: &str, timings: &Timings) -> Result<Operator> {
        Operator::start(self.replica_config(ns, identity, timings))
    }

    /// A replica of the benchmarked build watching `ns`, its Lease there too.
    fn replica_config(&self, ns: &str, identity: &str, timings: &Timings) -> OperatorConfig {
        OperatorConfig {
            binary: Some(self.binary.clone()),
            ..OperatorConfig::in_namespace(
                identity,
                self.cluster.kubeconfig.clone(),
                ns,
                self.root.join("target/bench/logs").join(&self.suffix),
                timings,
            )
        }
    }
}

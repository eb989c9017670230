//! `cargo xtask …`: the project's task runner.
//!
//! - `cluster up|down [--dir DIR] [--node]`: a local control plane that outlives the command,
//!   with a real node when asked; `cluster probe runc|kubelet`: docs/node-facts.md's fail-fast checks;
//! - `test`: every test (unit and end-to-end against a real control plane), seeded chaos
//!   rounds covering each fault kind once against processes, in scale-out mode, and
//!   against the chart's Pods and their nodes on three nodes, the demo once with an empty
//!   binaries cache (the first-use path), then a check that no control-plane process was
//!   left behind;
//! - `bench`: measurements (throughput against the API server's write ceiling, latency,
//!   takeover, memory, telemetry, failover and handover) written to
//!   `target/bench/report.{json,md}`; xtask reruns itself from a release build for it;
//! - `chaos [--in-cluster [--nodes 3] | --shard-leases S]`: seeded faults against three
//!   replicas (processes, processes in scale-out mode, or the chart's Pods on a node or on
//!   three, with the faults of the leader's node) under a workload, with the invariants
//!   checked; writes `target/chaos/` (or `target/chaos-in-cluster/`): `report.{json,md}`,
//!   `timeline.svg`;
//! - `image [--dir DIR]`: the operator's container image, built without Docker and loaded
//!   into the node of the cluster in DIR; prints the image reference last;
//! - `demo [--processes | --nodes 3]`: the main job end to end, on a real node with the chart
//!   (with `--nodes 3`, on three, then the leader's node partitioned and drained; with
//!   `--processes`, the replicas as processes beside a node-less control plane).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum as _};

mod bench;
mod chaos;
mod demo;
use e2e::cluster::{self, Cluster, ClusterConfig};
use e2e::process::{Lifetime, processes_under};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Tasks for myresource-operator")]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Start or stop a local control plane (etcd, kube-apiserver, kube-controller-manager).
    Cluster {
        #[command(subcommand)]
        action: ClusterAction,
    },
    /// Run every test: unit tests and end-to-end tests against a real local control plane,
    /// a short chaos run, and the demo with an empty binaries cache (the first-use path).
    Test {
        /// Extra arguments for `cargo test` (for example a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        cargo_args: Vec<String>,
    },
    /// Measure cold start against the write ceiling, latency, takeover, memory, telemetry,
    /// failover and handover; writes target/bench/report.{json,md}.
    Bench(bench::BenchArgs),
    /// Inject seeded faults into three replicas under a workload and check the invariants;
    /// writes target/chaos/report.{json,md} and timeline.svg.
    Chaos(chaos::ChaosArgs),
    /// Deterministic simulation of the leadership code (kube-leasehold): seeded
    /// adversarial histories against a simulated API server on a simulated clock
    /// (`cargo xtask simulate --help` for its options).
    Simulate {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the operator's container image (as deploy/Dockerfile makes it) without Docker
    /// and load it into the nodes of the cluster in DIR (`cluster up --nodes`); prints the
    /// image reference on its last line.
    Image {
        #[arg(long, default_value_os_t = default_cluster_dir())]
        dir: PathBuf,
    },
    /// The demo: a cluster with a node, the image, `helm install` of three replicas, the
    /// tutorial's example, the leader Pod deleted and the next leader's process killed.
    Demo {
        /// Leave everything running and print how to reach it.
        #[arg(long)]
        keep: bool,
        /// Without a node: the replicas as processes beside the control plane.
        #[arg(long, conflicts_with = "nodes")]
        processes: bool,
        /// Nodes in the cluster; with 3 (or more) the replicas land on three nodes and the
        /// demo goes on with the leader's node partitioned, then drained.
        #[arg(long, default_value_t = 1, value_name = "N", value_parser = fault_nodes)]
        nodes: u8,
    },
}

/// A `--nodes` for the node faults: 1 (none of them), or 3 to [`e2e::node::MAX_NODES`] (a
/// node to lose and two to lead from).
fn fault_nodes(arg: &str) -> Result<u8, String> {
    let max = e2e::node::MAX_NODES;
    match arg.parse::<u8>() {
        Ok(n) if n == 1 || (3..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "1, or 3 to {max} (the node faults need a node to lose and two to lead from)"
        )),
    }
}

#[derive(Subcommand)]
enum ClusterAction {
    /// Start a control plane whose files live in DIR; prints `export KUBECONFIG=…`.
    Up {
        /// Folder for kubeconfigs, PKI, logs, audit log and etcd data.
        #[arg(long, default_value_os_t = default_cluster_dir())]
        dir: PathBuf,
        /// OTLP gRPC endpoint (host:port) that kube-apiserver sends its traces to.
        #[arg(long)]
        otlp_endpoint: Option<String>,
        /// Also run N real nodes (1 when the number is left out), each in a network
        /// namespace of its own (containerd, runc, CNI bridge, kubelet, kube-proxy; and a
        /// kube-scheduler) so Pods run; `cluster down` removes every trace of them.
        #[arg(long, alias = "node", num_args = 0..=1, default_missing_value = "1", value_name = "N")]
        nodes: Option<u8>,
    },
    /// A node-level fault on node NAME (`mro-node-1` …) of the cluster in DIR: `partition`
    /// cuts the node (kubelet and Pods alike) off from the API server and the other nodes,
    /// `heal` undoes it, `stop` powers it off (every process of it killed at once), `start`
    /// boots it again under the same name and waits until it is Ready.
    Node {
        name: String,
        #[arg(value_enum)]
        fault: Fault,
        #[arg(long, default_value_os_t = default_cluster_dir())]
        dir: PathBuf,
    },
    /// Stop the control plane started in DIR and remove DIR.
    Down {
        #[arg(long, default_value_os_t = default_cluster_dir())]
        dir: PathBuf,
    },
    /// docs/node-facts.md's fail-fast checks of a real node, each on a throwaway node in DIR that is
    /// torn down afterwards: `runc` (ctr run with seccomp, memory limit, user 65532) or
    /// `kubelet` (the kubelet standalone with a static Pod on the CNI bridge).
    Probe {
        #[arg(value_enum)]
        step: ProbeStep,
        #[arg(long, default_value_os_t = workspace_root().join("target").join("node-probe"))]
        dir: PathBuf,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Fault {
    Partition,
    Heal,
    Stop,
    Start,
}

impl From<Fault> for e2e::cluster::NodeFault {
    fn from(fault: Fault) -> Self {
        match fault {
            Fault::Partition => Self::Partition,
            Fault::Heal => Self::Heal,
            Fault::Stop => Self::Stop,
            Fault::Start => Self::Start,
        }
    }
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ProbeStep {
    Runc,
    Kubelet,
}

/// `cargo xtask image`: build, load, and say what was loaded.
fn image(dir: &Path) -> Result<()> {
    let built = e2e::operator_image::build()?;
    let archive = e2e::node::import_into(&dir.join(cluster::NODES_DIR), &built.image)?;
    println!(
        "loaded into the node in {}: binary {:.1} MiB, image archive {:.1} MiB",
        dir.display(),
        built.binary_bytes as f64 / 1048576.0,
        archive as f64 / 1048576.0
    );
    println!("{}", built.image.reference);
    Ok(())
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn default_cluster_dir() -> PathBuf {
    workspace_root().join("target").join("cluster")
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    match cli.command {
        Task::Cluster {
            action:
                ClusterAction::Up {
                    dir,
                    otlp_endpoint,
                    nodes,
                },
        } => runtime.block_on(cluster_up(dir, otlp_endpoint, nodes)),
        Task::Cluster {
            action: ClusterAction::Node { name, fault, dir },
        } => runtime.block_on(async {
            let mut recorded = cluster::Recorded::open(&dir)?;
            let started = Instant::now();
            cluster::faults::apply(&mut recorded, &name, fault.into()).await?;
            eprintln!(
                "{name}: {} done in {:.1} s",
                fault.to_possible_value().expect("a value").get_name(),
                started.elapsed().as_secs_f64()
            );
            Ok(())
        }),
        Task::Cluster {
            action: ClusterAction::Down { dir },
        } => {
            cluster::stop_recorded(&dir)?;
            println!("stopped the cluster in {}", dir.display());
            Ok(())
        }
        Task::Cluster {
            action: ClusterAction::Probe { step, dir },
        } => {
            let report = match step {
                ProbeStep::Runc => e2e::node::probe::runc_alone(&dir)?,
                ProbeStep::Kubelet => e2e::node::probe::kubelet_standalone(&dir)?,
            };
            println!("{report}");
            Ok(())
        }
        Task::Image { dir } => image(&dir),
        Task::Test { cargo_args } => test(&cargo_args),
        Task::Simulate { args } => simulate(&args),
        Task::Chaos(args) => runtime.block_on(chaos::run(&workspace_root(), args)),
        // The ceiling's minimal client must be built like the operator it is compared with,
        // or its own CPU use on 2 cores lowers the ceiling.
        Task::Bench(_) if cfg!(debug_assertions) => release_self(),
        Task::Bench(args) => runtime.block_on(bench::run(&workspace_root(), args)),
        Task::Demo {
            keep,
            processes,
            nodes,
        } => runtime.block_on(demo::run(&workspace_root(), keep, processes, nodes)),
    }
}

/// The simulator (`sim/`), built with the release profile, run with `args`. It is built
/// on its own: its `simulation` feature of kube-leasehold (the historical defects'
/// switches) must never reach a build of the operator.
fn simulate(args: &[String]) -> Result<()> {
    let status = simulator_cargo()
        .args(["run", "--quiet", "--release", "--package", SIMULATOR, "--"])
        .args(args)
        .status()
        .context("running the simulator")?;
    if !status.success() {
        bail!("the simulation failed ({status})");
    }
    Ok(())
}

/// The simulation suite: the simulator's own tests (the histories it once found failing,
/// byte-for-byte replay), a fixed set of seeds and three random ones (printed, so a failure
/// replays), and every historical defect re-introduced in turn and caught.
fn simulation_suite() -> Result<()> {
    eprintln!("==> the simulator's tests, then 2,000 fixed and 3 random seeds, then every defect");
    let status = simulator_cargo()
        .args(["test", "--release", "--package", SIMULATOR])
        .status()
        .context("running the simulator's tests")?;
    if !status.success() {
        bail!("the simulator's tests failed ({status})");
    }
    simulate(&["--seeds", "2000", "--random", "3"].map(String::from))?;
    simulate(&["--every-bug", "--seeds", "2000"].map(String::from))
}

/// Cargo as the simulator is built: with `--cfg tokio_unstable`, so its runtimes take a
/// seed, in a target folder of its own, so the flag never makes the workspace's builds
/// rebuild. The folder is in the project's cache (`sim-target`), outside the clone, so a
/// fresh clone (CI) rebuilds only the simulator and the crate, not every dependency.
fn simulator_cargo() -> Command {
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cargo
        .current_dir(workspace_root())
        .env("RUSTFLAGS", "--cfg tokio_unstable")
        .env(
            "CARGO_TARGET_DIR",
            e2e::binaries::cache_root().join("sim-target"),
        );
    cargo
}

/// The simulator's package.
const SIMULATOR: &str = "leasehold-sim";

/// Runs this same command line again from a release build of xtask.
fn release_self() -> Result<()> {
    eprintln!("==> building xtask with the release profile");
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(workspace_root())
        .args(["run", "--quiet", "--release", "--package", "xtask", "--"])
        .args(std::env::args_os().skip(1))
        .status()
        .context("running the release build of xtask")?;
    if !status.success() {
        bail!("xtask (release) failed ({status})");
    }
    Ok(())
}

async fn cluster_up(dir: PathBuf, otlp_endpoint: Option<String>, nodes: Option<u8>) -> Result<()> {
    let started = Instant::now();
    let config = ClusterConfig {
        dir,
        otlp_endpoint,
        lifetime: Lifetime::Detached,
        crds: Vec::new(),
        shard_selector: true,
    };
    let cluster = match nodes {
        Some(n) => Cluster::start_with_nodes(config, n).await?,
        None => Cluster::start(config).await?,
    };
    if nodes.is_some() {
        eprintln!(
            "nodes {} Ready; the kubernetes Service answers from a Pod on each",
            cluster.node_names().join(", ")
        );
    }
    eprintln!(
        "control plane ready at {} in {:.1} s; logs and audit log in {}",
        cluster.server,
        started.elapsed().as_secs_f64(),
        cluster.dir.display()
    );
    eprintln!(
        "non-admin kubeconfig: {}",
        cluster.user_kubeconfig.display()
    );
    println!("export KUBECONFIG={}", cluster.kubeconfig.display());
    Ok(())
}

/// Free disk space a whole `cargo xtask test` needs beside what is already built and cached:
/// the test builds (the workspace's and the simulator's), the clusters' folders, the
/// first-use demo's fresh binaries cache and Go's link of the control plane into it. A
/// fresh clone's run on 2026-12-06 used 6.2 GiB at its peak; this adds a margin.
const TEST_DISK_GIB: u64 = 8;

/// Fails at once, with what to do, when the disk holding `path` has less than `gib` GiB free:
/// a full disk otherwise shows up minutes later as a compiler or linker error far from its
/// cause.
fn ensure_free_space(path: &Path, gib: u64) -> Result<()> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is a NUL-terminated path and `stat` a valid, writable statvfs.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("reading the free space of {}", path.display()));
    }
    let free = stat.f_bavail as u64 * stat.f_frsize as u64;
    let need = gib << 30;
    if free < need {
        bail!(
            "{} has {:.1} GiB free; a full test run needs about {gib} GiB more: remove old \
             build folders (`cargo clean` in other clones, leftover target/ or /tmp copies) \
             and run again",
            path.display(),
            free as f64 / f64::from(1 << 30),
        );
    }
    Ok(())
}

fn test(cargo_args: &[String]) -> Result<()> {
    ensure_free_space(&workspace_root(), TEST_DISK_GIB)?;
    ensure_free_space(&std::env::temp_dir(), TEST_DISK_GIB)?;
    let use_existing = std::env::var("USE_EXISTING_CLUSTER").is_ok_and(|v| v == "true");
    if !use_existing {
        // Build (or find) every program the tests run once, up front, with visible progress:
        // the control plane, kubectl, Jaeger, Helm, and Debian's Prometheus.
        e2e::binaries::ensure()?;
        e2e::binaries::kubectl()?;
        e2e::binaries::jaeger()?;
        e2e::binaries::helm()?;
        e2e::binaries::prometheus()?;
    }
    let before = leftovers();
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cargo
        .current_dir(workspace_root())
        // Every suite runs and reports, even after one fails.
        .args([
            "test",
            "--workspace",
            "--no-fail-fast",
            "--exclude",
            SIMULATOR,
        ])
        .args(cargo_args);
    if std::env::var_os("RUST_TEST_THREADS").is_none() {
        // End-to-end tests mostly wait on the API server: run more of them at once than
        // there are cores.
        cargo.env("RUST_TEST_THREADS", "8");
    }
    let mut status = cargo.status().context("running cargo test")?;
    // The simulation needs no cluster: it runs whenever the tests passed.
    let simulated = if status.success() {
        simulation_suite()
    } else {
        Ok(())
    };
    if status.success() && simulated.is_ok() && !use_existing {
        // Every run exercises failover: a short seeded chaos run (each fault kind once),
        // against processes, against processes in scale-out mode, and against the chart's
        // Pods and their nodes on three nodes, installed from the earlier release and
        // upgraded first.
        let rounds = chaos::ROUNDS_COVERING_EVERY_KIND.map(|n| n.to_string());
        let runs = [
            vec!["--rounds", &rounds[0]],
            vec!["--shard-leases", "6", "--rounds", &rounds[1]],
            vec![
                "--in-cluster",
                "--nodes",
                "3",
                "--rounds",
                &rounds[2],
                "--upgrade-from",
                chaos::EARLIER_RELEASE,
            ],
        ];
        for extra in runs {
            let chaos = Command::new(std::env::current_exe()?)
                .args(["chaos", "--seed", "1"])
                .args(extra)
                .status()
                .context("running the chaos suite")?;
            if !chaos.success() {
                status = chaos;
                break;
            }
        }
    }
    let first_use = if use_existing {
        Ok(())
    } else {
        first_use_demo()
    };
    let left: Vec<_> = leftovers()
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    if !left.is_empty() {
        bail!("processes outlived the test run: {left:?}");
    }
    eprintln!("no control-plane or operator process outlived the test run");
    if !status.success() {
        if let Err(err) = &first_use {
            eprintln!("error: {err:#}");
        }
        bail!("cargo test failed ({status})");
    }
    simulated?;
    first_use
}

/// The first-use path, proven on every run: `cargo xtask demo` as a child process (this
/// same binary) whose binaries cache (`MYRESOURCE_OPERATOR_CACHE`) is a fresh, empty
/// folder, so every program the demo uses must be built on the way, as on a new machine.
/// Go's own module and build caches are kept, so this is a relink, not a rebuild. The
/// folder is removed afterwards.
fn first_use_demo() -> Result<()> {
    let cache = std::env::temp_dir().join(format!(
        "myresource-operator-first-use-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&cache);
    std::fs::create_dir_all(&cache)?;
    eprintln!(
        "==> first use: cargo xtask demo with an empty binaries cache in {}",
        cache.display()
    );
    let started = Instant::now();
    let status = Command::new(std::env::current_exe()?)
        .arg("demo")
        .env("MYRESOURCE_OPERATOR_CACHE", &cache)
        // A new machine has no envtest assets either: everything comes from the cache.
        .env_remove("KUBEBUILDER_ASSETS")
        .status()
        .context("running the demo");
    let took = started.elapsed().as_secs_f64();
    // The demo's control plane dies with it; give the kernel a moment, then look.
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    let mut left = processes_under(&cache);
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
        left = processes_under(&cache);
    }
    let removed = std::fs::remove_dir_all(&cache);
    let status = status?;
    if !status.success() {
        bail!("the demo with an empty binaries cache failed after {took:.0} s ({status})");
    }
    if !left.is_empty() {
        bail!("processes outlived the first-use demo: {left:?}");
    }
    removed.with_context(|| format!("removing {}", cache.display()))?;
    eprintln!("first use: the demo with an empty binaries cache passed in {took:.0} s");
    Ok(())
}

/// Running control-plane binaries of ours and operator processes built in this workspace.
fn leftovers() -> Vec<(u32, PathBuf)> {
    let mut found = processes_under(&e2e::binaries::controlplane_cache());
    found.extend(
        processes_under(&workspace_root().join("target"))
            .into_iter()
            .filter(|(_, exe)| exe.file_name().is_some_and(|n| n == "myresource-operator")),
    );
    found
}

//! A real local Kubernetes control plane for tests, demos and benchmarks.
//!
//! - [`binaries`]: etcd, kube-apiserver and kube-controller-manager, built from pinned Go
//!   modules on first use and cached outside the clone (or taken from `KUBEBUILDER_ASSETS`);
//! - [`pki`]: the throwaway CA and certificates;
//! - [`chart`]: the Helm chart installed on a cluster with a node, and its Pods waited for;
//! - [`cluster`]: starting and stopping one control plane in a folder;
//! - [`node`]: a real node beside it (containerd, runc, CNI bridge, kubelet, kube-proxy);
//! - [`node_faults`]: the node faults a release of the chart meets on several nodes, as
//!   measured steps (the three-node test and `bench --pods N --nodes 3`);
//! - [`process`]: child processes that die with us, or outlive us on purpose;
//! - [`prometheus`]: a Prometheus on loopback for the chart tests;
//! - [`proxy`]: a loopback TCP proxy that tests cut to partition a replica;
//! - [`overload_proxy`]: a loopback HTTPS proxy that plays an overloaded API server (429s
//!   with `Retry-After`, writes delivered late);
//! - [`foreign_lease`]: foreign writes to the Lease (delete, cleared holder, relabelling);
//! - [`harness`]: one shared control plane per test binary, a namespace per test;
//! - [`lease`]: the replicas' Lease: its name, its holder, the test timings (4 s / 3 s / 1 s);
//! - [`jaeger`]: a Jaeger on loopback for the tracing tests;
//! - [`operator`]: the operator binary run as a real process, and how a replica is
//!   configured;
//! - [`operator_image`]: the operator's container image (as `deploy/Dockerfile` makes it),
//!   built without Docker;
//! - [`objects`]: the test workload's MyResources and their convergence;
//! - [`shards`]: scale-out mode's shard Leases, members and per-shard audit checks;
//! - [`audit`]: reading the audit log the tests use as ground truth;
//! - [`stats`]: percentiles and the min/median/p99/max summary of the bench and chaos reports;
//! - [`wait`]: polling instead of sleeping.

pub mod access;
pub mod audit;
pub mod binaries;
pub mod chart;
pub mod cluster;
pub mod foreign_lease;
pub mod harness;
pub mod jaeger;
pub mod kubeconfig;
pub mod lease;
pub mod node;
pub mod node_faults;
pub mod objects;
pub mod operator;
pub mod operator_image;
pub mod overload_proxy;
pub mod pki;
pub mod ports;
pub mod process;
pub mod prometheus;
pub mod proxy;
pub mod shards;
pub mod stats;
pub mod wait;

/// The controller tutorial's example MyResource, byte for byte.
pub const TUTORIAL_EXAMPLE: &str = "apiVersion: trstringer.com/v1
kind: MyResource
metadata:
  name: example-myresource
spec:
  message: hello world
  someValue: 13
";

//! Prometheus metrics, with the names and labels controller-runtime uses (so its dashboards
//! and alerts work unchanged), our own `myresource_operator_*` metrics, and process metrics.
//!
//! Deviations from controller-runtime, on purpose:
//! - the work queue is sharded: `workqueue_*` carry `name="myresource"` summed over shards
//!   (as controller-runtime's one queue would), and `myresource_operator_shard_queue_depth`
//!   has the per-shard depth;
//! - `rest_client_request_duration_seconds` is labelled `method`, `code`, `host` (client-go's
//!   has `verb`, `host`), matching `rest_client_requests_total`;
//! - `controller_runtime_reconcile_total{result}` uses controller-runtime's values `success`,
//!   `error`, `requeue_after` (we never return a bare `requeue`).
//!
//! Values that describe current state (queue depth, in-flight work, cache sizes, process)
//! are read at scrape time by collectors; events (reconciles, adds, requests) are counted
//! where they happen.

use std::sync::atomic::AtomicU64;
use std::sync::{LazyLock, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The `controller` label value (controller-runtime names it after the kind).
pub const CONTROLLER: &str = "myresource";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub controller: &'static str,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub controller: &'static str,
    pub name: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NameLabels {
    pub name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RestLabels {
    pub code: String,
    pub method: String,
    pub host: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShardLabels {
    pub shard: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub phase: &'static str,
}

pub const CONTROLLER_LABELS: ControllerLabels = ControllerLabels {
    controller: CONTROLLER,
};
pub const QUEUE_LABELS: QueueLabels = QueueLabels {
    controller: CONTROLLER,
    name: CONTROLLER,
};

/// Every metric the operator records.
pub struct Metrics {
    registry: Mutex<Registry>,
    pub reconcile_total: Family<ResultLabels, Counter>,
    pub reconcile_errors: Family<ControllerLabels, Counter>,
    pub reconcile_time: Family<ControllerLabels, Histogram>,
    pub active_workers: Family<ControllerLabels, Gauge>,
    pub max_concurrent_reconciles: Family<ControllerLabels, Gauge>,
    pub queue_adds: Family<QueueLabels, Counter>,
    pub queue_duration: Family<QueueLabels, Histogram>,
    pub work_duration: Family<QueueLabels, Histogram>,
    pub queue_retries: Family<QueueLabels, Counter>,
    pub leader_status: Family<NameLabels, Gauge>,
    pub rest_requests: Family<RestLabels, Counter>,
    pub rest_request_duration: Family<RestLabels, Histogram>,
    pub shard_queue_duration: Family<ShardLabels, Histogram>,
    pub leadership_transitions: Counter,
    pub takeover_seconds: Family<PhaseLabels, Gauge<f64, AtomicU64>>,
    pub lease_renew_seconds: Histogram,
}

fn reconcile_buckets() -> Histogram {
    // controller-runtime's buckets for controller_runtime_reconcile_time_seconds.
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8,
        0.9, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0,
        15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 60.0,
    ])
}

fn queue_buckets() -> Histogram {
    // client-go's workqueue buckets: 10 ns to 10 s, ×10.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1e-8, 10.0, 10,
    ))
}

impl Metrics {
    fn new() -> Self {
        let m = Metrics {
            registry: Mutex::new(Registry::default()),
            reconcile_total: Family::default(),
            reconcile_errors: Family::default(),
            reconcile_time: Family::new_with_constructor(reconcile_buckets),
            active_workers: Family::default(),
            max_concurrent_reconciles: Family::default(),
            queue_adds: Family::default(),
            queue_duration: Family::new_with_constructor(queue_buckets),
            work_duration: Family::new_with_constructor(queue_buckets),
            queue_retries: Family::default(),
            leader_status: Family::default(),
            rest_requests: Family::default(),
            rest_request_duration: Family::new_with_constructor(|| {
                Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
                    0.001, 2.0, 15,
                ))
            }),
            shard_queue_duration: Family::new_with_constructor(queue_buckets),
            leadership_transitions: Counter::default(),
            takeover_seconds: Family::default(),
            lease_renew_seconds: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 14),
            ),
        };
        {
            let mut r = m.registry.lock().expect("registry lock");
            r.register(
                "controller_runtime_reconcile",
                "Total number of reconciliations per controller",
                m.reconcile_total.clone(),
            );
            r.register(
                "controller_runtime_reconcile_errors",
                "Total number of reconciliation errors per controller",
                m.reconcile_errors.clone(),
            );
            r.register(
                "controller_runtime_reconcile_time_seconds",
                "Length of time per reconciliation per controller",
                m.reconcile_time.clone(),
            );
            r.register(
                "controller_runtime_active_workers",
                "Number of currently used workers per controller",
                m.active_workers.clone(),
            );
            r.register(
                "controller_runtime_max_concurrent_reconciles",
                "Maximum number of concurrent reconciles per controller",
                m.max_concurrent_reconciles.clone(),
            );
            r.register(
                "workqueue_adds",
                "Total number of adds handled by workqueue",
                m.queue_adds.clone(),
            );
            r.register(
                "workqueue_queue_duration_seconds",
                "How long in seconds an item stays in workqueue before being requested",
                m.queue_duration.clone(),
            );
            r.register(
                "workqueue_work_duration_seconds",
                "How long in seconds processing an item from workqueue takes",
                m.work_duration.clone(),
            );
            r.register(
                "workqueue_retries",
                "Total number of retries handled by workqueue",
                m.queue_retries.clone(),
            );
            r.register(
                "leader_election_master_status",
                "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master",
                m.leader_status.clone(),
            );
            r.register(
                "rest_client_requests",
                "Number of HTTP requests, partitioned by status code, method, and host",
                m.rest_requests.clone(),
            );
            r.register(
                "rest_client_request_duration_seconds",
                "Request latency in seconds, by method, status code and host",
                m.rest_request_duration.clone(),
            );
            r.register(
                "myresource_operator_shard_queue_duration_seconds",
                "How long keys wait in each shard's queue before a worker takes them",
                m.shard_queue_duration.clone(),
            );
            r.register(
                "myresource_operator_leadership_transitions",
                "Times this replica became leader",
                m.leadership_transitions.clone(),
            );
            r.register(
                "myresource_operator_takeover_seconds",
                "Last takeover: seconds from acquiring the Lease to the first reconcile (phase=first_reconcile) and to an empty queue (phase=drained)",
                m.takeover_seconds.clone(),
            );
            r.register(
                "myresource_operator_lease_renew_seconds",
                "Latency of successful Lease renewals",
                m.lease_renew_seconds.clone(),
            );
            r.register_collector(Box::new(ProcessCollector));
        }
        m
    }

    /// Creates the zero-valued series a dashboard expects before anything happened (as
    /// controller-runtime does), so a follower's scrape already has every name.
    pub fn init_series(&self) {
        for result in ["success", "error", "requeue_after"] {
            drop(self.reconcile_total.get_or_create(&ResultLabels {
                controller: CONTROLLER,
                result,
            }));
        }
        drop(self.reconcile_errors.get_or_create(&CONTROLLER_LABELS));
        drop(self.reconcile_time.get_or_create(&CONTROLLER_LABELS));
        drop(self.active_workers.get_or_create(&CONTROLLER_LABELS));
        drop(
            self.max_concurrent_reconciles
                .get_or_create(&CONTROLLER_LABELS),
        );
        drop(self.queue_adds.get_or_create(&QUEUE_LABELS));
        drop(self.queue_duration.get_or_create(&QUEUE_LABELS));
        drop(self.work_duration.get_or_create(&QUEUE_LABELS));
        drop(self.queue_retries.get_or_create(&QUEUE_LABELS));
    }

    /// Adds a scrape-time collector.
    pub fn register_collector(&self, collector: Box<dyn Collector>) {
        self.registry
            .lock()
            .expect("registry lock")
            .register_collector(collector);
    }

    /// Encodes everything: OpenMetrics text when `openmetrics`, else Prometheus text 0.0.4.
    pub fn encode(&self, openmetrics: bool) -> String {
        let registry = self.registry.lock().expect("registry lock");
        let mut out = String::new();
        let result = if openmetrics {
            prometheus_client::encoding::text::encode(&mut out, &registry)
        } else {
            prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
        };
        result.expect("encoding into a String cannot fail");
        out
    }
}

/// The process-wide metrics.
pub fn get() -> &'static Metrics {
    static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);
    &METRICS
}

/// A gauge value read at scrape time.
pub fn encode_gauge<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: &[(L, f64)],
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Gauge,
    )?;
    for (labels, value) in values {
        ConstGauge::new(*value).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

/// Process metrics from /proc/self, as the Go and Python clients name them.
#[derive(Debug)]
struct ProcessCollector;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NoLabels {}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(p) = ProcessStats::read() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(p.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                p.rss_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                p.vsize_bytes,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                p.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                p.max_fds,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                p.start_time_seconds,
            ),
        ];
        for (name, help, value) in gauges {
            encode_gauge(&mut encoder, name, help, &[(NoLabels {}, value)])?;
        }
        Ok(())
    }
}

struct ProcessStats {
    cpu_seconds: f64,
    rss_bytes: f64,
    vsize_bytes: f64,
    open_fds: f64,
    max_fds: f64,
    start_time_seconds: f64,
}

impl ProcessStats {
    fn read() -> Option<ProcessStats> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the parenthesised command name, starting with field 3 (state).
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let num = |i: usize| fields.get(i - 3).and_then(|v| v.parse::<f64>().ok());
        // SAFETY: sysconf has no preconditions.
        let (ticks, page) = unsafe {
            (
                libc::sysconf(libc::_SC_CLK_TCK) as f64,
                libc::sysconf(libc::_SC_PAGESIZE) as f64,
            )
        };
        let boot_time = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse::<f64>()
            .ok()?;
        let max_fds = std::fs::read_to_string("/proc/self/limits")
            .ok()?
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .and_then(|l| l.split_whitespace().nth(3))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN);
        Some(ProcessStats {
            cpu_seconds: (num(14)? + num(15)?) / ticks,
            start_time_seconds: boot_time + num(22)? / ticks,
            vsize_bytes: num(23)?,
            rss_bytes: num(24)? * page,
            open_fds: std::fs::read_dir("/proc/self/fd").ok()?.count() as f64,
            max_fds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_controller_runtime_name_is_exposed_in_both_formats() {
        let m = get();
        m.reconcile_total
            .get_or_create(&ResultLabels {
                controller: CONTROLLER,
                result: "success",
            })
            .inc();
        m.leader_status
            .get_or_create(&NameLabels { name: "l".into() })
            .set(1);
        for openmetrics in [false, true] {
            let text = m.encode(openmetrics);
            for name in [
                "controller_runtime_reconcile_total{controller=\"myresource\",result=\"success\"} 1",
                "leader_election_master_status{name=\"l\"} 1",
                "process_resident_memory_bytes",
                "process_cpu_seconds_total",
                "process_start_time_seconds",
            ] {
                assert!(text.contains(name), "{name} missing from:\n{text}");
            }
            assert_eq!(text.contains("# EOF"), openmetrics);
        }
    }
}

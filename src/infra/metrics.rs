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

use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use kube_leasehold::observe::{Observer, names};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The `controller` label value (controller-runtime names it after the kind).
const CONTROLLER: &str = "myresource";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    controller: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    controller: &'static str,
    name: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NameLabels {
    name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RestLabels {
    code: String,
    method: String,
    host: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardLabels {
    shard: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    lease: String,
    phase: &'static str,
}

const CONTROLLER_LABELS: ControllerLabels = ControllerLabels {
    controller: CONTROLLER,
};
const QUEUE_LABELS: QueueLabels = QueueLabels {
    controller: CONTROLLER,
    name: CONTROLLER,
};

/// Every metric the operator records: one per process, created by `main` and handed to
/// the parts that record (no global), each recording through a one-line method.
#[derive(Debug)]
pub struct Metrics {
    registry: Mutex<Registry>,
    reconcile_total: Family<ResultLabels, Counter>,
    reconcile_errors: Family<ControllerLabels, Counter>,
    reconcile_time: Family<ControllerLabels, Histogram>,
    active_workers: Family<ControllerLabels, Gauge>,
    max_concurrent_reconciles: Family<ControllerLabels, Gauge>,
    queue_adds: Family<QueueLabels, Counter>,
    queue_duration: Family<QueueLabels, Histogram>,
    work_duration: Family<QueueLabels, Histogram>,
    queue_retries: Family<QueueLabels, Counter>,
    leader_status: Family<NameLabels, Gauge>,
    rest_requests: Family<RestLabels, Counter>,
    rest_request_duration: Family<RestLabels, Histogram>,
    shard_queue_duration: Family<ShardLabels, Histogram>,
    leadership_transitions: Counter,
    takeover_seconds: Family<PhaseLabels, Gauge<f64, AtomicU64>>,
    lease_renew_seconds: Histogram,
    shards_led: Gauge,
    shards_cached: Gauge,
    shard_members: Gauge,
    shard_filter: Family<ModeLabels, Gauge>,
    events: Family<FateLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FateLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
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
    /// The metrics with every series a dashboard expects created at zero.
    pub fn new() -> Self {
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
            shards_led: Gauge::default(),
            shards_cached: Gauge::default(),
            shard_members: Gauge::default(),
            shard_filter: Family::default(),
            events: Family::default(),
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
                names::LEADER_ELECTION_MASTER_STATUS,
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
                "Last takeover: seconds from acquiring the Lease to the first reconcile (phase=first_reconcile), to every cached key queued (phase=enqueued) and to an empty queue (phase=drained)",
                m.takeover_seconds.clone(),
            );
            r.register(
                "myresource_operator_lease_renew_seconds",
                "Latency of successful Lease renewals",
                m.lease_renew_seconds.clone(),
            );
            r.register(
                "myresource_operator_shards_led",
                "Scale-out mode: shard Leases this replica leads",
                m.shards_led.clone(),
            );
            r.register(
                "myresource_operator_shards_cached",
                "Scale-out mode: shards this replica caches (led, standing by, or handing over)",
                m.shards_cached.clone(),
            );
            r.register(
                "myresource_operator_shard_members",
                "Scale-out mode: live replicas in this replica's view of the shard group",
                m.shard_members.clone(),
            );
            r.register(
                "myresource_operator_shard_filter",
                "Scale-out mode: 1 for how MyResources are filtered by shard: mode=server (the API server's shardSelector) or mode=client (listed in full, filtered here)",
                m.shard_filter.clone(),
            );
            r.register(
                "myresource_operator_events",
                "Events the reconciles asked for, by result: published, failed (refused or not answered), dropped (a full queue, or the leadership term ended first)",
                m.events.clone(),
            );
            r.register_collector(Box::new(ProcessCollector));
        }
        m.init_series();
        m
    }

    /// Creates the zero-valued series a dashboard expects before anything happened (as
    /// controller-runtime does), so a follower's scrape already has every name.
    fn init_series(&self) {
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
        for result in ["published", "failed", "dropped"] {
            drop(self.events.get_or_create(&FateLabels { result }));
        }
    }

    /// Reads the current state (queues, caches) from `read` at every scrape.
    pub fn observe_state(&self, read: impl Fn() -> State + Send + Sync + 'static) {
        self.registry
            .lock()
            .expect("registry lock")
            .register_collector(Box::new(StateCollector(Box::new(read))));
    }

    /// A key entered a queue it was not already waiting in.
    pub fn queue_added(&self) {
        self.queue_adds.get_or_create(&QUEUE_LABELS).inc();
    }

    /// A leadership term started (`workers` > 0) or ended (< 0) with that many workers.
    pub fn workers_changed(&self, workers: i64) {
        self.max_concurrent_reconciles
            .get_or_create(&CONTROLLER_LABELS)
            .inc_by(workers);
    }

    /// A worker took a key that had waited `waited` in shard `shard`'s queue.
    pub fn reconcile_started(&self, shard: usize, waited: Duration) {
        let waited = waited.as_secs_f64();
        self.queue_duration
            .get_or_create(&QUEUE_LABELS)
            .observe(waited);
        self.shard_queue_duration
            .get_or_create(&ShardLabels {
                shard: shard.to_string(),
            })
            .observe(waited);
        self.active_workers.get_or_create(&CONTROLLER_LABELS).inc();
    }

    /// A reconcile ended after `took`: with `result`, or cancelled with its term (`None`).
    pub fn reconcile_finished(&self, took: Duration, result: Option<ReconcileResult>) {
        let took = took.as_secs_f64();
        self.active_workers.get_or_create(&CONTROLLER_LABELS).dec();
        self.reconcile_time
            .get_or_create(&CONTROLLER_LABELS)
            .observe(took);
        self.work_duration
            .get_or_create(&QUEUE_LABELS)
            .observe(took);
        let Some(result) = result else { return };
        self.reconcile_total
            .get_or_create(&ResultLabels {
                controller: CONTROLLER,
                result: result.as_str(),
            })
            .inc();
        if result == ReconcileResult::Error {
            self.reconcile_errors
                .get_or_create(&CONTROLLER_LABELS)
                .inc();
            self.queue_retries.get_or_create(&QUEUE_LABELS).inc();
        }
    }

    /// The current term of Lease `lease` reached takeover `phase` `seconds` after
    /// acquiring it.
    pub fn takeover(&self, lease: &str, phase: &'static str, seconds: f64) {
        self.takeover_seconds
            .get_or_create(&PhaseLabels {
                lease: lease.into(),
                phase,
            })
            .set(seconds);
    }

    /// Scale-out mode: whether the API server filters by shard (`server`) or we do.
    /// What became of an Event a reconcile asked for: `result` is published, failed or
    /// dropped (`control::events::Fate`).
    pub fn event(&self, result: &'static str) {
        self.events.get_or_create(&FateLabels { result }).inc();
    }

    pub fn shard_filter(&self, server_side: bool) {
        let mode = if server_side { "server" } else { "client" };
        self.shard_filter.get_or_create(&ModeLabels { mode }).set(1);
    }

    /// An API request ended with `code` (a status, or `<error>`) after `took`.
    pub fn api_request(&self, code: String, method: String, host: String, took: Duration) {
        let labels = RestLabels { code, method, host };
        self.rest_requests.get_or_create(&labels).inc();
        self.rest_request_duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
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

/// How a reconcile ended, as controller-runtime labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReconcileResult {
    Success,
    RequeueAfter,
    Error,
}

impl ReconcileResult {
    pub fn as_str(self) -> &'static str {
        match self {
            ReconcileResult::Success => "success",
            ReconcileResult::RequeueAfter => "requeue_after",
            ReconcileResult::Error => "error",
        }
    }
}

/// One shard's queue at scrape time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueState {
    /// Keys ready to be taken.
    pub depth: usize,
    /// Seconds of work in progress, summed over the keys in processing.
    pub unfinished_seconds: f64,
    /// Seconds the longest key in processing has been processed.
    pub longest_seconds: f64,
}

/// The state read at scrape time: queues and caches.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// One entry per shard.
    pub queues: Vec<QueueState>,
    /// Objects cached, by kind.
    pub cached: Vec<(&'static str, usize)>,
    /// Whether every cache has completed its initial list.
    pub synced: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

/// Encodes a [`State`] read at scrape time.
struct StateCollector(Box<dyn Fn() -> State + Send + Sync>);

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StateCollector")
    }
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let state = (self.0)();
        let queues = &state.queues;
        let depth: usize = queues.iter().map(|q| q.depth).sum();
        let unfinished: f64 = queues.iter().map(|q| q.unfinished_seconds).sum();
        let longest = queues.iter().map(|q| q.longest_seconds).fold(0.0, f64::max);
        encode_gauge(
            &mut encoder,
            "workqueue_depth",
            "Current depth of workqueue",
            &[(QUEUE_LABELS, depth as f64)],
        )?;
        encode_gauge(
            &mut encoder,
            "workqueue_unfinished_work_seconds",
            "How many seconds of work has been done that is in progress and hasn't been observed by work_duration",
            &[(QUEUE_LABELS, unfinished)],
        )?;
        encode_gauge(
            &mut encoder,
            "workqueue_longest_running_processor_seconds",
            "How many seconds has the longest running processor for workqueue been running",
            &[(QUEUE_LABELS, longest)],
        )?;
        let per_shard: Vec<_> = queues
            .iter()
            .enumerate()
            .map(|(i, q)| {
                (
                    ShardLabels {
                        shard: i.to_string(),
                    },
                    q.depth as f64,
                )
            })
            .collect();
        encode_gauge(
            &mut encoder,
            "myresource_operator_shard_queue_depth",
            "Keys ready in each shard's queue",
            &per_shard,
        )?;
        let cached: Vec<_> = state
            .cached
            .iter()
            .map(|&(kind, n)| (KindLabels { kind }, n as f64))
            .collect();
        encode_gauge(
            &mut encoder,
            "myresource_operator_cache_objects",
            "Objects in this replica's caches, by kind",
            &cached,
        )?;
        encode_gauge(
            &mut encoder,
            "myresource_operator_caches_synced",
            "1 when every cache has completed its initial list",
            &[(
                KindLabels { kind: "all" },
                f64::from(u8::from(state.synced)),
            )],
        )
    }
}

/// A gauge value read at scrape time.
fn encode_gauge<L: EncodeLabelSet>(
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

/// What the leadership core reports, into this registry.
impl Observer for Metrics {
    /// `leader_election_master_status{name}`.
    fn leading(&self, lease: &str, leading: bool) {
        self.leader_status
            .get_or_create(&NameLabels { name: lease.into() })
            .set(i64::from(leading));
    }

    fn became_leader(&self, _lease: &str) {
        self.leadership_transitions.inc();
    }

    fn lease_renewed(&self, _lease: &str, took: Duration) {
        self.lease_renew_seconds.observe(took.as_secs_f64());
    }

    fn shards(&self, led: usize, cached: usize, members: usize) {
        self.shards_led.set(led as i64);
        self.shards_cached.set(cached as i64);
        self.shard_members.set(members as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_controller_runtime_name_is_exposed_in_both_formats() {
        let m = Metrics::new();
        m.reconcile_finished(Duration::ZERO, Some(ReconcileResult::Success));
        m.leading("l", true);
        m.observe_state(|| State {
            queues: vec![QueueState {
                depth: 2,
                unfinished_seconds: 0.5,
                longest_seconds: 0.25,
            }],
            cached: vec![("Pod", 3)],
            synced: true,
        });
        for openmetrics in [false, true] {
            let text = m.encode(openmetrics);
            for name in [
                "controller_runtime_reconcile_total{controller=\"myresource\",result=\"success\"} 1",
                "leader_election_master_status{name=\"l\"} 1",
                "workqueue_depth{controller=\"myresource\",name=\"myresource\"} 2",
                "myresource_operator_shard_queue_depth{shard=\"0\"} 2",
                "myresource_operator_cache_objects{kind=\"Pod\"} 3",
                "myresource_operator_caches_synced{kind=\"all\"} 1",
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

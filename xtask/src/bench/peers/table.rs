//! The comparison table of `report.md`: a row per measurement, a column per peer, the
//! definitions under it.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::replica::PEERS;

/// A cell: one figure, two figures `a / b` (each times `scale`), or a median with its range.
enum Cell {
    One(&'static [&'static str], usize),
    Two(&'static [&'static str], &'static [&'static str], usize, f64),
    Spread(&'static str),
}

/// The rows after the first (whose label names the ceiling): label, cell.
const ROWS: &[(&str, Cell)] = &[
    (
        "Cold start: process start → all Ready, s",
        Cell::One(&["cold_start", "spawn_to_all_ready_seconds"], 1),
    ),
    (
        "Idle: create → ConfigMap create, p50 / p99 ms",
        Cell::Two(
            &["idle_latency_ms", "to_configmap_create", "p50"],
            &["idle_latency_ms", "to_configmap_create", "p99"],
            1,
            1.0,
        ),
    ),
    (
        "Idle: create → status write, p50 / p99 ms",
        Cell::Two(
            &["idle_latency_ms", "to_status_write", "p50"],
            &["idle_latency_ms", "to_status_write", "p99"],
            1,
            1.0,
        ),
    ),
    (
        "Memory per cached object, leader / follower, bytes",
        Cell::Two(
            &["memory", "leader_bytes_per_object"],
            &["memory", "follower_bytes_per_object"],
            0,
            1.0,
        ),
    ),
    (
        "Resident memory with everything cached, leader / follower, MiB",
        Cell::Two(
            &["memory", "leader_bytes"],
            &["memory", "follower_bytes"],
            1,
            1.0 / 1_048_576.0,
        ),
    ),
    (
        "SIGKILL failover: signal → probe's ConfigMap, median (min–max) s",
        Cell::Spread("sigkill"),
    ),
    (
        "SIGTERM handover: signal → probe's ConfigMap, median (min–max) s",
        Cell::Spread("sigterm"),
    ),
    (
        "Takeover with everything cached (SIGTERM): signal → probe's ConfigMap, s",
        Cell::One(&["takeover", "signal_to_probe_configmap_seconds"], 2),
    ),
    (
        "Takeover, nothing changed: LISTs (and watch-lists) / writes by the new leader after acquiring",
        Cell::Two(
            &["takeover", "lists_after_acquiring"],
            &["takeover", "writes_after_acquiring"],
            0,
            1.0,
        ),
    ),
    (
        "Cold start: API requests / writes per object",
        Cell::Two(
            &["cold_start", "requests_per_object"],
            &["cold_start", "writes_per_object"],
            2,
            1.0,
        ),
    ),
];

/// The number at `path` in `v`, NaN when missing.
fn num(v: &Value, path: &[&str]) -> f64 {
    path.iter()
        .fold(v, |v, k| &v[*k])
        .as_f64()
        .unwrap_or(f64::NAN)
}

impl Cell {
    fn show(&self, v: &Value) -> String {
        match self {
            Cell::One(path, digits) => format!("{:.*}", digits, num(v, path)),
            Cell::Two(a, b, digits, scale) => format!(
                "{:.*} / {:.*}",
                digits,
                num(v, a) * scale,
                digits,
                num(v, b) * scale
            ),
            Cell::Spread(kind) => {
                let at = |stat| num(v, &["failover", kind, stat]);
                format!("{:.2} ({:.2}–{:.2})", at("median"), at("min"), at("max"))
            }
        }
    }
}

/// One pass over every peer: the order they ran in, the ceiling around them, what each
/// measured.
#[derive(Debug)]
pub(super) struct Pass {
    pub(super) order: Vec<&'static str>,
    /// writes/s of the ceiling's phases before and after this pass.
    pub(super) ceiling: f64,
    pub(super) results: BTreeMap<&'static str, Value>,
}

impl Pass {
    /// For report.json.
    pub(super) fn json(&self) -> Value {
        json!({"order": self.order, "ceiling_writes_per_second": self.ceiling, "results": self.results})
    }
}

/// The Markdown lines: the table (each cell the passes' figures, "pass 1 · pass 2"), then
/// what each row measures.
pub(super) fn markdown(passes: &[Pass], n: usize, command: &str) -> Vec<String> {
    let keys: Vec<&str> = PEERS
        .iter()
        .map(|p| p.key())
        .filter(|k| passes.iter().all(|p| p.results.contains_key(k)))
        .collect();
    let row = |label: &str, cells: Vec<String>| format!("| {label} | {} |", cells.join(" | "));
    // A cell: `show` of each pass's result for the peer `key`, joined.
    let cells = |show: &dyn Fn(&Value) -> String| -> Vec<String> {
        keys.iter()
            .map(|k| {
                let shown: Vec<String> = passes.iter().map(|p| show(&p.results[k])).collect();
                shown.join(" · ")
            })
            .collect()
    };
    let titles = keys
        .iter()
        .map(|k| {
            passes[0].results[k]["title"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    let ceilings = |scale: f64| {
        let each: Vec<String> = passes
            .iter()
            .map(|p| format!("{:.0}", p.ceiling * scale))
            .collect();
        each.join(" · ")
    };
    let orders: Vec<String> = passes
        .iter()
        .enumerate()
        .map(|(i, p)| format!("pass {}: {}", i + 1, p.order.join(", ")))
        .collect();
    let mut lines = vec![
        String::new(),
        format!("Command: `{command}`"),
        String::new(),
        format!("Order: {}.", orders.join("; ")),
        String::new(),
        row(
            &format!("{n} MyResources + {n} Pods (pass 1 · pass 2)"),
            titles,
        ),
        format!("|---|{}", "---|".repeat(keys.len())),
        row(
            &format!(
                "Cold start: objects/s (ratio to the ceiling, {} objects/s)",
                ceilings(1.0 / 3.0)
            ),
            cells(&|v| {
                format!(
                    "{:.0} ({:.2})",
                    num(v, &["cold_start", "objects_per_second"]),
                    num(v, &["cold_start", "objects_ceiling_ratio"])
                )
            }),
        ),
        row(
            &format!(
                "Cold start: writes/s (ratio to the ceiling, {} writes/s)",
                ceilings(1.0)
            ),
            cells(&|v| {
                format!(
                    "{:.0} ({:.2})",
                    num(v, &["cold_start", "writes_per_second"]),
                    num(v, &["cold_start", "ceiling_ratio"])
                )
            }),
        ),
    ];
    for (label, cell) in ROWS {
        lines.push(row(label, cells(&|v| cell.show(v))));
    }
    lines.push(String::new());
    lines.extend(DEFINITIONS.iter().map(|l| l.to_string()));
    lines
}

const DEFINITIONS: &[&str] = &[
    "The peers measured run one after the other on the same control plane, in two passes (the order of the columns, then the reverse, so each runs on average at the same point of the store's growth), each with the same objects, 8 reconciles at a time and Lease timings 15 s / 10 s / 2 s (kube-lease-manager: 15 s duration, renewed 13 s before expiry, i.e. every 2 s; it has no renew deadline). Every figure comes from outside the processes, the same way for all: the API server's audit log (requests by user agent, API server clock), a watch on the MyResources, /proc, and the signals sent.",
    "",
    "- Cold start, objects/s and writes/s: the objects, and the successful writes (ConfigMaps, status, Events), from the process's start to its last write, over that time (so each peer's LISTs and Lease acquisition count, before or after it campaigns); the ceiling is a minimal client making the 3 writes of a reconcile from scratch, 8 objects at a time, measured before and after each pass (a pass's ratio uses the two around it). It is a reference, not a bound: a client that pipelines its writes better can pass it. Writes/s counts redundant writes too; objects/s does not.",
    "- Cold start: from spawning the process to the watch seeing every MyResource Ready for its generation.",
    "- Idle latency: objects created one at a time, 50 ms apart, against an idle leader: from the create committed to the leader's first ConfigMap create (its first write; none of the peers exposes a reconcile start) and to its first status write for that object, as the API server received them.",
    "- Memory per cached object: resident memory with N MyResources, N ConfigMaps and N Pods in the namespace (plus the idle-latency objects) minus that of the same role in an empty namespace, divided by the objects. A follower that caches nothing (controller-runtime without warm-up, kube-runtime with kube-lease-manager) shows about 0.",
    "- Failover and handover: three replicas on 10 objects; the leader is SIGKILLed (or SIGTERMed) and a probe object created at once; the time from the signal to the probe's ConfigMap created by another replica.",
    "- Takeover: a follower started beside the leader with everything cached and settled for 8 s; the leader SIGTERMed; LISTs and writes (Leases aside) the new leader sent in the 15 s after acquiring the Lease (or until the probe was handled, if later), the probe's own requests aside. kube's watcher pages its LISTs (500 objects a page), so 3 resources of 2,000 objects take 14 LIST requests; since client-go 1.35 an informer fills its cache with a watch-list (a WATCH with `sendInitialEvents=true`) instead of a LIST: counted as a LIST, since it reads the full state just the same.",
    "- API requests per object: every audited request (writes, LISTs, WATCHes, watch-lists; GETs are not audited) the leader sent in its namespace during the cold start, Leases aside, over N.",
];

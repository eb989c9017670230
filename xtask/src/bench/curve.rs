//! `--curve N1,N2,…`: how the operator's cost grows with the work. At each N, one after
//! another on one control plane (each N in namespaces of its own): the write ceiling and the
//! cold start against it, idle and loaded latency, the SIGTERM and SIGKILL takeovers with N
//! cached, leader and follower memory, a follower's memory per cached Pod. The report holds
//! each N's section, a table of every quantity against N, and one SVG plot per quantity
//! (log–log); it is rewritten after each N, so a run stopped at a large N keeps the smaller.

use std::path::Path;

use anyhow::Result;
use serde_json::{Value, json};

use super::Bench;
use super::plot::{Series, plot};
use super::report::Report;

/// A series of a plotted quantity: its name and its value at a point.
type Line = (&'static str, fn(&Point) -> Option<f64>);

/// One plotted quantity: its file, title, y axis, whether that axis is logarithmic, and
/// its series.
struct Quantity {
    file: &'static str,
    title: &'static str,
    unit: &'static str,
    log_y: bool,
    series: &'static [Line],
}

/// The report of one N.
struct Point {
    n: usize,
    fields: Value,
}

impl Point {
    fn get(&self, path: &[&str]) -> Option<f64> {
        path.iter()
            .try_fold(&self.fields, |v, key| v.get(key))?
            .as_f64()
    }

    /// Bytes per MyResource (with its ConfigMap and Pod) of the resident memory at `path`,
    /// beyond that of a replica with nothing to cache (measured at the same point).
    fn per_object(&self, path: &[&str]) -> Option<f64> {
        let empty = self.get(&["rss_bytes_empty_follower"])?;
        Some((self.get(path)? - empty) / self.n as f64)
    }
}

const QUANTITIES: &[Quantity] = &[
    Quantity {
        file: "cold-start.svg",
        title: "Cold start: to all Ready",
        unit: "seconds",
        log_y: true,
        series: &[
            ("operator", |p| p.get(&["cold_start_seconds"])),
            ("ceiling (same writes)", |p| {
                let rate = p.get(&["ceiling_writes_per_second"])?;
                let writes =
                    p.get(&["cold_start_seconds"])? * p.get(&["operator_writes_per_second"])?;
                Some(writes / rate)
            }),
        ],
    },
    Quantity {
        file: "throughput-ratio.svg",
        title: "Cold start: operator writes/s over the ceiling",
        unit: "ratio",
        log_y: false,
        series: &[("operator / ceiling", |p| p.get(&["throughput_ratio"]))],
    },
    Quantity {
        file: "memory.svg",
        title: "Resident memory",
        unit: "MiB",
        log_y: true,
        series: &[
            ("leader", |p| {
                Some(p.get(&["rss_bytes_leader"])? / 1048576.0)
            }),
            ("follower", |p| {
                Some(p.get(&["rss_bytes_follower"])? / 1048576.0)
            }),
        ],
    },
    Quantity {
        file: "memory-per-object.svg",
        title: "Memory per object (MyResource, ConfigMap, Pod), beyond an empty replica",
        unit: "bytes",
        log_y: true,
        series: &[
            ("leader", |p| p.per_object(&["rss_bytes_leader"])),
            ("follower", |p| p.per_object(&["rss_bytes_follower"])),
            ("cached Pod alone", |p| {
                p.get(&["rss_bytes_per_cached_object"])
            }),
        ],
    },
    Quantity {
        file: "takeover-first.svg",
        title: "Takeover: first reconcile after acquiring",
        unit: "ms",
        log_y: true,
        series: &[
            ("SIGTERM", |p| p.get(&["takeover_first_reconcile_ms"])),
            ("SIGKILL", |p| {
                p.get(&["sigkill_takeover_first_reconcile_ms"])
            }),
        ],
    },
    Quantity {
        file: "takeover-enqueued.svg",
        title: "Takeover: every cached key queued after acquiring",
        unit: "seconds",
        log_y: true,
        series: &[
            ("SIGTERM", |p| p.get(&["takeover_enqueued_seconds"])),
            ("SIGKILL", |p| {
                p.get(&["sigkill_takeover_drain_seconds", "enqueued"])
            }),
        ],
    },
    Quantity {
        file: "takeover-drain.svg",
        title: "Takeover: every key reconciled after acquiring",
        unit: "seconds",
        log_y: true,
        series: &[
            ("SIGTERM", |p| p.get(&["takeover_drain_seconds"])),
            ("SIGKILL", |p| {
                p.get(&["sigkill_takeover_drain_seconds", "drain"])
            }),
        ],
    },
    Quantity {
        file: "latency.svg",
        title: "Idle: watch event → reconcile start",
        unit: "ms",
        log_y: true,
        series: &[
            ("p50", |p| {
                p.get(&[
                    "event_to_reconcile_ms",
                    "idle",
                    "watch_event_to_start",
                    "p50",
                ])
            }),
            ("p99", |p| {
                p.get(&[
                    "event_to_reconcile_ms",
                    "idle",
                    "watch_event_to_start",
                    "p99",
                ])
            }),
        ],
    },
    Quantity {
        file: "cpu.svg",
        title: "Operator CPU per 1,000 reconciles (cold start)",
        unit: "CPU seconds",
        log_y: true,
        series: &[("operator", |p| p.get(&["cpu_seconds_per_1000_reconciles"]))],
    },
];

impl Bench {
    /// The sections at each of `sizes`, then the plots; see the module doc.
    pub(super) async fn curve(
        &mut self,
        sizes: &[usize],
        latency_objects: usize,
        out: &Path,
    ) -> Result<()> {
        let mut points: Vec<Point> = Vec::new();
        let mut sections: Vec<String> = Vec::new();
        for &n in sizes {
            eprintln!("==> curve: {n} objects");
            self.suffix = format!("-{n}");
            let outer = std::mem::replace(&mut self.report, Report::bare());
            let measured = self.at(n, latency_objects).await;
            let (fields, lines) = std::mem::replace(&mut self.report, outer).parts();
            sections.push(format!("## {n} objects\n"));
            sections.extend(lines);
            sections.push(String::new());
            if !fields.as_object().is_some_and(|f| f.is_empty()) {
                points.push(Point { n, fields });
            }
            // Written after each N, so a run stopped at a larger N keeps this one.
            self.curve_report(&points, &sections, out)?.write(out)?;
            measured?;
        }
        self.suffix.clear();
        // The report the caller writes last.
        self.report = self.curve_report(&points, &sections, out)?;
        Ok(())
    }

    async fn at(&mut self, n: usize, latency_objects: usize) -> Result<()> {
        self.throughput_and_takeover(n, latency_objects).await?;
        self.memory_per_pod(n).await
    }

    /// The report so far: the table, the plots (written into `out`) and each N's section.
    fn curve_report(&self, points: &[Point], sections: &[String], out: &Path) -> Result<Report> {
        std::fs::create_dir_all(out)?;
        let mut report = Report::titled("Cost against the number of objects");
        let sizes: Vec<String> = points.iter().map(|p| p.n.to_string()).collect();
        report.quiet(format!("| quantity | {} |", sizes.join(" | ")));
        report.quiet(format!("|---|{}", "---:|".repeat(points.len())));
        for q in QUANTITIES {
            let mut series = Vec::new();
            for (name, value) in q.series {
                let values: Vec<String> = points
                    .iter()
                    .map(|p| value(p).map_or("–".into(), |v| format!("{v:.3}")))
                    .collect();
                report.quiet(format!(
                    "| {} ({name}), {} | {} |",
                    q.title,
                    q.unit,
                    values.join(" | ")
                ));
                series.push(Series {
                    name: name.to_string(),
                    points: points
                        .iter()
                        .filter_map(|p| Some((p.n as f64, value(p)?)))
                        .collect(),
                });
            }
            std::fs::write(out.join(q.file), plot(q.title, q.unit, q.log_y, &series))?;
        }
        report.quiet(String::new());
        for q in QUANTITIES {
            report.quiet(format!("![{}]({})", q.title, q.file));
        }
        report.quiet(String::new());
        for line in sections {
            report.quiet(line.clone());
        }
        let points: Vec<Value> = points
            .iter()
            .map(|p| json!({"objects": p.n, "report": p.fields}))
            .collect();
        report.insert("points", json!(points));
        Ok(report)
    }
}

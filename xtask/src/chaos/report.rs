//! The chaos report: what each round and each fault kind measured and what the checks
//! found, written as `report.json`, `report.md` and the `timeline.svg` of leadership.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use e2e::audit::Acquisition;
use e2e::lease::TEST_TIMINGS;
use e2e::stats;
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

use super::ChaosArgs;
use super::checks::Counts;
use super::checks::Fencing;
use super::schedule::goal_of;
use super::workload::Operations;

/// The report of a run: its rounds (`faults`), per fault kind, and what the checks found.
pub(super) fn build(
    args: &ChaosArgs,
    faults: Vec<Value>,
    fencing: &Fencing,
    counts: &Counts,
    operations: &Operations,
) -> Value {
    let failovers: Vec<f64> = faults
        .iter()
        .filter_map(|f| f["failover_seconds"].as_f64())
        .collect();
    let by_kind = by_kind(&faults);
    let failover = match args.shard_leases {
        None => "fault → a change made right after it handled (the probe's ConfigMap)",
        Some(_) => {
            "fault → a change made right after it handled in every shard the struck replica held"
        }
    };
    json!({
        "failover_measures": failover,
        "rounds": args.rounds,
        "seed": args.seed,
        "lease_timings": TEST_TIMINGS.args(),
        "faults": faults,
        "by_kind": by_kind,
        "overlapping_leadership_writes": fencing.findings.len(),
        "overlapping_examples": fencing.findings.iter().take(10).collect::<Vec<_>>(),
        "writes_examined": fencing.writes_examined,
        "terms_examined": fencing.terms_examined,
        "rounds_missing_goal": faults.iter().filter(|f| f["goal_met"] == false).count(),
        "lost_updates": counts.lost_updates,
        "panics": counts.panics,
        "unexpected_exits": counts.unexpected_exits,
        "rounds_without_single_leader": counts.rounds_without_single_leader,
        "failover_seconds": stats::summary(&failovers),
        "workload_operations": operations.attempted,
        "workload_operations_failed": operations.failed,
        "lease_terms": fencing.terms.len(),
    })
}

/// Writes `report.json`, `report.md` and `timeline.svg` into `out`, and prints the Markdown.
pub(super) fn write(
    out: &Path,
    report: &Value,
    terms: &[Acquisition],
    start: Timestamp,
    end: Timestamp,
) -> Result<()> {
    std::fs::write(out.join("report.json"), serde_json::to_vec_pretty(report)?)?;
    std::fs::write(out.join("report.md"), markdown(report))?;
    std::fs::write(
        out.join("timeline.svg"),
        super::svg::timeline(terms, report, start, end),
    )?;
    println!("{}", markdown(report));
    Ok(())
}

/// Per fault kind: rounds, failover, time to a new leader (and its goal), round duration,
/// overlapping writes and lost updates.
fn by_kind(faults: &[Value]) -> Value {
    let mut kinds: BTreeMap<&str, Vec<&Value>> = BTreeMap::new();
    for f in faults {
        kinds
            .entry(f["kind"].as_str().unwrap_or(""))
            .or_default()
            .push(f);
    }
    let samples = |rounds: &[&Value], field: &str| -> Vec<f64> {
        rounds.iter().filter_map(|f| f[field].as_f64()).collect()
    };
    let total = |rounds: &[&Value], field: &str| -> u64 {
        rounds.iter().filter_map(|f| f[field].as_u64()).sum()
    };
    let map: serde_json::Map<String, Value> = kinds
        .into_iter()
        .map(|(kind, rounds)| {
            let goal = goal_of(kind);
            let entry = json!({
                "rounds": rounds.len(),
                "failover_seconds": stats::summary(&samples(&rounds, "failover_seconds")),
                "new_leader_seconds": stats::summary(&samples(&rounds, "new_leader_seconds")),
                "new_leader_goal_seconds": goal.map(|g| g.as_secs_f64()),
                "round_seconds": stats::summary(&samples(&rounds, "round_seconds")),
                "overlapping_writes": total(&rounds, "overlapping_writes"),
                "lost_updates": total(&rounds, "lost_updates"),
            });
            (kind.to_string(), entry)
        })
        .collect();
    map.into()
}

fn markdown(report: &Value) -> String {
    let seconds = |v: &Value| v.as_f64().map_or("–".to_string(), |s| format!("{s:.2}"));
    let mut md = vec![
        "# Chaos report".to_string(),
        String::new(),
        format!(
            "{} rounds, seed {}, Lease timings {}; {} workload operations, {} of them failed.",
            report["rounds"],
            report["seed"],
            report["lease_timings"],
            report["workload_operations"],
            report["workload_operations_failed"]
        ),
        String::new(),
        "| check | result |".into(),
        "|---|---|".into(),
        format!(
            "| late writes, unattributed writes, unparsed agents (audit log, by effect) | {} |",
            report["overlapping_leadership_writes"]
        ),
        format!(
            "| writes and terms the fencing check examined | {} and {} |",
            report["writes_examined"], report["terms_examined"]
        ),
        format!(
            "| rounds whose failover missed its goal or never came | {} |",
            report["rounds_missing_goal"]
        ),
        format!("| lost updates | {} |", report["lost_updates"]),
        format!("| panics | {} |", report["panics"]),
        format!("| unexpected exits | {} |", report["unexpected_exits"]),
        format!(
            "| rounds without exactly one leader after recovery | {} |",
            report["rounds_without_single_leader"]
        ),
        format!(
            "| failover seconds ({}) | {} |",
            report["failover_measures"].as_str().unwrap_or_default(),
            report["failover_seconds"]
        ),
        String::new(),
        "| round | fault | failover s | new leader s | goal met | late writes | lost updates | converged after s | operations (succeeded) | round s | details |"
            .into(),
        "|---|---|---|---|---|---|---|---|---|---|---|".into(),
    ];
    for f in report["faults"].as_array().into_iter().flatten() {
        md.push(format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} ({}) | {} | {} |",
            f["round"],
            f["kind"].as_str().unwrap_or(""),
            seconds(&f["failover_seconds"]),
            seconds(&f["new_leader_seconds"]),
            f["goal_met"],
            f["overlapping_writes"],
            f["lost_updates"],
            seconds(&f["converge_seconds"]),
            f["operations"],
            f["operations_succeeded"],
            seconds(&f["round_seconds"]),
            f["details"]
        ));
    }
    md.push(String::new());
    md.push(format!(
        "Failover: {}. New leader: fault → first acquisition by another replica (the audit \
         log), none when leadership stayed.",
        report["failover_measures"].as_str().unwrap_or_default()
    ));
    md.push(String::new());
    md.push(
        "| fault | rounds | failover median s | max s | new leader median s | max s | goal s | overlapping writes | round median s |"
            .into(),
    );
    md.push("|---|---|---|---|---|---|---|---|---|".into());
    for (kind, k) in report["by_kind"].as_object().into_iter().flatten() {
        md.push(format!(
            "| {kind} | {} | {} | {} | {} | {} | {} | {} | {} |",
            k["rounds"],
            seconds(&k["failover_seconds"]["median"]),
            seconds(&k["failover_seconds"]["max"]),
            seconds(&k["new_leader_seconds"]["median"]),
            seconds(&k["new_leader_seconds"]["max"]),
            seconds(&k["new_leader_goal_seconds"]),
            k["overlapping_writes"],
            seconds(&k["round_seconds"]["median"]),
        ));
    }
    md.join("\n") + "\n"
}

//! Summaries of measured samples (seconds, milliseconds) for the reports of `cargo xtask
//! bench` and `cargo xtask chaos`: percentiles by nearest rank, and the one summary both
//! write, `{"min", "median", "p99", "max"}`.

use serde_json::{Value, json};

/// The `p`-th percentile (0 to 100) of `samples` by nearest rank: 0 is the minimum, 100
/// the maximum. `samples` must not be empty.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// `{"min", "median", "p99", "max"}` of `samples`; `null` when there are none.
pub fn summary(samples: &[f64]) -> Value {
    if samples.is_empty() {
        return Value::Null;
    }
    json!({
        "min": percentile(samples, 0.0),
        "median": percentile(samples, 50.0),
        "p99": percentile(samples, 99.0),
        "max": percentile(samples, 100.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles_and_the_summary() {
        let samples = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(percentile(&samples, 0.0), 1.0);
        assert_eq!(percentile(&samples, 50.0), 3.0);
        assert_eq!(percentile(&samples, 99.0), 5.0);
        assert_eq!(percentile(&samples, 100.0), 5.0);
        assert_eq!(
            summary(&samples),
            json!({"min": 1.0, "median": 3.0, "p99": 5.0, "max": 5.0})
        );
        assert_eq!(summary(&[]), Value::Null);
    }
}

//! The timeline of a chaos run as SVG: leadership per replica slot over time, faults
//! marked.

use e2e::audit::Acquisition;
use k8s_openapi::jiff::Timestamp;
use serde_json::Value;

/// Leadership per replica over time, faults marked; a gap between bars is a failover.
pub(super) fn timeline(
    terms: &[Acquisition],
    report: &Value,
    start: Timestamp,
    end: Timestamp,
) -> String {
    let total = end.duration_since(start).as_secs_f64().max(1.0);
    let width = 1200.0;
    let x =
        |t: Timestamp| 120.0 + (t.duration_since(start).as_secs_f64() / total) * (width - 140.0);
    let slot_of = |holder: &str| {
        holder
            .strip_prefix("replica-")
            .and_then(|r| r.split('-').next())
            .and_then(|s| s.parse::<usize>().ok())
    };
    let mut svg = vec![format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="260" font-family="sans-serif" font-size="11">"#
    )];
    svg.push(r#"<rect width="100%" height="100%" fill="white"/>"#.into());
    for slot in 0..3 {
        let y = 40 + slot * 50;
        svg.push(format!(
            r#"<text x="10" y="{}">replica slot {slot}</text>"#,
            y + 15
        ));
        svg.push(format!(
            r##"<line x1="120" y1="{0}" x2="{1}" y2="{0}" stroke="#ddd"/>"##,
            y + 10,
            width - 20.0
        ));
    }
    for (i, term) in terms.iter().enumerate() {
        let Some(slot) = slot_of(&term.holder) else {
            continue;
        };
        let until = terms.get(i + 1).map_or(end, |t| t.at);
        let (x0, x1) = (x(term.at), x(until));
        svg.push(format!(
            r##"<rect x="{x0:.1}" y="{}" width="{:.1}" height="20" fill="#4c9be8"><title>{} leads</title></rect>"##,
            40 + slot * 50,
            (x1 - x0).max(1.0),
            term.holder
        ));
    }
    for f in report["faults"].as_array().into_iter().flatten() {
        let Some(at) = f["at"].as_str().and_then(|t| t.parse::<Timestamp>().ok()) else {
            continue;
        };
        let fx = x(at);
        svg.push(format!(r##"<line x1="{fx:.1}" y1="30" x2="{fx:.1}" y2="200" stroke="#d33" stroke-dasharray="3,2"/>"##));
        svg.push(format!(
            r##"<text x="{fx:.1}" y="215" fill="#d33" transform="rotate(45 {fx:.1} 215)">{}</text>"##,
            f["kind"].as_str().unwrap_or("")
        ));
    }
    svg.push(format!(r#"<text x="10" y="20">Leadership per replica slot over {total:.0} s (blue: holds the Lease; red: fault)</text>"#));
    svg.push("</svg>".into());
    svg.join("\n")
}

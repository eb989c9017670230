//! Line plots as SVG for the benchmark reports: one quantity against the number of objects,
//! both axes logarithmic (or the y axis linear, for ratios), one line per series.

/// One line of a plot: its name and its points (x, y); points with y ≤ 0 on a log axis are
/// left out.
pub(super) struct Series {
    pub(super) name: String,
    pub(super) points: Vec<(f64, f64)>,
}

const WIDTH: f64 = 520.0;
const HEIGHT: f64 = 300.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 150.0;
const TOP: f64 = 36.0;
const BOTTOM: f64 = 44.0;
const COLOURS: [&str; 4] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

/// An axis: its range (in log10 units when logarithmic) and where it maps to.
struct Axis {
    log: bool,
    low: f64,
    high: f64,
}

impl Axis {
    fn of(values: impl Iterator<Item = f64>, log: bool) -> Axis {
        let values: Vec<f64> = values
            .filter(|v| v.is_finite() && (!log || *v > 0.0))
            .map(|v| if log { v.log10() } else { v })
            .collect();
        let low = values.iter().copied().fold(f64::INFINITY, f64::min);
        let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let (low, high) = if !low.is_finite() {
            (0.0, 1.0)
        } else if log {
            (low.floor(), high.ceil().max(low.floor() + 1.0))
        } else {
            (
                low.min(0.0),
                if high > low.min(0.0) { high * 1.1 } else { 1.0 },
            )
        };
        Axis { log, low, high }
    }

    /// Where `v` lies between 0 (low) and 1 (high).
    fn fraction(&self, v: f64) -> f64 {
        let v = if self.log { v.log10() } else { v };
        (v - self.low) / (self.high - self.low)
    }

    /// Tick values: every decade on a log axis, five steps on a linear one.
    fn ticks(&self) -> Vec<f64> {
        if self.log {
            (self.low as i32..=self.high as i32)
                .map(|e| 10f64.powi(e))
                .collect()
        } else {
            (0..=5)
                .map(|i| self.low + (self.high - self.low) * f64::from(i) / 5.0)
                .collect()
        }
    }
}

fn label(v: f64) -> String {
    match v.abs() {
        a if a >= 1e6 => format!("{}M", v / 1e6),
        a if a >= 1e3 => format!("{}k", v / 1e3),
        a if a >= 1.0 || a == 0.0 => format!("{v:.0}"),
        a if a >= 0.1 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}

/// `title` with `y_label`, x logarithmic (objects), y logarithmic when `log_y`.
pub(super) fn plot(title: &str, y_label: &str, log_y: bool, series: &[Series]) -> String {
    let all = || series.iter().flat_map(|s| s.points.iter());
    let x = Axis::of(all().map(|p| p.0), true);
    let y = Axis::of(all().map(|p| p.1), log_y);
    let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
    let px = |v: f64| LEFT + x.fraction(v) * plot_w;
    let py = |v: f64| TOP + (1.0 - y.fraction(v)) * plot_h;
    let mut svg = vec![
        format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="11">"#
        ),
        r#"<rect width="100%" height="100%" fill="white"/>"#.into(),
        format!(r#"<text x="{LEFT}" y="20" font-size="13">{title}</text>"#),
    ];
    for t in x.ticks() {
        let at = px(t);
        svg.push(format!(
            r##"<line x1="{at:.1}" y1="{TOP}" x2="{at:.1}" y2="{:.1}" stroke="#eee"/><text x="{at:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 15.0,
            label(t)
        ));
    }
    for t in y.ticks() {
        let at = py(t);
        svg.push(format!(
            r##"<line x1="{LEFT}" y1="{at:.1}" x2="{:.1}" y2="{at:.1}" stroke="#eee"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            at + 4.0,
            label(t)
        ));
    }
    svg.push(format!(
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>"##
    ));
    svg.push(format!(
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">objects (MyResources, as many Pods)</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 8.0
    ));
    svg.push(format!(
        r#"<text transform="translate(14 {:.1}) rotate(-90)" text-anchor="middle">{y_label}</text>"#,
        TOP + plot_h / 2.0
    ));
    for (i, s) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let points: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(|(_, v)| v.is_finite() && (!log_y || *v > 0.0))
            .map(|&(a, b)| (px(a), py(b)))
            .collect();
        let path: Vec<String> = points
            .iter()
            .map(|(a, b)| format!("{a:.1},{b:.1}"))
            .collect();
        svg.push(format!(
            r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
            path.join(" ")
        ));
        for (a, b) in &points {
            svg.push(format!(
                r#"<circle cx="{a:.1}" cy="{b:.1}" r="3" fill="{colour}"/>"#
            ));
        }
        let legend_y = TOP + 12.0 + 16.0 * i as f64;
        svg.push(format!(
            r#"<rect x="{:.1}" y="{:.1}" width="10" height="10" fill="{colour}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            LEFT + plot_w + 10.0,
            legend_y - 9.0,
            LEFT + plot_w + 24.0,
            legend_y,
            s.name
        ));
    }
    svg.push("</svg>".into());
    svg.join("\n") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decades_span_the_data_and_points_land_inside_the_frame() {
        let series = [Series {
            name: "a".into(),
            points: vec![(1000.0, 2.0), (10_000.0, 30.0), (100_000.0, 700.0)],
        }];
        let svg = plot("t", "s", true, &series);
        let x = Axis::of([1000.0, 100_000.0].into_iter(), true);
        assert_eq!(x.ticks(), vec![1000.0, 10_000.0, 100_000.0]);
        let y = Axis::of([2.0, 700.0].into_iter(), true);
        assert_eq!(y.ticks(), vec![1.0, 10.0, 100.0, 1000.0]);
        assert_eq!(svg.matches("<circle").count(), 3);
        for circle in svg.lines().filter(|l| l.starts_with("<circle")) {
            let num = |attr: &str| -> f64 {
                let rest = &circle[circle.find(attr).unwrap() + attr.len() + 2..];
                rest[..rest.find('"').unwrap()].parse().unwrap()
            };
            assert!((LEFT..=WIDTH - RIGHT).contains(&num("cx")), "{circle}");
            assert!((TOP..=HEIGHT - BOTTOM).contains(&num("cy")), "{circle}");
        }
        // A zero on a log axis is left out, not drawn at minus infinity.
        let zero = [Series {
            name: "z".into(),
            points: vec![(1000.0, 0.0), (10_000.0, 1.0)],
        }];
        assert_eq!(plot("t", "s", true, &zero).matches("<circle").count(), 1);
    }
}

//! The benchmark report: each measurement printed as a line, kept as a line of
//! `report.md` and a field of `report.json`.

use std::path::Path;

use anyhow::Result;
use serde_json::Value;

pub(super) struct Report {
    json: serde_json::Map<String, Value>,
    md: Vec<String>,
}

impl Report {
    /// An empty report: the Markdown heading, the machine and the command.
    pub(super) fn new() -> Report {
        Report::titled("Benchmark report")
    }

    /// An empty report under the heading `title`, with the machine and the command
    /// that produced it (the xtask's own arguments, so a rerun reproduces it).
    pub(super) fn titled(title: &str) -> Report {
        let args: Vec<String> = std::env::args().skip(1).collect();
        Report {
            json: serde_json::Map::new(),
            md: vec![
                format!("# {title}"),
                String::new(),
                format!(
                    "Machine: {} cores; command: `cargo xtask {}`",
                    std::thread::available_parallelism().map_or(0, |n| n.get()),
                    args.join(" ")
                ),
                String::new(),
            ],
        }
    }

    /// An empty report without heading: one part of a larger one (see [`Report::parts`]).
    pub(super) fn bare() -> Report {
        Report {
            json: serde_json::Map::new(),
            md: Vec::new(),
        }
    }

    /// The fields and the Markdown lines so far.
    pub(super) fn parts(self) -> (Value, Vec<String>) {
        (Value::Object(self.json), self.md)
    }

    /// A line of `report.md` alone, printed too.
    pub(super) fn line(&mut self, line: String) {
        println!("{line}");
        self.md.push(line);
    }

    /// A line of `report.md` alone, not printed.
    pub(super) fn quiet(&mut self, line: String) {
        self.md.push(line);
    }

    /// One measurement: `line` printed and added to the Markdown, `value` stored as `key`.
    pub(super) fn record(&mut self, key: &str, value: Value, line: String) {
        println!("{line}");
        self.md.push(format!("- {line}"));
        self.json.insert(key.into(), value);
    }

    /// A field of `report.json` alone.
    pub(super) fn insert(&mut self, key: &str, value: Value) {
        self.json.insert(key.into(), value);
    }

    /// Writes `report.json` and `report.md` into `dir`.
    pub(super) fn write(self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(
            dir.join("report.json"),
            serde_json::to_vec_pretty(&Value::Object(self.json))?,
        )?;
        std::fs::write(dir.join("report.md"), self.md.join("\n") + "\n")?;
        eprintln!("wrote {}/report.json and report.md", dir.display());
        Ok(())
    }
}

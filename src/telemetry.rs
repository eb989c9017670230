//! Logging: JSON lines when stderr is not a terminal (or `--log-format json`), readable text
//! otherwise; the filter from RUST_LOG, else `--log-level`.

use std::io::IsTerminal;

use anyhow::{Context, Result};
use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;

/// Installs the global subscriber.
pub fn init(level: &str, format: Option<LogFormat>) -> Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.is_empty() => EnvFilter::try_new(directives),
        _ => EnvFilter::try_new(level),
    }
    .with_context(|| format!("invalid log filter {level:?}"))?;
    let json = match format {
        Some(LogFormat::Json) => true,
        Some(LogFormat::Text) => false,
        None => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init();
    } else {
        builder.init();
    }
    Ok(())
}

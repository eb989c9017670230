//! One audit event (`audit.k8s.io/v1` Event, `ResponseComplete` stage) and the log that
//! holds them, read across the API server's rotated files.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;
use serde_json::Value;

/// The user agent prefix of the operator's requests: `myresource-operator/VERSION (IDENTITY)`.
pub const AGENT: &str = "myresource-operator/";

/// The fields of an audit event the checks read.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditEvent {
    pub verb: String,
    pub user: User,
    #[serde(default)]
    pub user_agent: String,
    #[serde(default)]
    pub object_ref: Option<ObjectRef>,
    #[serde(default)]
    pub response_status: Option<ResponseStatus>,
    pub stage: String,
    /// The path and query as the client sent them.
    #[serde(default, rename = "requestURI")]
    pub request_uri: String,
    pub request_received_timestamp: Timestamp,
    pub stage_timestamp: Timestamp,
    /// The request body (writes of the resources the policy logs at `Request` or above).
    #[serde(default)]
    pub request_object: Option<Value>,
    /// The answer's body (writes of the resources the policy logs at `RequestResponse`).
    #[serde(default)]
    pub response_object: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct User {
    /// Empty for a request that failed authentication (401).
    #[serde(default)]
    pub username: String,
    #[serde(default)]
    pub groups: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectRef {
    #[serde(default)]
    pub resource: String,
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub api_group: String,
    #[serde(default)]
    pub subresource: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ResponseStatus {
    #[serde(default)]
    pub code: u16,
}

impl AuditEvent {
    /// Whether the request changed (or tried to change) state. A token or access review
    /// is a `create` that stores nothing (a secured metrics endpoint asks them of followers
    /// too): not a write.
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        ) && !matches!(
            self.resource(),
            "tokenreviews"
                | "subjectaccessreviews"
                | "selfsubjectaccessreviews"
                | "localsubjectaccessreviews"
                | "selfsubjectreviews"
        )
    }

    /// Whether the request succeeded (2xx).
    pub fn succeeded(&self) -> bool {
        self.code().is_some_and(|c| (200..300).contains(&c))
    }

    /// The answer's status code, if the server recorded one.
    pub fn code(&self) -> Option<u16> {
        self.response_status
            .as_ref()
            .map(|s| s.code)
            .filter(|c| *c != 0)
    }

    /// The operator replica that made the request, from its user agent
    /// `myresource-operator/VERSION (IDENTITY)`.
    pub fn replica(&self) -> Option<&str> {
        let rest = self.user_agent.strip_prefix(AGENT)?;
        let (_, identity) = rest.split_once(" (")?;
        identity.strip_suffix(')').filter(|i| !i.is_empty())
    }

    /// Whether the user agent claims to be the operator but names no replica: such a
    /// request cannot be attributed, so a check that meets one must fail, not skip it.
    pub fn unparsed_agent(&self) -> bool {
        self.user_agent.starts_with(AGENT) && self.replica().is_none()
    }

    /// The resource, or "" when absent.
    pub fn resource(&self) -> &str {
        self.object_ref.as_ref().map_or("", |o| o.resource.as_str())
    }

    /// The object's namespace, or "" when cluster-scoped or absent.
    pub fn namespace(&self) -> &str {
        self.object_ref
            .as_ref()
            .map_or("", |o| o.namespace.as_str())
    }

    /// The object's name, or "" when absent (a create's name is in its body).
    pub fn name(&self) -> &str {
        self.object_ref.as_ref().map_or("", |o| o.name.as_str())
    }

    /// Whether the request is about a Lease.
    pub fn is_lease(&self) -> bool {
        self.resource() == "leases"
            && self
                .object_ref
                .as_ref()
                .is_some_and(|o| o.api_group == "coordination.k8s.io")
    }

    /// The server-side `timeout` the client gave the request (`timeout=1500ms`), if any.
    pub fn timeout(&self) -> Option<Duration> {
        let (_, query) = self.request_uri.split_once('?')?;
        let value = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("timeout="))?;
        parse_go_duration(value)
    }

    /// The event without its request and response bodies (most of its memory).
    pub fn without_bodies(self) -> AuditEvent {
        AuditEvent {
            request_object: None,
            response_object: None,
            ..self
        }
    }

    /// A short description for a failure message.
    pub fn describe(&self) -> String {
        let o = self.object_ref.clone().unwrap_or_default();
        let sub = if o.subresource.is_empty() {
            String::new()
        } else {
            format!("/{}", o.subresource)
        };
        format!(
            "{} {} {}{sub} {}/{} → {} (received {}, answered {})",
            self.user_agent,
            self.verb,
            o.resource,
            o.namespace,
            o.name,
            self.code().map_or("no status".into(), |c| c.to_string()),
            self.request_received_timestamp,
            self.stage_timestamp
        )
    }
}

/// Parses the Go durations clients send as `timeout` (`1500ms`, `4s`, `1m30s`, `250us`).
fn parse_go_duration(text: &str) -> Option<Duration> {
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .filter(|n| *n > 0)?;
        let number: f64 = rest[..digits].parse().ok()?;
        let unit_len = rest[digits..]
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len() - digits);
        let unit = match &rest[digits..digits + unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += Duration::from_secs_f64(number * unit);
        rest = &rest[digits + unit_len..];
    }
    Some(total)
}

/// Every completed event of an audit log, oldest first, across the files the API server
/// rotated it into.
#[derive(Debug, Clone, Default)]
pub struct Log {
    pub events: Vec<AuditEvent>,
    /// The files read, oldest first.
    pub files: Vec<PathBuf>,
}

impl Log {
    /// Fails unless the log holds an event at or before `from`: a log whose start was lost
    /// (rotated away, truncated) cannot vouch for what happened in the window.
    pub fn covers(&self, from: Timestamp) -> Result<()> {
        let first = self.events.iter().map(|e| e.stage_timestamp).min();
        ensure!(
            first.is_some_and(|f| f <= from),
            "the audit log ({:?}) begins at {first:?}, after {from}: it does not cover the window",
            self.files
        );
        Ok(())
    }
}

impl std::ops::Deref for Log {
    type Target = [AuditEvent];
    fn deref(&self) -> &[AuditEvent] {
        &self.events
    }
}

/// Reads the audit log at `path` and every rotated file beside it (`audit-<time>.log`,
/// as the API server's log rotation names them), oldest first; keeps the events of the
/// `ResponseComplete` stage.
pub fn read(path: &Path) -> Result<Log> {
    read_filtered(path, Some)
}

/// [`read`], keeping what `keep` returns for each `ResponseComplete` event: a line at a time,
/// so a log of millions of events (100,000 objects) costs only what is kept. Callers that
/// count requests keep [`AuditEvent::without_bodies`].
pub fn read_filtered(
    path: &Path,
    mut keep: impl FnMut(AuditEvent) -> Option<AuditEvent>,
) -> Result<Log> {
    let dir = path.parent().context("the audit log's folder")?;
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .context("the audit log's name")?;
    let ext = path.extension().and_then(|s| s.to_str()).unwrap_or("");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.strip_prefix(stem)
                    .and_then(|r| r.strip_prefix('-'))
                    .is_some_and(|r| r.ends_with(&format!(".{ext}")))
            })
        })
        .collect();
    // The rotated files' names carry their time: in name order they are in time order.
    files.sort();
    files.push(path.to_path_buf());
    let mut events = Vec::new();
    for file in &files {
        let reading = || format!("reading {}", file.display());
        let lines = BufReader::new(std::fs::File::open(file).with_context(reading)?).lines();
        for line in lines {
            let line = line.with_context(reading)?;
            if line.trim().is_empty() {
                continue;
            }
            let event: AuditEvent = serde_json::from_str(&line)
                .with_context(|| format!("parsing audit line {line}"))?;
            if event.stage == "ResponseComplete" {
                events.extend(keep(event));
            }
        }
    }
    Ok(Log { events, files })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse() {
        assert_eq!(
            parse_go_duration("1500ms"),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(parse_go_duration("4s"), Some(Duration::from_secs(4)));
        assert_eq!(parse_go_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("4"), None);
        assert_eq!(parse_go_duration("s"), None);
    }

    #[test]
    fn rotated_files_are_read_oldest_first_and_coverage_is_checked() {
        let dir = std::env::temp_dir().join(format!("audit-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let line = |at: &str| {
            format!(
                r#"{{"verb":"get","user":{{"username":"u"}},"stage":"ResponseComplete","requestReceivedTimestamp":"{at}","stageTimestamp":"{at}"}}"#
            )
        };
        std::fs::write(
            dir.join("audit-2026-01-01T00-00-01.000.log"),
            line("2026-01-01T00:00:00Z"),
        )
        .unwrap();
        std::fs::write(
            dir.join("audit-2026-01-01T00-00-02.000.log"),
            line("2026-01-01T00:00:01Z"),
        )
        .unwrap();
        let with_body = line("2026-01-01T00:00:02Z").replacen('{', r#"{"requestObject":{},"#, 1);
        std::fs::write(dir.join("audit.log"), with_body).unwrap();
        std::fs::write(dir.join("audit-policy.json"), "{}").unwrap();
        let log = read(&dir.join("audit.log")).unwrap();
        let at: Vec<String> = log.iter().map(|e| e.stage_timestamp.to_string()).collect();
        assert_eq!(
            at,
            [
                "2026-01-01T00:00:00Z",
                "2026-01-01T00:00:01Z",
                "2026-01-01T00:00:02Z"
            ]
        );
        assert!(log.covers("2026-01-01T00:00:00Z".parse().unwrap()).is_ok());
        assert!(log[2].request_object.is_some());
        // A filtered read keeps what the filter returns, without bodies when asked.
        let first = "2026-01-01T00:00:00Z".parse().unwrap();
        let later = read_filtered(&dir.join("audit.log"), |e| {
            (e.stage_timestamp > first).then(|| e.without_bodies())
        })
        .unwrap();
        assert_eq!(later.len(), 2);
        assert!(later.iter().all(|e| e.request_object.is_none()));
        // Without the rotated files, the window's start is lost: the check says so.
        std::fs::remove_file(dir.join("audit-2026-01-01T00-00-01.000.log")).unwrap();
        let log = read(&dir.join("audit.log")).unwrap();
        assert!(log.covers("2026-01-01T00:00:00Z".parse().unwrap()).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_operator_agent_without_an_identity_is_unparsed() {
        let event = |ua: &str| -> AuditEvent {
            serde_json::from_value(serde_json::json!({
                "verb": "patch", "user": {"username": "u"}, "userAgent": ua,
                "stage": "ResponseComplete",
                "requestReceivedTimestamp": "2026-01-01T00:00:00Z",
                "stageTimestamp": "2026-01-01T00:00:00Z",
            }))
            .unwrap()
        };
        assert_eq!(event("myresource-operator/0.1.0 (a)").replica(), Some("a"));
        assert!(!event("myresource-operator/0.1.0 (a)").unparsed_agent());
        assert!(event("myresource-operator/0.1.0").unparsed_agent());
        assert!(event("myresource-operator/0.1.0 ()").unparsed_agent());
        assert!(!event("kubectl/v1.37.2").unparsed_agent());
    }
}

//! Reading the apiserver's audit log (JSON lines, `audit.k8s.io/v1` Event).

use std::path::Path;

use anyhow::{Context, Result};
use serde::Deserialize;

/// The fields of an audit event the tests read.
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
    pub request_received_timestamp: String,
    pub stage_timestamp: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct User {
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
    /// Whether the request changed (or tried to change) state.
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        )
    }

    /// The object's namespace, or "" when cluster-scoped or absent.
    pub fn namespace(&self) -> &str {
        self.object_ref
            .as_ref()
            .map_or("", |o| o.namespace.as_str())
    }
}

/// Every completed event in the log (`ResponseComplete` stage).
pub fn read(path: &Path) -> Result<Vec<AuditEvent>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut events = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let event: AuditEvent =
            serde_json::from_str(line).with_context(|| format!("parsing audit line {line}"))?;
        if event.stage == "ResponseComplete" {
            events.push(event);
        }
    }
    Ok(events)
}

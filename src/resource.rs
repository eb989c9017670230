//! The `MyResource` custom resource (`trstringer.com/v1`, compatible with the tutorial) and
//! its CRD, generated from these types.
//!
//! Invariants: the generated schema is structural, every field has a description (doc
//! comments become `kubectl explain` text), and the API server itself rejects bad specs
//! (empty or over-long `message`, `someValue` outside int32, unknown fields under strict
//! field validation), so the operator never sees them.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The label that ties a Pod to the MyResource of that name in the Pod's namespace.
pub const POD_LABEL: &str = "trstringer.com/myresource";

/// The label on every ConfigMap this operator owns (what its ConfigMap cache selects).
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Its value.
pub const MANAGED_BY: &str = "myresource-operator";

/// The field manager of every write this operator makes.
pub const FIELD_MANAGER: &str = "myresource-operator";

/// The longest `spec.message` the API server accepts.
pub const MAX_MESSAGE_LEN: u32 = 1024;

/// Desired state of a MyResource.
// clippy reads the repeated `type_` keys of separate printcolumn(...) groups as duplicates.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "trstringer.com",
    version = "v1",
    kind = "MyResource",
    plural = "myresources",
    shortname = "myr",
    namespaced,
    status = "MyResourceStatus",
    derive = "PartialEq",
    doc = "A message and a value that the operator publishes as a ConfigMap of the same name, \
           with a count of the Pods labelled `trstringer.com/myresource=<name>`.",
    printcolumn(name = "Message", type_ = "string", json_path = ".spec.message"),
    printcolumn(name = "Value", type_ = "integer", json_path = ".spec.someValue"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Pods-Ready",
        type_ = "integer",
        description = "Labelled Pods whose Ready condition is True",
        json_path = ".status.pods.ready"
    ),
    printcolumn(
        name = "Pods",
        type_ = "integer",
        description = "Labelled Pods in the namespace",
        json_path = ".status.pods.total"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct MyResourceSpec {
    /// Text copied into the `message` key of the ConfigMap the operator keeps for this
    /// resource. Required; 1 to 1024 characters.
    #[schemars(length(min = 1, max = 1024))]
    pub message: String,
    /// A number copied into the `someValue` key of that ConfigMap. Required; a 32-bit signed
    /// integer (-2147483648 to 2147483647).
    #[schemars(range(min = -2147483648, max = 2147483647))]
    pub some_value: i32,
}

/// Observed state of a MyResource, written only by the operator.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MyResourceStatus {
    /// The metadata.generation of the spec that this status describes. When it is lower than
    /// metadata.generation the operator has not acted on the latest spec yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The latest observations of the resource's state. `Ready` is True when the ConfigMap
    /// matches the spec; when False, its reason and message say what is wrong and what to do.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Name of the ConfigMap (in the same namespace) that the operator keeps in step with the
    /// spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_name: Option<String>,
    /// Counts of the Pods in this namespace labelled `trstringer.com/myresource=<name>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<PodCounts>,
}

/// How many labelled Pods exist and how many of them are Ready.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct PodCounts {
    /// Labelled Pods in the namespace, in any phase.
    pub total: i32,
    /// Labelled Pods whose Ready condition is True.
    pub ready: i32,
}

impl MyResource {
    /// Whether its status does not yet describe its latest spec (a new object, or a spec
    /// changed since the last reconcile that wrote the status): the work a takeover looks at
    /// first.
    pub fn awaits_reconcile(&self) -> bool {
        self.status.as_ref().and_then(|s| s.observed_generation) != self.metadata.generation
    }
}

/// The CRD for MyResource.
pub fn crd() -> CustomResourceDefinition {
    MyResource::crd()
}

/// The CRD as YAML, as `myresource-operator crd` prints it and `deploy/crd.yaml` holds it.
pub fn crd_yaml() -> String {
    let yaml = serde_saphyr::to_string(&crd()).expect("a CRD serializes to YAML");
    format!("# Generated by `myresource-operator crd`; do not edit.\n---\n{yaml}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_in_crd_matches_the_types() {
        let checked_in = include_str!("../deploy/crd.yaml");
        assert!(
            checked_in == crd_yaml(),
            "deploy/crd.yaml is stale: run `cargo run -- crd > deploy/crd.yaml`"
        );
    }

    #[test]
    fn every_schema_property_has_a_description() {
        let schema = serde_json::to_value(crd().spec.versions[0].schema.clone()).unwrap();
        let mut missing = Vec::new();
        walk(&schema["openAPIV3Schema"], "", &mut missing);
        assert!(
            missing.is_empty(),
            "fields without description: {missing:?}"
        );
    }

    fn walk(node: &serde_json::Value, path: &str, missing: &mut Vec<String>) {
        if let Some(props) = node.get("properties").and_then(|p| p.as_object()) {
            for (name, prop) in props {
                let here = format!("{path}.{name}");
                // apiVersion/kind/metadata are described by Kubernetes itself.
                let standard =
                    path.is_empty() && ["apiVersion", "kind", "metadata"].contains(&name.as_str());
                if !standard && prop.get("description").is_none() {
                    missing.push(here.clone());
                }
                walk(prop, &here, missing);
            }
        }
        if let Some(items) = node.get("items") {
            walk(items, &format!("{path}[]"), missing);
        }
    }

    #[test]
    fn spec_validation_is_in_the_schema() {
        let schema = serde_json::to_value(crd().spec.versions[0].schema.clone()).unwrap();
        let spec = &schema["openAPIV3Schema"]["properties"]["spec"];
        assert_eq!(
            spec["required"],
            serde_json::json!(["message", "someValue"])
        );
        assert_eq!(spec["properties"]["message"]["minLength"], 1);
        assert_eq!(spec["properties"]["message"]["maxLength"], MAX_MESSAGE_LEN);
        let bound = |b: &str| spec["properties"]["someValue"][b].as_f64();
        assert_eq!(bound("maximum"), Some(f64::from(i32::MAX)));
        assert_eq!(bound("minimum"), Some(f64::from(i32::MIN)));
    }

    #[test]
    fn an_object_awaits_a_reconcile_until_its_status_observes_its_generation() {
        let spec = MyResourceSpec {
            message: "m".into(),
            some_value: 1,
        };
        let mut mr = MyResource::new("a", spec);
        mr.metadata.generation = Some(2);
        assert!(mr.awaits_reconcile(), "new: no status");
        mr.status = Some(MyResourceStatus {
            observed_generation: Some(1),
            ..MyResourceStatus::default()
        });
        assert!(mr.awaits_reconcile(), "the spec changed after the status");
        mr.status.as_mut().unwrap().observed_generation = Some(2);
        assert!(!mr.awaits_reconcile());
    }
}

//! Who may read the operator's metrics, as a test sets it up: ServiceAccount tokens
//! (TokenRequest), ClusterRole bindings, and the API server's own review of them.

use std::time::Duration;

use anyhow::{Result, anyhow};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};

use crate::wait::poll;

/// Creates the ServiceAccount `name` in `namespace` (if absent) and returns a token for it
/// (TokenRequest, one hour).
pub async fn service_account_token(client: &Client, namespace: &str, name: &str) -> Result<String> {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    if accounts.get_opt(name).await?.is_none() {
        let mut account = ServiceAccount::default();
        account.metadata.name = Some(name.into());
        accounts.create(&PostParams::default(), &account).await?;
    }
    let request = TokenRequest {
        spec: TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        },
        ..Default::default()
    };
    let issued = accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await?;
    Ok(issued
        .status
        .ok_or_else(|| anyhow!("a TokenRequest answer without status"))?
        .token)
}

/// Creates the ClusterRole `name` granting `get` on the non-resource URL `/metrics` (what
/// the chart's metrics-reader role grants), if absent.
pub async fn create_metrics_reader(client: &Client, name: &str) -> Result<()> {
    let roles: Api<ClusterRole> = Api::all(client.clone());
    if roles.get_opt(name).await?.is_some() {
        return Ok(());
    }
    let mut role = ClusterRole::default();
    role.metadata.name = Some(name.into());
    role.rules = Some(vec![PolicyRule {
        non_resource_urls: Some(vec!["/metrics".into()]),
        verbs: vec!["get".into()],
        ..Default::default()
    }]);
    roles.create(&PostParams::default(), &role).await?;
    Ok(())
}

/// Binds the ClusterRole `role` (which may not exist yet) to the ServiceAccount `account`
/// of `namespace`, as the ClusterRoleBinding `<namespace>-<role>`, if absent.
pub async fn bind_cluster_role(
    client: &Client,
    namespace: &str,
    role: &str,
    account: &str,
) -> Result<()> {
    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    let name = format!("{namespace}-{role}");
    if bindings.get_opt(&name).await?.is_some() {
        return Ok(());
    }
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(name),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: role.into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: account.into(),
            namespace: Some(namespace.into()),
            ..Default::default()
        }]),
    };
    bindings.create(&PostParams::default(), &binding).await?;
    Ok(())
}

/// Waits until the API server allows the ServiceAccount `account` of `namespace` `get` on
/// the non-resource URL `path` (a binding is in force).
pub async fn wait_allowed(
    client: &Client,
    namespace: &str,
    account: &str,
    path: &str,
) -> Result<()> {
    let user = format!("system:serviceaccount:{namespace}:{account}");
    let reviews: Api<SubjectAccessReview> = Api::all(client.clone());
    poll(
        "the binding to be in force",
        Duration::from_secs(30),
        || async {
            let review = SubjectAccessReview {
                spec: SubjectAccessReviewSpec {
                    user: Some(user.clone()),
                    non_resource_attributes: Some(NonResourceAttributes {
                        path: Some(path.into()),
                        verb: Some("get".into()),
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            let decided = reviews.create(&PostParams::default(), &review).await?;
            Ok(decided.status.is_some_and(|s| s.allowed).then_some(()))
        },
    )
    .await
}

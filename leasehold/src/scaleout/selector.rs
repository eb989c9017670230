//! Asking the API server for one shard: `shardSelector` on lists and watches (KEP-5866,
//! feature gate `ShardedListAndWatch`), whether the server serves it, and the query
//! parameter kube's `watcher::Config` does not know.
//!
//! A server without the gate ignores the parameter and returns everything: filter on the
//! client side then ([`crate::scaleout::ShardKey::shard_of_uid`]), which
//! [`serves_shard_selector`] tells you to do.

use http::{Method, Request};
use kube::Client;

/// Percent-encodes a query parameter's value.
pub fn encode_query_value(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `client`, with `name=value` added to the query of every GET (lists and watches): how a
/// watch passes a parameter kube's `watcher::Config` does not know, such as
/// `shardSelector`.
pub fn with_query(client: &Client, name: &str, value: &str) -> Client {
    let base = client.clone();
    let param = format!("{name}={}", encode_query_value(value));
    let service = tower::service_fn(move |mut request: Request<kube::client::Body>| {
        if request.method() == Method::GET {
            let uri = request.uri();
            let query = match uri.query() {
                Some(q) if !q.is_empty() => format!("{q}&{param}"),
                _ => param.clone(),
            };
            let mut parts = uri.clone().into_parts();
            parts.path_and_query = format!("{}?{query}", uri.path()).parse().ok();
            if let Ok(uri) = http::Uri::from_parts(parts) {
                *request.uri_mut() = uri;
            }
        }
        let base = base.clone();
        async move { base.send(request).await }
    });
    Client::new(service, client.default_namespace())
}

/// Whether the API server filters lists by `shardSelector` (KEP-5866, feature gate
/// `ShardedListAndWatch`): a server that does echoes the selector in the list's
/// `metadata.shardInfo`; one that does not ignores the parameter.
pub async fn serves_shard_selector(
    client: &Client,
    path: &str,
    selector: &str,
) -> Result<bool, kube::Error> {
    let uri = format!(
        "{path}?limit=1&shardSelector={}",
        encode_query_value(selector)
    );
    let request = Request::get(uri)
        .body(Vec::new())
        .map_err(kube::Error::HttpError)?;
    let text = client.request_text(request).await?;
    let list: serde_json::Value = serde_json::from_str(&text).map_err(kube::Error::SerdeError)?;
    Ok(list["metadata"]["shardInfo"]["selector"].is_string())
}

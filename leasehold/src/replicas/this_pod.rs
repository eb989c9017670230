//! The Pod this replica runs in, as its ServiceAccount token's claims describe it
//! (`kubernetes.io.serviceaccount` and `kubernetes.io.pod`), read without verifying the
//! token (the API server does that for every request the token carries).
//!
//! - The ServiceAccount owns the Lease: the replicas create their Lease at run time, so
//!   `helm uninstall` (which deletes what the chart made) would leave it behind; with the
//!   chart's ServiceAccount as its owner the garbage collector removes it with the release.
//!   No permission on the ServiceAccount is needed, as the reference does not block its
//!   deletion.
//! - The Pod's uid and the process's instance token go on every Lease this replica writes,
//!   so that followers can tell the holder's Pod from a later one of the same name, and its
//!   process from a later one in the same container (see [`crate::replicas::exit`]).
//! - The Pod's name and namespace: a replica watches its own Pod and its peers
//!   ([`crate::replicas`]) and stops as soon as its Pod is being deleted, before the
//!   kubelet's SIGTERM arrives, so a leader Pod's deletion hands over as fast as the API
//!   server can tell the replicas.
//!
//! Outside a Pod (a kubeconfig, a user's token) there is neither: the Lease has no owner and
//! crashes are detected by lease expiry only.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::replicas::exit;

/// What the token says about this replica's Pod.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodInfo {
    /// The Pod's ServiceAccount, as an owner reference.
    pub service_account: OwnerReference,
    /// The Pod's name.
    pub name: String,
    /// The Pod's namespace.
    pub namespace: String,
    /// The Pod's uid.
    pub uid: String,
    /// This process's instance token, announced in the container's termination message
    /// ([`crate::replicas::exit`]); `None` when that failed (no crash proof is offered).
    pub instance: Option<String>,
}

impl PodInfo {
    /// The annotations naming this replica's Pod and process on every Lease it writes.
    pub fn annotations(&self) -> BTreeMap<String, String> {
        let mut annotations = BTreeMap::from([(exit::HOLDER_UID.into(), self.uid.clone())]);
        if let Some(instance) = &self.instance {
            annotations.insert(exit::HOLDER_INSTANCE.into(), instance.clone());
        }
        annotations
    }
}

/// Where a Pod's ServiceAccount token is mounted.
const TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

/// This replica's Pod; `None` outside a Pod.
pub fn this_pod() -> Result<Option<PodInfo>, String> {
    match std::fs::read_to_string(TOKEN) {
        Ok(token) => from_token(token.trim()).map(Some),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(err) => Err(format!("reading {TOKEN}: {err}")),
    }
}

/// The Pod and ServiceAccount a (projected) ServiceAccount token names.
fn from_token(token: &str) -> Result<PodInfo, String> {
    let payload = token
        .split('.')
        .nth(1)
        .ok_or("the ServiceAccount token is not a JWT")?;
    let claims: serde_json::Value = serde_json::from_slice(&base64url(payload)?)
        .map_err(|e| format!("the ServiceAccount token's claims are not JSON: {e}"))?;
    let field = |object: &str, name: &str| {
        claims["kubernetes.io"][object][name]
            .as_str()
            .map(String::from)
            .ok_or_else(|| format!("the ServiceAccount token names no {object} {name}"))
    };
    Ok(PodInfo {
        service_account: OwnerReference {
            api_version: "v1".into(),
            kind: "ServiceAccount".into(),
            name: field("serviceaccount", "name")?,
            uid: field("serviceaccount", "uid")?,
            controller: None,
            block_owner_deletion: None,
        },
        name: field("pod", "name")?,
        namespace: claims["kubernetes.io"]["namespace"]
            .as_str()
            .map(String::from)
            .ok_or("the ServiceAccount token names no namespace")?,
        uid: field("pod", "uid")?,
        instance: None,
    })
}

/// Decodes unpadded base64url (RFC 4648 §5), as JWTs use it.
fn base64url(text: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut bits, mut count) = (0u32, 0u32);
    for c in text.bytes().filter(|&c| c != b'=') {
        let value = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' => 62,
            b'_' => 63,
            _ => return Err(format!("the ServiceAccount token holds {:?}", c as char)),
        };
        bits = (bits << 6) | u32::from(value);
        count += 6;
        if count >= 8 {
            count -= 8;
            out.push((bits >> count) as u8);
            bits &= (1 << count) - 1;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64url_decodes_every_length() {
        assert_eq!(base64url("").unwrap(), b"");
        assert_eq!(base64url("Zg").unwrap(), b"f");
        assert_eq!(base64url("Zm8").unwrap(), b"fo");
        assert_eq!(base64url("Zm9v").unwrap(), b"foo");
        assert_eq!(base64url("Zm9vYg==").unwrap(), b"foob");
        assert_eq!(base64url("-_8").unwrap(), [0xfb, 0xff]);
        assert!(base64url("a+b").is_err());
    }

    #[test]
    fn the_token_names_the_service_account_and_the_pod() {
        // The claims of a projected token, as kube-apiserver 1.37 issues them.
        let claims = r#"{"aud":["https://kubernetes.default.svc"],"kubernetes.io":{"namespace":"mro","pod":{"name":"p","uid":"1"},"serviceaccount":{"name":"mro-sa","uid":"0a1b"}},"sub":"system:serviceaccount:mro:mro-sa"}"#;
        let encode = |bytes: &[u8]| {
            const ALPHABET: &[u8] =
                b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
            let mut out = String::new();
            for chunk in bytes.chunks(3) {
                let n = chunk.iter().fold(0u32, |acc, &b| (acc << 8) | u32::from(b))
                    << (8 * (3 - chunk.len()));
                for i in 0..=chunk.len() {
                    out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
                }
            }
            out
        };
        let token = format!("{}.{}.sig", encode(b"{}"), encode(claims.as_bytes()));
        let pod = from_token(&token).unwrap();
        assert_eq!(
            (pod.name.as_str(), pod.namespace.as_str(), pod.uid.as_str()),
            ("p", "mro", "1")
        );
        let owner = pod.service_account;
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("ServiceAccount", "mro-sa", "0a1b")
        );
        assert_eq!(
            owner.block_owner_deletion, None,
            "needs no delete permission"
        );
        assert!(from_token("not-a-jwt").is_err());
        let no_account = format!("x.{}.y", encode(br#"{"sub":"me"}"#));
        assert!(
            from_token(&no_account)
                .unwrap_err()
                .contains("serviceaccount")
        );
    }
}

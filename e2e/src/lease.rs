//! The replicas' Lease as tests, the demo, chaos and bench see it: its name, who holds it,
//! and the Lease timings replicas are started with.

use std::time::Duration;

use anyhow::Result;
use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};

use crate::wait::poll;

/// The Lease's name (the operator's default `--lease-name`).
pub const NAME: &str = "myresource-operator";

/// Lease timings, as the operator's `--lease-duration`, `--renew-deadline` and
/// `--retry-period` flags take them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timings {
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

/// The test timings, 4 s lease, 3 s renew deadline, 1 s retry: short, so a failover takes
/// seconds.
pub const TEST_TIMINGS: Timings = Timings::secs(4, 3, 1);

/// The operator's own defaults, 15 s / 10 s / 2 s.
pub const DEFAULT_TIMINGS: Timings = Timings::secs(15, 10, 2);

impl Timings {
    /// Timings in whole seconds: lease duration, renew deadline, retry period.
    pub const fn secs(lease_duration: u64, renew_deadline: u64, retry_period: u64) -> Timings {
        Timings {
            lease_duration: Duration::from_secs(lease_duration),
            renew_deadline: Duration::from_secs(renew_deadline),
            retry_period: Duration::from_secs(retry_period),
        }
    }

    /// The three durations in whole seconds.
    pub fn as_secs(&self) -> (u64, u64, u64) {
        (
            self.lease_duration.as_secs(),
            self.renew_deadline.as_secs(),
            self.retry_period.as_secs(),
        )
    }

    /// The operator's flags for these timings: `--lease-duration=4s`, `--renew-deadline=3s`,
    /// `--retry-period=1s`.
    pub fn args(&self) -> [String; 3] {
        let (lease, renew, retry) = self.as_secs();
        [
            format!("--lease-duration={lease}s"),
            format!("--renew-deadline={renew}s"),
            format!("--retry-period={retry}s"),
        ]
    }
}

/// The holder of the Lease [`NAME`] in `namespace`: `None` when there is no Lease, `""` when
/// it was released (or its holder cleared).
pub async fn holder(client: &Client, namespace: &str) -> Result<Option<String>> {
    holder_of(client, namespace, NAME).await
}

/// The holder of the Lease `name` in `namespace`, as [`holder`] tells it.
pub async fn holder_of(client: &Client, namespace: &str, name: &str) -> Result<Option<String>> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    Ok(leases
        .get_opt(name)
        .await?
        .map(|l| l.spec.and_then(|s| s.holder_identity).unwrap_or_default()))
}

/// Waits up to `limit` until the Lease in `namespace` names a holder (other than `not`,
/// when given), and returns it.
pub async fn wait_for_holder(
    client: &Client,
    namespace: &str,
    not: Option<&str>,
    limit: Duration,
) -> Result<String> {
    poll("a leader", limit, || async {
        Ok(holder(client, namespace)
            .await?
            .filter(|h| !h.is_empty() && Some(h.as_str()) != not))
    })
    .await
}

/// The `acquireTime` of the Lease in `namespace` (when its current term began), as written.
pub async fn acquire_time(client: &Client, namespace: &str) -> Result<Option<String>> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    Ok(leases
        .get_opt(NAME)
        .await?
        .and_then(|l| l.spec?.acquire_time)
        .map(|t| t.0.to_string()))
}

/// Waits up to `limit` until a term other than the one that began at `term` (an
/// [`acquire_time`]) holds the Lease; returns its holder.
pub async fn wait_for_new_term(
    client: &Client,
    namespace: &str,
    term: &str,
    limit: Duration,
) -> Result<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    poll("a new term", limit, || async {
        let spec = leases.get_opt(NAME).await?.and_then(|l| l.spec);
        Ok(spec.and_then(|s| {
            let began = s.acquire_time?.0.to_string();
            let holder = s.holder_identity.filter(|h| !h.is_empty())?;
            (began != term).then_some(holder)
        }))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_as_flags() {
        assert_eq!(
            TEST_TIMINGS.args(),
            [
                "--lease-duration=4s",
                "--renew-deadline=3s",
                "--retry-period=1s"
            ]
        );
        assert_eq!(DEFAULT_TIMINGS.as_secs(), (15, 10, 2));
    }
}

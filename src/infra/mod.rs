//! What the operator runs on: the command line ([`cli`]), the Kubernetes clients
//! ([`kubeclient`]), metrics ([`metrics`]) and the HTTP endpoints that serve them
//! ([`endpoints`]) over TLS ([`tls`]) to the scrapers the cluster authorises
//! ([`access`]), logs and traces ([`telemetry`]).

pub mod access;
pub mod cli;
pub mod endpoints;
pub mod kubeclient;
pub mod metrics;
pub mod telemetry;
pub mod tls;

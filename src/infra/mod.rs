//! What the operator runs on: the command line ([`cli`]), the Kubernetes clients
//! ([`kubeclient`]), metrics ([`metrics`]) and the HTTP endpoints that serve them
//! ([`endpoints`]), logs and traces ([`telemetry`]).

pub mod cli;
pub mod endpoints;
pub mod kubeclient;
pub mod metrics;
pub mod telemetry;

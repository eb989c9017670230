//! The three replica slots: each replica's proxies to the API server, its configuration,
//! starting and replacing the process in a slot, and finding the slot that leads.

use std::time::Duration;

use anyhow::Result;
use e2e::kubeconfig::write_kubeconfig_via;
use e2e::lease::{self, TEST_TIMINGS, Timings};
use e2e::operator::{Operator, OperatorConfig};
use e2e::overload_proxy::OverloadProxy;
use e2e::proxy::Proxy;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

use super::{Chaos, NAMESPACE};

/// One replica slot: its proxies to the API server (the replica's kubeconfig names the TCP
/// proxy, which forwards to the overload proxy), its Lease timings and the process
/// currently in it.
pub(super) struct Slot {
    pub(super) proxy: Proxy,
    pub(super) api: OverloadProxy,
    timings: Timings,
    pub(super) operator: Operator,
    generation: usize,
}

impl Chaos {
    /// Starts the three replicas, each behind proxies of its own, and waits for a leader.
    pub(super) async fn start_replicas(&mut self) -> Result<()> {
        for slot in 0..3 {
            let proxies = self.start_proxies().await?;
            let started = self.start_slot(slot, 0, proxies, TEST_TIMINGS).await?;
            self.slots.push(started);
        }
        self.leader_slot(Duration::from_secs(30)).await?;
        Ok(())
    }

    fn replica_config(
        &self,
        slot: usize,
        generation: usize,
        proxy: &Proxy,
        timings: &Timings,
    ) -> Result<OperatorConfig> {
        let kubeconfig = self.cluster.dir.join(format!("slot-{slot}.kubeconfig"));
        write_kubeconfig_via(&self.cluster.kubeconfig, proxy.addr, &kubeconfig)?;
        let config = OperatorConfig::in_namespace(
            format!("replica-{slot}-{generation}"),
            kubeconfig,
            NAMESPACE,
            self.out.join("logs"),
            timings,
        );
        Ok(match self.shards {
            Some(shards) => config.with_args(&[&format!("--shard-leases={shards}")]),
            None => config,
        })
    }

    /// Starts slot `slot`'s proxies: the overload proxy presents the API server's own
    /// serving pair (signed by the test CA, SANs localhost and 127.0.0.1) and forwards with
    /// the admin certificate, which the replicas' kubeconfigs use too.
    async fn start_proxies(&self) -> Result<(Proxy, OverloadProxy)> {
        let pki = self.cluster.dir.join("pki");
        let api = OverloadProxy::start(
            &self.cluster.kubeconfig,
            &pki.join("apiserver.crt"),
            &pki.join("apiserver.key"),
        )
        .await?;
        Ok((Proxy::start(api.addr).await?, api))
    }

    async fn start_slot(
        &mut self,
        slot: usize,
        generation: usize,
        (proxy, api): (Proxy, OverloadProxy),
        timings: Timings,
    ) -> Result<Slot> {
        let config = self.replica_config(slot, generation, &proxy, &timings)?;
        let mut operator = Operator::start(config)?;
        self.logs.push(operator.process.log.clone());
        operator.wait_ready().await?;
        Ok(Slot {
            proxy,
            api,
            timings,
            operator,
            generation,
        })
    }

    /// Replaces the replica in `slot` with a new process (a new identity, as a new Pod)
    /// with the same timings.
    pub(super) async fn restart_slot(&mut self, slot: usize) -> Result<()> {
        let timings = self.slots[slot].timings;
        self.restart_slot_with(slot, timings).await
    }

    /// Replaces the replica in `slot` with a new process running `timings`.
    pub(super) async fn restart_slot_with(&mut self, slot: usize, timings: Timings) -> Result<()> {
        let old = self.slots.remove(slot);
        let generation = old.generation + 1;
        let Slot {
            proxy,
            api,
            mut operator,
            ..
        } = old;
        operator.kill();
        drop(operator);
        let fresh = self
            .start_slot(slot, generation, (proxy, api), timings)
            .await?;
        self.slots.insert(slot, fresh);
        Ok(())
    }

    /// Replaces every replica that died without being killed by us (a finding); returns
    /// how many.
    pub(super) async fn replace_exited(&mut self) -> Result<usize> {
        let mut exited = 0;
        for slot in 0..self.slots.len() {
            if !self.slots[slot].operator.process.is_running() {
                eprintln!(
                    "replica {} exited unexpectedly",
                    self.slots[slot].operator.config.identity
                );
                exited += 1;
                self.restart_slot(slot).await?;
            }
        }
        Ok(exited)
    }

    pub(super) fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), NAMESPACE)
    }

    /// The Lease holder ("" when there is none).
    pub(super) async fn holder(&self) -> Result<String> {
        Ok(lease::holder(&self.client, NAMESPACE)
            .await?
            .unwrap_or_default())
    }

    /// The slot whose live replica holds the Lease; in scale-out mode, once every shard is
    /// held by a live replica, the slot holding the most.
    pub(super) async fn leader_slot(&self, limit: Duration) -> Result<usize> {
        if let Some(shards) = self.shards {
            return e2e::wait::poll("every shard held by a live replica", limit, || async {
                let held = e2e::shards::snapshot(&self.client, NAMESPACE, shards).await?;
                let ids: Vec<&str> = self
                    .slots
                    .iter()
                    .map(|s| s.operator.config.identity.as_str())
                    .collect();
                if !held.holders.iter().all(|h| ids.contains(&h.as_str())) {
                    return Ok(None);
                }
                Ok((0..self.slots.len())
                    .max_by_key(|i| held.held_by(&self.slots[*i].operator.config.identity).len()))
            })
            .await;
        }
        e2e::wait::poll("a live leader", limit, || async {
            let holder = self.holder().await?;
            Ok(self
                .slots
                .iter()
                .position(|s| s.operator.config.identity == holder))
        })
        .await
    }
}

//! Scale-out mode on a server that serves `shardSelector` (feature gate
//! `ShardedListAndWatch` on, as the local control plane runs it): see the scenario.

mod scaleout_scenario;

#[tokio::test]
async fn shards_split_rebalance_fail_over_and_shrink_with_shard_selector() -> anyhow::Result<()> {
    let env = e2e::harness::setup("scaleout").await?;
    scaleout_scenario::run(env, true).await
}

//! Scale-out mode on a server that ignores `shardSelector` (feature gate
//! `ShardedListAndWatch` off, as on most clusters today): the replicas filter MyResources
//! on the client side and say so; everything else is the same scenario.

mod scaleout_scenario;

#[tokio::test]
async fn shards_split_rebalance_fail_over_and_shrink_without_shard_selector() -> anyhow::Result<()>
{
    let env = e2e::harness::setup_ungated("scaleout-ungated").await?;
    scaleout_scenario::run(env, false).await
}

//! The shard key of scale-out mode: which of S shard Leases a MyResource and its children
//! belong to, and how a watch asks the API server for exactly one shard.
//!
//! The key is the FNV-1a 64 hash of the **MyResource's uid**, the hash space cut into 256
//! buckets (its top byte) and the buckets into S contiguous shards. Why:
//! - the server can hash only `metadata.uid` or `metadata.namespace` (KEP-5866). Namespace
//!   names are not random: FNV-1a's top bits barely depend on a name's last characters, so
//!   `tenant-0` … `tenant-99` fall into one or two ranges (docs/scaleout.md: measured spreads). Uids
//!   are random, so shards are even;
//! - a MyResource's ConfigMap has a uid of its own, so the server cannot put it on its
//!   owner's shard by hashing. But the operator writes that ConfigMap, so it labels it with
//!   its owner's bucket ([`BUCKET_LABEL`]), and a label selector `bucket in (…)` filters it on
//!   every server, gated or not. Buckets are what make a shard expressible both as a
//!   `shardRange` and as a label set;
//! - labelled Pods are not ours to label; they stay in the slim Pod index of every replica
//!   (the operator keeps a slim index of them on every replica).
//!
//! Invariants: the hash is the server's (`k8s.io/apimachinery/pkg/sharding`: FNV-1a 64 over
//! the field's bytes, compared as `0x` + 16 hex digits), so a shard's `shardRange` selects
//! on the server exactly the MyResources [`ShardKey::shard_of_uid`] puts in it, and its
//! bucket set exactly their ConfigMaps; shards are contiguous, disjoint and cover all 256
//! buckets, so every object has one shard.

/// The label on each operator-written ConfigMap: its owner's bucket, two hex digits.
pub const BUCKET_LABEL: &str = "trstringer.com/shard-bucket";

/// Buckets: the top byte of the hash.
pub const BUCKETS: usize = 256;

/// FNV-1a 64, as the API server hashes a shard key.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET, |h, b| (h ^ u64::from(*b)).wrapping_mul(PRIME))
}

/// The bucket of a MyResource uid.
pub fn bucket_of(uid: &str) -> usize {
    (fnv1a64(uid.as_bytes()) >> 56) as usize
}

/// The [`BUCKET_LABEL`] value of a bucket.
pub fn bucket_label(bucket: usize) -> String {
    format!("{bucket:02x}")
}

/// S shards over the 256 buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardKey {
    shards: usize,
}

impl ShardKey {
    /// `shards` shards, 1 to 256.
    pub fn new(shards: usize) -> Self {
        assert!(
            (1..=BUCKETS).contains(&shards),
            "1 to {BUCKETS} shards, not {shards}"
        );
        ShardKey { shards }
    }

    /// How many shards there are.
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// First bucket of shard `index`; `index == shards` gives 256, the end.
    fn first_bucket(&self, index: usize) -> usize {
        (index * BUCKETS).div_ceil(self.shards)
    }

    /// The buckets of shard `index`.
    pub fn buckets(&self, index: usize) -> std::ops::Range<usize> {
        self.first_bucket(index)..self.first_bucket(index + 1)
    }

    /// The shard of a bucket.
    pub fn shard_of_bucket(&self, bucket: usize) -> usize {
        // The last shard whose first bucket is not above `bucket`.
        (0..self.shards)
            .rev()
            .find(|i| self.first_bucket(*i) <= bucket)
            .expect("shard 0 starts at bucket 0")
    }

    /// The shard of the MyResource with this uid (and of its ConfigMap).
    pub fn shard_of_uid(&self, uid: &str) -> usize {
        self.shard_of_bucket(bucket_of(uid))
    }

    /// Whether the MyResource with this uid (and its ConfigMap) belongs to shard `index`:
    /// what a shard's store keeps and its worker may write (the routing the operator and
    /// the simulator share).
    pub fn owns(&self, index: usize, uid: &str) -> bool {
        crate::bugs::on(crate::bugs::Bug::AnyShardStore) || self.shard_of_uid(uid) == index
    }

    /// The `shardSelector` of shard `index` for MyResources, in the server's notation
    /// (bounds as `0x` and 16 hex digits, the end of the space as `0x10000000000000000`).
    pub fn selector(&self, index: usize) -> String {
        let bound = |bucket: usize| {
            if bucket == BUCKETS {
                "0x10000000000000000".to_string()
            } else {
                format!("0x{:016x}", (bucket as u64) << 56)
            }
        };
        let range = self.buckets(index);
        format!(
            "shardRange(object.metadata.uid, '{}', '{}')",
            bound(range.start),
            bound(range.end)
        )
    }

    /// The label selector term that selects shard `index`'s ConfigMaps.
    pub fn bucket_selector(&self, index: usize) -> String {
        let values: Vec<String> = self.buckets(index).map(bucket_label).collect();
        format!("{BUCKET_LABEL} in ({})", values.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_matches_the_servers() {
        // k8s.io/apimachinery/pkg/sharding.HashField("default") and ("").
        assert_eq!(format!("{:016x}", fnv1a64(b"default")), "ebada5168620c5fe");
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(bucket_of("default"), 0xeb);
        assert_eq!(bucket_label(0xeb), "eb");
        assert_eq!(bucket_label(7), "07");
    }

    #[test]
    fn selectors_cut_the_buckets_into_contiguous_shards() {
        let key = ShardKey::new(4);
        assert_eq!(
            key.selector(0),
            "shardRange(object.metadata.uid, '0x0000000000000000', '0x4000000000000000')"
        );
        assert_eq!(
            key.selector(3),
            "shardRange(object.metadata.uid, '0xc000000000000000', '0x10000000000000000')"
        );
        assert_eq!(
            ShardKey::new(128).bucket_selector(5),
            "trstringer.com/shard-bucket in (0a,0b)"
        );
        for shards in [1, 3, 7, 12, 256] {
            let key = ShardKey::new(shards);
            let mut next = 0;
            for i in 0..shards {
                let range = key.buckets(i);
                assert_eq!(range.start, next);
                assert!(!range.is_empty());
                assert!(range.len() == BUCKETS / shards || range.len() == BUCKETS / shards + 1);
                for b in range.clone() {
                    assert_eq!(key.shard_of_bucket(b), i);
                }
                next = range.end;
            }
            assert_eq!(next, BUCKETS);
        }
    }

    #[test]
    fn uids_spread_evenly() {
        let key = ShardKey::new(12);
        let mut counts = [0usize; 12];
        for i in 0..12_000u64 {
            // uid-shaped, pseudo-random text.
            let uid = format!("{:016x}-{i}", fnv1a64(&i.to_le_bytes()));
            counts[key.shard_of_uid(&uid)] += 1;
        }
        assert!(
            counts.iter().all(|c| (800..1200).contains(c)),
            "uneven {counts:?}"
        );
    }
}

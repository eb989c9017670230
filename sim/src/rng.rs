//! The simulator's only source of chance: a seeded generator (SplitMix64), so a seed
//! replays the same history byte for byte. Twenty lines of our own instead of a crate: the
//! sequence must never change under us with a dependency update.

use std::time::Duration;

/// A seeded pseudo-random generator.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    /// A duration in `[lo, hi]`, to the microsecond.
    pub fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let span = hi.saturating_sub(lo).as_micros() as u64;
        lo + Duration::from_micros(self.below(span + 1))
    }

    /// A duration in `[lo, hi]`, to the millisecond: the paused clock's timers fire on
    /// whole milliseconds, so a fault drawn so takes effect exactly when its history says.
    pub fn between_ms(&mut self, lo: Duration, hi: Duration) -> Duration {
        Duration::from_millis(self.between(lo, hi).as_millis() as u64)
    }

    /// One of `items`.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_and_seeds_differ() {
        let draw = |seed| {
            (0..4)
                .map(|_| Rng::new(seed).next_u64())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(Rng::new(7).next_u64(), Rng::new(8).next_u64());
        let mut rng = Rng::new(1);
        let d = rng.between(Duration::from_millis(5), Duration::from_millis(6));
        assert!((Duration::from_millis(5)..=Duration::from_millis(6)).contains(&d));
    }
}

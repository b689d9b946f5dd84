//! The simulation's random numbers: a small seeded generator (SplitMix64), so that a seed gives
//! the same scenario on every machine, every run and every Rust version.

/// SplitMix64: a 64-bit state advanced by a fixed odd constant, each output a mix of the state.
pub(super) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (the modulo's bias is far below what a scenario can notice).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        debug_assert!(lo <= hi);
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Between `lo` and `hi`, each order of magnitude as likely as the next.
    pub fn log_uniform(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + self.unit() * (hi.ln() - lo.ln())).exp()
    }

    /// An index drawn with the given weights.
    pub fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u64 = weights.iter().map(|&w| u64::from(w)).sum();
        let mut x = self.range(0, total - 1);
        for (i, &w) in weights.iter().enumerate() {
            if x < u64::from(w) {
                return i;
            }
            x -= u64::from(w);
        }
        unreachable!("x is below the total")
    }
}

/// The seed of the `i`th scenario of a run: spread out, so neighbouring scenarios share nothing.
pub(super) fn scenario_seed(base: u64, i: u64) -> u64 {
    Rng::new(base ^ i.wrapping_mul(0xd1b5_4a32_d192_ed03)).next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_numbers_and_ranges_hold() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
            let x = a.range(3, 9);
            assert!((3..=9).contains(&x));
            b.range(3, 9);
            let u = a.unit();
            assert!((0.0..1.0).contains(&u));
            b.unit();
        }
        assert_ne!(scenario_seed(1, 0), scenario_seed(1, 1));
    }
}

//! Hash maps keyed by identifiers hostd assigns itself (device ids, pQP
//! numbers, LIDs): hashed with a multiply-rotate hash instead of SipHash,
//! which costs a large share of the datapath's time per WQE. Only for keys
//! a vdev cannot choose: a map whose keys a peer picks (QP numbers, memory
//! keys) keeps the default, collision-resistant hasher.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map keyed by hostd-assigned identifiers.
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// The FxHash mixing step over machine words.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl IdHasher {
    fn mix(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.mix(n.into());
    }

    fn write_u16(&mut self, n: u16) {
        self.mix(n.into());
    }

    fn write_u32(&mut self, n: u32) {
        self.mix(n.into());
    }

    fn write_u64(&mut self, n: u64) {
        self.mix(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.mix(n as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_work_and_spread_small_keys() {
        let mut m: IdMap<(u64, u32), u32> = IdMap::default();
        for d in 1..=64u64 {
            for q in 0..4u32 {
                m.insert((d, q), q);
            }
        }
        assert_eq!(m.len(), 256);
        assert_eq!(m.get(&(7, 3)), Some(&3));
        let hash = |k: u64| {
            let mut h = IdHasher::default();
            h.write_u64(k);
            h.finish()
        };
        assert_ne!(hash(1) >> 57, hash(2) >> 57, "top bits differ");
    }
}

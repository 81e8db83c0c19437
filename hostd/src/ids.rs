//! Identifiers hostd assigns itself, and their tables.
//!
//! - [`IdMap`]: hash maps keyed by such identifiers (device ids, pQP
//!   numbers, LIDs), hashed with a multiply-rotate hash instead of SipHash,
//!   which costs a large share of the datapath's time per WQE. Only for
//!   keys a vdev cannot choose.
//! - [`PickedMap`]: hash maps keyed by numbers a vdev picks (its QP, CQ,
//!   SRQ and AH numbers), looked up per packet and per WQE: foldhash with
//!   a random seed per map — a fraction of SipHash's cost, and a vdev that
//!   does not know the seed cannot choose numbers that collide (SipHash
//!   was 5–10 % of a datapath thread's time on a UD receive).
//! - [`Slab`]: objects by a dense index hostd hands out, for the datapath's
//!   references between objects (no hashing at all).
//! - [`os_random`]: the kernel's randomness, for identifiers that must not
//!   be guessed (key tags, handover tokens).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map keyed by hostd-assigned identifiers.
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// A map keyed by numbers a vdev picks (see the module doc).
pub type PickedMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

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

/// Objects by dense index; freed indices are reused.
#[derive(Debug)]
pub struct Slab<T> {
    items: Vec<Option<T>>,
    free: Vec<usize>,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            items: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> Slab<T> {
    /// Stores `item` and returns its index.
    pub fn insert(&mut self, item: T) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.items[i] = Some(item);
                i
            }
            None => {
                self.items.push(Some(item));
                self.items.len() - 1
            }
        }
    }

    /// Takes the item at `i` out.
    pub fn remove(&mut self, i: usize) -> Option<T> {
        let item = self.items.get_mut(i)?.take()?;
        self.free.push(i);
        Some(item)
    }

    pub fn get(&self, i: usize) -> Option<&T> {
        self.items.get(i)?.as_ref()
    }

    pub fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.items.get_mut(i)?.as_mut()
    }

    /// Every item with its index.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        (self.items.iter().enumerate()).filter_map(|(i, item)| Some((i, item.as_ref()?)))
    }

    /// Every item, mutably, with its index.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut T)> {
        (self.items.iter_mut().enumerate()).filter_map(|(i, item)| Some((i, item.as_mut()?)))
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.items.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Fills `buf` from the kernel's randomness (`getrandom`, retried when a
/// signal interrupts it or it returns less).
pub fn os_random(buf: &mut [u8]) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let rest = &mut buf[got..];
        // SAFETY: writes at most `rest.len()` bytes into `rest`.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        got += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slab_reuses_freed_indices() {
        let mut slab = Slab::default();
        let a = slab.insert("a");
        let b = slab.insert("b");
        assert_eq!(slab.remove(a), Some("a"));
        assert_eq!(slab.remove(a), None);
        assert_eq!(slab.get(a), None);
        assert_eq!(slab.insert("c"), a);
        assert_eq!(slab.get(b), Some(&"b"));
        assert_eq!(slab.len(), 2);
        let all: Vec<_> = slab.iter().map(|(_, v)| *v).collect();
        assert_eq!(all, vec!["c", "b"]);
    }

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

//! Maps keyed by small integers the device looks up on every packet: queue pair numbers and
//! same-host peers' addresses.
//!
//! std's default hasher (SipHash with random keys) costs more than the rest of a lookup, and a
//! WRITE's post looked its peer's ring up twice: a fifth of the time it took (profiled on the
//! rings' latency loop, bench/results/dropin.md). The keys here are not chosen by a remote
//! peer: queue pair numbers are this device's own (a packet's destination number is looked up,
//! never inserted), and the peers' addresses are local devices that proved themselves. A
//! multiplicative hash serves them.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` with [`IntHasher`].
pub(crate) type IntMap<K, V> = HashMap<K, V, BuildHasherDefault<IntHasher>>;

/// Creates an empty [`IntMap`].
pub(crate) fn int_map<K, V>() -> IntMap<K, V> {
    HashMap::with_hasher(BuildHasherDefault::default())
}

/// A multiply-rotate hasher for integer keys (and the few bytes of an address).
#[derive(Default, Clone, Copy)]
pub(crate) struct IntHasher(u64);

/// An odd constant with well-mixed bits (the golden ratio's fraction, 64 bits).
const K: u64 = 0x9E37_79B9_7F4A_7C15;

impl IntHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
    }
}

impl Hasher for IntHasher {
    fn finish(&self) -> u64 {
        // hashbrown takes its control bits from the top and its bucket from the bottom: fold
        // the well-mixed high half into the low one.
        self.0 ^ (self.0 >> 32)
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }

    fn write_u8(&mut self, v: u8) {
        self.add(u64::from(v));
    }

    fn write_u16(&mut self, v: u16) {
        self.add(u64::from(v));
    }

    fn write_u32(&mut self, v: u32) {
        self.add(u64::from(v));
    }

    fn write_u64(&mut self, v: u64) {
        self.add(v);
    }

    fn write_usize(&mut self, v: usize) {
        self.add(v as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn keys_map_to_their_values() {
        let mut m: IntMap<u32, u32> = int_map();
        for q in 0..5000u32 {
            m.insert(q * 7 + 17, q);
        }
        for q in 0..5000u32 {
            assert_eq!(m.get(&(q * 7 + 17)), Some(&q));
            assert_eq!(m.get(&(q * 7 + 18)), None);
        }
        let mut a: IntMap<Ipv4Addr, u8> = int_map();
        for i in 0..=255u8 {
            a.insert(Ipv4Addr::new(127, 0, i, 1), i);
        }
        for i in 0..=255u8 {
            assert_eq!(a.get(&Ipv4Addr::new(127, 0, i, 1)), Some(&i));
            assert_eq!(a.get(&Ipv4Addr::new(127, 1, i, 1)), None);
        }
    }

    #[test]
    fn consecutive_queue_pair_numbers_spread_over_buckets() {
        // The low bits pick a bucket: consecutive numbers (how the device hands them out) must
        // not share them.
        let h = |q: u32| {
            let mut s = IntHasher::default();
            s.write_u32(q);
            s.finish() & 1023
        };
        let buckets: std::collections::HashSet<u64> = (0..1024u32).map(|q| h(0x11 + q)).collect();
        assert!(buckets.len() > 600, "{} of 1024 buckets", buckets.len());
    }
}

//! The modelled network: its faults and rates ([`NetConfig`]), what it did ([`NetStats`]), and
//! the seeded generator every random choice comes from ([`Rng`]).

use std::time::Duration;

/// A small, fast, seeded generator (splitmix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x6A09_E667_F3BC_C909)
    }

    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// `true` with probability `p` (clamped to 0..=1).
    pub fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        if p >= 1.0 {
            return true;
        }
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64) < p
    }

    /// Fills `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// The network's behaviour.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetConfig {
    /// One-way propagation delay.
    pub delay: Duration,
    /// Link rate of every device's transmitter, bits per second (serialization delay).
    pub bits_per_sec: u64,
    /// Probability a datagram is lost.
    pub loss: f64,
    /// Probability a datagram is held back by up to `reorder_window` (reordering it).
    pub reorder: f64,
    /// How long a reordered datagram may be held back.
    pub reorder_window: Duration,
    /// Probability a datagram is delivered twice.
    pub duplicate: f64,
    /// Probability one random bit of a datagram is flipped.
    pub corrupt: f64,
}

impl NetConfig {
    /// 5 µs, 10 Gb/s, no faults.
    pub fn ideal() -> NetConfig {
        NetConfig {
            delay: Duration::from_micros(5),
            bits_per_sec: 10_000_000_000,
            loss: 0.0,
            reorder: 0.0,
            reorder_window: Duration::from_micros(20),
            duplicate: 0.0,
            corrupt: 0.0,
        }
    }

    /// [`NetConfig::ideal`] with a fault rate of `p`: each datagram is hit with probability
    /// about `p`, the fault split evenly between loss, reordering, duplication and corruption
    /// (`p / 4` each).
    pub fn faulty(p: f64) -> NetConfig {
        NetConfig::each_fault(p / 4.0)
    }

    /// [`NetConfig::ideal`] with loss, reordering, duplication and corruption each at `p`,
    /// independently (at 0.3 a datagram survives loss and corruption only about half the time).
    pub fn each_fault(p: f64) -> NetConfig {
        NetConfig {
            loss: p,
            reorder: p,
            duplicate: p,
            corrupt: p,
            ..NetConfig::ideal()
        }
    }

    /// [`NetConfig::ideal`] with loss `p` and no other fault.
    pub fn lossy(p: f64) -> NetConfig {
        NetConfig {
            loss: p,
            ..NetConfig::ideal()
        }
    }
}

/// What the network did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Datagrams devices sent.
    pub sent: u64,
    /// Datagrams lost.
    pub lost: u64,
    /// Extra copies delivered.
    pub duplicated: u64,
    /// Datagrams with a flipped bit.
    pub corrupted: u64,
    /// Datagrams held back.
    pub reordered: u64,
    /// Datagrams delivered.
    pub delivered: u64,
    /// Datagrams addressed to no device.
    pub unroutable: u64,
}

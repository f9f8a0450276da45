//! How a ring is built and run: [`RingConfig`], its checks, and the fingerprint every rank
//! must share.

use std::time::Duration;

use super::MAX_SLOTS;
use crate::error::{Error, Result};
use crate::qp::ConnectOptions;

/// How a ring is built and run.
#[derive(Debug, Clone)]
pub struct RingConfig {
    /// Queue pairs per ring link (`NCCL_IB_QPS_PER_CONNECTION`).
    pub qps_per_connection: usize,
    /// Largest chunk, in bytes (also the size of one staging slot).
    pub chunk_bytes: usize,
    /// Staging slots (credits) per queue pair: the most chunks in flight on one queue pair
    /// (the window may allow fewer).
    pub slots: usize,
    /// Smallest chunk a segment is cut into, in bytes (capped by `chunk_bytes`): a segment
    /// smaller than `qps_per_connection` chunks of this size travels on fewer queue pairs.
    pub min_chunk_bytes: usize,
    /// Most bytes this rank keeps in flight towards its successor (chunks sent and not yet
    /// consumed there), at least one chunk: bounds how much data sits in the device's and the
    /// kernel's buffers at once.
    pub window_bytes: usize,
    /// Capacity of the communicator's buffer: the largest AllReduce, in bytes. The buffer and
    /// the staging slots are allocated, and made resident, when the communicator is created.
    pub max_bytes: usize,
    /// Longest wait for any progress (a chunk, a credit, a completion) before giving up.
    pub timeout: Duration,
    /// How long to poll for a completion (yielding the CPU between polls) before sleeping
    /// until one comes, in calls of at most [`RingConfig::spin_max_bytes`]: their steps are
    /// latency-bound, and polling also lets this thread do the device's receive work (where the
    /// host has fewer than two CPUs per rank: [`Communicator::host_share`](super::Communicator::host_share)).
    pub spin: Duration,
    /// Largest call that polls before sleeping; larger ones sleep at once (their completions
    /// come at the pace of the data, and a polling thread takes CPU from the device).
    pub spin_max_bytes: usize,
    /// How the queue pairs are connected (transport timeout and retries bound how long a dead
    /// peer takes to be noticed).
    pub connect: ConnectOptions,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            qps_per_connection: 8,
            // 256 KiB chunks, 4 in flight per queue pair: on the soft device per-chunk costs
            // (a completion, a credit, a wake-up) then stay small against the bytes moved. In
            // three interleaved sweeps (4 ranks, 2 cores, soft devices) busbw at 4-64 MiB was
            // 20-30% above what 64 KiB chunks gave.
            chunk_bytes: 256 << 10,
            slots: 4,
            // Chunks as large as the slots (a 1 MiB call over 4 ranks: one 256 KiB chunk per
            // step, not 8 of 32 KiB), the steps rotating over the queue pairs: in interleaved
            // runs against the previous 4 KiB floor (4 ranks, 2 cores, soft devices) a 128 KiB
            // floor raised busbw 30-50% at 1 MiB and 15-20% at 2 MiB, as per-chunk costs
            // (completions, credits, acknowledgements) fall, and 256 KiB another 3-19% at
            // 1-4 MiB. At most 2 MiB in flight per link: +9% at 4 MiB (10 paired rounds), no
            // change at 8 MiB; less data waiting in the devices' and the kernel's buffers
            // leaves the copies more of the cache.
            min_chunk_bytes: 256 << 10,
            window_bytes: 2 << 20,
            max_bytes: 64 << 20,
            timeout: Duration::from_secs(15),
            spin: Duration::from_millis(1),
            // Polling through larger calls too (soft devices, 4 and 16 MiB, paired rounds): on 2
            // CPUs, 2 ranks 1.47× and 1.29× as fast, 4 ranks 0.97× and 1.01×, 8 ranks 0.92× and
            // 0.97×; on a 16-CPU host about 0.7× at 4 MiB once there are 1.5 CPUs or more per
            // rank (sleeping ranks leave the receiving to the engine threads, on CPUs of their
            // own), and mixed at one (0.93–1.12 in a later run, bench/results/log.md). With
            // two CPUs per rank, polling through every call with the receiving left to the engine
            // threads was 1.2–1.5× as fast at 1 MiB and even or slower at 4–16 MiB: only calls
            // up to this size leave it to them (`Communicator::host_share`), larger ones keep
            // sleeping.
            spin_max_bytes: 2 << 20,
            // A retransmission timer of 4.096 µs × 2^16 ≈ 270 ms, 7 retries: a rank descheduled
            // for a while on a busy host is not taken for dead, a dead one is noticed in ~2 s,
            // and a lost last packet costs one timer period.
            connect: ConnectOptions {
                timeout: 16,
                retry_cnt: 7,
                ..ConnectOptions::default()
            },
        }
    }
}

impl RingConfig {
    pub(super) fn validate(&self) -> Result<()> {
        let bad = |w: String| Err(Error::invalid(w));
        if self.qps_per_connection == 0 || self.qps_per_connection > 64 {
            return bad(format!(
                "{} queue pairs per connection (1..=64)",
                self.qps_per_connection
            ));
        }
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return bad(format!(
                "{} slots per queue pair (1..={MAX_SLOTS})",
                self.slots
            ));
        }
        if self.chunk_bytes < 64 || self.chunk_bytes > (1 << 30) {
            return bad(format!(
                "a chunk of {} bytes (64..=1 GiB)",
                self.chunk_bytes
            ));
        }
        Ok(())
    }

    /// What every rank must agree on, as [`FINGERPRINT_LEN`] bytes.
    pub(super) fn fingerprint(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(FINGERPRINT_LEN);
        v.extend_from_slice(&(self.qps_per_connection as u32).to_be_bytes());
        v.extend_from_slice(&(self.slots as u32).to_be_bytes());
        v.extend_from_slice(&(self.chunk_bytes as u64).to_be_bytes());
        v.extend_from_slice(&(self.min_chunk_bytes as u64).to_be_bytes());
        v.extend_from_slice(&(self.max_bytes as u64).to_be_bytes());
        debug_assert_eq!(v.len(), FINGERPRINT_LEN);
        v
    }
}

/// Bytes of [`RingConfig::fingerprint`]; a rank's description of its host follows them in the
/// setup data.
pub(super) const FINGERPRINT_LEN: usize = 32;

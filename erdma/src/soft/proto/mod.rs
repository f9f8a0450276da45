//! The soft device's RC protocol core: sans-IO state machines on virtual time.
//!
//! Owns RoCEv2 RC behaviour, byte-compatible with Linux rxe: per queue pair a requester
//! (segmentation, PSNs, go-back-N), a completer (ACKs, read responses, retries, work
//! completions) and a responder (PSN checks, execution with full key/bounds/rights enforcement,
//! ACK/NAK and lazily generated read responses), plus the device-level receive checks
//! ([`validate`]). Routing datagrams to queue pairs is the engine's (`soft::engine`).
//!
//! It must not do I/O, read a clock, spawn threads or touch memory other than through
//! [`Memory`]; time arrives as an [`Instant`] value. A driver:
//! 1. checks each received UDP payload with [`validate`] and hands it to the queue pair its
//!    destination QPN names ([`Qp::handle_packet`]);
//! 2. calls `handle_timeout(now)` when `poll_timeout()` is due;
//! 3. drains `poll_transmit(now, buf, mem)` into its socket (each call writes one complete UDP
//!    payload, ICRC included, into `buf`);
//! 4. drains `poll_completion()` into its completion queues.
//!
//! Should be polled after: any datagram, timeout, post or modify — transmits, completions and
//! the next deadline can all change.

#![forbid(unsafe_code)]

mod completer;
mod device;
mod memory;
mod qp;
mod queue;
mod requester;
mod responder;
mod shared;
mod timer;
mod wr;

use core::ops::{Add, Sub};
use core::time::Duration;

pub use device::{DropCounters, DropReason, RxMeta, validate};
pub use memory::{AtomicOp, Memory, MemoryError, Region};
pub use qp::{Lent, ModifyError, Qp, QpAsyncError, QpCounters, QpParams, Transmit};
pub use timer::{Timer, TimerTable};
pub use wr::{
    InlineData, MAX_INLINE, MAX_MESSAGE, MAX_SGE, PostError, RecvWqe, SendData, SendWqe, SgeList,
};

/// Most PSNs a requester leaves unacknowledged (rxe's window).
pub const MAX_UNACKED_PSNS: u32 = 128;
/// A requester sets AckReq at least once every this many packets of a long message.
pub const ACK_REQ_EVERY: u32 = 64;
/// Largest initiator / responder depth for READs and atomics.
pub const MAX_RD_ATOMIC: u8 = 128;
/// Most PSNs one READ may consume (keeps every compared PSN pair well inside half the space).
pub const MAX_READ_PSNS: u32 = 1 << 22;
/// Largest datagram (UDP payload) a queue pair emits: headers, 4096 bytes of payload, ICRC.
pub const MAX_DATAGRAM: usize = 40 + 4096 + 4;
/// Payload bytes one reference packet stands for ([`crate::soft::wire::peer_ref`]): a message
/// sent by reference is cut into segments of this size, not of the path MTU (the bytes never
/// travel in the datagram, so the MTU does not bound them).
pub const PEER_REF_SEGMENT: u32 = 64 * 1024;

/// A point in time: nanoseconds since an epoch the driver picks. The protocol never reads a
/// clock; every call that needs the time takes one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(u64);

impl Instant {
    /// The epoch.
    pub const ZERO: Instant = Instant(0);

    /// `ns` nanoseconds after the epoch.
    pub const fn from_nanos(ns: u64) -> Instant {
        Instant(ns)
    }

    /// Nanoseconds since the epoch.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub const fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    /// Saturates at the end of time rather than wrapping.
    fn add(self, d: Duration) -> Instant {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        Instant(self.0.saturating_add(ns))
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;
    fn sub(self, earlier: Instant) -> Duration {
        self.saturating_duration_since(earlier)
    }
}

/// The local ACK timeout for the IB `timeout` attribute: 4.096 µs · 2^timeout (0: none).
pub const fn ack_timeout(timeout: u8) -> Option<Duration> {
    if timeout == 0 {
        None
    } else {
        Some(Duration::from_nanos(4096u64 << (timeout & 31)))
    }
}

#[cfg(test)]
mod slow_peer;
#[cfg(test)]
mod tests;

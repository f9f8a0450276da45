//! The software eRDMA device: RoCEv2 RC over UDP port 4791 in userspace, wire-compatible with
//! Linux rxe, behind the same API as kernel devices.
//!
//! What users of the soft device see here: [`counter`] (the names of its port counters) and
//! [`coalesce_sends`]. Inside, by layer:
//! - `wire`: RoCEv2 headers as zero-copy views, the ICRC, 24-bit PSN arithmetic.
//! - `proto`: the sans-IO RC requester, responder and completer (no sockets, no clock, no
//!   unsafe).
//! - `engine`: one device's queue pairs, memory, timers and the rounds that move its packets,
//!   clock-free and socket-free (crate-private).
//! - `driver`: the UDP socket, the engine thread and the clock (crate-private).
//! - `sim`: a deterministic simulation of engines on virtual time over a modelled network
//!   with seeded faults.
//!
//! A soft device is bound to one local IPv4 address and named `soft:<addr>`; its GID is
//! `::ffff:<addr>`. Several share a host on different loopback addresses.

pub mod counter;
pub(crate) mod driver;
pub(crate) mod engine;
mod fast_map;

// The protocol core, the wire format and the simulation are the soft device's internals: public
// only with the `internals` feature (the fuzz targets and benchmarks use it), and not part of
// the API this crate promises.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod proto;
#[cfg(not(feature = "internals"))]
#[allow(dead_code, unused_imports, unreachable_pub)]
pub(crate) mod proto;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod sim;
#[cfg(all(test, not(feature = "internals")))]
#[allow(dead_code, unused_imports, unreachable_pub)]
pub(crate) mod sim;
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod wire;
#[cfg(not(feature = "internals"))]
#[allow(dead_code, unused_imports, unreachable_pub)]
pub(crate) mod wire;

/// Runs `f`; on a soft device, the packets that this thread's posts inside it make sendable
/// leave together when `f` returns (or unwinds): one system call for them all, and equal-size
/// packets of different queue pairs to one peer share UDP GSO messages. Nested calls send at the
/// end of the outermost one; a full batch or a post to another soft device sends early.
///
/// Use it around a burst of posts (a striped link, a fan-out), never around waiting for their
/// completions: nothing leaves before `f` returns. Kernel devices ring their doorbell on every
/// post; there it only runs `f`. So does a soft device whose lanes transmit
/// (`ERDMA_SOFT_TX=lane`, the default with several engines): its posts go to the lanes at
/// once, and each lane sends what its queue pairs have in batches of its own.
pub fn coalesce_sends<R>(f: impl FnOnce() -> R) -> R {
    engine::coalesce_sends(f)
}

//! The software eRDMA device: RoCEv2 RC over UDP port 4791 in userspace, wire-compatible with
//! Linux rxe, behind the same API as kernel devices.
//!
//! - [`wire`]: RoCEv2 headers as zero-copy views, the ICRC, 24-bit PSN arithmetic.
//! - [`proto`]: the sans-IO RC requester, responder and completer (no sockets, no clock, no
//!   unsafe).
//! - `engine`: one device's queue pairs, memory, timers and the rounds that move its packets,
//!   clock-free and socket-free (crate-private).
//! - `driver`: the UDP socket, the engine thread and the clock (crate-private).
//! - [`sim`]: a deterministic simulation of engines on virtual time over a modelled network
//!   with seeded faults.
//!
//! A soft device is bound to one local IPv4 address and named `soft:<addr>`; its GID is
//! `::ffff:<addr>`. Several share a host on different loopback addresses.

pub mod counter;
pub(crate) mod driver;
pub(crate) mod engine;
pub mod proto;
pub mod sim;
pub mod wire;

pub(crate) use engine::coalesce_sends;

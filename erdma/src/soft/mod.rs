//! The software eRDMA device: RoCEv2 RC over UDP port 4791 in userspace, wire-compatible with
//! Linux rxe, behind the same API as kernel devices.
//!
//! - [`wire`]: RoCEv2 headers as zero-copy views, the ICRC, 24-bit PSN arithmetic.
//! - [`proto`]: the sans-IO RC requester, responder and completer (no sockets, no clock, no
//!   unsafe).
//! - [`sim`]: a deterministic simulation of devices on virtual time with seeded faults.
//! - `driver`: the socket, the engine thread and the provider glue (crate-private).
//!
//! A soft device is bound to one local IPv4 address and named `soft:<addr>`; its GID is
//! `::ffff:<addr>`. Several share a host on different loopback addresses.

pub mod counter;
pub mod proto;
pub mod sim;
pub mod wire;

pub(crate) mod driver;

pub(crate) use driver::{SoftCq, SoftCtx, SoftMr, SoftPd, SoftQp, coalesce_sends, list_devices};

//! # erdma — safe, fast RDMA for Alibaba Cloud eRDMA and any verbs device
//!
//! One API over two providers:
//! - **verbs**: kernel RDMA devices through libibverbs, loaded at run time (eRDMA's `erdma_0`,
//!   mlx5, rxe, …);
//! - **soft**: a userspace RoCEv2 RC device over UDP port 4791, wire-compatible with Linux rxe,
//!   that runs anywhere — the default where no kernel device exists. Name one `soft:<ipv4>`.
//!
//! The shape of a program:
//!
//! ```no_run
//! use erdma::{Access, Context, InitOptions, QpConfig, SendWr, RecvWr};
//! # fn main() -> erdma::Result<()> {
//! let ctx = Context::open("soft:127.0.0.1")?;          // or Context::open_default()
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(256)?;
//! let mut mr = pd.alloc(4096, Access::LOCAL_WRITE)?;    // owned, registered memory
//! let qp = pd.create_qp(&QpConfig::new(&cq))?;          // Qp<Reset>
//! let qp = qp.init(&InitOptions::default())?;              // Qp<Init>
//! let me = qp.endpoint()?;                              // send this to the peer, get theirs
//! # let peer = me;
//! let qp = qp.connect(&peer, &Default::default())?;     // Qp<Rts>
//! erdma::scope(|s| -> erdma::Result<()> {
//!     let (recv_buf, send_buf) = mr.slice_mut(..).split_at(2048);
//!     s.post_recv(&qp, RecvWr::new(1, recv_buf))?;
//!     s.post_send(&qp, SendWr::send(2, &[send_buf.into_local()]))?;
//!     for _ in 0..2 {
//!         cq.wait_one(std::time::Duration::from_secs(5))?.ok()?;
//!     }
//!     Ok(())
//! })?;
//! # Ok(()) }
//! ```
//!
//! ## Safety model
//! - Handles ([`Context`], [`Pd`], [`Cq`], [`Qp`]) are cheap clones that keep their parents alive.
//! - Memory regions are typed by the memory's lifetime ([`Mr<'a>`]); work requests borrow the
//!   memory they use, and [`scope`] keeps those borrows until the device is done. The `unsafe`
//!   raw path ([`Qp::post_send_raw`]) has a precise contract for zero-overhead users.
//! - Async code posts with owned buffers (feature `tokio`): an [`OwnedBuf`] moves into the
//!   request and comes back with its completion (`AsyncQp`, `RecvPool`); a dropped future parks
//!   its buffer in the SDK until the device is done with it.
//! - Queue-pair states are types: sending needs `Qp<Rts>`.
//! - Every request is checked against the device's limit profile (the eRDMA profile on eRDMA and
//!   on the soft device) before the device sees it, with errors that name the limit.

#![warn(missing_docs)]
#![deny(unsafe_code)]

#[cfg(feature = "tokio")]
mod async_cq;
#[cfg(feature = "tokio")]
mod async_qp;
pub mod collective;
pub mod connect;
mod context;
mod cq;
mod error;
mod event;
#[cfg(feature = "gpu")]
pub mod gpu;
mod limits;
mod mr;
mod owned;
mod pd;
pub mod profile;
mod provider;
mod qp;
mod scope;
pub mod soft;
mod sync;
mod vocab;
mod wr;

#[cfg(feature = "tokio")]
pub use async_cq::{AsyncCq, CompletionStream, Ticket};
#[cfg(feature = "tokio")]
pub use async_qp::{AsyncQp, Posted, Received, RecvPool};
pub use context::{Context, OpenOptions, default_device_name, devices};
pub use cq::Cq;
pub use error::{Error, Result};
pub use limits::{Limits, ProfileKind};
pub use mr::{HostBuffer, Mr, MrSlice, MrSliceMut, RemoteMr};
pub use owned::OwnedBuf;
pub use pd::Pd;
pub use qp::{
    CanRecv, ConnectOptions, Init, InitOptions, Qp, QpConfig, QpEndpoint, Reset, Rtr, RtrOptions,
    Rts, RtsOptions, StateMarker, TransitionError,
};
pub use scope::{Scope, ScopeEnd, ScopeOptions, scope, scope_with};
pub use vocab::{
    Access, AddressVector, AsyncEvent, AsyncEventKind, AtomicCap, Capability, Completion,
    DeviceAttr, DeviceInfo, EventElement, Gid, GidEntry, GidType, Limit, LinkLayer, Mtu,
    ParseError, PeerLoss, PortAttr, PortCounters, PortState, ProviderKind, QpAttr, QpCaps,
    QpFailure, QpState, SendFlags, Sge, Transport, WcOpcode, WcStatus, WorkQueue, WrOpcode,
    find_ipv4_gid,
};
pub use wr::{RawRecvWr, RawSendWr, RecvWr, SendWr};

/// The soft device's raw provider line, for the drop-in libibverbs (`erdma-verbs`). Not part of
/// the API this crate promises.
#[cfg(feature = "raw-provider")]
#[doc(hidden)]
pub use provider::raw as raw_provider;

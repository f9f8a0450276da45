//! The verbs vocabulary: the plain values every layer speaks — the safe handles, the provider
//! line, the verbs backend and the soft device's protocol core alike. One definition each.
//!
//! Owns opcodes ([`WrOpcode`], [`WcOpcode`]), statuses ([`WcStatus`]), [`Access`] rights,
//! [`SendFlags`], [`Sge`], [`Completion`], queue-pair states and attributes ([`QpState`],
//! [`QpCaps`], [`QpAttr`], [`AddressVector`]), device and port attributes, GIDs and MTUs,
//! asynchronous events and the names of limits. Numbering follows `<infiniband/verbs.h>`.
//!
//! It must not do I/O, hold a handle, or use `unsafe`; nothing here imports another module of
//! the crate.

#![forbid(unsafe_code)]

mod access;
mod device;
mod event;
#[cfg(feature = "gpu")]
mod gpu;
mod limit;
mod qp;
mod wc;
mod wr;

use core::fmt;

pub use access::Access;
pub use device::{
    AtomicCap, DeviceAttr, DeviceInfo, Gid, GidEntry, GidType, LinkLayer, Mtu, PortAttr,
    PortCounters, PortState, ProviderKind, Transport, find_ipv4_gid,
};
pub use event::{AsyncEvent, AsyncEventKind, ElementClass, EventElement};
#[cfg(feature = "gpu")]
pub use gpu::{GpuSpan, RegistrationPath};
pub use limit::{Capability, Limit};
pub use qp::{AddressVector, QpAttr, QpCaps, QpState};
pub use wc::{
    Completion, PeerLoss, QpFailure, WC_WITH_IMM, WC_WITH_INV, WcOpcode, WcStatus, WorkQueue,
};
pub use wr::{SendFlags, Sge, WrOpcode};

/// A value that did not parse: what it was meant to be, the text, and what was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    what: &'static str,
    input: String,
    expected: &'static str,
}

impl ParseError {
    pub(crate) fn new(what: &'static str, input: &str, expected: &'static str) -> ParseError {
        ParseError {
            what,
            input: input.to_string(),
            expected,
        }
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} `{}`: expected {}",
            self.what, self.input, self.expected
        )
    }
}

impl std::error::Error for ParseError {}

//! RoCEv2 transport headers as zero-copy views, the RC opcode table, PSN arithmetic and the ICRC.
//!
//! Owns the byte layout of everything between the UDP header and the end of a RoCEv2 datagram
//! (BTH, RETH, AETH, ImmDt, IETH, AtomicETH, AtomicAckETH, payload, pad, ICRC), byte-compatible
//! with Linux rxe. It does not own protocol behaviour (that is `soft::proto`), sockets or time.
//!
//! Every header follows one pattern: a `Packet<T: AsRef<[u8]>>` view over a buffer with a private
//! `field` module of byte ranges, and a `Repr` value with `parse` / `emit` / `buffer_len`.
//!
//! # The length contract
//! If a view's `check_len` returned `Ok(())` (which `new_checked` calls), no getter or setter of
//! that view panics. Untrusted input must go through `new_checked` (or [`PacketView::new_checked`],
//! which checks a whole datagram). `new_unchecked` is for buffers the caller sized itself, e.g. to
//! emit into a buffer of `buffer_len()` bytes; accessors on a too-short unchecked buffer panic.
//!
//! Unknown opcodes and NAK codes are values (`Unknown(u8)`), never a panic.

#![forbid(unsafe_code)]

use core::fmt;

pub use aeth::{NakCode, Syndrome};
pub use icrc::{Checksum, ChecksumCapabilities, IcrcHeaders, IpPair, Ipv4IdSolver};
pub use opcode::{OpFlags, Opcode};
pub use packet::{Headers, PacketView, PacketWriter};
pub use psn::Psn;

/// The UDP destination port of RoCEv2.
pub const ROCE_PORT: u16 = 4791;

/// Length of the ICRC trailer.
pub const ICRC_LEN: usize = 4;

/// Why a buffer is not a valid header or packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PacketError {
    /// The buffer is shorter than the header (or packet) it should hold.
    Truncated,
    /// The lengths are inconsistent (pad larger than the bytes present, a payload on an opcode
    /// that carries none, extension headers that do not match the opcode, …).
    Malformed,
    /// The opcode is not an RC opcode this implementation knows (the raw value).
    UnknownOpcode(u8),
    /// BTH.TVer is not 0 (the raw value).
    BadVersion(u8),
}

impl fmt::Display for PacketError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PacketError::Truncated => f.write_str("truncated packet"),
            PacketError::Malformed => f.write_str("malformed packet"),
            PacketError::UnknownOpcode(op) => write!(f, "unknown opcode {op:#04x}"),
            PacketError::BadVersion(v) => write!(f, "transport header version {v} (expected 0)"),
        }
    }
}

impl std::error::Error for PacketError {}

/// The wire layer's result type.
pub type PacketResult<T> = core::result::Result<T, PacketError>;

// Declared before the header modules so that they can use it (macro scope is textual).
/// The constructors every fixed-length header view shares (see the length contract above).
macro_rules! fixed_view {
    ($name:literal) => {
        /// A read/write view of the header.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct Packet<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> Packet<T> {
            /// A view with no length check (see the module-level length contract of `wire`).
            pub const fn new_unchecked(buffer: T) -> Packet<T> {
                Packet { buffer }
            }

            #[doc = concat!("A view of a buffer that holds at least ", $name, ".")]
            ///
            /// # Errors
            /// [`PacketError::Truncated`](crate::soft::wire::PacketError::Truncated) when the buffer is
            /// shorter than [`HEADER_LEN`].
            pub fn new_checked(buffer: T) -> crate::soft::wire::PacketResult<Packet<T>> {
                let p = Packet::new_unchecked(buffer);
                p.check_len()?;
                Ok(p)
            }

            #[doc = concat!("Checks that the buffer holds ", $name, ".")]
            ///
            /// # Errors
            /// [`PacketError::Truncated`](crate::soft::wire::PacketError::Truncated) when it does not.
            pub fn check_len(&self) -> crate::soft::wire::PacketResult<()> {
                if self.buffer.as_ref().len() < HEADER_LEN {
                    Err(crate::soft::wire::PacketError::Truncated)
                } else {
                    Ok(())
                }
            }

            /// The underlying buffer.
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}

pub mod aeth;
pub mod atomic_ack_eth;
pub mod atomic_eth;
pub mod bth;
pub mod icrc;
pub mod ieth;
pub mod immdt;
pub mod opcode;
pub mod packet;
pub mod peer_ref;
pub mod psn;
pub mod reth;

/// Byte ranges inside a header.
mod field {
    pub type Field = core::ops::Range<usize>;
}

/// Big-endian integer access used by every header view.
mod be {
    #[inline]
    pub fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_be_bytes([b[at], b[at + 1]])
    }
    #[inline]
    pub fn u24_at(b: &[u8], at: usize) -> u32 {
        u32::from_be_bytes([0, b[at], b[at + 1], b[at + 2]])
    }
    #[inline]
    pub fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
    }
    #[inline]
    pub fn u64_at(b: &[u8], at: usize) -> u64 {
        (u64::from(u32_at(b, at)) << 32) | u64::from(u32_at(b, at + 4))
    }
    #[inline]
    pub fn put_u16(b: &mut [u8], at: usize, v: u16) {
        b[at..at + 2].copy_from_slice(&v.to_be_bytes());
    }
    #[inline]
    pub fn put_u24(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 3].copy_from_slice(&v.to_be_bytes()[1..]);
    }
    #[inline]
    pub fn put_u32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_be_bytes());
    }
    #[inline]
    pub fn put_u64(b: &mut [u8], at: usize, v: u64) {
        b[at..at + 8].copy_from_slice(&v.to_be_bytes());
    }
}

/// Parses a hex string (whitespace ignored) for golden-byte tests.
#[cfg(test)]
pub(crate) fn hex(s: &str) -> Vec<u8> {
    let digits: Vec<u8> = s
        .bytes()
        .filter(|c| !c.is_ascii_whitespace())
        .map(|c| match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            b'A'..=b'F' => c - b'A' + 10,
            _ => panic!("not a hex digit: {c}"),
        })
        .collect();
    assert!(digits.len() % 2 == 0, "odd number of hex digits");
    digits.chunks(2).map(|p| (p[0] << 4) | p[1]).collect()
}

/// Parses a hexdump in the `0000  45 00 …` layout of the reference vectors.
#[cfg(test)]
pub(crate) fn hexdump(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for line in s.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let (_, bytes) = line.split_once(' ').expect("offset column");
        out.extend(hex(bytes));
    }
    out
}

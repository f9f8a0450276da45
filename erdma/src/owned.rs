//! Registered buffers owned by value: the memory of requests that own their buffers.
//!
//! Owns [`OwnedBuf`]: a part of a registered region, `'static` by construction (it holds the
//! registration, and the memory with it, alive), that moves into an owned request
//! ([`crate::AsyncQp`]) and comes back with the request's completion — the model io-uring
//! runtimes use. While it is in flight nobody holds it, so nothing can read, write or free its
//! bytes; a request whose future is dropped keeps it parked in the SDK until the completion
//! comes. Also owns the range of request numbers (`wr_id`s) reserved for owned requests, which
//! every other posting path refuses, so a completion can be routed to its owner and to nobody
//! else.
//!
//! It must not: hand out a reference to bytes a peer may write (the rules of [`crate::Mr`]
//! apply), nor give two values overlapping bytes.

#![allow(unsafe_code)] // views of the bytes of a registered region

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::mr::{Mr, MrInner, MrSlice, MrSliceMut, RemoteMr};
use crate::pd::Pd;
use crate::vocab::{Access, Sge};

/// The top 16 bits of every `wr_id` an owned request carries.
const OWNED_TAG: u64 = 0xE4D3 << 48;
const TAG_MASK: u64 = 0xFFFF << 48;

/// Whether `wr_id` lies in the range reserved for owned requests.
pub(crate) fn is_owned_id(wr_id: u64) -> bool {
    wr_id & TAG_MASK == OWNED_TAG
}

/// A fresh request number for an owned request: unique in the process (2^48 of them).
#[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by `AsyncQp` only
pub(crate) fn next_owned_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    OWNED_TAG | (NEXT.fetch_add(1, Ordering::Relaxed) & !TAG_MASK)
}

/// Refuses a request number an application chose in the range reserved for owned requests:
/// its completion could otherwise hand an owned buffer back while the device still uses it.
///
/// # Errors
/// [`Error::InvalidArgument`] for a `wr_id` whose top 16 bits are `0xE4D3`.
pub(crate) fn check_user_wr_id(wr_id: u64) -> Result<()> {
    if is_owned_id(wr_id) {
        return Err(Error::invalid(format!(
            "wr_id {wr_id:#x}: request numbers whose top 16 bits are {:#x} are reserved for the \
             SDK's owned-buffer requests",
            OWNED_TAG >> 48
        )));
    }
    Ok(())
}

/// A registered buffer owned by value: a part of a region that no other value can reach.
///
/// Make one with [`OwnedBuf::alloc`] or from any `Mr<'static>` ([`OwnedBuf::from_mr`]), split
/// one into disjoint parts with [`OwnedBuf::split_at`] / [`OwnedBuf::chunks`], and move it into
/// an owned request ([`crate::AsyncQp`]); the request's completion gives it back. The region is
/// deregistered, and its memory freed, when the last part of it goes.
///
/// Like a `Vec<u8>` of fixed capacity whose bytes are always initialised: [`OwnedBuf::len`] is
/// what a SEND or WRITE sends and what a READ fills, [`OwnedBuf::capacity`] what a receive may
/// fill (a completed receive sets the length to the bytes received). Dereferences to its first
/// `len()` bytes.
pub struct OwnedBuf {
    mr: Arc<MrInner>,
    off: usize,
    cap: usize,
    len: usize,
}

impl OwnedBuf {
    /// Allocates `len` zeroed, page-aligned bytes ([`Pd::alloc`]) registered with `access`, as
    /// one buffer of length `len`.
    ///
    /// # Errors
    /// As [`Pd::alloc`]; [`Error::InvalidArgument`] for `len == 0`.
    pub fn alloc(pd: &Pd, len: usize, access: Access) -> Result<OwnedBuf> {
        Ok(OwnedBuf::from_mr(pd.alloc(len, access)?))
    }

    /// The whole of a region whose memory lives as long as it does ([`Pd::alloc`],
    /// [`Pd::register`], ...), as one buffer.
    pub fn from_mr(mr: Mr<'static>) -> OwnedBuf {
        let cap = mr.len();
        OwnedBuf {
            mr: mr.inner,
            off: 0,
            cap,
            len: cap,
        }
    }

    /// Bytes a SEND or WRITE sends, a READ fills, and `Deref` shows.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether [`OwnedBuf::len`] is zero.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes this buffer spans: what a receive may fill.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the length (the bytes keep their values: they are always initialised).
    ///
    /// # Panics
    /// When `len` exceeds the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.cap,
            "length {len} exceeds the buffer's capacity {}",
            self.cap
        );
        self.len = len;
    }

    /// Splits into `[0, mid)` and `[mid, capacity)`, each at its full capacity.
    ///
    /// # Panics
    /// When `mid` exceeds the capacity.
    pub fn split_at(self, mid: usize) -> (OwnedBuf, OwnedBuf) {
        assert!(
            mid <= self.cap,
            "split point {mid} past the capacity {}",
            self.cap
        );
        let tail = OwnedBuf {
            mr: self.mr.clone(),
            off: self.off + mid,
            cap: self.cap - mid,
            len: self.cap - mid,
        };
        let head = OwnedBuf {
            mr: self.mr,
            off: self.off,
            cap: mid,
            len: mid,
        };
        (head, tail)
    }

    /// Splits into consecutive buffers of `size` bytes (the last may be shorter): a pool.
    ///
    /// # Panics
    /// When `size == 0`.
    pub fn chunks(self, size: usize) -> Vec<OwnedBuf> {
        assert!(size > 0, "chunk size must be positive");
        let mut out = Vec::with_capacity(self.cap.div_ceil(size));
        let mut rest = self;
        while rest.cap > size {
            let (head, tail) = rest.split_at(size);
            out.push(head);
            rest = tail;
        }
        out.push(rest);
        out
    }

    /// The access rights of the region.
    pub fn access(&self) -> Access {
        self.mr.access
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey
    }

    /// What a peer needs to reach this buffer's capacity (useful only with remote rights).
    pub fn remote(&self) -> RemoteMr {
        RemoteMr {
            addr: self.addr(),
            len: self.cap as u64,
            rkey: self.mr.rkey,
        }
    }

    /// The first byte's address.
    pub fn addr(&self) -> u64 {
        self.mr.addr as u64 + self.off as u64
    }

    /// Whether a peer may write the region: then the buffer hands out no reference to its
    /// bytes (see [`Mr::peer_writable`]); copy with [`OwnedBuf::read_at`] instead.
    pub fn peer_writable(&self) -> bool {
        self.mr
            .access
            .intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
    }

    /// Copies `out.len()` bytes from `offset` (within the capacity) into `out`, whatever the
    /// region's rights.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range lies outside the capacity.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len())?;
        // The range lies inside this buffer (checked), whose memory the region keeps alive;
        // `out` is a distinct `&mut`; no reference to the region's bytes is made.
        // SAFETY: both ranges are valid for `out.len()` bytes and disjoint (above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.mr.addr.add(self.off + offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Copies `data` into the buffer from `offset` (within the capacity), whatever the region's
    /// rights.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range lies outside the capacity.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len())?;
        // As in `read_at`; `&mut self` is the only handle on these bytes.
        // SAFETY: both ranges are valid for `data.len()` bytes and disjoint (above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.mr.addr.add(self.off + offset),
                data.len(),
            )
        };
        Ok(())
    }

    /// The first `len()` bytes as a segment the device reads, for synchronous posting in a
    /// [`crate::scope`] (the segment borrows the buffer, so it cannot move meanwhile).
    pub fn as_mr_slice(&self) -> MrSlice<'_> {
        MrSlice::from_parts(
            self.addr(),
            self.len as u64,
            self.mr.lkey,
            self.mr.device,
            self.peer_writable(),
        )
    }

    /// The whole capacity as a segment the device writes (a receive, READ or atomic target),
    /// for synchronous posting in a [`crate::scope`].
    pub fn as_mr_slice_mut(&mut self) -> MrSliceMut<'_> {
        MrSliceMut::from_parts(
            self.addr(),
            self.cap as u64,
            self.mr.lkey,
            self.mr.device,
            self.peer_writable(),
        )
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.cap => Ok(()),
            _ => Err(Error::OutOfBounds {
                what: "owned buffer",
                offset: offset as u64,
                len: len as u64,
                available: self.cap as u64,
            }),
        }
    }

    /// The SGE over the first `len` bytes (what the device reads, or a READ fills).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] past `u32::MAX` bytes (one SGE's most).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by `AsyncQp` only
    pub(crate) fn sge(&self) -> Result<Sge> {
        self.sge_of(self.len)
    }

    /// The SGE over the whole capacity (what a receive may fill).
    ///
    /// # Errors
    /// As [`OwnedBuf::sge`].
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by `AsyncQp` only
    pub(crate) fn full_sge(&self) -> Result<Sge> {
        self.sge_of(self.cap)
    }

    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by `AsyncQp` only
    fn sge_of(&self, len: usize) -> Result<Sge> {
        let length = u32::try_from(len).map_err(|_| {
            Error::invalid(format!(
                "a {len}-byte buffer: one request moves at most {} bytes",
                u32::MAX
            ))
        })?;
        Ok(Sge {
            addr: self.addr(),
            length,
            lkey: self.mr.lkey,
        })
    }

    /// Whether the buffer's region belongs to `pd`.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))] // used by `AsyncQp` only
    pub(crate) fn in_pd(&self, pd: &Pd) -> bool {
        Arc::ptr_eq(&self.mr.pd.inner, &pd.inner)
    }

    fn check_view(&self) {
        assert!(
            !self.mr.device,
            "this buffer is GPU memory, which the CPU cannot access in place"
        );
        assert!(
            !self.peer_writable(),
            "a peer may write this buffer (REMOTE_WRITE or REMOTE_ATOMIC), which Rust forbids \
             under a reference: copy it with OwnedBuf::read_at / write_at"
        );
    }
}

impl Deref for OwnedBuf {
    type Target = [u8];

    /// # Panics
    /// When the buffer is GPU memory or a peer may write it ([`OwnedBuf::peer_writable`]).
    fn deref(&self) -> &[u8] {
        self.check_view();
        // `[off, off+len)` lies inside the region (`len <= cap`, and parts are only made by
        // splitting inside it), the region's memory lives while `self.mr` does, no peer may
        // write it (checked), and no other value reaches these bytes: buffers are made from a
        // whole `Mr<'static>` taken by value and split without overlap, and a buffer in flight
        // is held by the SDK, not by any application value. `&self` excludes `&mut self`.
        // SAFETY: the bytes are live, initialised and not written while `&self` lives (above).
        unsafe { std::slice::from_raw_parts(self.mr.addr.add(self.off), self.len) }
    }
}

impl DerefMut for OwnedBuf {
    /// # Panics
    /// As `deref`.
    fn deref_mut(&mut self) -> &mut [u8] {
        self.check_view();
        // SAFETY: as in `deref`; `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.mr.addr.add(self.off), self.len) }
    }
}

impl fmt::Debug for OwnedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedBuf")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .field("lkey", &format_args!("{:#x}", self.mr.lkey))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_ids_are_refused_and_fresh_ids_are_reserved() {
        let a = next_owned_id();
        let b = next_owned_id();
        assert_ne!(a, b);
        assert!(is_owned_id(a) && is_owned_id(b));
        assert!(check_user_wr_id(a).is_err());
        assert!(check_user_wr_id(0).is_ok());
        assert!(check_user_wr_id(u64::MAX).is_ok());
        assert!(check_user_wr_id(0x7fff_dead_beef).is_ok());
    }
}

//! How the protocol reaches registered memory: the [`Memory`] trait the caller implements.
//!
//! The protocol performs every check itself (key → region lookup, protection domain, access
//! rights, bounds) and only then asks the implementation to move bytes within a region it has
//! validated. Implementations copy; they re-check bounds against their own records as a second
//! line of defence, keyed by [`Region::handle`]. Calls are coarse: one per packet payload and
//! region (never per byte), so an implementation may take a lock or issue a device copy per call.

use core::fmt;

use crate::soft::wire::peer_ref::PeerRefs;
use crate::vocab::Access;

/// A registered memory region as the caller's table describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    /// The implementation's identity for the region (slot index, pointer, …); the protocol passes
    /// it back untouched.
    pub handle: u64,
    /// The key (lkey and rkey: the soft device uses one key for both).
    pub key: u32,
    /// Protection domain.
    pub pd: u32,
    /// The address peers and work requests use for the region's first byte.
    pub iova: u64,
    /// Length in bytes.
    pub len: u64,
    /// Rights granted.
    pub access: Access,
}

impl Region {
    /// The offset of `[va, va+len)` inside the region, or `None` when the range leaves it (or
    /// its end overflows).
    pub const fn offset_of(&self, va: u64, len: u64) -> Option<u64> {
        if va < self.iova {
            return None;
        }
        let off = va - self.iova;
        match off.checked_add(len) {
            Some(end) if end <= self.len => Some(off),
            _ => None,
        }
    }
}

/// An 8-byte atomic operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AtomicOp {
    /// If the value equals `compare`, replace it with `swap`.
    CompareSwap {
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// Add `add` (wrapping).
    FetchAdd {
        /// Addend.
        add: u64,
    },
}

/// A memory operation the implementation refused or failed (its own bounds check caught a
/// range, or a device copy failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemoryError;

impl fmt::Display for MemoryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("memory access failed")
    }
}

impl std::error::Error for MemoryError {}

/// Registered memory, as the protocol sees it.
///
/// Offsets are relative to the region's first byte. The protocol has already checked that
/// `[offset, offset + len)` lies inside the region, that the region belongs to the right
/// protection domain and that it grants the right needed; an implementation must still refuse
/// (with [`MemoryError`]) any range that leaves its own record of the region.
pub trait Memory {
    /// The live region `key` names, or `None` when no live region has that key (never registered,
    /// deregistered, or invalidated).
    fn region(&self, key: u32) -> Option<Region>;

    /// Copies `dst.len()` bytes out of `region` at `offset`.
    ///
    /// # Errors
    /// [`MemoryError`] when the range is outside the region or the copy failed.
    fn read(&mut self, region: &Region, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError>;

    /// Copies `src` into `region` at `offset`.
    ///
    /// # Errors
    /// [`MemoryError`] when the range is outside the region or the copy failed.
    fn write(&mut self, region: &Region, offset: u64, src: &[u8]) -> Result<(), MemoryError>;

    /// Runs an 8-byte atomic on the naturally aligned word at `offset` and returns the value it
    /// held before. Must be atomic with respect to every other atomic of this device.
    ///
    /// # Errors
    /// [`MemoryError`] when the word is outside the region or misaligned.
    fn atomic(&mut self, region: &Region, offset: u64, op: AtomicOp) -> Result<u64, MemoryError>;

    /// Invalidates the region's key (SEND_WITH_INVALIDATE): afterwards [`Memory::region`] returns
    /// `None` for it.
    ///
    /// # Errors
    /// [`MemoryError`] when the region is no longer live.
    fn invalidate(&mut self, region: &Region) -> Result<(), MemoryError>;

    /// Offers to lend the packet being written `len` bytes of `region` at `offset` instead of
    /// copying them into it: an implementation that accepts (returns `true`) puts those bytes on
    /// the wire itself, straight from the region, where the packet's payload goes, and
    /// [`Memory::hash_lent`] feeds them to the ICRC. Declining (the default) makes the protocol
    /// copy them with [`Memory::read`]. Only a request's own payload (the local memory of a
    /// posted send or WRITE) is offered.
    fn lend(&mut self, region: &Region, offset: u64, len: usize) -> bool {
        let _ = (region, offset, len);
        false
    }

    /// Feeds the bytes of the last accepted [`Memory::lend`] to `hasher`.
    fn hash_lent(&mut self, hasher: &mut crc32fast::Hasher) {
        let _ = hasher;
    }

    /// Where `len` bytes of `region` at `offset` lie in this process, when a same-host peer may
    /// be handed a reference to them instead of the bytes ([`crate::soft::wire::peer_ref`]);
    /// `None` (the default) keeps them on the wire. Asked only for a request's own payload,
    /// after the protocol checked the range, and only on a queue pair whose peer accepts
    /// references ([`super::Qp::set_peer_refs`]).
    fn peer_addr(&mut self, region: &Region, offset: u64, len: usize) -> Option<u64> {
        let _ = (region, offset, len);
        None
    }

    /// Copies the bytes `src` names in the memory of the peer that sent the packet being
    /// handled into `region` at `offset` (`src.total()` bytes): a reference packet's payload,
    /// moved with one copy. The default refuses (the device then answers with a remote
    /// operational error, as for any failed copy).
    ///
    /// # Errors
    /// [`MemoryError`] when the range is outside the region, the sender is not a verified
    /// same-host peer, or its memory could not be read.
    fn write_from_peer(
        &mut self,
        region: &Region,
        offset: u64,
        src: &PeerRefs,
    ) -> Result<(), MemoryError> {
        let _ = (region, offset, src);
        Err(MemoryError)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_stay_inside() {
        let r = Region {
            handle: 0,
            key: 1,
            pd: 1,
            iova: 0x1000,
            len: 0x100,
            access: Access::ALL,
        };
        assert_eq!(r.offset_of(0x1000, 0x100), Some(0));
        assert_eq!(r.offset_of(0x10FF, 1), Some(0xFF));
        assert_eq!(
            r.offset_of(0x1100, 0),
            Some(0x100),
            "an empty range at the end"
        );
        assert_eq!(r.offset_of(0x10FF, 2), None);
        assert_eq!(r.offset_of(0xFFF, 1), None);
        assert_eq!(r.offset_of(0x1001, u64::MAX), None, "overflowing end");
    }
}

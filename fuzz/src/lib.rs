//! Shared pieces of the fuzz targets: a memory wrapper that turns every access the protocol
//! should never make into a panic (which libFuzzer reports as a crash), and packet builders.

use std::collections::HashMap;

use erdma::soft::proto::{AtomicOp, Memory, MemoryError, Region};

/// What the protocol may do to one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allowed {
    /// Copy bytes out of it.
    pub read: bool,
    /// Copy bytes into it, or run atomics on it.
    pub write: bool,
}

impl Allowed {
    /// Nothing at all.
    pub const NONE: Allowed = Allowed {
        read: false,
        write: false,
    };
    /// Reads only.
    pub const READ: Allowed = Allowed {
        read: true,
        write: false,
    };
    /// Reads and writes.
    pub const ALL: Allowed = Allowed {
        read: true,
        write: true,
    };
}

/// A [`Memory`] that checks every access against a per-key policy and against the region's own
/// bounds before passing it on, and panics on a violation: the protocol must do every check
/// itself, so the implementation's second line of defence is never needed.
#[derive(Debug)]
pub struct Guarded<'m, M: Memory> {
    /// The memory accesses go to.
    pub inner: &'m mut M,
    /// Allowed accesses by key; a key not listed allows nothing.
    pub policy: &'m HashMap<u32, Allowed>,
}

impl<M: Memory> Guarded<'_, M> {
    fn check(&self, region: &Region, offset: u64, len: u64, write: bool) {
        let live = self
            .inner
            .region(region.key)
            .unwrap_or_else(|| panic!("access to a dead key {:#x}", region.key));
        assert_eq!(&live, region, "the protocol passed a stale region record");
        let end = offset.checked_add(len).expect("offset + len overflows");
        assert!(
            end <= region.len,
            "access [{offset}, {end}) outside a {}-byte region",
            region.len
        );
        let allowed = self
            .policy
            .get(&region.key)
            .copied()
            .unwrap_or(Allowed::NONE);
        if write {
            assert!(allowed.write, "write to protected region {:#x}", region.key);
        } else {
            assert!(allowed.read, "read of protected region {:#x}", region.key);
        }
    }
}

impl<M: Memory> Memory for Guarded<'_, M> {
    fn region(&self, key: u32) -> Option<Region> {
        self.inner.region(key)
    }

    fn read(&mut self, region: &Region, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        self.check(region, offset, dst.len() as u64, false);
        self.inner.read(region, offset, dst)
    }

    fn write(&mut self, region: &Region, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.check(region, offset, src.len() as u64, true);
        self.inner.write(region, offset, src)
    }

    fn atomic(&mut self, region: &Region, offset: u64, op: AtomicOp) -> Result<u64, MemoryError> {
        self.check(region, offset, 8, true);
        assert_eq!(
            region.iova.wrapping_add(offset) % 8,
            0,
            "atomic on an unaligned address"
        );
        self.inner.atomic(region, offset, op)
    }

    fn invalidate(&mut self, region: &Region) -> Result<(), MemoryError> {
        self.inner.invalidate(region)
    }
}

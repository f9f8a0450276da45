//! The soft device's memory-region table and the only code that touches registered memory.
//!
//! Owns [`MrTable`] (keys → regions, with a generation byte in every key so a stale key never
//! reaches a later region that reuses its slot) and the raw byte copies and 8-byte atomics the
//! protocol asks for. The protocol core checks keys, PDs, rights and bounds before it asks; the
//! copies here check the bounds again, so a protocol bug cannot turn into a write outside a region.
//!
//! The table sits behind a lock that the engine holds while it moves bytes; deregistering takes the
//! lock exclusively, so once `deregister` returns the device can no longer touch the memory.
//! The one other reader is the send path's gather: a request's payload lent to a transmit batch
//! (`DevMemory::lend`, `TxBatch::commit_lent`) is read by the ICRC and by the kernel's `sendmmsg`
//! under that same lock, or copied into the batch before the lock goes (`TxBatch::own_lent`).

#[cfg(feature = "gpu")]
use std::sync::Arc;

#[cfg(feature = "gpu")]
use crate::gpu::stage::Stager;
use crate::vocab::Access;

/// Where a region's bytes live.
#[derive(Debug, Clone)]
pub(crate) enum RegionKind {
    /// Host memory, reached with plain loads and stores.
    Host,
    /// Device (GPU) memory, reached through its stager's copies.
    #[cfg(feature = "gpu")]
    Device(Arc<Stager>),
}

impl PartialEq for RegionKind {
    fn eq(&self, other: &RegionKind) -> bool {
        match (self, other) {
            (RegionKind::Host, RegionKind::Host) => true,
            #[cfg(feature = "gpu")]
            (RegionKind::Device(a), RegionKind::Device(b)) => Arc::ptr_eq(a, b),
            #[cfg(feature = "gpu")]
            _ => false,
        }
    }
}

impl Eq for RegionKind {}

impl RegionKind {
    /// The stager of a device-memory region.
    #[cfg(feature = "gpu")]
    pub(crate) fn stager(&self) -> Option<&Arc<Stager>> {
        match self {
            RegionKind::Device(s) => Some(s),
            RegionKind::Host => None,
        }
    }
}

/// One registered region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Region {
    pub pd: u32,
    pub addr: u64,
    pub len: u64,
    pub access: Access,
    pub key: u32,
    pub kind: RegionKind,
}

/// Keys → regions.
#[derive(Debug, Default)]
pub(crate) struct MrTable {
    slots: Vec<Option<Region>>,
    generations: Vec<u8>,
    free: Vec<u32>,
    live: usize,
}

impl MrTable {
    /// Adds a host-memory region and returns its key (`(slot + 1) << 8 | generation`; never 0).
    pub(crate) fn insert(&mut self, pd: u32, addr: u64, len: u64, access: Access) -> Option<u32> {
        self.insert_kind(pd, addr, len, access, RegionKind::Host)
    }

    /// Adds a region of any kind and returns its key.
    pub(crate) fn insert_kind(
        &mut self,
        pd: u32,
        addr: u64,
        len: u64,
        access: Access,
        kind: RegionKind,
    ) -> Option<u32> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let s = self.slots.len() as u32;
                if s >= (1 << 24) - 1 {
                    return None;
                }
                self.slots.push(None);
                self.generations.push(0);
                s
            }
        };
        let i = slot as usize;
        self.generations[i] = self.generations[i].wrapping_add(1);
        let key = ((slot + 1) << 8) | self.generations[i] as u32;
        self.slots[i] = Some(Region {
            pd,
            addr,
            len,
            access,
            key,
            kind,
        });
        self.live += 1;
        Some(key)
    }

    fn index(&self, key: u32) -> Option<usize> {
        let slot = (key >> 8).checked_sub(1)? as usize;
        (slot < self.slots.len() && self.generations[slot] == key as u8).then_some(slot)
    }

    /// The region a key names, if it is live.
    pub(crate) fn get(&self, key: u32) -> Option<&Region> {
        self.slots[self.index(key)?].as_ref()
    }

    /// Removes a region.
    pub(crate) fn remove(&mut self, key: u32) -> Option<Region> {
        let i = self.index(key)?;
        let r = self.slots[i].take()?;
        self.free.push(i as u32);
        self.live -= 1;
        Some(r)
    }

    /// Number of live regions.
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// The live regions.
    #[cfg(feature = "gpu")]
    pub(crate) fn regions(&self) -> impl Iterator<Item = &Region> {
        self.slots.iter().flatten()
    }
}

/// Whether `[offset, offset+len)` lies inside `region`.
fn inside(region: &Region, offset: u64, len: usize) -> bool {
    offset
        .checked_add(len as u64)
        .is_some_and(|end| end <= region.len)
}

/// Copies `dst.len()` bytes from `region` at `offset`. Returns `false` (and copies nothing) when
/// the range is not inside the region.
pub(crate) fn read(region: &Region, offset: u64, dst: &mut [u8]) -> bool {
    if !inside(region, offset, dst.len()) {
        return false;
    }
    if dst.is_empty() {
        return true;
    }
    #[cfg(feature = "gpu")]
    if let RegionKind::Device(stager) = &region.kind {
        return stager.read(None, offset, dst).is_ok();
    }
    // The region is live (the caller holds the table lock that deregistration needs), so
    // `[addr, addr+len)` is memory its owner registered and keeps allocated; the range was just
    // checked to lie inside it, and `dst` is a distinct Rust buffer.
    // SAFETY: both ranges are valid for `dst.len()` bytes and do not overlap (above).
    unsafe {
        std::ptr::copy_nonoverlapping(
            (region.addr + offset) as *const u8,
            dst.as_mut_ptr(),
            dst.len(),
        );
    }
    true
}

/// Copies `src` into `region` at `offset`. Returns `false` (and writes nothing) when the range
/// is not inside the region.
pub(crate) fn write(region: &Region, offset: u64, src: &[u8]) -> bool {
    if !inside(region, offset, src.len()) {
        return false;
    }
    if src.is_empty() {
        return true;
    }
    // Device memory: staged here, placed by the stager's flush, which the driver runs before
    // anything reports these bytes as placed.
    #[cfg(feature = "gpu")]
    if let RegionKind::Device(stager) = &region.kind {
        return stager.write(offset, src).is_ok();
    }
    // As in `read`; the region was registered with local write access checked by the
    // protocol, and the memory belongs to the registrant, who granted the device this write.
    // SAFETY: both ranges are valid for `src.len()` bytes and do not overlap (above).
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), (region.addr + offset) as *mut u8, src.len());
    }
    true
}

/// An 8-byte atomic on a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AtomicOp {
    /// Compare and swap.
    CompareSwap { compare: u64, swap: u64 },
    /// Fetch and add.
    FetchAdd { add: u64 },
}

/// Runs an atomic on the naturally aligned 8 bytes at `offset`, returning the original value;
/// `None` when the target is out of range or misaligned. The operation is a CPU atomic, so it is
/// atomic with respect to the application's own atomics on that word (`ATOMIC_GLOB`).
pub(crate) fn atomic(region: &Region, offset: u64, op: AtomicOp) -> Option<u64> {
    if !inside(region, offset, 8) || (region.addr + offset) % 8 != 0 {
        return None;
    }
    // Atomics need CPU access to the word: device memory refuses them (the peer's request
    // completes with a remote operational error), as a NIC without PCIe atomics to GPU memory
    // would.
    if region.kind != RegionKind::Host {
        return None;
    }
    let ptr = (region.addr + offset) as *mut u64;
    // `ptr` is 8-byte aligned (checked), inside a live registered region (checked and
    // guaranteed by the table lock), and valid for reads and writes for the duration of this
    // call; every access the device makes to it goes through this atomic.
    // SAFETY: an aligned, live, exclusively-atomically-accessed word (above).
    let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(ptr) };
    use std::sync::atomic::Ordering::SeqCst;
    Some(match op {
        AtomicOp::CompareSwap { compare, swap } => {
            match word.compare_exchange(compare, swap, SeqCst, SeqCst) {
                Ok(v) | Err(v) => v,
            }
        }
        AtomicOp::FetchAdd { add } => word.fetch_add(add, SeqCst),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_a_generation() {
        let mut t = MrTable::default();
        let k1 = t.insert(1, 0x1000, 64, Access::LOCAL_WRITE).unwrap();
        assert_ne!(k1, 0);
        assert_eq!(t.get(k1).unwrap().addr, 0x1000);
        assert!(t.remove(k1).is_some());
        assert!(t.get(k1).is_none());
        let k2 = t.insert(1, 0x2000, 64, Access::LOCAL_WRITE).unwrap();
        assert_eq!(k1 >> 8, k2 >> 8, "slot reused");
        assert_ne!(k1, k2, "but the key differs");
        assert!(
            t.get(k1).is_none(),
            "a stale key never reaches the new region"
        );
        assert!(t.get(0).is_none() && t.get(0xffff_ffff).is_none());
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn copies_stay_inside_the_region() {
        let mut mem = vec![0u8; 32];
        let r = Region {
            pd: 1,
            addr: mem.as_mut_ptr() as u64,
            len: 16,
            access: Access::ALL,
            key: 0x100,
            kind: RegionKind::Host,
        };
        assert!(write(&r, 8, &[7; 8]));
        assert!(!write(&r, 9, &[9; 8]), "one byte past the end");
        assert!(!write(&r, u64::MAX, &[9; 1]), "overflowing offset");
        let mut out = [0u8; 8];
        assert!(read(&r, 8, &mut out));
        assert_eq!(out, [7; 8]);
        assert!(
            mem[16..].iter().all(|&b| b == 0),
            "nothing written past the region"
        );
    }

    #[test]
    fn atomics_are_aligned_and_bounded() {
        let mut mem = vec![0u64; 4];
        let r = Region {
            pd: 1,
            addr: mem.as_mut_ptr() as u64,
            len: 32,
            access: Access::ALL,
            key: 0x100,
            kind: RegionKind::Host,
        };
        assert_eq!(atomic(&r, 8, AtomicOp::FetchAdd { add: 5 }), Some(0));
        assert_eq!(atomic(&r, 8, AtomicOp::FetchAdd { add: 5 }), Some(5));
        assert_eq!(
            atomic(
                &r,
                8,
                AtomicOp::CompareSwap {
                    compare: 10,
                    swap: 1
                }
            ),
            Some(10)
        );
        assert_eq!(
            atomic(
                &r,
                8,
                AtomicOp::CompareSwap {
                    compare: 10,
                    swap: 2
                }
            ),
            Some(1),
            "failed compare leaves the value"
        );
        assert_eq!(mem[1], 1);
        assert_eq!(
            atomic(&r, 4, AtomicOp::FetchAdd { add: 1 }),
            None,
            "misaligned"
        );
        assert_eq!(
            atomic(&r, 32, AtomicOp::FetchAdd { add: 1 }),
            None,
            "past the end"
        );
    }
}

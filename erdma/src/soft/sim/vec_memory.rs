//! Memory regions backed by `Vec`s, for tests and fuzz targets that drive the protocol core
//! ([`crate::soft::proto::Qp`]) directly, without an engine.

use crate::soft::proto::{AtomicOp, Memory, MemoryError, Region};
use crate::vocab::Access;

/// One `Vec`-backed region.
#[derive(Debug, Clone)]
struct VecRegion {
    key: u32,
    pd: u32,
    iova: u64,
    access: Access,
    data: Vec<u8>,
    /// Not invalidated (SEND_WITH_INV) and not deregistered.
    valid: bool,
}

/// A registered region as the test sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrInfo {
    /// Key (lkey = rkey).
    pub key: u32,
    /// Address of the first byte.
    pub iova: u64,
    /// Length.
    pub len: u64,
}

/// Memory regions backed by `Vec<u8>`, one address space per device.
///
/// Regions get disjoint addresses with unmapped gaps between them, so an access that strays
/// past a region's end never lands in another.
#[derive(Debug, Clone)]
pub struct VecMemory {
    slots: Vec<Option<VecRegion>>,
    generation: u8,
    next_iova: u64,
}

impl Default for VecMemory {
    fn default() -> VecMemory {
        VecMemory::new()
    }
}

impl VecMemory {
    /// No regions.
    pub fn new() -> VecMemory {
        VecMemory {
            slots: Vec::new(),
            generation: 0,
            next_iova: 0x10_0000,
        }
    }

    /// Registers `len` zeroed bytes in protection domain `pd` with rights `access`.
    pub fn register(&mut self, pd: u32, len: usize, access: Access) -> MrInfo {
        self.generation = self.generation.wrapping_add(1);
        let slot = self.slots.len() as u32;
        let key = ((slot + 1) << 8) | u32::from(self.generation);
        let iova = self.next_iova;
        self.next_iova = (iova + len as u64 + 0x2000) & !0xFFF;
        self.slots.push(Some(VecRegion {
            key,
            pd,
            iova,
            access,
            data: vec![0; len],
            valid: true,
        }));
        MrInfo {
            key,
            iova,
            len: len as u64,
        }
    }

    /// Deregisters a region; its bytes stay readable through [`VecMemory::bytes`].
    pub fn deregister(&mut self, key: u32) -> bool {
        match self.find_mut(key) {
            Some(r) => {
                let was = r.valid;
                r.valid = false;
                was
            }
            None => false,
        }
    }

    fn find(&self, key: u32) -> Option<&VecRegion> {
        let slot = (key >> 8).checked_sub(1)? as usize;
        self.slots.get(slot)?.as_ref().filter(|r| r.key == key)
    }

    fn find_mut(&mut self, key: u32) -> Option<&mut VecRegion> {
        let slot = (key >> 8).checked_sub(1)? as usize;
        self.slots.get_mut(slot)?.as_mut().filter(|r| r.key == key)
    }

    /// A region's bytes (valid or not).
    pub fn bytes(&self, key: u32) -> Option<&[u8]> {
        self.find(key).map(|r| &r.data[..])
    }

    /// A region's bytes, to fill test data.
    pub fn bytes_mut(&mut self, key: u32) -> Option<&mut [u8]> {
        self.find_mut(key).map(|r| &mut r.data[..])
    }

    /// Whether the key still grants access.
    pub fn is_valid(&self, key: u32) -> bool {
        self.find(key).is_some_and(|r| r.valid)
    }

    /// The region behind `r.handle` after the second-line bounds check.
    fn checked(&mut self, r: &Region, offset: u64, len: usize) -> Result<&mut [u8], MemoryError> {
        let slot = self
            .slots
            .get_mut(r.handle as usize)
            .and_then(Option::as_mut)
            .ok_or(MemoryError)?;
        if slot.key != r.key || !slot.valid {
            return Err(MemoryError);
        }
        let start = usize::try_from(offset).map_err(|_| MemoryError)?;
        let end = start.checked_add(len).ok_or(MemoryError)?;
        slot.data.get_mut(start..end).ok_or(MemoryError)
    }
}

impl Memory for VecMemory {
    fn region(&self, key: u32) -> Option<Region> {
        let r = self.find(key).filter(|r| r.valid)?;
        Some(Region {
            handle: u64::from((key >> 8) - 1),
            key,
            pd: r.pd,
            iova: r.iova,
            len: r.data.len() as u64,
            access: r.access,
        })
    }

    fn read(&mut self, region: &Region, offset: u64, dst: &mut [u8]) -> Result<(), MemoryError> {
        let src = self.checked(region, offset, dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn write(&mut self, region: &Region, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
        self.checked(region, offset, src.len())?
            .copy_from_slice(src);
        Ok(())
    }

    fn atomic(&mut self, region: &Region, offset: u64, op: AtomicOp) -> Result<u64, MemoryError> {
        if (region.iova.wrapping_add(offset)) % 8 != 0 {
            return Err(MemoryError);
        }
        let word = self.checked(region, offset, 8)?;
        let mut b = [0u8; 8];
        b.copy_from_slice(word);
        let old = u64::from_ne_bytes(b);
        let new = match op {
            AtomicOp::CompareSwap { compare, swap } => {
                if old == compare {
                    swap
                } else {
                    old
                }
            }
            AtomicOp::FetchAdd { add } => old.wrapping_add(add),
        };
        word.copy_from_slice(&new.to_ne_bytes());
        Ok(old)
    }

    fn invalidate(&mut self, region: &Region) -> Result<(), MemoryError> {
        match self.find_mut(region.key) {
            Some(r) if r.valid => {
                r.valid = false;
                Ok(())
            }
            _ => Err(MemoryError),
        }
    }
}

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

#![allow(unsafe_code)] // registered memory: copies and atomics by address

use std::ptr::NonNull;
#[cfg(feature = "gpu")]
use std::sync::{Arc, Mutex};

use crate::soft::proto;
use crate::soft::wire::peer_ref::PeerRefs;
#[cfg(feature = "gpu")]
use crate::sync::{AtomicBool, Ordering};
use crate::vocab::Access;

use super::same_host;
#[cfg(feature = "gpu")]
use super::stage::Stager;

/// Host memory the table owns (a region registered with [`super::Engine::reg_owned`]): zeroed
/// bytes allocated with the region and freed with it.
#[derive(Debug)]
pub(crate) struct Owned {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: `Owned` is the sole owner of its allocation (a boxed slice given up with
// `Box::into_raw`); the pointer is only a handle to it, so moving or sharing it between threads
// is as safe as moving or sharing the box. The bytes are reached only by the table's raw copies,
// under the table's lock.
unsafe impl Send for Owned {}
// SAFETY: as above.
unsafe impl Sync for Owned {}

#[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))] // the simulation's
impl Owned {
    /// `len` zeroed bytes (at least one, so the region has an address of its own).
    pub(crate) fn zeroed(len: usize) -> Owned {
        let b = vec![0u8; len.max(1)].into_boxed_slice();
        let len = b.len();
        // Kept as a raw pointer, not a `Box`: a box would assert unique access to the bytes on
        // every move while the device writes them through the region's address.
        let ptr = NonNull::new(Box::into_raw(b).cast::<u8>()).unwrap_or(NonNull::dangling());
        Owned { ptr, len }
    }

    /// The address of the first byte.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // `ptr`/`len` are exactly what `Box::into_raw` gave in `zeroed`, freed only here.
        // SAFETY: rebuilds the box `zeroed` gave up, once.
        drop(unsafe { Box::from_raw(slice) });
    }
}

/// Where a region's bytes live.
#[derive(Debug)]
pub(crate) enum RegionKind {
    /// Host memory of the registrant's, reached with plain loads and stores.
    Host,
    /// Host memory the table owns (kept here for its drop, after the region leaves the
    /// table).
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))] // the simulation's
    Owned(#[allow(dead_code)] Owned),
    /// Device (GPU) memory, reached through its stager's copies.
    #[cfg(feature = "gpu")]
    Device(Arc<Stager>),
}

impl RegionKind {
    /// Whether the table owns the memory.
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))] // the simulation's
    pub(crate) fn is_owned(&self) -> bool {
        matches!(self, RegionKind::Owned(_))
    }

    /// Whether the CPU reaches the bytes with loads and stores (host memory).
    pub(crate) fn is_host(&self) -> bool {
        match self {
            RegionKind::Host | RegionKind::Owned(_) => true,
            #[cfg(feature = "gpu")]
            RegionKind::Device(_) => false,
        }
    }

    /// The stager of a device-memory region.
    #[cfg(feature = "gpu")]
    pub(crate) fn stager(&self) -> Option<&Arc<Stager>> {
        match self {
            RegionKind::Device(s) => Some(s),
            RegionKind::Host | RegionKind::Owned(_) => None,
        }
    }
}

/// One registered region.
#[derive(Debug)]
pub(crate) struct Region {
    pub pd: u32,
    pub addr: u64,
    pub len: u64,
    pub access: Access,
    pub kind: RegionKind,
}

/// Keys → regions.
#[derive(Debug)]
pub(crate) struct MrTable {
    slots: Vec<Option<Region>>,
    /// The 8-bit key part each slot's latest region got.
    key_bytes: Vec<u8>,
    free: Vec<u32>,
    live: usize,
    /// Draws the 8-bit key parts (xorshift).
    rng: u64,
}

impl Default for MrTable {
    fn default() -> MrTable {
        MrTable::with_seed(random_seed())
    }
}

/// 64 bits from the kernel's generator (the clock where it fails).
fn random_seed() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: `b` is a valid, writable 8-byte buffer for the duration of the call.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == 8 {
        u64::from_ne_bytes(b)
    } else {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x9E37_79B9_7F4A_7C15, |d| d.as_nanos() as u64)
    }
}

impl MrTable {
    /// An empty table whose key parts are drawn from `seed` (models that replay a run).
    pub(crate) fn with_seed(seed: u64) -> MrTable {
        MrTable {
            slots: Vec::new(),
            key_bytes: Vec::new(),
            free: Vec::new(),
            live: 0,
            rng: seed | 1,
        }
    }

    /// The next 8-bit key part: random, as rxe draws it, and never the slot's previous one.
    fn key_byte(&mut self, previous: Option<u8>) -> u8 {
        loop {
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            let b = (self.rng >> 24) as u8;
            if Some(b) != previous {
                return b;
            }
        }
    }

    /// Adds a region and returns its key, `(slot + 1) << 8 | k` with `k` a random byte (so never
    /// 0; a slot's next region never gets the key of the one before).
    pub(crate) fn insert(
        &mut self,
        pd: u32,
        addr: u64,
        len: u64,
        access: Access,
        kind: RegionKind,
    ) -> Option<u32> {
        let (slot, previous) = match self.free.pop() {
            Some(s) => (s, Some(self.key_bytes[s as usize])),
            None => {
                let s = self.slots.len() as u32;
                if s >= (1 << 24) - 1 {
                    return None;
                }
                self.slots.push(None);
                self.key_bytes.push(0);
                (s, None)
            }
        };
        let i = slot as usize;
        self.key_bytes[i] = self.key_byte(previous);
        let key = ((slot + 1) << 8) | u32::from(self.key_bytes[i]);
        self.slots[i] = Some(Region {
            pd,
            addr,
            len,
            access,
            kind,
        });
        self.live += 1;
        Some(key)
    }

    fn index(&self, key: u32) -> Option<usize> {
        let slot = (key >> 8).checked_sub(1)? as usize;
        (slot < self.slots.len() && self.key_bytes[slot] == key as u8).then_some(slot)
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
    if !region.kind.is_host() {
        return None;
    }
    let ptr = (region.addr + offset) as *mut u64;
    // `ptr` is 8-byte aligned (checked), inside a live registered region (checked and
    // guaranteed by the table lock), and valid for reads and writes for the duration of this
    // call. Every access the device makes to the word goes through such an atomic; the
    // application's own accesses are its business, as with a NIC's atomics (a plain copy by
    // the application racing a peer's atomic sees either value, never a torn one on x86-64).
    // SAFETY: an aligned, live word the device reaches only atomically (above).
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

/// Device-memory regions with staged writes that nothing has reported as placed yet. They are
/// flushed before the device next emits anything (an acknowledgement or a completion reports
/// bytes as placed; a READ response stream emits nothing until its completion), so receiving
/// into device memory does not wait for copies at every batch.
#[cfg(feature = "gpu")]
#[derive(Default)]
pub(crate) struct UnplacedWrites {
    /// Whether `list` may be non-empty (cleared, under the lock, only after a flush finished).
    any: AtomicBool,
    list: Mutex<Vec<Arc<Stager>>>,
}

#[cfg(feature = "gpu")]
impl UnplacedWrites {
    fn add(&self, st: &Arc<Stager>) {
        let mut list = super::lock(&self.list);
        if !list.iter().any(|d| Arc::ptr_eq(d, st)) {
            list.push(st.clone());
        }
        self.any.store(true, Ordering::Release);
    }

    /// Waits until every staged write is in device memory. Holding the lock while flushing
    /// makes any other thread about to emit output wait for the same flush.
    pub(crate) fn place(&self) {
        if !self.any.load(Ordering::Acquire) {
            return;
        }
        let mut list = super::lock(&self.list);
        for st in list.drain(..) {
            if let Err(e) = st.flush() {
                // The region is now unusable: later accesses fail and the peer sees errors.
                eprintln!("erdma soft device: GPU region write failed: {e}");
            }
        }
        self.any.store(false, Ordering::Release);
    }

    /// Drops a region being deregistered (its memory is about to go).
    pub(crate) fn remove(&self, key: &Arc<Stager>) {
        super::lock(&self.list).retain(|d| !Arc::ptr_eq(d, key));
    }
}

/// A payload lent for the packet being written: its address and length, and whether a peer may
/// write the region it lies in.
#[derive(Debug, Clone, Copy)]
struct LentPayload {
    addr: u64,
    len: usize,
    peer_writable: bool,
}

/// Memory as the protocol sees it: the region table, read-locked for the duration of one batch.
///
/// Lending: with gather on, a request's payload is not copied into its packet; the packet is
/// committed to the transmit batch with the payload's address (`TxBatch::commit_lent`) and the
/// kernel reads the bytes from the region when the batch is sent. A region stays registered
/// only while the table is read-locked, so every scope that holds this lock and makes progress
/// into a batch sends that batch, or copies the lent payloads into it (`TxBatch::own_lent`),
/// before it lets the lock go.
pub(crate) struct DevMemory<'a> {
    table: &'a MrTable,
    /// Whether to accept [`proto::Memory::lend`] offers.
    gather: bool,
    /// The payload the protocol accepted to lend for the packet it is writing.
    lent: Option<LentPayload>,
    /// Whether the device takes part in the same-host exchange: host memory can then be named
    /// to a peer by address ([`proto::Memory::peer_addr`]).
    refs: bool,
    /// The process of the verified same-host peer that sent the packet being handled, when it
    /// carries a reference payload ([`proto::Memory::write_from_peer`]).
    peer: Option<i32>,
    /// Where device-memory regions with staged writes are recorded, to be flushed before the
    /// device emits anything that could report the bytes as placed.
    #[cfg(feature = "gpu")]
    unplaced: &'a UnplacedWrites,
    /// The queue pair whose work is being done (device-memory reads are announced per queue
    /// pair).
    #[cfg(feature = "gpu")]
    qpn: Option<u32>,
}

impl proto::Memory for DevMemory<'_> {
    fn region(&self, key: u32) -> Option<proto::Region> {
        let r = self.table.get(key)?;
        Some(proto::Region {
            handle: u64::from(key),
            key,
            pd: r.pd,
            iova: r.addr,
            len: r.len,
            access: r.access,
        })
    }

    fn read(
        &mut self,
        region: &proto::Region,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), proto::MemoryError> {
        let r = self.live(region)?;
        #[cfg(feature = "gpu")]
        if let Some(st) = r.kind.stager() {
            let inside = offset
                .checked_add(dst.len() as u64)
                .is_some_and(|e| e <= r.len);
            return match inside && st.read(self.qpn, offset, dst).is_ok() {
                true => Ok(()),
                false => Err(proto::MemoryError),
            };
        }
        read(r, offset, dst).then_some(()).ok_or(proto::MemoryError)
    }

    fn write(
        &mut self,
        region: &proto::Region,
        offset: u64,
        src: &[u8],
    ) -> Result<(), proto::MemoryError> {
        let r = self.live(region)?;
        let written = write(r, offset, src);
        // Recorded right after staging, still under the queue pair's lock: whichever thread
        // next emits output (an ACK of these bytes, a completion) flushes them first.
        #[cfg(feature = "gpu")]
        if let Some(st) = r.kind.stager() {
            self.unplaced.add(st);
        }
        written.then_some(()).ok_or(proto::MemoryError)
    }

    fn atomic(
        &mut self,
        region: &proto::Region,
        offset: u64,
        op: proto::AtomicOp,
    ) -> Result<u64, proto::MemoryError> {
        let r = self.live(region)?;
        let op = match op {
            proto::AtomicOp::CompareSwap { compare, swap } => {
                AtomicOp::CompareSwap { compare, swap }
            }
            proto::AtomicOp::FetchAdd { add } => AtomicOp::FetchAdd { add },
        };
        atomic(r, offset, op).ok_or(proto::MemoryError)
    }

    /// Regions registered with `reg_mr` cannot be invalidated by a peer: IBTA reserves remote
    /// invalidation for memory windows and fast-registered regions, which this device does not
    /// have, and rxe refuses it the same way (the receive completes with `REM_INV_REQ_ERR`).
    fn invalidate(&mut self, region: &proto::Region) -> Result<(), proto::MemoryError> {
        self.live(region)?;
        Err(proto::MemoryError)
    }

    /// Host memory only: device memory is reached through its stager's copies.
    fn lend(&mut self, region: &proto::Region, offset: u64, len: usize) -> bool {
        if !self.gather {
            return false;
        }
        let Ok(r) = self.live(region) else {
            return false;
        };
        if !r.kind.is_host() {
            return false;
        }
        if len == 0 || offset.checked_add(len as u64).is_none_or(|end| end > r.len) {
            return false;
        }
        self.lent = Some(LentPayload {
            addr: r.addr + offset,
            len,
            peer_writable: r
                .access
                .intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC),
        });
        true
    }

    /// Host memory only, and only on a device that takes part in the same-host exchange.
    fn peer_addr(&mut self, region: &proto::Region, offset: u64, len: usize) -> Option<u64> {
        if !self.refs {
            return None;
        }
        let r = self.live(region).ok()?;
        let inside = offset
            .checked_add(len as u64)
            .is_some_and(|end| end <= r.len);
        (r.kind.is_host() && inside).then(|| r.addr + offset)
    }

    fn write_from_peer(
        &mut self,
        region: &proto::Region,
        offset: u64,
        src: &PeerRefs,
    ) -> Result<(), proto::MemoryError> {
        let pid = self.peer.ok_or(proto::MemoryError)?;
        let r = self.live(region)?;
        let len = src.total() as usize;
        if !inside(r, offset, len) {
            return Err(proto::MemoryError);
        }
        if !r.kind.is_host() {
            // Device memory takes its bytes through the stager: read them here first.
            let mut buf = vec![0u8; len];
            // SAFETY: `buf` is `len` writable bytes of this process, alive for the call.
            let came = unsafe {
                same_host::copy_from_process(pid, src.pieces(), buf.as_mut_ptr() as u64, len)
            };
            if !came {
                return Err(proto::MemoryError);
            }
            return proto::Memory::write(self, region, offset, &buf);
        }
        // `[addr + offset, +len)` lies inside a live host region (checked above), which stays
        // registered while this table borrow lives; the protocol checked the key, protection
        // domain and rights, as for `write`, whose contract (the device may write the region
        // at any time the registrant granted) this shares.
        // SAFETY: the destination is writable for `len` bytes for the call (above).
        let came = unsafe { same_host::copy_from_process(pid, src.pieces(), r.addr + offset, len) };
        came.then_some(()).ok_or(proto::MemoryError)
    }

    fn hash_lent(&mut self, hasher: &mut crc32fast::Hasher) {
        let Some(l) = self.lent else {
            return;
        };
        if !l.peer_writable {
            // `lend` checked that `[addr, addr+len)` lies inside a live host region, which stays
            // registered (its memory allocated) while this table borrow lives. No peer may write
            // the region, and the application leaves a posted request's source alone until the
            // request completes: nothing changes the bytes while the slice lives.
            // SAFETY: `len` readable bytes at `addr`, unchanged while borrowed (above).
            let bytes = unsafe { std::slice::from_raw_parts(l.addr as *const u8, l.len) };
            hasher.update(bytes);
            return;
        }
        // A peer may write these bytes at any moment, so no reference is made to them: they
        // are hashed through a raw pointer. The race is the one every RDMA device has: a peer
        // rewriting a request's source while it is sent puts some mix of old and new bytes on
        // the wire, and this ICRC covers exactly the bytes read here, while the kernel reads the
        // region again when it sends. A packet whose bytes changed in between fails the
        // receiver's ICRC check and is retransmitted.
        // SAFETY: `lend` checked that `[addr, addr+len)` lies inside a live host region, which
        // stays registered (its memory allocated) while this table borrow lives: `len` readable
        // bytes at `addr` for the call. Racing writes are accepted (above).
        unsafe { super::crc_raw::update(hasher, l.addr as *const u8, l.len) };
    }
}

impl<'a> DevMemory<'a> {
    pub(crate) fn new(
        table: &'a MrTable,
        gather: bool,
        refs: bool,
        #[cfg(feature = "gpu")] unplaced: &'a UnplacedWrites,
    ) -> DevMemory<'a> {
        DevMemory {
            table,
            gather,
            lent: None,
            refs,
            peer: None,
            #[cfg(feature = "gpu")]
            unplaced,
            #[cfg(feature = "gpu")]
            qpn: None,
        }
    }

    /// The verified same-host process that sent the packet about to be handled, when its
    /// payload is a reference list; `None` otherwise.
    pub(crate) fn set_peer(&mut self, pid: Option<i32>) {
        self.peer = pid;
    }

    /// The queue pair whose work follows (device memory is read per queue pair).
    pub(crate) fn set_qp(&mut self, qpn: u32) {
        #[cfg(feature = "gpu")]
        {
            self.qpn = Some(qpn);
        }
        let _ = qpn;
    }

    /// Tells a device-memory region that queue pair `qpn` is about to read `[addr, addr+len)`
    /// of the region with `key`: a request reading it was posted, or (`read_request`) a READ
    /// request for it arrived.
    #[cfg(feature = "gpu")]
    pub(crate) fn expect_read(&self, qpn: u32, key: u32, addr: u64, len: u64, read_request: bool) {
        if let Some(r) = self.table.get(key)
            && let Some(st) = r.kind.stager()
            && addr >= r.addr
            && addr.checked_add(len).is_some_and(|e| e <= r.addr + r.len)
        {
            // A failure shows again, as an error, on the read itself.
            let _ = st.expect(qpn, addr - r.addr, len, read_request);
        }
    }

    /// Forgets what queue pair `qpn` announced to device-memory regions (it was reset, failed
    /// or destroyed: those requests will not be read).
    pub(crate) fn forget_qp(&self, qpn: u32) {
        #[cfg(feature = "gpu")]
        for r in self.table.regions() {
            if let Some(st) = r.kind.stager() {
                st.forget(qpn);
            }
        }
        let _ = qpn;
    }

    /// The payload lent for the packet just written, if any (forgotten here): its address and
    /// length.
    pub(crate) fn take_lent(&mut self) -> Option<(u64, usize)> {
        self.lent.take().map(|l| (l.addr, l.len))
    }

    /// The table's record for a region the protocol resolved, checked to be the same region.
    fn live(&self, region: &proto::Region) -> Result<&'a Region, proto::MemoryError> {
        let table: &'a MrTable = self.table;
        match table.get(region.key) {
            Some(r) if r.addr == region.iova && r.len == region.len && r.pd == region.pd => Ok(r),
            _ => Err(proto::MemoryError),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_carry_a_random_byte_that_changes_with_each_region() {
        let mut t = MrTable::default();
        let k1 = t
            .insert(1, 0x1000, 64, Access::LOCAL_WRITE, RegionKind::Host)
            .unwrap();
        assert_ne!(k1, 0);
        assert_eq!(t.get(k1).unwrap().addr, 0x1000);
        assert!(t.remove(k1).is_some());
        assert!(t.get(k1).is_none());
        let k2 = t
            .insert(1, 0x2000, 64, Access::LOCAL_WRITE, RegionKind::Host)
            .unwrap();
        assert_eq!(k1 >> 8, k2 >> 8, "slot reused");
        assert_ne!(k1, k2, "but the key differs");
        assert!(
            t.get(k1).is_none(),
            "a stale key never reaches the new region"
        );
        assert!(t.get(0).is_none() && t.get(0xffff_ffff).is_none());
        assert_eq!(t.len(), 1);
        // The key byte is drawn, not counted: over many regions most bytes show up (a counter
        // would give every new slot the same one).
        let mut t = MrTable::with_seed(7);
        let mut seen = [false; 256];
        for i in 0..512u64 {
            let k = t
                .insert(1, 0x1000 * i, 64, Access::LOCAL_WRITE, RegionKind::Host)
                .unwrap();
            seen[(k & 0xff) as usize] = true;
        }
        assert!(seen.iter().filter(|&&s| s).count() > 200);
    }

    #[test]
    fn copies_stay_inside_the_region() {
        let mut mem = vec![0u8; 32];
        let r = Region {
            pd: 1,
            addr: mem.as_mut_ptr() as u64,
            len: 16,
            access: Access::ALL,
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

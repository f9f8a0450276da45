//! Memory regions and the memory behind them.
//!
//! Owns: [`Access`] flags, [`HostBuffer`] (memory a region can own: heap, anonymous or huge-page
//! mappings), [`Mr`] (a registration, typed by the lifetime of the memory it covers), the local
//! segments work requests use ([`MrSlice`] for memory the device reads, [`MrSliceMut`] for memory the
//! device writes) and [`RemoteMr`] (what a peer needs to reach a region).
//!
//! The rules that keep device access sound:
//! - An `Mr<'a>` over borrowed memory holds the borrow (`&'a mut [u8]`) for as long as it lives,
//!   so the memory cannot be freed, moved or touched except through the region.
//! - Borrowed memory may be registered for local access only. Granting a peer access
//!   (`REMOTE_*`) needs memory the region owns ([`HostBuffer`]) — a peer's access is outside this
//!   process's control, and a region leaked with `mem::forget` must never expose freed memory.
//! - A work request takes [`MrSlice`] (shared borrow: the device reads) or [`MrSliceMut`] (exclusive
//!   borrow, moved into the request: the device writes) segments; scoped posting
//!   ([`crate::scope`]) keeps those borrows alive until the device is done with them.
//! - Memory a peer may write (`REMOTE_WRITE`, `REMOTE_ATOMIC`) can change at any moment the peer
//!   chooses, like a shared mapping with another process — and so can it through this process's
//!   own queue pairs, since a [`RemoteMr`] borrows nothing. Rust requires the bytes behind a
//!   `&[u8]` not to change while it lives, and the compiler relies on that, so such a region
//!   hands out no reference to its bytes: [`Mr::as_slice`], [`Mr::as_mut_slice`] and the
//!   segments' `Deref` refuse (panic), and [`Mr::read_at`], [`Mr::to_vec`], [`Mr::write_at`]
//!   and [`Mr::fill`] copy instead. Read after the peer has signalled (a SEND or WRITE_WITH_IMM
//!   completion), as every RDMA protocol does; bytes a peer writes during a copy may come out
//!   torn, never out of bounds. Code that knows nothing writes the region for a while takes the
//!   `unsafe` [`Mr::as_slice_unchecked`] / [`Mr::as_mut_slice_unchecked`].

#![allow(unsafe_code)] // the memory behind regions: raw views and copies

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, Deref, DerefMut, RangeBounds};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::pd::Pd;
use crate::provider::MrImpl;
use crate::vocab::Access;

/// Checks the verbs rule that remote write and remote atomic need local write.
pub(crate) fn check_access(access: Access) -> Result<()> {
    if access.is_consistent() {
        Ok(())
    } else {
        Err(Error::invalid(
            "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE as well",
        ))
    }
}

mod host_buffer;
pub use host_buffer::HostBuffer;

/// What a peer needs to reach a region (or part of one): exchanged out of band.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RemoteMr {
    /// The region's address in the owner's address space (the RDMA virtual address).
    pub addr: u64,
    /// Bytes reachable from `addr`.
    pub len: u64,
    /// The remote key.
    pub rkey: u32,
}

impl RemoteMr {
    /// The part of this region from `offset` on, `len` bytes long.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the part does not fit, or would end past the top of the
    /// address space (a peer's description can claim any address).
    pub fn slice(&self, offset: u64, len: u64) -> Result<RemoteMr> {
        let end = offset.checked_add(len);
        let addr = self.addr.checked_add(offset);
        match (end, addr) {
            // The last byte, `addr + len - 1`, must be an address.
            (Some(end), Some(addr))
                if end <= self.len && (len == 0 || addr.checked_add(len - 1).is_some()) =>
            {
                Ok(RemoteMr {
                    addr,
                    len,
                    rkey: self.rkey,
                })
            }
            _ => Err(Error::OutOfBounds {
                what: "remote region",
                offset,
                len,
                available: self.len,
            }),
        }
    }

    /// The address `offset` bytes into the region (for atomics and single-target requests).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when `offset` lies past the end.
    pub fn at(&self, offset: u64) -> Result<RemoteMr> {
        self.slice(offset, self.len.saturating_sub(offset).min(self.len))
            .and_then(|r| {
                if offset >= self.len {
                    Err(Error::OutOfBounds {
                        what: "remote region",
                        offset,
                        len: 1,
                        available: self.len,
                    })
                } else {
                    Ok(r)
                }
            })
    }
}

pub(crate) struct MrInner {
    pub(crate) pd: Pd,
    pub(crate) imp: MrImpl,
    pub(crate) addr: *mut u8,
    pub(crate) len: usize,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    pub(crate) access: Access,
    /// The memory, when the region owns it. Dropped after `imp` (deregistration first).
    pub(crate) owned: Option<HostBuffer>,
    /// Whether the memory is device (GPU) memory, which the CPU cannot dereference.
    pub(crate) device: bool,
}

impl Drop for MrInner {
    fn drop(&mut self) {
        // Deregister before the memory goes: once deregistration returns, the device can no
        // longer reach the memory, whatever a peer or a forgotten request tries.
        // SAFETY: Drop runs once and the region is not used after.
        unsafe { self.imp.deregister(&self.pd.context().inner.imp) };
        drop(self.owned.take());
    }
}

// SAFETY: `addr` points into memory the region either owns (`owned`) or holds an exclusive borrow
// of (the `'a` of `Mr<'a>`); the pointer itself is only dereferenced through `&self`/`&mut self`
// methods of `Mr`, which follow Rust's aliasing rules, and by the device.
unsafe impl Send for MrInner {}
// SAFETY: see `Send`; shared access only reads.
unsafe impl Sync for MrInner {}

/// A registered memory region over memory that lives for `'a` (`'static` when the region owns
/// it).
///
/// Dropping the region deregisters it (the device loses access) and then frees memory it owns.
pub struct Mr<'a> {
    pub(crate) inner: Arc<MrInner>,
    _memory: PhantomData<&'a mut [u8]>,
}

impl<'a> Mr<'a> {
    pub(crate) fn from_inner(inner: MrInner) -> Mr<'a> {
        Mr {
            inner: Arc::new(inner),
            _memory: PhantomData,
        }
    }

    /// The region's start address (its RDMA virtual address).
    pub fn addr(&self) -> u64 {
        self.inner.addr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the region is empty (never: zero-length regions are refused).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }

    /// The access rights the region was registered with.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// The protection domain it belongs to.
    pub fn pd(&self) -> &Pd {
        &self.inner.pd
    }

    /// What a peer needs to reach the whole region.
    pub fn remote(&self) -> RemoteMr {
        RemoteMr {
            addr: self.addr(),
            len: self.len() as u64,
            rkey: self.rkey(),
        }
    }

    /// The first byte, for raw use ([`Qp::post_send_raw`](crate::Qp::post_send_raw), copies
    /// that must not make a reference).
    pub fn as_ptr(&self) -> *const u8 {
        self.inner.addr
    }

    /// The first byte, mutably, for raw use.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.inner.addr
    }

    /// Whether a peer may write the region (`REMOTE_WRITE` or `REMOTE_ATOMIC`): then its bytes
    /// can change at any moment the peer chooses, like a shared mapping with another process.
    /// Rust requires the bytes behind a `&[u8]` not to change while it lives, so such a region
    /// hands out no reference to them: [`Mr::as_slice`], [`Mr::as_mut_slice`] and the segments'
    /// `Deref` panic, and [`Mr::read_at`], [`Mr::to_vec`], [`Mr::write_at`] and [`Mr::fill`]
    /// copy instead. Read after the peer has signalled (a SEND or WRITE_WITH_IMM completion);
    /// bytes a peer writes during a copy may come out torn, never out of bounds. Code that knows
    /// nothing writes the region for a while takes the `unsafe` [`Mr::as_slice_unchecked`].
    pub fn peer_writable(&self) -> bool {
        self.access()
            .intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
    }

    /// The region's bytes.
    ///
    /// # Panics
    /// When a peer may write the region ([`Mr::peer_writable`]): copy its bytes with
    /// [`Mr::read_at`] or [`Mr::to_vec`] instead, or see [`Mr::as_slice_unchecked`].
    pub fn as_slice(&self) -> &[u8] {
        assert_private(self.peer_writable());
        // SAFETY: no peer may write the region (checked above): the unchecked form's contract.
        unsafe { self.as_slice_unchecked() }
    }

    /// The region's bytes, mutably. Needs `&mut self`, so no work request can be using the
    /// region at the time.
    ///
    /// # Panics
    /// When a peer may write the region ([`Mr::peer_writable`]): use [`Mr::write_at`],
    /// [`Mr::fill`] or [`Mr::read_at`] instead, or see [`Mr::as_mut_slice_unchecked`].
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        assert_private(self.peer_writable());
        // SAFETY: no peer may write the region (checked above).
        unsafe { self.as_mut_slice_unchecked() }
    }

    /// The region's bytes, whatever its access rights.
    ///
    /// # Safety
    /// While the slice lives, nothing writes the region through its remote key: neither a peer
    /// nor a queue pair of this process (for example because the peers write only when told to,
    /// and none has been told). Local device writes need no promise: they only happen through
    /// [`MrSliceMut`] segments, which `&self` excludes.
    pub unsafe fn as_slice_unchecked(&self) -> &[u8] {
        // `addr..addr+len` is memory this region owns or exclusively borrows for `'a`; `&self`
        // excludes `&mut self` users and every `MrSliceMut` segment; remote writes are excluded
        // by the caller.
        // SAFETY: the bytes are live and nothing writes them while `&self` is held (above).
        unsafe { std::slice::from_raw_parts(self.inner.addr, self.inner.len) }
    }

    /// The region's bytes, mutably, whatever its access rights.
    ///
    /// # Safety
    /// As [`Mr::as_slice_unchecked`]: nothing writes or reads the region through its remote key
    /// while the slice lives.
    pub unsafe fn as_mut_slice_unchecked(&mut self) -> &mut [u8] {
        // As in `as_slice_unchecked`; `&mut self` also excludes every `MrSlice` segment, and
        // remote reads are excluded by the caller.
        // SAFETY: the bytes are live and reachable through this borrow only (above).
        unsafe { std::slice::from_raw_parts_mut(self.inner.addr, self.inner.len) }
    }

    /// Copies `out.len()` bytes from `offset` on into `out`. Works on every region; on one a
    /// peer may write, bytes the peer writes during the copy may come out torn.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range lies outside the region.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let (start, _) = resolve(offset..offset.saturating_add(out.len()), self.len())?;
        self.copy_out(start, out);
        Ok(())
    }

    /// A copy of the bytes in `range` (see [`Mr::read_at`]).
    ///
    /// # Panics
    /// When the range lies outside the region, like slice indexing.
    pub fn to_vec(&self, range: impl RangeBounds<usize>) -> Vec<u8> {
        let (start, end) = match resolve(range, self.len()) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        };
        let mut v = vec![0u8; end - start];
        self.copy_out(start, &mut v);
        v
    }

    /// Copies `out.len()` bytes from `start` on; the caller has checked that they lie inside.
    fn copy_out(&self, start: usize, out: &mut [u8]) {
        debug_assert!(start + out.len() <= self.len());
        // The range lies inside the region (the caller's check), whose memory lives while
        // `&self` is held; `out` is a distinct `&mut` borrow, so the two do not overlap. No
        // reference to the region's bytes is made: a concurrent write by a peer is not
        // assumed away.
        // SAFETY: both ranges are valid for `out.len()` bytes and disjoint (above).
        unsafe {
            std::ptr::copy_nonoverlapping(self.inner.addr.add(start), out.as_mut_ptr(), out.len())
        };
    }

    /// Copies `data` into the region from `offset` on. Needs `&mut self`, so no work request
    /// can be using the region at the time.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range lies outside the region.
    pub fn write_at(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        let (start, _) = resolve(offset..offset.saturating_add(data.len()), self.len())?;
        // The range lies inside the region (checked), which `&mut self` keeps alive and free of
        // `MrSlice`/`MrSliceMut` segments; `data` is a distinct shared borrow.
        // SAFETY: both ranges are valid for `data.len()` bytes and disjoint (above).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.inner.addr.add(start), data.len())
        };
        Ok(())
    }

    /// Sets every byte in `range` to `byte`.
    ///
    /// # Panics
    /// When the range lies outside the region, like slice indexing.
    pub fn fill(&mut self, range: impl RangeBounds<usize>, byte: u8) {
        let (start, end) = match resolve(range, self.len()) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        };
        // The range lies inside the region (checked), which is live and free of segments while
        // `&mut self` is held; no reference to its bytes is made.
        // SAFETY: the range is valid for writes (above).
        unsafe { std::ptr::write_bytes(self.inner.addr.add(start), byte, end - start) };
    }

    /// A segment of the region that the device will read (SEND and WRITE sources).
    ///
    /// # Panics
    /// When the range lies outside the region, like slice indexing. Use [`Mr::get`] for a
    /// checked form.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> MrSlice<'_> {
        match self.get(range) {
            Ok(l) => l,
            Err(e) => panic!("{e}"),
        }
    }

    /// A segment of the region that the device will read, or an error when it lies outside.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn get(&self, range: impl RangeBounds<usize>) -> Result<MrSlice<'_>> {
        let (start, end) = resolve(range, self.len())?;
        Ok(MrSlice {
            addr: self.addr() + start as u64,
            len: (end - start) as u64,
            lkey: self.lkey(),
            device: self.inner.device,
            peer_writable: self.peer_writable(),
            _memory: PhantomData,
        })
    }

    /// A segment of the region that the device will write (receive buffers, READ and atomic
    /// targets). Split it with [`MrSliceMut::split_at`] to post several.
    ///
    /// # Panics
    /// When the range lies outside the region. Use [`Mr::get_mut`] for a checked form.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> MrSliceMut<'_> {
        match self.get_mut(range) {
            Ok(l) => l,
            Err(e) => panic!("{e}"),
        }
    }

    /// Checked form of [`Mr::slice_mut`].
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Result<MrSliceMut<'_>> {
        let (start, end) = resolve(range, self.len())?;
        Ok(MrSliceMut {
            addr: self.addr() + start as u64,
            len: (end - start) as u64,
            lkey: self.lkey(),
            device: self.inner.device,
            peer_writable: self.peer_writable(),
            _memory: PhantomData,
        })
    }
}

impl fmt::Debug for Mr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.access())
            .finish()
    }
}

fn resolve(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    if start > end || end > len {
        return Err(Error::OutOfBounds {
            what: "memory region",
            offset: start as u64,
            len: end.saturating_sub(start) as u64,
            available: len as u64,
        });
    }
    Ok((start, end))
}

/// A part of a registered region that the device reads. Like `&'m [u8]`, with the local key.
#[derive(Clone, Copy)]
pub struct MrSlice<'m> {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) lkey: u32,
    /// Device (GPU) memory: not dereferenceable by the CPU.
    pub(crate) device: bool,
    /// In a region a peer may write: no reference to its bytes is handed out.
    pub(crate) peer_writable: bool,
    _memory: PhantomData<&'m [u8]>,
}

impl<'m> MrSlice<'m> {
    /// A segment over registered bytes.
    ///
    /// The caller makes sure `[addr, addr+len)` lies in a region with key `lkey` that stays
    /// registered, and unwritten by the CPU, for `'m` (a borrow of what owns it).
    pub(crate) fn from_parts(
        addr: u64,
        len: u64,
        lkey: u32,
        device: bool,
        peer_writable: bool,
    ) -> MrSlice<'m> {
        MrSlice {
            addr,
            len,
            lkey,
            device,
            peer_writable,
            _memory: PhantomData,
        }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether the segment is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// Whether the segment is GPU memory (registered through `erdma::gpu`), which the CPU
    /// cannot dereference.
    pub fn is_device(&self) -> bool {
        self.device
    }

    /// A sub-segment (offsets relative to this segment).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn get(&self, range: impl RangeBounds<usize>) -> Result<MrSlice<'m>> {
        let (start, end) = resolve(range, self.len())?;
        Ok(MrSlice {
            addr: self.addr + start as u64,
            len: (end - start) as u64,
            lkey: self.lkey,
            device: self.device,
            peer_writable: self.peer_writable,
            _memory: PhantomData,
        })
    }
}

impl Deref for MrSlice<'_> {
    type Target = [u8];
    /// # Panics
    /// When the segment is GPU memory, which the CPU cannot read in place, or lies in a region
    /// a peer may write ([`Mr::peer_writable`]).
    fn deref(&self) -> &[u8] {
        assert_host(self.device);
        assert_private(self.peer_writable);
        // A `MrSlice<'m>` is only made from `&'m Mr` (or by downgrading a `MrSliceMut<'m>`), so the
        // bytes are registered memory that stays alive and unmutated by the CPU for `'m`.
        // SAFETY: the bytes are live and unmutated for `'m` (above).
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len as usize) }
    }
}

impl fmt::Debug for MrSlice<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "MrSlice {{ addr: {:#x}, len: {}, lkey: {:#x} }}",
            self.addr, self.len, self.lkey
        )
    }
}

/// Refuses a reference to memory a peer may write (see [`Mr::peer_writable`]).
fn assert_private(peer_writable: bool) {
    assert!(
        !peer_writable,
        "a peer may write this memory (REMOTE_WRITE or REMOTE_ATOMIC), which Rust forbids \
         under a reference: copy it with Mr::read_at / to_vec / write_at / fill, or see \
         Mr::as_slice_unchecked"
    );
}

/// Refuses CPU access to device memory: its addresses are not mapped in this process.
#[track_caller]
fn assert_host(device: bool) {
    assert!(
        !device,
        "this segment is GPU memory, which the CPU cannot access in place: copy it with \
         GpuBuffer::copy_to_host / copy_from_host"
    );
}

/// A part of a registered region that the device writes. Like `&'m mut [u8]`, with the local
/// key: posting moves it into the request, so nothing else touches those bytes meanwhile.
pub struct MrSliceMut<'m> {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) lkey: u32,
    /// Device (GPU) memory: not dereferenceable by the CPU.
    pub(crate) device: bool,
    /// In a region a peer may write: no reference to its bytes is handed out.
    pub(crate) peer_writable: bool,
    _memory: PhantomData<&'m mut [u8]>,
}

impl<'m> MrSliceMut<'m> {
    /// A segment the device may write.
    ///
    /// The caller makes sure `[addr, addr+len)` lies in a region with key `lkey` that stays
    /// registered for `'m`, and that nothing else reaches those bytes meanwhile (an exclusive
    /// borrow of what owns them).
    pub(crate) fn from_parts(
        addr: u64,
        len: u64,
        lkey: u32,
        device: bool,
        peer_writable: bool,
    ) -> MrSliceMut<'m> {
        MrSliceMut {
            addr,
            len,
            lkey,
            device,
            peer_writable,
            _memory: PhantomData,
        }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether the segment is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// Whether the segment is GPU memory (registered through `erdma::gpu`), which the CPU
    /// cannot dereference.
    pub fn is_device(&self) -> bool {
        self.device
    }

    /// Splits into `[0, mid)` and `[mid, len)`.
    ///
    /// # Panics
    /// When `mid > len`, like `slice::split_at_mut`.
    pub fn split_at(self, mid: usize) -> (MrSliceMut<'m>, MrSliceMut<'m>) {
        assert!(
            mid as u64 <= self.len,
            "split point {mid} past {}",
            self.len
        );
        let tail = MrSliceMut {
            addr: self.addr + mid as u64,
            len: self.len - mid as u64,
            lkey: self.lkey,
            device: self.device,
            peer_writable: self.peer_writable,
            _memory: PhantomData,
        };
        (
            MrSliceMut {
                len: mid as u64,
                ..self
            },
            tail,
        )
    }

    /// Splits into consecutive segments of `size` bytes (the last may be shorter).
    ///
    /// # Panics
    /// When `size == 0`.
    pub fn chunks(self, size: usize) -> Vec<MrSliceMut<'m>> {
        assert!(size > 0, "chunk size must be positive");
        let mut out = Vec::with_capacity(self.len().div_ceil(size));
        let mut rest = self;
        while rest.len() > size {
            let (head, tail) = rest.split_at(size);
            out.push(head);
            rest = tail;
        }
        if !rest.is_empty() || out.is_empty() {
            out.push(rest);
        }
        out
    }

    /// Gives up write access: the segment becomes one the device reads.
    pub fn into_local(self) -> MrSlice<'m> {
        MrSlice {
            addr: self.addr,
            len: self.len,
            lkey: self.lkey,
            device: self.device,
            peer_writable: self.peer_writable,
            _memory: PhantomData,
        }
    }

    /// Reborrows as a shorter-lived segment, so it can be posted and then used again after the
    /// shorter borrow (a scope) ends.
    pub fn reborrow(&mut self) -> MrSliceMut<'_> {
        MrSliceMut {
            addr: self.addr,
            len: self.len,
            lkey: self.lkey,
            device: self.device,
            peer_writable: self.peer_writable,
            _memory: PhantomData,
        }
    }
}

impl Deref for MrSliceMut<'_> {
    type Target = [u8];
    /// # Panics
    /// When the segment is GPU memory, which the CPU cannot read in place, or lies in a region
    /// a peer may write ([`Mr::peer_writable`]).
    fn deref(&self) -> &[u8] {
        assert_host(self.device);
        assert_private(self.peer_writable);
        // A `MrSliceMut<'m>` is made from `&'m mut Mr` and split without overlap, so these bytes
        // are registered, alive for `'m`, and reachable through this value only.
        // SAFETY: the bytes are live for `'m` and reachable through this value only (above).
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len as usize) }
    }
}

impl DerefMut for MrSliceMut<'_> {
    /// # Panics
    /// When the segment is GPU memory, which the CPU cannot write in place, or lies in a region
    /// a peer may write ([`Mr::peer_writable`]).
    fn deref_mut(&mut self) -> &mut [u8] {
        assert_host(self.device);
        assert_private(self.peer_writable);
        // SAFETY: as in `deref`; `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len as usize) }
    }
}

impl fmt::Debug for MrSliceMut<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "MrSliceMut {{ addr: {:#x}, len: {}, lkey: {:#x} }}",
            self.addr, self.len, self.lkey
        )
    }
}

#[cfg(test)]
mod tests;

//! Staging of device (GPU) memory for the soft device: the copy pipeline between a region's
//! device memory and the packets the engine sends and receives.
//!
//! Owns the [`CopyEngine`] trait (the narrow interface a copy backend offers: pinned host slots,
//! asynchronous copies in one ordered stream, a wait per slot) and [`Stager`], which turns the
//! protocol's per-packet reads and writes into a few large asynchronous copies:
//!
//! - **Reads** (SEND/WRITE sources, READ responses) are served from read slots. A miss fetches a
//!   slot-sized piece; each read then keeps the next pieces of the expected ranges in flight
//!   (read-ahead), so the engine rarely waits. Expected ranges come from [`Stager::expect`],
//!   called when a request that will read the memory is posted (or a READ request arrives),
//!   per queue pair and in order. Staged bytes serve a request only if they were fetched after
//!   it was announced: bytes staged earlier may predate the application's last change to the
//!   memory, while bytes fetched since cannot have changed (the application leaves memory
//!   alone while a request that reads it is outstanding).
//! - **Writes** (incoming WRITE/SEND payloads, READ responses) are packed into write slots; a
//!   full slot is copied to the device asynchronously while the next fills. [`Stager::flush`]
//!   waits for every outstanding write: the driver calls it before any acknowledgement or
//!   completion that reports the bytes as placed.
//!
//! Every copy goes through one in-order stream, so a fetch issued after a write observes it.
//! Must not: touch device memory directly (only the engine does), or serve a read from a slot
//! whose copy was not waited for.

#![allow(unsafe_code)] // staging slots of pinned host memory

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Mutex;

/// A copy backend failed (the driver's error text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CopyError(pub String);

impl fmt::Display for CopyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a staging copy backend offers: `slot_count` host buffers of `slot_len` bytes and
/// asynchronous copies between them and the region's device memory, executed in the order they
/// are issued.
pub(crate) trait CopyEngine: Send {
    /// Number of host slots.
    fn slot_count(&self) -> usize;
    /// Bytes per slot.
    fn slot_len(&self) -> usize;
    /// The slot's host memory (`slot_len` bytes, valid while the engine lives). The CPU may
    /// touch it only when no copy using it is outstanding (after [`CopyEngine::wait`]).
    fn slot_ptr(&self, slot: usize) -> *mut u8;
    /// Queues a copy of device bytes `[offset, offset+len)` into the slot.
    fn to_host(&mut self, slot: usize, offset: u64, len: usize) -> Result<(), CopyError>;
    /// Queues a copy of the slot's first `len` bytes to device bytes `[offset, offset+len)`.
    fn to_device(&mut self, slot: usize, offset: u64, len: usize) -> Result<(), CopyError>;
    /// Blocks until the last copy queued for the slot (and every copy queued before it) is done.
    fn wait(&mut self, slot: usize) -> Result<(), CopyError>;
}

/// Read slots (the rest are write slots).
pub(crate) const READ_SLOTS: usize = 4;
/// Write slots.
pub(crate) const WRITE_SLOTS: usize = 8;
/// Largest slot: a region of 2 MiB or more pins 12 × 2 MiB = 24 MiB of host memory. Against
/// 1 MiB slots, WRITE bandwidth of GPU regions on an H200 (bench/results/gpu.md, interleaved rounds):
/// +16-33% at 16 MiB and +11-17% at 64 MiB, where every WRITE fetches its source again and
/// the read-ahead's distance bounds the rate; within ±10% at 64 KiB-4 MiB.
pub(crate) const MAX_SLOT_LEN: usize = 2 << 20;
/// A write slot holding this fraction of a full slot (512 KiB of 2 MiB) is copied to the device
/// at once. Smaller pieces shorten the wait of a flush (the receiver flushes before each
/// acknowledgement, every 256 KiB of a WRITE) but cost a copy launch each, which a receiver
/// taking a READ response stream (which is not flow-controlled) cannot afford.
const WRITE_SUBMIT_DIVISOR: usize = 4;
/// Expected ranges remembered per region.
const MAX_HINTS: usize = 1024;

/// The slot length for a region of `len` bytes: up to [`MAX_SLOT_LEN`], in whole pages.
pub(crate) fn slot_len_for(len: u64) -> usize {
    (len.min(MAX_SLOT_LEN as u64) as usize).div_ceil(4096) * 4096
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    /// Holds device bytes `[off, off+len)` once waited for (`pending`), fetched when `epoch`
    /// expectations had been announced.
    Read {
        off: u64,
        len: usize,
        pending: bool,
        used: u64,
        epoch: u64,
    },
    /// Being filled by the CPU with bytes for `[off, off+filled)`.
    Open {
        off: u64,
        filled: usize,
    },
    /// Copy to the device queued, not yet waited for.
    Flushing,
}

/// Copy counters (for tests and diagnostics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct StageStats {
    /// Device-to-host copies issued.
    pub to_host: u64,
    /// Host-to-device copies issued.
    pub to_device: u64,
    /// Reads that found their bytes already staged or in flight.
    pub hits: u64,
    /// Reads that had to fetch synchronously.
    pub misses: u64,
}

/// A range a request will read: `[start, end)`, announced as expectation number `seq`.
#[derive(Debug, Clone, Copy)]
struct Hint {
    start: u64,
    end: u64,
    seq: u64,
    /// Announced by an incoming READ request (not by a posted request).
    read_request: bool,
}

struct Inner {
    engine: Box<dyn CopyEngine>,
    len: u64,
    slot_len: usize,
    slots: Vec<Slot>,
    next_write: usize,
    open: Option<usize>,
    /// Announced ranges per queue pair, in posting order (a queue pair reads its requests'
    /// memory in that order).
    hints: HashMap<u32, VecDeque<Hint>>,
    /// Expectations announced so far.
    seq: u64,
    clock: u64,
    failed: Option<CopyError>,
    stats: StageStats,
}

/// The staging state of one device-memory region (see the module docs). Thread-safe: the
/// engine thread and application threads share it.
pub(crate) struct Stager {
    inner: Mutex<Inner>,
}

impl fmt::Debug for Stager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = self.lock();
        f.debug_struct("Stager")
            .field("len", &g.len)
            .field("slot_len", &g.slot_len)
            .field("stats", &g.stats)
            .finish()
    }
}

impl Stager {
    /// A stager for a region of `len` bytes over `engine`, whose first [`READ_SLOTS`] slots
    /// serve reads and the rest writes (it needs at least one of each).
    pub(crate) fn new(engine: Box<dyn CopyEngine>, len: u64) -> Stager {
        let n = engine.slot_count();
        assert!(
            n > READ_SLOTS,
            "a stager needs read and write slots ({n} slots)"
        );
        let slot_len = engine.slot_len();
        Stager {
            inner: Mutex::new(Inner {
                engine,
                len,
                slot_len,
                slots: vec![Slot::Free; n],
                next_write: READ_SLOTS,
                open: None,
                hints: HashMap::new(),
                seq: 0,
                clock: 0,
                failed: None,
                stats: StageStats::default(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Copy counters so far.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn stats(&self) -> StageStats {
        self.lock().stats
    }

    /// Announces that queue pair `qpn` is about to read `[offset, offset+len)`: a request
    /// reading it was posted, or (`read_request`) a READ request for it arrived. Bytes staged
    /// before this call are not used for that read (the application may have changed them
    /// since), and the range is read ahead when its turn comes.
    ///
    /// Every announcement retires the queue pair's earlier READ-request announcements that
    /// overlap it: a READ request may be abandoned (retransmitted, or its requester gone) before
    /// it is read to its end, and must not leave behind an announcement older than a later
    /// change of the memory. (Retiring a live one only makes its remaining reads fetch again.)
    /// Posted requests need no such care: the queue pair reads them in order, and their
    /// announcements are forgotten when it is reset.
    pub(crate) fn expect(
        &self,
        qpn: u32,
        offset: u64,
        len: u64,
        read_request: bool,
    ) -> Result<(), CopyError> {
        let mut g = self.lock();
        g.usable()?;
        let end = match offset.checked_add(len) {
            Some(e) if e <= g.len && len > 0 => e,
            _ => return Ok(()),
        };
        g.seq += 1;
        let seq = g.seq;
        let list = g.hints.entry(qpn).or_default();
        list.retain(|h| !(h.read_request && h.start < end && offset < h.end));
        if list.len() >= MAX_HINTS {
            list.pop_front();
        }
        list.push_back(Hint {
            start: offset,
            end,
            seq,
            read_request,
        });
        Ok(())
    }

    /// Forgets what queue pair `qpn` announced (it was reset, moved to the error state or
    /// destroyed: its requests will not be read).
    pub(crate) fn forget(&self, qpn: u32) {
        self.lock().hints.remove(&qpn);
    }

    /// Copies `dst.len()` bytes of the region at `offset` into `dst`, for queue pair `qpn`
    /// (`None` when unknown: then only bytes fetched after the latest announcement are used).
    pub(crate) fn read(
        &self,
        qpn: Option<u32>,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), CopyError> {
        let mut g = self.lock();
        g.usable()?;
        let end = g.range(offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        g.submit_open()?;
        // Staged bytes serve this read only if fetched after the request it belongs to was
        // announced: the queue pair's oldest unfinished announced range, when it holds the read
        // (that request has been outstanding since, so its bytes cannot have changed). Any
        // other read (a retransmission) takes only bytes fetched after the latest announcement.
        let front = qpn
            .and_then(|q| g.hints.get(&q))
            .and_then(|l| l.front().copied())
            .filter(|h| h.start <= offset && end <= h.end);
        let need = front.map_or(g.seq, |h| h.seq);
        let mut pos = offset;
        while pos < end {
            let s = match g.find_read(pos, need) {
                Some(s) => {
                    g.stats.hits += 1;
                    s
                }
                None => {
                    g.stats.misses += 1;
                    let n = g.fetch_len(pos);
                    g.fetch(pos, n, &[])?
                }
            };
            let Slot::Read {
                off,
                len,
                pending,
                epoch,
                ..
            } = g.slots[s]
            else {
                unreachable!("find_read and fetch return read slots");
            };
            if pending {
                let r = g.engine.wait(s);
                g.note(r)?;
            }
            let stamp = g.tick();
            g.slots[s] = Slot::Read {
                off,
                len,
                pending: false,
                used: stamp,
                epoch,
            };
            let n = (end.min(off + len as u64) - pos) as usize;
            let at = (pos - offset) as usize;
            // The slot's copy was waited for, so its `slot_len` bytes are initialised host memory
            // nobody else writes now (the lock is held); `pos - off + n <= len <= slot_len`, and
            // `dst[at..at+n]` is in bounds because `pos + n <= end`.
            // SAFETY: both ranges are in bounds and not written by anyone else (above).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    g.engine.slot_ptr(s).add((pos - off) as usize),
                    dst.as_mut_ptr().add(at),
                    n,
                );
            }
            pos += n as u64;
        }
        let Some(q) = qpn else { return Ok(()) };
        if front.is_some_and(|h| h.end == end)
            && let Some(list) = g.hints.get_mut(&q)
        {
            list.pop_front();
            if list.is_empty() {
                g.hints.remove(&q);
            }
        }
        g.read_ahead(q, end)
    }

    /// Stages `src` for the region at `offset`; the bytes reach the device asynchronously, at
    /// the latest when [`Stager::flush`] returns.
    pub(crate) fn write(&self, offset: u64, src: &[u8]) -> Result<(), CopyError> {
        let mut g = self.lock();
        g.usable()?;
        let end = g.range(offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        // Staged reads of these bytes become stale once the write lands.
        for s in 0..READ_SLOTS {
            if let Slot::Read { off, len, .. } = g.slots[s]
                && off < end
                && offset < off + len as u64
            {
                g.slots[s] = Slot::Free;
            }
        }
        let submit_at = (g.slot_len / WRITE_SUBMIT_DIVISOR).max(1);
        let mut pos = offset;
        let mut rest = src;
        while !rest.is_empty() {
            if let Some(s) = g.open {
                if let Slot::Open { off, filled } = g.slots[s]
                    && off + filled as u64 == pos
                    && filled < g.slot_len
                {
                    let n = (g.slot_len - filled).min(rest.len());
                    // An open slot has no outstanding copy (it was waited for before it was
                    // opened); `filled + n <= slot_len`; `rest` is a distinct Rust slice.
                    // SAFETY: the slot range is in bounds and idle (above).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            rest.as_ptr(),
                            g.engine.slot_ptr(s).add(filled),
                            n,
                        );
                    }
                    g.slots[s] = Slot::Open {
                        off,
                        filled: filled + n,
                    };
                    pos += n as u64;
                    rest = &rest[n..];
                    if filled + n >= submit_at {
                        g.submit_open()?;
                    }
                    continue;
                }
                g.submit_open()?;
            }
            let s = g.next_write;
            g.next_write = if s + 1 >= g.slots.len() {
                READ_SLOTS
            } else {
                s + 1
            };
            if g.slots[s] == Slot::Flushing {
                let r = g.engine.wait(s);
                g.note(r)?;
            }
            g.slots[s] = Slot::Open {
                off: pos,
                filled: 0,
            };
            g.open = Some(s);
        }
        Ok(())
    }

    /// Waits until every byte written so far is in device memory.
    pub(crate) fn flush(&self) -> Result<(), CopyError> {
        let mut g = self.lock();
        g.usable()?;
        g.submit_open()?;
        for s in READ_SLOTS..g.slots.len() {
            if g.slots[s] == Slot::Flushing {
                let r = g.engine.wait(s);
                g.note(r)?;
                g.slots[s] = Slot::Free;
            }
        }
        Ok(())
    }

    /// Whether writes wait in slots or in flight.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn dirty(&self) -> bool {
        let g = self.lock();
        g.open.is_some() || g.slots.contains(&Slot::Flushing)
    }
}

impl Inner {
    fn usable(&self) -> Result<(), CopyError> {
        match &self.failed {
            Some(e) => Err(CopyError(format!(
                "an earlier copy of this GPU region failed: {e}"
            ))),
            None => Ok(()),
        }
    }

    /// Records a failure: the region stays unusable (bytes may be lost).
    fn note(&mut self, r: Result<(), CopyError>) -> Result<(), CopyError> {
        if let Err(e) = &r {
            self.failed = Some(e.clone());
        }
        r
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The end of `[offset, offset+len)`, checked against the region.
    fn range(&self, offset: u64, len: usize) -> Result<u64, CopyError> {
        offset
            .checked_add(len as u64)
            .filter(|&e| e <= self.len)
            .ok_or_else(|| {
                CopyError(format!(
                    "bytes {offset}+{len} lie outside the {}-byte GPU region",
                    self.len
                ))
            })
    }

    /// A read slot holding `pos`, fetched at or after expectation `need`.
    fn find_read(&self, pos: u64, need: u64) -> Option<usize> {
        (0..READ_SLOTS).find(|&s| {
            matches!(self.slots[s], Slot::Read { off, len, epoch, .. }
                if off <= pos && pos < off + len as u64 && epoch >= need)
        })
    }

    /// How much to fetch at `pos`: to the end of an announced range holding it, else of the
    /// region, at most one slot.
    fn fetch_len(&self, pos: u64) -> usize {
        let limit = self
            .hints
            .values()
            .flatten()
            .find(|h| h.start <= pos && pos < h.end)
            .map_or(self.len, |h| h.end);
        ((limit - pos) as usize).min(self.slot_len)
    }

    /// Queues a fetch of `[pos, pos+len)` into the free or least recently used read slot that
    /// is not in `keep`.
    fn fetch(&mut self, pos: u64, len: usize, keep: &[usize]) -> Result<usize, CopyError> {
        let s = (0..READ_SLOTS)
            .filter(|s| !keep.contains(s))
            .min_by_key(|&s| match self.slots[s] {
                Slot::Read { used, .. } => used,
                _ => 0,
            })
            .unwrap_or(0);
        let r = self.engine.to_host(s, pos, len);
        self.note(r)?;
        self.stats.to_host += 1;
        let stamp = self.tick();
        self.slots[s] = Slot::Read {
            off: pos,
            len,
            pending: true,
            used: stamp,
            epoch: self.seq,
        };
        Ok(s)
    }

    /// Keeps up to `READ_SLOTS` pieces from `from` on staged or in flight: the rest of queue
    /// pair `qpn`'s announced range holding `from`, then its following announced ranges.
    fn read_ahead(&mut self, qpn: u32, from: u64) -> Result<(), CopyError> {
        let mut plan = [(0u64, 0u64, 0u64); READ_SLOTS];
        let mut planned = 0;
        for h in self.hints.get(&qpn).into_iter().flatten() {
            let start = if planned == 0 && h.start <= from && from < h.end {
                from
            } else {
                h.start
            };
            plan[planned] = (start, h.end, h.seq);
            planned += 1;
            if planned == READ_SLOTS {
                break;
            }
        }
        // The slots this plan covers, which its own fetches must not evict.
        let mut keep = [usize::MAX; READ_SLOTS];
        let mut kept = 0;
        for &(mut pos, end, need) in &plan[..planned] {
            while pos < end && kept < READ_SLOTS {
                if let Some(s) = self.find_read(pos, need) {
                    if let Slot::Read { off, len, .. } = self.slots[s] {
                        pos = off + len as u64;
                    }
                    keep[kept] = s;
                    kept += 1;
                    continue;
                }
                let n = ((end - pos) as usize).min(self.slot_len);
                keep[kept] = self.fetch(pos, n, &keep[..kept])?;
                kept += 1;
                pos += n as u64;
            }
        }
        Ok(())
    }

    /// Queues the open write slot's copy to the device.
    fn submit_open(&mut self) -> Result<(), CopyError> {
        let Some(s) = self.open.take() else {
            return Ok(());
        };
        let Slot::Open { off, filled } = self.slots[s] else {
            return Ok(());
        };
        if filled == 0 {
            self.slots[s] = Slot::Free;
            return Ok(());
        }
        let r = self.engine.to_device(s, off, filled);
        self.note(r)?;
        self.stats.to_device += 1;
        self.slots[s] = Slot::Flushing;
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Arc;

    /// A host-memory backend that behaves like a CUDA stream: copies run only when waited for,
    /// in issue order, so a missing wait or flush shows up as wrong bytes.
    pub(crate) struct MockEngine {
        pub dev: Arc<Mutex<Vec<u8>>>,
        /// Host slots the stager writes through `slot_ptr` while the mock holds them: interior
        /// mutability, as a real engine's pinned memory has.
        slots: Vec<Box<[std::cell::UnsafeCell<u8>]>>,
        queue: VecDeque<(bool, usize, u64, usize)>,
        pub max_queued: Arc<Mutex<usize>>,
        pub fail_after: Option<usize>,
        issued: usize,
    }

    impl MockEngine {
        pub(crate) fn new(dev: Arc<Mutex<Vec<u8>>>, slot_len: usize) -> MockEngine {
            MockEngine {
                dev,
                slots: (0..READ_SLOTS + WRITE_SLOTS)
                    .map(|_| {
                        (0..slot_len)
                            .map(|_| std::cell::UnsafeCell::new(0xEE))
                            .collect()
                    })
                    .collect(),
                queue: VecDeque::new(),
                max_queued: Arc::new(Mutex::new(0)),
                fail_after: None,
                issued: 0,
            }
        }

        fn issue(&mut self, op: (bool, usize, u64, usize)) -> Result<(), CopyError> {
            self.issued += 1;
            if self.fail_after.is_some_and(|n| self.issued > n) {
                return Err(CopyError("CUDA_ERROR_ILLEGAL_ADDRESS (mock)".into()));
            }
            self.queue.push_back(op);
            let mut m = self.max_queued.lock().unwrap();
            *m = (*m).max(self.queue.len());
            Ok(())
        }
    }

    impl CopyEngine for MockEngine {
        fn slot_count(&self) -> usize {
            self.slots.len()
        }
        fn slot_len(&self) -> usize {
            self.slots[0].len()
        }
        fn slot_ptr(&self, slot: usize) -> *mut u8 {
            // `UnsafeCell<u8>` has the layout of `u8`, and its bytes may be written through a
            // pointer derived from a shared reference.
            self.slots[slot].as_ptr() as *mut u8
        }
        fn to_host(&mut self, slot: usize, offset: u64, len: usize) -> Result<(), CopyError> {
            self.issue((false, slot, offset, len))
        }
        fn to_device(&mut self, slot: usize, offset: u64, len: usize) -> Result<(), CopyError> {
            self.issue((true, slot, offset, len))
        }
        fn wait(&mut self, slot: usize) -> Result<(), CopyError> {
            let Some(last) = self.queue.iter().rposition(|op| op.1 == slot) else {
                return Ok(());
            };
            for (to_dev, s, off, len) in self.queue.drain(..=last) {
                let mut dev = self.dev.lock().unwrap();
                let range = off as usize..off as usize + len;
                let slot = self.slots[s].as_ptr() as *mut u8;
                let dev = dev[range].as_mut_ptr();
                // SAFETY: the slot holds at least `len` bytes (the stager never asks for more)
                // and nothing else touches it until this wait returns; `dev` is a distinct
                // allocation of `len` bytes from `off`.
                unsafe {
                    if to_dev {
                        std::ptr::copy_nonoverlapping(slot, dev, len);
                    } else {
                        std::ptr::copy_nonoverlapping(dev, slot, len);
                    }
                }
            }
            Ok(())
        }
    }

    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
            .collect()
    }

    const SLOT: usize = 64 << 10;
    /// The queue pair the tests read for.
    const Q: u32 = 0x11;

    /// Shared memory of the mock: the "device" bytes, or the deepest queue seen.
    type Shared<T> = Arc<Mutex<T>>;

    fn stager(len: usize, fill: u8) -> (Stager, Shared<Vec<u8>>, Shared<usize>) {
        let dev = Arc::new(Mutex::new(pattern(fill, len)));
        let engine = MockEngine::new(dev.clone(), SLOT);
        let queued = engine.max_queued.clone();
        (Stager::new(Box::new(engine), len as u64), dev, queued)
    }

    #[test]
    fn packet_sized_reads_become_few_pipelined_copies() {
        let len = 16 * SLOT;
        let (st, dev, queued) = stager(len, 1);
        st.expect(Q, 0, len as u64, false).unwrap();
        let mut out = vec![0u8; len];
        for (i, pkt) in out.chunks_mut(4096).enumerate() {
            st.read(Some(Q), (i * 4096) as u64, pkt).unwrap();
        }
        assert_eq!(out, *dev.lock().unwrap(), "bytes read through the slots");
        let stats = st.stats();
        assert_eq!(
            stats.to_host, 16,
            "one copy per slot, not per packet: {stats:?}"
        );
        assert_eq!(
            stats.misses, 1,
            "only the first read waits for a fetch it issued"
        );
        assert!(
            *queued.lock().unwrap() >= READ_SLOTS - 1,
            "copies are kept in flight ahead of the reads"
        );
    }

    #[test]
    fn writes_are_packed_and_land_by_flush() {
        let len = 8 * SLOT + 100;
        let (st, dev, _) = stager(len, 2);
        let data = pattern(9, len);
        for (i, pkt) in data.chunks(1000).enumerate() {
            st.write((i * 1000) as u64, pkt).unwrap();
        }
        assert!(st.dirty());
        assert_ne!(
            *dev.lock().unwrap(),
            data,
            "the tail is still staged before the flush"
        );
        st.flush().unwrap();
        assert!(!st.dirty());
        assert_eq!(
            *dev.lock().unwrap(),
            data,
            "every byte placed after the flush"
        );
        let copies = st.stats().to_device as usize;
        let writes = len.div_ceil(1000);
        assert!(
            copies <= len / (SLOT / WRITE_SUBMIT_DIVISOR) + 2 && copies * 4 < writes,
            "packed copies, not one per 1000-byte write: {copies} for {writes} writes"
        );
    }

    #[test]
    fn scattered_writes_and_reads_see_each_other() {
        let len = 4 * SLOT;
        let (st, dev, _) = stager(len, 3);
        let mut model = dev.lock().unwrap().clone();
        let mut x = 12345u64;
        for round in 0..400 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let off = (x >> 33) as usize % len;
            let n = ((x >> 13) as usize % 9000).min(len - off);
            if round % 3 == 0 {
                let mut got = vec![0u8; n];
                st.read(Some(Q), off as u64, &mut got).unwrap();
                assert_eq!(got, model[off..off + n], "round {round}");
            } else {
                let data = pattern(round as u8, n);
                st.write(off as u64, &data).unwrap();
                model[off..off + n].copy_from_slice(&data);
            }
        }
        st.flush().unwrap();
        assert_eq!(*dev.lock().unwrap(), model);
    }

    fn read_all(st: &Stager, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        for (i, pkt) in out.chunks_mut(4096).enumerate() {
            st.read(Some(Q), (i * 4096) as u64, pkt).unwrap();
        }
        out
    }

    #[test]
    fn expect_refreshes_bytes_staged_before_a_change() {
        let len = 2 * SLOT;
        let (st, dev, _) = stager(len, 4);
        st.expect(Q, 0, len as u64, false).unwrap();
        read_all(&st, len);
        // The request finished; the application changes the memory (a kernel, a cuMemcpy) and
        // posts a new request.
        dev.lock().unwrap()[..4096].fill(0x5A);
        st.expect(Q, 0, 4096, false).unwrap();
        let mut again = vec![0u8; 4096];
        st.read(Some(Q), 0, &mut again).unwrap();
        assert!(again.iter().all(|&b| b == 0x5A), "fresh bytes after expect");
        // A request cut short (its queue pair failed and was reset) leaves nothing behind that
        // would let old bytes serve the next one.
        st.expect(Q, 0, len as u64, false).unwrap();
        let mut part = vec![0u8; 4096];
        st.read(Some(Q), 0, &mut part).unwrap();
        st.forget(Q);
        dev.lock().unwrap()[..8192].fill(0x6B);
        st.expect(Q, 0, len as u64, false).unwrap();
        let got = read_all(&st, len);
        assert!(
            got[..8192].iter().all(|&b| b == 0x6B),
            "fresh bytes after a reset"
        );
        // A retransmitted READ request that is never read to its end leaves nothing behind:
        // the next overlapping READ request retires it.
        st.expect(Q, 0, len as u64, true).unwrap();
        st.read(Some(Q), 0, &mut part).unwrap();
        st.expect(Q, 0, len as u64, true).unwrap();
        read_all(&st, len);
        dev.lock().unwrap()[..4096].fill(0x11);
        st.expect(Q, 0, len as u64, true).unwrap();
        st.read(Some(Q), 0, &mut part).unwrap();
        assert!(
            part.iter().all(|&b| b == 0x11),
            "fresh bytes for the next READ"
        );
        read_all(&st, len);
        // Nor does one abandoned before a request the queue pair posts itself.
        st.expect(Q, 0, len as u64, true).unwrap();
        st.read(Some(Q), 0, &mut part).unwrap();
        dev.lock().unwrap()[..4096].fill(0x22);
        st.expect(Q, 0, len as u64, false).unwrap();
        st.read(Some(Q), 0, &mut part).unwrap();
        assert!(
            part.iter().all(|&b| b == 0x22),
            "fresh bytes for the posted request"
        );
        st.forget(Q);
        // Unknown readers only take bytes fetched after the latest announcement.
        dev.lock().unwrap()[..4096].fill(0x7C);
        st.expect(Q + 1, SLOT as u64, 4096, false).unwrap();
        st.read(None, 0, &mut part).unwrap();
        assert!(part.iter().all(|&b| b == 0x7C));
    }

    #[test]
    fn one_range_posted_many_times_is_fetched_once_per_change() {
        let len = 2 * SLOT;
        let (st, dev, _) = stager(len, 6);
        // Four requests over the same bytes, posted before any is sent (a window of WRITEs).
        for _ in 0..4 {
            st.expect(Q, 0, len as u64, false).unwrap();
        }
        let first = dev.lock().unwrap().clone();
        for _ in 0..4 {
            assert_eq!(read_all(&st, len), first);
        }
        assert_eq!(
            st.stats().to_host,
            2,
            "fetched once for all four: {:?}",
            st.stats()
        );
        // All four done; the application changes the bytes and posts again.
        dev.lock().unwrap().iter_mut().for_each(|b| *b ^= 0xFF);
        st.expect(Q, 0, len as u64, false).unwrap();
        let second = dev.lock().unwrap().clone();
        assert_eq!(
            read_all(&st, len),
            second,
            "the new request sees the change"
        );
        assert_eq!(st.stats().to_host, 4);
    }

    #[test]
    fn out_of_range_is_refused_and_nothing_is_written() {
        let len = SLOT;
        let (st, dev, _) = stager(len, 5);
        let before = dev.lock().unwrap().clone();
        assert!(st.write(len as u64 - 3, &[1, 2, 3, 4]).is_err());
        assert!(st.write(u64::MAX, &[1]).is_err());
        let mut out = [0u8; 8];
        assert!(st.read(Some(Q), len as u64 - 4, &mut out).is_err());
        st.flush().unwrap();
        assert_eq!(*dev.lock().unwrap(), before);
        // Hostile expectations are ignored, not trusted.
        st.expect(Q, u64::MAX - 1, 10, false).unwrap();
        st.expect(Q, 0, u64::MAX, false).unwrap();
    }

    #[test]
    fn a_failed_copy_makes_the_region_unusable() {
        let dev = Arc::new(Mutex::new(vec![0u8; 4 * SLOT]));
        let mut engine = MockEngine::new(dev, SLOT);
        engine.fail_after = Some(2);
        let st = Stager::new(Box::new(engine), 4 * SLOT as u64);
        let data = vec![7u8; 4 * SLOT];
        let r = st.write(0, &data);
        let r = r.and_then(|_| st.flush());
        let e = r.expect_err("the third copy fails");
        assert!(e.0.contains("ILLEGAL_ADDRESS"), "{e}");
        let mut out = [0u8; 1];
        assert!(
            st.read(Some(Q), 0, &mut out).is_err(),
            "later use fails too"
        );
    }

    #[test]
    fn slot_sizes_follow_the_region() {
        assert_eq!(slot_len_for(1), 4096);
        assert_eq!(slot_len_for(5000), 8192);
        assert_eq!(slot_len_for(1 << 30), MAX_SLOT_LEN);
    }
}

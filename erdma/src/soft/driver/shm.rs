//! Shared-memory channels between soft devices of one host: the packets themselves, not only
//! their payloads, move through memory.
//!
//! A device that proves itself to a peer of this host (`engine::same_host`) offers it a ring:
//! a `memfd` it maps, named in its PROOF by descriptor number. The peer, having verified the
//! proof and holding a pidfd of the prover's process, takes the descriptor with
//! `pidfd_getfd` (the kernel's ptrace check, as for `process_vm_readv`) and maps it too; its
//! ACCEPT says whether it did. From then on the prover's packets to that peer are written into
//! the ring, byte for byte the datagrams they would have been (headers and ICRC included), and
//! the peer's receive rounds take them from there before they look at their socket. Each
//! direction has its own ring, offered by its sender: nothing in the protocol changes, only
//! the carrier, and a packet that would not fit is dropped as a full socket would drop it.
//!
//! A ring is single-producer (the sending device, under its lock) and single-consumer (the
//! receiving device's lane 0, under its receive lock). Its consumer, about to sleep in
//! `ppoll`, says so in the ring's header and looks once more; a producer that then finds it
//! asleep sends it one small WAKE datagram, which its socket turns into a wake-up. A polling
//! consumer costs the producer nothing but the copy.
//!
//! Trust: the consumer reads everything in the ring as hostile (lengths, offsets, the
//! producer's counters) and stops reading a ring that breaks its rules; what it takes out
//! goes through the same validation as a datagram. Only the two devices' processes, or one
//! allowed to trace them, can write the ring.
//!
//! Must not: block, or hand out a reference into the shared mapping.

#![allow(unsafe_code)] // memfd, mmap, pidfd_getfd, and reads and writes of the shared mapping

use std::collections::HashMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

// Plain std atomics, not the crate's model-checked ones: another process reads these words.
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};

use crate::soft::engine::batch::{NO_PKT, TxBatch};
use crate::soft::engine::lock;
use crate::soft::engine::same_host::{self, Channels};
use crate::soft::fast_map::{IntMap, int_map};

/// Bytes of a ring's data area (a power of two).
pub(crate) const RING_BYTES: usize = 1 << 20;
/// Bytes of the header page in front of it.
const HEAD_BYTES: usize = 4096;
/// The largest packet a ring carries (a soft device's largest datagram fits).
pub(crate) const MAX_PACKET: usize = 9216;
/// A record's header: the packet's length and its kind.
const REC: usize = 8;
/// Record kinds.
const PACKET: u32 = 1;
const PAD: u32 = 2;
/// What a fresh ring's header says it is.
const MAGIC: u64 = u64::from_be_bytes(*b"erdmaSHM");
/// Nanoseconds between two looks at whether a consumer's process still runs.
const ALIVE_EVERY_NS: u64 = 1_000_000;

/// The consumer's sleep word.
const AWAKE: u32 = 0;
const ASLEEP: u32 = 1;
/// A producer has sent the WAKE for this sleep.
const WOKEN: u32 = 2;

/// A ring's header page. Every field is an atomic word of the shared mapping.
#[repr(C, align(64))]
struct Header {
    magic: AtomicU64,
    size: AtomicU64,
    /// The consumer's process id, written when it maps the ring.
    consumer_pid: AtomicU32,
    /// Set by either side when it lets the ring go.
    closed: AtomicU32,
    _a: [u64; 5],
    /// Bytes written (producer).
    tail: AtomicU64,
    _b: [u64; 7],
    /// Bytes read (consumer).
    head: AtomicU64,
    _c: [u64; 7],
    /// [`AWAKE`], [`ASLEEP`] or [`WOKEN`] (consumer sets the first two, producers the last).
    sleep: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEAD_BYTES);

/// A shared mapping of one ring, unmapped on drop.
struct Map {
    ptr: NonNull<u8>,
}

// SAFETY: the mapping is plain memory; every access to it goes through atomics or through
// copies whose callers own the range (the producer its free space, the consumer its records).
unsafe impl Send for Map {}
// SAFETY: as above; shared access is only through the header's atomics.
unsafe impl Sync for Map {}

const MAP_BYTES: usize = HEAD_BYTES + RING_BYTES;

impl Map {
    /// Maps `fd` (checked to be at least [`MAP_BYTES`] long) shared, read-write.
    fn new(fd: &OwnedFd) -> io::Result<Map> {
        // SAFETY: an all-zero `stat` is a valid value; fstat fills it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and a writable stat buffer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || (st.st_size as u64) < MAP_BYTES as u64 {
            return Err(io::Error::from(io::ErrorKind::InvalidData));
        }
        // Only a file that can never shrink: else its owner could truncate it under the
        // mapping, and the next read of it would kill this process (SIGBUS).
        // SAFETY: a valid descriptor; F_GET_SEALS takes no argument.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        let need = libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
        if seals < 0 || seals & need != need {
            return Err(io::Error::from(io::ErrorKind::InvalidData));
        }
        // SAFETY: a fresh shared mapping of a regular file at least this long; the kernel
        // chooses the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MAP_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Map {
            ptr: NonNull::new(p.cast()).ok_or_else(|| io::Error::from(io::ErrorKind::Other))?,
        })
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts page-aligned and is at least a header page long; every
        // field of `Header` is an atomic, valid for any bit pattern and for shared access.
        unsafe { &*self.ptr.as_ptr().cast::<Header>() }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: in bounds: the data area follows the header page inside the mapping.
        unsafe { self.ptr.as_ptr().add(HEAD_BYTES) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `Map::new`, of that length, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), MAP_BYTES) };
    }
}

/// A new ring: a `memfd` of the right size, mapped, its header written.
fn create() -> io::Result<(OwnedFd, Map)> {
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: a NUL-terminated name and flags; returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(c"erdma-soft-ring".as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just returned by the kernel and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: a valid descriptor and a length.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), MAP_BYTES as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // Sealed at its size for good: a peer that maps it can rely on every page being there
    // (a file shrunk under a mapping would fault its reader with SIGBUS).
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: a valid descriptor and an int argument.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let map = Map::new(&fd)?;
    let h = map.header();
    h.size.store(RING_BYTES as u64, Ordering::Relaxed);
    h.magic.store(MAGIC, Ordering::Release);
    Ok((fd, map))
}

fn padded(len: usize) -> usize {
    REC + len.div_ceil(8) * 8
}

/// The sending side of a ring.
struct OutRing {
    map: Map,
    /// Bytes written (ours; published in the header).
    tail: u64,
    /// The consumer's head as last read.
    head: u64,
    /// The consumer's process, to notice it exit.
    consumer: Option<OwnedFd>,
    /// The ring was found full: messages go to the socket until the consumer has read it
    /// out, so that none overtakes one still in the ring (the consumer reads the socket only
    /// once its rings are empty).
    spilling: bool,
}

/// What pushing a packet did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pushed {
    Written,
    /// No room: the packet is dropped.
    Full,
    /// The consumer let the ring go.
    Closed,
}

impl OutRing {
    /// Writes one packet, made of `parts` (pointer, length), into the ring; not yet published
    /// ([`OutRing::publish`]).
    ///
    /// # Safety
    /// Each part must be readable for its length.
    unsafe fn push(&mut self, parts: &[(*const u8, usize)]) -> Pushed {
        let h = self.map.header();
        if h.closed.load(Ordering::Relaxed) != 0 {
            return Pushed::Closed;
        }
        let len: usize = parts.iter().map(|p| p.1).sum();
        if len > MAX_PACKET {
            return Pushed::Full;
        }
        let need = padded(len);
        let size = RING_BYTES as u64;
        let pos = (self.tail % size) as usize;
        let to_end = RING_BYTES - pos;
        let total = if to_end < need { to_end + need } else { need } as u64;
        // Wrapping: the consumer's head is its word, not ours to trust.
        let fits = |head: u64| {
            let used = self.tail.wrapping_sub(head);
            used <= size && used + total <= size
        };
        if !fits(self.head) {
            self.head = h.head.load(Ordering::Acquire);
            if !fits(self.head) {
                return Pushed::Full;
            }
        }
        let data = self.map.data();
        let mut at = pos;
        if to_end < need {
            // SAFETY: `pos` is 8-aligned and at least REC short of the end (every record is
            // a multiple of 8 long); the space is free (checked above).
            unsafe { write_rec(data.add(pos), 0, PAD) };
            self.tail += to_end as u64;
            at = 0;
        }
        // SAFETY: `[at, at + need)` is free space inside the data area (checked above).
        unsafe {
            write_rec(data.add(at), len as u32, PACKET);
            let mut d = data.add(at + REC);
            for &(p, n) in parts {
                std::ptr::copy_nonoverlapping(p, d, n);
                d = d.add(n);
            }
        }
        self.tail += need as u64;
        Pushed::Written
    }

    /// Whether `need` bytes fit now (see [`OutRing::spilling`]).
    fn room(&mut self, need: u64) -> bool {
        let size = RING_BYTES as u64;
        // Wrapping: the consumer's head is its word, not ours to trust.
        let fits = |tail: u64, head: u64| {
            let used = tail.wrapping_sub(head);
            used <= size && used + need <= size
        };
        if self.spilling || !fits(self.tail, self.head) {
            self.head = self.map.header().head.load(Ordering::Acquire);
        }
        if self.spilling {
            if self.head != self.tail {
                return false;
            }
            self.spilling = false;
        }
        if !fits(self.tail, self.head) {
            self.spilling = true;
            return false;
        }
        true
    }

    /// Publishes what was written; `true` when the consumer sleeps and this call is the one
    /// to wake it.
    fn publish(&self) -> bool {
        let h = self.map.header();
        h.tail.store(self.tail, Ordering::Release);
        // Pairs with the consumer's: it says it sleeps, then reads `tail`; we write `tail`,
        // then read its word. One of the two sees the other.
        fence(Ordering::SeqCst);
        h.sleep.load(Ordering::Relaxed) == ASLEEP
            && h.sleep
                .compare_exchange(ASLEEP, WOKEN, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }

    fn consumer_gone(&self) -> bool {
        self.map.header().closed.load(Ordering::Relaxed) != 0
            || self
                .consumer
                .as_ref()
                .is_some_and(|fd| !same_host::process_alive(fd))
    }
}

impl Drop for OutRing {
    fn drop(&mut self) {
        self.map.header().closed.store(1, Ordering::Release);
    }
}

/// # Safety
/// `at` must be 8-aligned, writable for [`REC`] bytes.
unsafe fn write_rec(at: *mut u8, len: u32, kind: u32) {
    // SAFETY: the caller's contract; the words are written whole.
    unsafe {
        at.cast::<u32>().write_volatile(len);
        at.add(4).cast::<u32>().write_volatile(kind);
    }
}

/// The receiving side of a ring.
struct InRing {
    map: Map,
    peer: Ipv4Addr,
    /// Bytes read (ours; published in the header).
    head: u64,
    /// The producer broke the ring's rules: it is read no more.
    broken: bool,
}

impl InRing {
    fn pending(&self) -> bool {
        !self.broken && self.map.header().tail.load(Ordering::Acquire) != self.head
    }

    /// Copies the next packet into `out` (at least [`MAX_PACKET`] long). `None` when there is
    /// none (or the ring broke).
    fn pop(&mut self, out: &mut [u8]) -> Option<usize> {
        if self.broken {
            return None;
        }
        let h = self.map.header();
        let size = RING_BYTES as u64;
        let tail = h.tail.load(Ordering::Acquire);
        loop {
            if tail == self.head {
                return None;
            }
            let avail = tail.wrapping_sub(self.head);
            let pos = (self.head % size) as usize;
            if avail > size || avail < REC as u64 || pos % 8 != 0 {
                self.broken = true;
                return None;
            }
            let data = self.map.data();
            // SAFETY: `pos` is 8-aligned and REC short of the end at least (the data area's
            // length is a multiple of 8); the words are read whole. A producer writing them
            // now gives garbage, which the checks below and the packet's validation catch.
            let (len, kind) = unsafe {
                let p = data.add(pos);
                (
                    p.cast::<u32>().read_volatile() as usize,
                    p.add(4).cast::<u32>().read_volatile(),
                )
            };
            match kind {
                PAD => {
                    let skip = (RING_BYTES - pos) as u64;
                    if skip > avail {
                        self.broken = true;
                        return None;
                    }
                    self.head += skip;
                    h.head.store(self.head, Ordering::Release);
                }
                PACKET
                    if len <= MAX_PACKET
                        && padded(len) <= RING_BYTES - pos
                        && padded(len) as u64 <= avail
                        && len <= out.len() =>
                {
                    // SAFETY: `[pos + REC, pos + REC + len)` lies inside the data area
                    // (checked); `out` is ours and at least `len` long. The bytes are copied,
                    // never referenced.
                    unsafe {
                        std::ptr::copy_nonoverlapping(data.add(pos + REC), out.as_mut_ptr(), len)
                    };
                    self.head += padded(len) as u64;
                    h.head.store(self.head, Ordering::Release);
                    return Some(len);
                }
                _ => {
                    self.broken = true;
                    return None;
                }
            }
        }
    }
}

impl Drop for InRing {
    fn drop(&mut self) {
        self.map.header().closed.store(1, Ordering::Release);
    }
}

/// A device's shared-memory channels.
pub(crate) struct Shm {
    addr: Ipv4Addr,
    /// Rings offered in a PROOF, not yet accepted.
    offered: Mutex<HashMap<Ipv4Addr, (OwnedFd, Map)>>,
    /// Rings to peers that took them.
    out: Mutex<IntMap<Ipv4Addr, OutRing>>,
    /// How many `out` holds (read without the lock on every send).
    outs: AtomicUsize,
    /// When `out` was last checked for consumers that went away (ns).
    checked: AtomicU64,
    /// Rings peers write to us, each under its own lock (lane 0's receive path reads them).
    inbound: Mutex<Vec<Arc<Mutex<InRing>>>>,
    /// Bumped whenever `inbound` changes.
    generation: AtomicU64,
    /// Packets written to rings, packets read from them, messages spilled to the socket.
    pub(crate) counts: [AtomicU64; 3],
}

/// What [`Shm::send`] left for the socket; kept by the sending thread and reused, so that a
/// send allocates nothing in the steady state.
#[derive(Debug, Default)]
pub(crate) struct Sent {
    /// Per message of the batches (in order): whether the ring took it.
    pub(crate) taken: Vec<bool>,
    /// Peers to wake with a WAKE datagram.
    pub(crate) wake: Vec<Ipv4Addr>,
    /// Packets dropped (larger than a ring carries).
    pub(crate) dropped: u64,
    /// Messages left to the socket because their ring was full.
    pub(crate) spilled: u64,
    /// Peers written to, and peers whose ring closed, in this send.
    written: Vec<Ipv4Addr>,
    closed: Vec<Ipv4Addr>,
}

impl Shm {
    pub(crate) fn new(addr: Ipv4Addr) -> Shm {
        Shm {
            addr,
            offered: Mutex::new(HashMap::new()),
            out: Mutex::new(int_map()),
            outs: AtomicUsize::new(0),
            checked: AtomicU64::new(0),
            inbound: Mutex::new(Vec::new()),
            generation: AtomicU64::new(0),
            counts: Default::default(),
        }
    }

    /// Whether any peer writes to us through a ring (else a receive round reads the socket
    /// every time).
    pub(crate) fn reads_rings(&self) -> bool {
        !lock(&self.inbound).is_empty()
    }

    /// Whether any peer reads a ring of ours (else every message goes to the socket).
    pub(crate) fn sends(&self) -> bool {
        self.outs.load(Ordering::Relaxed) != 0
    }

    /// Writes every message of `batches` to a peer with a ring into that ring. `now`: ns.
    pub(crate) fn send(&self, batches: &[&mut TxBatch], now: u64, sent: &mut Sent) {
        sent.taken.clear();
        sent.wake.clear();
        sent.written.clear();
        sent.closed.clear();
        sent.dropped = 0;
        sent.spilled = 0;
        let mut out = lock(&self.out);
        let last = self.checked.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= ALIVE_EVERY_NS {
            self.checked.store(now, Ordering::Relaxed);
            out.retain(|_, r| !r.consumer_gone());
            self.outs.store(out.len(), Ordering::Relaxed);
        }
        let mut written_n = 0u64;
        for b in batches.iter() {
            let buf = b.buf();
            for m in b.msgs() {
                let dst = *m.dst.ip();
                let Some(ring) = out.get_mut(&dst).filter(|_| !sent.closed.contains(&dst)) else {
                    sent.taken.push(false);
                    continue;
                };
                if ring.map.header().closed.load(Ordering::Relaxed) != 0 {
                    sent.closed.push(dst);
                    sent.taken.push(false);
                    continue;
                }
                // The whole message, or none of it (then the socket carries it).
                let mut need = REC + MAX_PACKET;
                let mut p = m.head;
                while p != NO_PKT {
                    let k = b.pkt(p);
                    need += padded(k.len as usize);
                    p = k.next;
                }
                if !ring.room(need as u64) {
                    sent.spilled += 1;
                    sent.taken.push(false);
                    continue;
                }
                let mut p = m.head;
                while p != NO_PKT {
                    let k = b.pkt(p);
                    p = k.next;
                    let (off, len) = (k.off as usize, k.len as usize);
                    let pkt = &buf[off..off + len];
                    let parts: [(*const u8, usize); 3];
                    let parts: &[(*const u8, usize)] = match k.lent {
                        Some(l) => {
                            parts = [
                                (pkt.as_ptr(), l.at),
                                (l.addr as *const u8, l.len),
                                (pkt[l.at + l.len..].as_ptr(), len - l.at - l.len),
                            ];
                            &parts
                        }
                        None => {
                            parts = [(pkt.as_ptr(), len), (pkt.as_ptr(), 0), (pkt.as_ptr(), 0)];
                            &parts[..1]
                        }
                    };
                    // SAFETY: the packet's bytes are the batch's; a lent payload stays
                    // readable until the batch is sent (`TxBatch::commit_lent`'s contract).
                    match unsafe { ring.push(parts) } {
                        Pushed::Written => {
                            written_n += 1;
                            if !sent.written.contains(&dst) {
                                sent.written.push(dst);
                            }
                        }
                        Pushed::Full => sent.dropped += 1,
                        Pushed::Closed => {
                            sent.closed.push(dst);
                            break;
                        }
                    }
                }
                // A message for a ring that closed under it goes to the socket whole.
                sent.taken.push(!sent.closed.contains(&dst));
            }
        }
        // Counted only when there is something to count: a shared word off the send path.
        if written_n != 0 {
            self.counts[0].fetch_add(written_n, Ordering::Relaxed);
        }
        if sent.spilled != 0 {
            self.counts[2].fetch_add(sent.spilled, Ordering::Relaxed);
        }
        for &dst in &sent.written {
            if let Some(r) = out.get(&dst)
                && r.publish()
            {
                sent.wake.push(dst);
            }
        }
        for dst in &sent.closed {
            out.remove(dst);
        }
        self.outs.store(out.len(), Ordering::Relaxed);
    }

    /// The rings peers write to us, if they changed since `generation` (which is updated).
    fn inbound_since(&self, generation: &mut u64) -> Option<Vec<Arc<Mutex<InRing>>>> {
        let g = self.generation.load(Ordering::Acquire);
        if g == *generation {
            return None;
        }
        *generation = g;
        let mut list = lock(&self.inbound);
        // A ring its producer let go, once read out, is forgotten.
        let before = list.len();
        list.retain(|r| {
            let r = lock(r);
            !(r.broken || r.map.header().closed.load(Ordering::Acquire) != 0 && !r.pending())
        });
        if list.len() != before {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
        Some(list.clone())
    }

    /// Forgets inbound rings that are closed and read out, or broken.
    fn tidy(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Says every inbound ring's consumer is about to sleep; `false` (and nothing said) when
    /// one has packets.
    pub(crate) fn park(&self) -> bool {
        let list = lock(&self.inbound);
        for r in list.iter() {
            let r = lock(r);
            if !r.broken {
                r.map.header().sleep.store(ASLEEP, Ordering::SeqCst);
            }
        }
        // After saying so: a packet published before is seen here (see `OutRing::publish`).
        fence(Ordering::SeqCst);
        let busy = list.iter().any(|r| lock(r).pending());
        if busy {
            drop(list);
            self.unpark();
        }
        !busy
    }

    pub(crate) fn unpark(&self) {
        for r in lock(&self.inbound).iter() {
            lock(r).map.header().sleep.store(AWAKE, Ordering::Relaxed);
        }
    }
}

impl Channels for Shm {
    fn offer(&self, peer: Ipv4Addr) -> Option<u32> {
        let (fd, map) = create().ok()?;
        let n = u32::try_from(fd.as_raw_fd()).ok()?;
        lock(&self.offered).insert(peer, (fd, map));
        Some(n)
    }

    fn take(&self, peer: Ipv4Addr, pidfd: &OwnedFd, fd: u32) -> bool {
        let Some(fd) = pidfd_getfd(pidfd, fd) else {
            return false;
        };
        let Ok(map) = Map::new(&fd) else {
            return false;
        };
        let h = map.header();
        if h.magic.load(Ordering::Acquire) != MAGIC
            || h.size.load(Ordering::Relaxed) != RING_BYTES as u64
        {
            return false;
        }
        h.consumer_pid.store(std::process::id(), Ordering::Release);
        // Taken as asleep: this device's engine thread may be sleeping now on a `park` that did
        // not know this ring (a polling application thread's round took it), and no one else
        // would wake it for the first packets. At worst one WAKE too many.
        h.sleep.store(ASLEEP, Ordering::SeqCst);
        let head = h.head.load(Ordering::Acquire);
        let ring = InRing {
            map,
            peer,
            head,
            broken: false,
        };
        let mut list = lock(&self.inbound);
        list.retain(|r| lock(r).peer != peer);
        list.push(Arc::new(Mutex::new(ring)));
        self.generation.fetch_add(1, Ordering::AcqRel);
        true
    }

    fn settle(&self, peer: Ipv4Addr, taken: bool) {
        let Some((_fd, map)) = lock(&self.offered).remove(&peer) else {
            return;
        };
        if !taken {
            return;
        }
        let pid = map.header().consumer_pid.load(Ordering::Acquire);
        let consumer = i32::try_from(pid)
            .ok()
            .filter(|&p| p > 0)
            .and_then(same_host::pidfd_open);
        let mut out = lock(&self.out);
        out.insert(
            peer,
            OutRing {
                map,
                tail: 0,
                head: 0,
                consumer,
                spilling: false,
            },
        );
        self.outs.store(out.len(), Ordering::Relaxed);
    }

    fn forget(&self, peer: Ipv4Addr) {
        let mut out = lock(&self.out);
        out.remove(&peer);
        self.outs.store(out.len(), Ordering::Relaxed);
    }

    fn counts(&self) -> [u64; 3] {
        self.counts.each_ref().map(|c| c.load(Ordering::Relaxed))
    }
}

impl std::fmt::Debug for Shm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shm").field("addr", &self.addr).finish()
    }
}

/// Descriptor `fd` of the process behind `pidfd`, duplicated into this one.
fn pidfd_getfd(pidfd: &OwnedFd, fd: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number and flags and returns a new
    // descriptor or -1; no memory is passed.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    let r = i32::try_from(r).ok().filter(|&r| r >= 0)?;
    // SAFETY: the descriptor was just returned by the kernel and is owned by nobody else.
    let owned = unsafe { OwnedFd::from_raw_fd(r) };
    // SAFETY: a valid descriptor; marks it close-on-exec.
    unsafe { libc::fcntl(owned.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    Some(owned)
}

/// Lane 0's view of the inbound rings, kept with its socket's receive batch.
pub(crate) struct RingRx {
    shm: Arc<Shm>,
    generation: u64,
    rings: Vec<Arc<Mutex<InRing>>>,
    /// Packets taken by the last fill: their bytes (`used` of them), and (source, offset,
    /// length).
    buf: Vec<u8>,
    used: usize,
    pkts: Vec<(SocketAddrV4, usize, usize)>,
    /// Fills since the socket was last read (with rings to read, a polling thread reads the
    /// socket when told it has datagrams, and otherwise only every [`SOCKET_EVERY`] fills).
    since_socket: u32,
    /// Fills in a row that took packets (a stream: the socket is read every
    /// [`SOCKET_EVERY_BUSY`] of them, since a thread that does not sleep is not told).
    busy: u32,
    /// Told that the socket has datagrams, not read yet (the rings came first).
    socket_due: bool,
}

/// Packets one fill takes at most.
const RX_PACKETS: usize = 16;
/// Fills between two reads of the socket while rings are read and nothing said it has data.
/// The engine thread tells of each arrival while the application polls (`edges.rs`); this is
/// the floor for when it cannot run to tell (a few tens of µs of a polling thread's rounds).
const SOCKET_EVERY: u32 = 1024;
/// Fills in a row that took packets between two reads of the socket: a stream on the rings
/// keeps its thread from sleeping, and so from watching the socket (a ping-pong's fill that
/// takes its peer's packet comes after empty ones and never reaches this).
const SOCKET_EVERY_BUSY: u32 = 16;

impl RingRx {
    pub(crate) fn new(shm: Arc<Shm>) -> RingRx {
        RingRx {
            shm,
            generation: u64::MAX,
            rings: Vec::new(),
            // Room for a receive batch's worth of the largest packets, zeroed once.
            buf: vec![0; RX_PACKETS * MAX_PACKET],
            used: 0,
            pkts: Vec::with_capacity(RX_PACKETS),
            since_socket: 0,
            busy: 0,
            socket_due: false,
        }
    }

    /// Takes up to `want` packets out of the rings. Returns how many, and whether the socket
    /// should be read too (`socket_ready`: the engine thread saw datagrams arrive). With rings
    /// to read, the socket is read once told so (and otherwise every [`SOCKET_EVERY`] fills, or
    /// every [`SOCKET_EVERY_BUSY`] in a row that took packets), once the rings are empty, then
    /// leaving it at least one of the fill's slots: a polling thread's empty fills cost no
    /// system call, and a stream on a ring does not starve the socket's senders (a sender that
    /// fills its ring goes on by the socket).
    pub(crate) fn fill(&mut self, want: usize, socket_ready: bool) -> (usize, bool) {
        self.used = 0;
        self.pkts.clear();
        if let Some(list) = self.shm.inbound_since(&mut self.generation) {
            self.rings = list;
        }
        if self.rings.is_empty() {
            return (0, true);
        }
        self.since_socket = self.since_socket.saturating_add(1);
        self.socket_due |= socket_ready;
        let due =
            self.socket_due || self.since_socket >= SOCKET_EVERY || self.busy >= SOCKET_EVERY_BUSY;
        let take = if due && want > 1 { want - 1 } else { want };
        let mut broke = false;
        let mut drained = true;
        for r in &self.rings {
            let mut r = lock(r);
            let src = SocketAddrV4::new(r.peer, super::socket::ROCE_PORT);
            while self.pkts.len() < take && self.buf.len() - self.used >= MAX_PACKET {
                let at = self.used;
                match r.pop(&mut self.buf[at..]) {
                    Some(n) => {
                        self.used += n;
                        self.pkts.push((src, at, n));
                    }
                    None => {
                        broke |= r.broken;
                        break;
                    }
                }
            }
            drained &= !r.pending();
        }
        if broke {
            self.shm.tidy();
        }
        let got = self.pkts.len();
        self.busy = if got == 0 {
            0
        } else {
            self.busy.saturating_add(1)
        };
        if got != 0 {
            // Not on a polling thread's empty fills: a shared word off the poll path.
            self.shm.counts[1].fetch_add(got as u64, Ordering::Relaxed);
        }
        // Only once the rings are read out: a sender whose ring was full sent on by the
        // socket, and those packets follow the ring's.
        let read_socket = due && drained && got < want;
        if read_socket {
            self.since_socket = 0;
            self.busy = 0;
            self.socket_due = false;
        }
        (got, read_socket)
    }

    pub(crate) fn len(&self) -> usize {
        self.pkts.len()
    }

    pub(crate) fn for_each(&self, f: &mut dyn FnMut(SocketAddrV4, &[u8])) {
        for &(src, at, n) in &self.pkts {
            f(src, &self.buf[at..at + n]);
        }
    }
}

#[cfg(test)]
mod tests;

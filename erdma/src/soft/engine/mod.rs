//! The soft device's engine: the state one device shares between the threads that drive it, the
//! verbs-shaped operations on it, and the rounds that move its packets. Clock-free and
//! socket-free: it reads the time and moves datagrams only through an [`Io`], so the driver's
//! threads and the deterministic simulation (virtual time, a modelled network) run the same code.
//!
//! Owns [`Engine`]: the memory-region table, the queue pairs (each a [`proto::Qp`] behind its own
//! lock, in a [`QpCell`]), the timer table, the receive path and the transmit batches, and the
//! rules of who sends what when (`progress.rs`).
//!
//! Who makes progress: whoever holds a queue pair's lock. An application thread that posts a
//! request transmits what the request makes sendable itself, inline, before it returns. A round
//! ([`Engine::round`], from an engine thread or the simulation; [`Engine::app_round`], from a
//! polling application thread) receives datagrams, runs due timers and transmits what those
//! make sendable (ACK-opened windows, READ responses, retransmissions).
//!
//! Must not: read a clock, open a socket, spawn a thread or sleep.
//!
//! Lock order, everywhere: the memory-region table (read) before a queue pair's lock, so a
//! deregistration waiting for the table can never deadlock with a queue pair.

#![allow(unsafe_code)] // registers memory by address

mod app_tx;
#[cfg(test)]
pub(crate) use app_tx::app_tx_gone;
pub(crate) use app_tx::coalesce_sends;
pub(crate) mod batch;
mod crc_raw;
pub(crate) mod lane;
pub(crate) mod memory;
pub(crate) mod notify;
pub(crate) mod progress;
pub(crate) mod ring;
pub(crate) mod same_host;
#[cfg(feature = "gpu")]
pub(crate) mod stage;
pub(crate) mod timers;

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use crate::error::{Error, PostResult, Result};
use crate::soft::fast_map::{IntMap, int_map};
use crate::soft::proto;
use crate::soft::wire::{ChecksumCapabilities, Ipv4IdSolver};
use crate::sync::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use crate::vocab::{Access, Completion, Limit, Mtu, QpAttr, QpCaps, QpState, WorkQueue};

use batch::TxBatch;
use lane::{Handed, Lane, lane_of};
#[cfg(feature = "gpu")]
use memory::UnplacedWrites;
use memory::{DevMemory, MrTable};
use notify::{CompletionRing, EventSink};
pub(crate) use progress::RxClaim;

/// How an engine reaches the world: the time, and the datagrams it sends and receives.
pub(crate) trait Io: Send + Sync {
    /// Now, on the engine's clock.
    fn now(&self) -> proto::Instant;
    /// Sends every message of the batches, in order, and empties them, through lane `lane`'s
    /// side of the network. A message the network refuses is dropped alone (the protocol
    /// retransmits); only a broken link is an error.
    fn send(&self, lane: usize, batches: &mut [&mut TxBatch]) -> io::Result<()>;
    /// Whether sends may put equal-size packets in one message (UDP GSO).
    fn gso(&self) -> bool;
    /// Lane `lane` has work its thread may be sleeping past: a deadline earlier than the one it
    /// sleeps until, or datagrams another lane handed it.
    fn wake(&self, lane: usize);
    /// How many receive queues the network side offers: the engine runs one lane on each.
    fn lanes(&self) -> usize;
    /// The receive queue lane `lane`'s receive path takes datagrams from (called once per
    /// lane).
    fn receiver(&self, lane: usize) -> Box<dyn RxQueue>;
    /// Messages the network refused to send so far.
    fn refused(&self) -> u64;
    /// Datagrams for the device that were dropped before it could receive them, where known.
    fn kernel_drops(&self) -> Option<u64>;
    /// Shared-memory rings to devices of this host, where the network side has them.
    fn channels(&self) -> Option<&dyn same_host::Channels>;
}

/// Where received datagrams come from, batch by batch.
pub(crate) trait RxQueue: Send {
    /// Takes at most `want` messages (at least one) without blocking; returns how many came. A
    /// message is a datagram or several coalesced ones (UDP GRO).
    fn fill(&mut self, want: usize) -> io::Result<usize>;
    /// Messages one fill can take.
    fn slots(&self) -> usize;
    /// Datagrams the last fill took.
    fn len(&self) -> usize;
    /// Calls `f` with each datagram of the last fill (its source and bytes), in order.
    fn for_each(&self, f: &mut dyn FnMut(SocketAddrV4, &[u8]));
}

/// What an engine is made with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Config {
    /// The device's address (packets' source; the ICRC covers it).
    pub addr: Ipv4Addr,
    /// ICRC checking and filling.
    pub checksum: ChecksumCapabilities,
    /// The MTU the port reports active.
    pub active_mtu: Mtu,
    /// Whether polling application threads may do the receive work.
    pub poll_rx: bool,
    /// Whether an application thread that polls takes the receive path over (the engine
    /// thread then keeps off it while the application polls), shares it with the engine
    /// thread (for programs that wait by watching memory rather than a completion queue,
    /// which would otherwise wait for the engine's grace to run out), or finds out which.
    pub claim_rx: RxClaim,
    /// Whether requests' payloads go to the socket straight from their memory regions (one
    /// iovec each) instead of being copied into the packets first.
    pub gather: bool,
    /// Whether posting hands a queue pair's transmit work to its lane (the lane's next round
    /// sends what the post made sendable) instead of doing it in the posting thread. With
    /// several lanes, the lanes' threads then share the transmit work as they share the
    /// receive work, where one posting thread would otherwise do all of it.
    pub tx_on_lanes: bool,
    /// Seeds the random part of memory keys (models that replay a run); `None` seeds it from
    /// the kernel's generator.
    pub key_seed: Option<u64>,
    /// Whether payloads move by reference between soft devices of this host ([`same_host`]).
    pub same_host: bool,
}

/// The profile numbers the soft device enforces and reports (eRDMA's, with the ones hardware
/// reports set to what the soft device supports).
pub(crate) mod caps {
    /// Queue pairs.
    pub const MAX_QP: u32 = 4095;
    /// Work requests per queue.
    pub const MAX_QP_WR: u32 = 8192;
    /// Entries per completion queue.
    pub const MAX_CQE: u32 = 1 << 20;
    /// Bytes per memory region.
    pub const MAX_MR_SIZE: u64 = 64 << 30;
    /// Protection domains.
    pub const MAX_PD: u32 = 128 * 1024;
    /// Completion queues.
    pub const MAX_CQ: u32 = 2 * MAX_QP - 1;
    /// Memory regions.
    pub const MAX_MR: u32 = 2 * MAX_QP;
    /// Bytes per message.
    pub const MAX_MSG: u32 = 1 << 31;
    /// Supported page sizes.
    pub const PAGE_SIZE_CAP: u64 = 0x7FFF_F000;
    /// GID table entries per port.
    pub const GID_TABLE_LEN: u32 = 16;
}

/// The first QPN handed out (like rxe, which starts user QPs at 0x11).
const FIRST_QPN: u32 = 0x11;

/// The error for one object too many of a kind the device counts (`live` exist already).
fn too_many(limit: Limit, live: u32, max: u32) -> Error {
    Error::LimitExceeded {
        limit,
        requested: u64::from(live) + 1,
        max: u64::from(max),
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One soft device's state, shared by its engine thread (or the simulation) and the
/// application threads that post, poll and modify.
pub(crate) struct Engine {
    pub(crate) addr: Ipv4Addr,
    pub(crate) io: Arc<dyn Io>,
    pub(crate) caps: ChecksumCapabilities,
    pub(crate) active_mtu: Mtu,
    mrs: RwLock<MrTable>,
    qps: RwLock<IntMap<u32, Arc<QpCell>>>,
    next_qpn: Mutex<u32>,
    next_pd: AtomicU32,
    live_pds: AtomicU32,
    live_cqs: AtomicU32,
    /// The receive paths, their timers and their threads' state: queue pair `qpn` is served by
    /// lane [`lane_of`]`(qpn, lanes.len())`.
    lanes: Box<[Lane]>,
    /// Whether polling threads may do the receive work.
    poll_rx: bool,
    /// See [`Config::claim_rx`]; an adaptive device's evidence ([`progress::ClaimState`]).
    claim_rx: progress::ClaimState,
    /// See [`Config::gather`].
    gather: bool,
    /// See [`Config::tx_on_lanes`].
    tx_on_lanes: bool,
    /// The same-host exchange, when the device takes part ([`Config::same_host`]).
    same_host: Option<same_host::SameHost>,
    /// Datagrams dropped before any queue pair saw them.
    drops: Mutex<proto::DropCounters>,
    /// Datagrams received, valid or not.
    rcvd_datagrams: AtomicU64,
    /// The counters of destroyed queue pairs (the port's counters include them). Taken before
    /// `qps` or a queue pair's lock, never while holding either.
    retired: Mutex<proto::QpCounters>,
    /// Device-memory regions holding staged writes not yet known to be placed.
    #[cfg(feature = "gpu")]
    unplaced: UnplacedWrites,
}

/// One queue pair.
pub(crate) struct QpCell {
    pub(crate) qpn: u32,
    /// The lane serving it ([`lane_of`]).
    pub(crate) lane: usize,
    proto: Mutex<proto::Qp>,
    send_cq: Arc<CompletionRing>,
    recv_cq: Arc<CompletionRing>,
    /// Where the queue pair's asynchronous events go.
    events: Arc<dyn EventSink>,
    /// The deadline already in the timer heap (ns), `u64::MAX` for none.
    scheduled: AtomicU64,
    /// The transmit batch ([`TxState::id`]) holding this queue pair's requests or responses
    /// not yet handed to the network, 0 for none. While one batch holds some, no other batch
    /// takes more of them: the packets of a queue pair reach the wire in PSN order whichever
    /// threads emit them (a thread's batch leaves after it released the queue pair's lock; a
    /// later packet sent first by another thread would reach the peer out of sequence and cost
    /// a NAK and a go-back-N retry). [`GONE`] once the queue pair is destroyed: then no batch
    /// sends for it any more. Read and written under the queue pair's lock.
    tx_owner: AtomicU64,
    /// Whether a thread found packets to emit while another batch owned the queue pair: the
    /// owner emits them when it releases it ([`Engine::release`]).
    tx_wanted: AtomicBool,
}

/// [`QpCell::tx_owner`] of a destroyed queue pair (no [`TxState::id`] reaches it).
const GONE: u64 = u64::MAX;

/// A transmit batch and what it owns, for one thread's progress.
struct TxState {
    batch: TxBatch,
    solver: Ipv4IdSolver,
    /// Whether every packet in `batch` answers a peer's request (ACK, NAK, atomic ACK).
    answers_only: bool,
    /// This batch's identity for [`QpCell::tx_owner`] (never 0).
    id: u64,
    /// The queue pairs whose packets `batch` holds (it owns them until [`Engine::release`]).
    owned: Vec<Arc<QpCell>>,
}

impl TxState {
    fn new(gso: bool) -> TxState {
        // Plain std atomics: an identity counter, outside any model.
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        TxState {
            batch: TxBatch::new(1 << 18, proto::MAX_DATAGRAM, gso),
            solver: Ipv4IdSolver::new(),
            answers_only: true,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            owned: Vec::new(),
        }
    }

    /// Drops a batch left holding lent payloads outside the region-table lock (only a call
    /// that unwound midway leaves one: [`TxBatch::discard_stale_lent`]), and gives back the
    /// queue pairs it owned, so their next packets are not held for a batch that is gone.
    /// Returns whether it dropped one.
    fn discard_stale_lent(&mut self) -> bool {
        if !self.batch.discard_stale_lent() {
            return false;
        }
        for cell in self.owned.drain(..) {
            let _ =
                cell.tx_owner
                    .compare_exchange(self.id, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
        true
    }
}

/// What receiving needs: the receive queue, a transmit batch for the answers, scratch.
struct RxState {
    rx: Box<dyn RxQueue>,
    tx: TxState,
    touched: Vec<Arc<QpCell>>,
    /// Timers due in this round (kept to reuse its allocation).
    due: Vec<(u64, u32)>,
    /// Datagrams other lanes handed over, taken from the inbox for this round.
    handed: Vec<Handed>,
    /// Whether the last application round received nothing.
    app_dry: bool,
}

impl Engine {
    /// An engine on `io`.
    pub(crate) fn new(io: Arc<dyn Io>, cfg: Config) -> Arc<Engine> {
        let gso = io.gso();
        let lanes = (0..io.lanes().max(1))
            .map(|i| Lane::new(i, io.receiver(i), gso))
            .collect();
        Arc::new(Engine {
            addr: cfg.addr,
            caps: cfg.checksum,
            active_mtu: cfg.active_mtu,
            mrs: RwLock::new(match cfg.key_seed {
                Some(seed) => MrTable::with_seed(seed),
                None => MrTable::default(),
            }),
            qps: RwLock::new(int_map()),
            next_qpn: Mutex::new(FIRST_QPN),
            next_pd: AtomicU32::new(1),
            live_pds: AtomicU32::new(0),
            live_cqs: AtomicU32::new(0),
            lanes,
            poll_rx: cfg.poll_rx,
            claim_rx: progress::ClaimState::new(cfg.claim_rx),
            gather: cfg.gather,
            tx_on_lanes: cfg.tx_on_lanes,
            same_host: cfg.same_host.then(|| same_host::SameHost::new(cfg.addr)),
            drops: Mutex::new(proto::DropCounters::default()),
            rcvd_datagrams: AtomicU64::new(0),
            retired: Mutex::new(proto::QpCounters::default()),
            #[cfg(feature = "gpu")]
            unplaced: UnplacedWrites::default(),
            io,
        })
    }

    pub(crate) fn now(&self) -> proto::Instant {
        self.io.now()
    }

    /// Whether polling application threads may do the receive work ([`Config::poll_rx`]).
    #[cfg_attr(not(test), allow(dead_code))] // the provider's tests'
    pub(crate) fn polls_receive(&self) -> bool {
        self.poll_rx
    }

    /// The device's lanes.
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))] // the simulation's
    pub(crate) fn lanes(&self) -> &[Lane] {
        &self.lanes
    }

    /// How many lanes the device has.
    pub(crate) fn lane_count(&self) -> usize {
        self.lanes.len()
    }

    /// Lane `i` (for the driver's sleep handshake and the simulation).
    pub(crate) fn lane(&self, i: usize) -> &Lane {
        &self.lanes[i]
    }

    // ----- protection domains and memory regions

    /// Allocates a protection domain number.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] past [`caps::MAX_PD`].
    pub(crate) fn alloc_pd(&self) -> Result<u32> {
        let live = self.live_pds.fetch_add(1, Ordering::AcqRel);
        if live >= caps::MAX_PD {
            self.live_pds.fetch_sub(1, Ordering::AcqRel);
            return Err(too_many(Limit::MaxPd, live, caps::MAX_PD));
        }
        Ok(self.next_pd.fetch_add(1, Ordering::AcqRel))
    }

    /// Gives a protection domain back.
    pub(crate) fn dealloc_pd(&self) {
        self.live_pds.fetch_sub(1, Ordering::AcqRel);
    }

    /// Registers `len` bytes of host memory at `addr`; returns the key (lkey = rkey).
    ///
    /// # Safety
    /// Until [`Engine::dereg_mr`] returns for the key, `[addr, addr+len)` must stay allocated,
    /// and the device may read and write it at any time (as a peer's or a request's access
    /// asks).
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] past [`caps::MAX_MR`]; `ENOMEM` when keys run out.
    pub(crate) unsafe fn reg_mr(
        &self,
        pd: u32,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<u32> {
        self.insert_region(pd, addr, len, access, memory::RegionKind::Host)
    }

    /// Registers memory the table owns: `len` zeroed bytes, freed when the region is
    /// deregistered (for models and tests, which reach them with [`Engine::read_region`] and
    /// [`Engine::write_region`]). Returns the key and the region's address.
    ///
    /// # Errors
    /// As [`Engine::reg_mr`].
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))] // the simulation's
    pub(crate) fn reg_owned(&self, pd: u32, len: usize, access: Access) -> Result<(u32, u64)> {
        let mem = memory::Owned::zeroed(len);
        let addr = mem.addr();
        let key =
            self.insert_region(pd, addr, len as u64, access, memory::RegionKind::Owned(mem))?;
        Ok((key, addr))
    }

    /// Registers device (GPU) memory at `addr`, reached through `stager`.
    ///
    /// # Errors
    /// As [`Engine::reg_mr`].
    #[cfg(feature = "gpu")]
    pub(crate) fn reg_device_mr(
        &self,
        pd: u32,
        addr: u64,
        len: u64,
        access: Access,
        stager: Arc<stage::Stager>,
    ) -> Result<u32> {
        self.insert_region(pd, addr, len, access, memory::RegionKind::Device(stager))
    }

    fn insert_region(
        &self,
        pd: u32,
        addr: u64,
        len: u64,
        access: Access,
        kind: memory::RegionKind,
    ) -> Result<u32> {
        let mut table = self.mrs.write().unwrap_or_else(|e| e.into_inner());
        if table.len() >= caps::MAX_MR as usize {
            return Err(too_many(Limit::MaxMr, table.len() as u32, caps::MAX_MR));
        }
        table
            .insert(pd, addr, len, access, kind)
            .ok_or_else(|| Error::Verb {
                verb: "ibv_reg_mr",
                source: io::Error::from_raw_os_error(libc::ENOMEM),
            })
    }

    /// Deregisters a region: once this returns, the device touches its memory no more.
    pub(crate) fn dereg_mr(&self, key: u32) {
        // The write lock waits for any batch moving bytes.
        let mut table = self.mrs.write().unwrap_or_else(|e| e.into_inner());
        let region = table.remove(key);
        // A device-memory region's stager goes now too (its last copies finish as it drops),
        // before the memory behind it is freed.
        #[cfg(feature = "gpu")]
        if let Some(st) = region.as_ref().and_then(|r| r.kind.stager()) {
            self.unplaced.remove(st);
        }
        drop(region);
    }

    /// The length of an owned region ([`Engine::reg_owned`]).
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))] // the simulation's
    pub(crate) fn owned_len(&self, key: u32) -> Option<u64> {
        let table = self.mrs.read().unwrap_or_else(|e| e.into_inner());
        table.get(key).filter(|r| r.kind.is_owned()).map(|r| r.len)
    }

    /// Copies `out.len()` bytes at `offset` of an owned region ([`Engine::reg_owned`]) out;
    /// `false` when the key names no such region or the range leaves it.
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))] // the simulation's
    pub(crate) fn read_region(&self, key: u32, offset: u64, out: &mut [u8]) -> bool {
        let table = self.mrs.read().unwrap_or_else(|e| e.into_inner());
        table
            .get(key)
            .is_some_and(|r| r.kind.is_owned() && memory::read(r, offset, out))
    }

    /// Copies `data` into an owned region at `offset`; as [`Engine::read_region`].
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))] // the simulation's
    pub(crate) fn write_region(&self, key: u32, offset: u64, data: &[u8]) -> bool {
        let table = self.mrs.read().unwrap_or_else(|e| e.into_inner());
        table
            .get(key)
            .is_some_and(|r| r.kind.is_owned() && memory::write(r, offset, data))
    }

    /// Runs `f` with the region table read-locked.
    fn with_memory<R>(&self, f: impl FnOnce(&mut DevMemory<'_>) -> R) -> R {
        let table = self.mrs.read().unwrap_or_else(|e| e.into_inner());
        f(&mut self.dev_memory(&table))
    }

    fn dev_memory<'a>(&'a self, table: &'a MrTable) -> DevMemory<'a> {
        DevMemory::new(
            table,
            self.gather,
            self.same_host.is_some(),
            #[cfg(feature = "gpu")]
            &self.unplaced,
        )
    }

    // ----- completion queues

    /// Creates a completion queue of `depth` entries signalling `event` when armed; overruns are reported to `events` as `CqErr` naming `id`.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] past [`caps::MAX_CQ`].
    pub(crate) fn create_cq(
        &self,
        depth: u32,
        event: crate::sync::EventFd,
        events: Arc<dyn EventSink>,
        id: u64,
    ) -> Result<Arc<CompletionRing>> {
        let live = self.live_cqs.fetch_add(1, Ordering::AcqRel);
        if live >= caps::MAX_CQ {
            self.live_cqs.fetch_sub(1, Ordering::AcqRel);
            return Err(too_many(Limit::MaxCq, live, caps::MAX_CQ));
        }
        Ok(Arc::new(
            CompletionRing::new(depth as usize, event).with_report(events, id),
        ))
    }

    /// Gives a completion queue back.
    pub(crate) fn destroy_cq(&self) {
        self.live_cqs.fetch_sub(1, Ordering::AcqRel);
    }

    /// Takes completions from `ring`. With `inline`, a poll that finds it empty does the
    /// device's receive work first (when no other thread is doing it) and looks again.
    ///
    /// # Errors
    /// [`Error::Verb`] once, when the queue overran (completions were lost).
    pub(crate) fn poll_cq(
        &self,
        ring: &CompletionRing,
        out: &mut [Completion],
        inline: bool,
    ) -> Result<usize> {
        let mut n = ring.pop_into(out);
        if n == 0 && inline {
            // An armed queue's poll is the last look before its thread sleeps.
            if self.app_round(ring.lanes(), !ring.is_armed()) {
                n = ring.pop_into(out);
            }
        } else {
            // The thread is back for more: what its last receive round held back goes now if
            // it has waited a while (a round would send it first), so a stream's ACKs do not
            // wait while the thread works through a full queue re-posting receives.
            self.flush_held_aged();
        }
        if n == 0 && ring.take_overrun() {
            return Err(Error::Verb {
                verb: "ibv_poll_cq",
                source: io::Error::other(
                    "completion queue overrun: completions were lost and the queue pairs \
                     using it were moved to the error state (make the CQ deeper)",
                ),
            });
        }
        Ok(n)
    }

    /// Arms a completion queue: the application is about to sleep, so what its last receive
    /// round held back goes now, and the engine thread takes the receive path back.
    pub(crate) fn arm_cq(&self, ring: &CompletionRing, solicited_only: bool) {
        self.flush_held();
        ring.arm(solicited_only);
        self.app_sleeps(ring.lanes());
    }

    // ----- queue pairs

    /// Creates a queue pair in RESET; returns it with the capacities granted.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] past [`caps::MAX_QP`].
    pub(crate) fn create_qp(
        &self,
        pd: u32,
        send_cq: &Arc<CompletionRing>,
        recv_cq: &Arc<CompletionRing>,
        caps: &QpCaps,
        sig_all: bool,
        events: Arc<dyn EventSink>,
    ) -> Result<(Arc<QpCell>, QpCaps)> {
        let mut qps = self.qps.write().unwrap_or_else(|e| e.into_inner());
        if qps.len() >= caps::MAX_QP as usize {
            return Err(too_many(Limit::MaxQp, qps.len() as u32, caps::MAX_QP));
        }
        let qpn = {
            let mut next = lock(&self.next_qpn);
            loop {
                let n = *next;
                *next = if n >= 0xff_ffff { FIRST_QPN } else { n + 1 };
                if !qps.contains_key(&n) {
                    break n;
                }
            }
        };
        let mut params = proto::QpParams::new(pd, IpAddr::V4(self.addr));
        params.caps = QpCaps {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_send_sge.min(proto::MAX_SGE as u32),
            max_recv_sge: caps.max_recv_sge.min(proto::MAX_SGE as u32),
            max_inline_data: caps.max_inline_data.min(proto::MAX_INLINE as u32),
        };
        params.sq_sig_all = sig_all;
        params.checksum = self.caps;
        let granted = params.caps;
        let lane = lane_of(qpn, self.lanes.len());
        // Polls of these queues do this lane's receive work too.
        send_cq.add_lane(lane);
        recv_cq.add_lane(lane);
        let cell = Arc::new(QpCell {
            qpn,
            lane,
            proto: Mutex::new(proto::Qp::new(qpn, params)),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            events,
            scheduled: AtomicU64::new(u64::MAX),
            tx_owner: AtomicU64::new(0),
            tx_wanted: AtomicBool::new(false),
        });
        qps.insert(qpn, cell.clone());
        Ok((cell, granted))
    }

    /// The queue pair's state.
    pub(crate) fn qp_state(&self, cell: &QpCell) -> QpState {
        lock(&cell.proto).state()
    }

    /// Reads the queue pair's protocol state (the simulation's attributes and counters).
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))] // the simulation's
    pub(crate) fn read_qp<R>(&self, cell: &QpCell, f: impl FnOnce(&proto::Qp) -> R) -> R {
        f(&lock(&cell.proto))
    }

    /// Modifies the queue pair (the verbs rules for RC); what the change makes sendable (a
    /// flush's completions, say) goes at once. A move to ERR first takes in what has arrived
    /// (as a NIC has by then): a request whose ACK came in completes rather than flushes.
    ///
    /// # Errors
    /// The protocol's refusal; nothing changed then.
    pub(crate) fn modify_qp(
        self: &Arc<Engine>,
        cell: &Arc<QpCell>,
        attr: &QpAttr,
    ) -> std::result::Result<(), proto::ModifyError> {
        if attr.state == Some(QpState::Err) {
            self.round(cell.lane, false);
        }
        self.with_app_tx(cell.lane, |mem, tx| {
            let mut q = lock(&cell.proto);
            q.modify(attr)?;
            if matches!(attr.state, Some(QpState::Reset | QpState::Err)) {
                mem.forget_qp(cell.qpn);
            }
            if matches!(attr.state, Some(QpState::Rtr | QpState::Rts)) {
                self.ask_same_host(&mut q, tx);
            }
            self.progress(cell, &mut q, mem, tx, self.now());
            self.end_call(cell.lane, tx);
            Ok(())
        })
    }

    /// Posts send requests, in order, and transmits what they make sendable (unless the thread
    /// coalesces sends), or leaves that to the queue pair's lane ([`Config::tx_on_lanes`]). `wqes` yields each request, or the error that stops the chain there.
    ///
    /// # Errors
    /// How many went in, and why the next did not.
    pub(crate) fn post_send(
        self: &Arc<Engine>,
        cell: &Arc<QpCell>,
        wqes: impl IntoIterator<Item = Result<proto::SendWqe>>,
    ) -> PostResult {
        self.with_app_tx(cell.lane, |mem, tx| {
            let mut q = lock(&cell.proto);
            let mut result = Ok(());
            for (i, wqe) in wqes.into_iter().enumerate() {
                let wqe = match wqe {
                    Ok(w) => w,
                    Err(e) => {
                        result = Err((i, e));
                        break;
                    }
                };
                if let Err(e) = q.post_send(wqe) {
                    result = Err((i, post_error(WorkQueue::Send, e)));
                    break;
                }
                // Device memory this request will read: announced once the request is posted.
                #[cfg(feature = "gpu")]
                if let proto::SendData::Sges(sges) = wqe.data
                    && !wqe.opcode.writes_local()
                {
                    for s in sges.as_slice() {
                        mem.expect_read(cell.qpn, s.lkey, s.addr, u64::from(s.length), false);
                    }
                }
            }
            self.after_post(cell, &mut q, mem, tx, WorkQueue::Send);
            result
        })
    }

    /// What follows a post, under the queue pair's lock: its transmit progress now, in this
    /// thread, or (with [`Config::tx_on_lanes`]) in its lane's next round. The lane runs it
    /// as a due deadline: [`Engine::schedule`] wakes its thread if it sleeps, and the deadline
    /// is read under this lock, so a round that took an earlier entry for this queue pair
    /// either runs after this post or left no entry behind that would hide this one. A receive
    /// makes nothing sendable (it unblocks an RNR-waiting peer only through that peer's retry):
    /// the lane is woken for one only in ERR, where posting it made a flush completion.
    fn after_post(
        &self,
        cell: &Arc<QpCell>,
        q: &mut proto::Qp,
        mem: &mut DevMemory<'_>,
        tx: &mut TxState,
        queue: WorkQueue,
    ) {
        let now = self.now();
        if self.tx_on_lanes {
            if queue == WorkQueue::Send || q.state() == QpState::Err {
                self.schedule(cell, now.as_nanos());
            }
        } else {
            self.progress(cell, q, mem, tx, now);
            self.end_call(cell.lane, tx);
        }
    }

    /// Posts receive requests, in order; as [`Engine::post_send`].
    ///
    /// # Errors
    /// How many went in, and why the next did not.
    pub(crate) fn post_recv(
        self: &Arc<Engine>,
        cell: &Arc<QpCell>,
        wqes: impl IntoIterator<Item = Result<proto::RecvWqe>>,
    ) -> PostResult {
        self.with_app_tx(cell.lane, |mem, tx| {
            let mut q = lock(&cell.proto);
            let mut result = Ok(());
            for (i, wqe) in wqes.into_iter().enumerate() {
                let posted =
                    wqe.and_then(|w| q.post_recv(w).map_err(|e| post_error(WorkQueue::Recv, e)));
                if let Err(e) = posted {
                    result = Err((i, e));
                    break;
                }
            }
            // A receive may unblock an RNR-waiting peer only through its retry, but posting in
            // ERR produces flush completions that must be delivered.
            self.after_post(cell, &mut q, mem, tx, WorkQueue::Recv);
            result
        })
    }

    /// Destroys a queue pair: it sends nothing more (`GONE`, under its lock, which a releasing
    /// batch checks), takes in what has arrived (as [`Engine::modify_qp`] to ERR), leaves.
    pub(crate) fn destroy_qp(&self, cell: &QpCell) {
        let q = lock(&cell.proto);
        cell.tx_owner.store(GONE, Ordering::Relaxed);
        drop(q);
        self.round(cell.lane, false);
        self.with_memory(|mem| mem.forget_qp(cell.qpn));
        // Its counts move to the port's retired totals in the same step as it leaves the
        // table, so that a concurrent `counters` sees them in exactly one of the two.
        let mut retired = lock(&self.retired);
        self.qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&cell.qpn);
        retired.add(lock(&cell.proto).counters());
    }

    // ----- counters

    /// Every queue pair's counters added up (destroyed ones included), with the drops before
    /// routing folded into `drops`, and the datagrams received.
    pub(crate) fn counters(&self) -> (proto::QpCounters, u64) {
        let mut total = {
            // Held while the live queue pairs are read, so none moves to it meanwhile.
            let retired = lock(&self.retired);
            let cells: Vec<Arc<QpCell>> = self
                .qps
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .cloned()
                .collect();
            let mut total = retired.clone();
            for cell in &cells {
                total.add(lock(&cell.proto).counters());
            }
            total
        };
        total.drops.add(&lock(&self.drops));
        (total, self.rcvd_datagrams.load(Ordering::Relaxed))
    }

    /// Datagrams dropped because a lane's hand-off inbox was full ([`lane::INBOX_CAP`], [`lane::INBOX_BYTES`]).
    pub(crate) fn handoff_drops(&self) -> u64 {
        self.lanes.iter().map(|l| l.inbox.dropped()).sum()
    }

    fn qp(&self, qpn: u32) -> Option<Arc<QpCell>> {
        self.qps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&qpn)
            .cloned()
    }

    /// Puts a queue pair's deadline in the timer heap and wakes the engine thread if it would
    /// sleep past it.
    fn schedule(&self, cell: &QpCell, deadline: u64) {
        let prev = cell.scheduled.load(Ordering::Acquire);
        if prev <= deadline {
            return;
        }
        cell.scheduled.store(deadline, Ordering::Release);
        if self.lanes[cell.lane].timers.schedule(deadline, cell.qpn) {
            self.io.wake(cell.lane);
        }
    }
}

/// A protocol refusal at posting, as the SDK reports it.
fn post_error(queue: WorkQueue, e: proto::PostError) -> Error {
    match e {
        proto::PostError::QueueFull { depth } => Error::QueueFull { queue, depth },
        other => Error::Verb {
            verb: match queue {
                WorkQueue::Send => "post_send",
                WorkQueue::Recv => "post_recv",
            },
            source: io::Error::new(io::ErrorKind::InvalidInput, other.to_string()),
        },
    }
}

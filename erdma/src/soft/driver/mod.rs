//! The soft device's driver: the socket, the engine thread, and the provider glue.
//!
//! Owns one [`Core`] per local IPv4 address (shared by every context of this process that opens
//! it): the UDP socket bound to `<addr>:4791`, the memory-region table, the queue pairs (each a
//! [`proto::Qp`] behind its own lock) and the engine thread.
//!
//! Who makes progress: whoever holds a queue pair's lock. An application thread that posts a
//! request transmits what the request makes sendable itself, inline, before it returns — no hop
//! to another thread on the send path. The engine thread receives datagrams, runs timers, and
//! transmits what those make sendable (ACK-opened windows, READ responses, retransmissions).
//! It follows the thin-driver shape: reap I/O → feed datagrams → fire timers → drain transmits →
//! sleep until the next deadline or a wake-up.
//!
//! Lock order, everywhere: the memory-region table (read) before a queue pair's lock, so a
//! deregistration waiting for the table can never deadlock with a queue pair.

pub(crate) mod memory;
pub(crate) mod notify;
pub(crate) mod ring;
pub(crate) mod socket;
pub(crate) mod timers;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::provider::PostResult;
use crate::soft::proto;
use crate::soft::wire::{ChecksumCapabilities, Ipv4IdSolver, OpFlags, Opcode, icrc};
use crate::sync::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use crate::vocab::{
    Access, AsyncEvent, AsyncEventKind, AtomicCap, DeviceAttr, DeviceInfo, EventElement, Gid,
    GidEntry, GidType, Limit, LinkLayer, Mtu, PortAttr, PortCounters, PortState, ProviderKind,
    QpAttr, QpCaps, QpState, SendFlags, Sge, Transport, WorkQueue,
};
use crate::wr::{RecvReq, SendReq};

use crate::sync::EventFd;
use memory::{MrTable, Region};
use notify::{CompletionRing, EventSink};
use socket::{LentBytes, Outgoing, ROCE_PORT, RxBatch, SockOptions, TxBatch, UdpSock};
use timers::{Sleep, Timers};

/// Environment variables that tune the soft device (read once per device).
mod env {
    /// `0` turns UDP GSO off.
    pub const GSO: &str = "ERDMA_SOFT_GSO";
    /// `0` turns UDP GRO off.
    pub const GRO: &str = "ERDMA_SOFT_GRO";
    /// Microseconds the engine busy-polls before sleeping (default 0).
    pub const SPIN_US: &str = "ERDMA_SOFT_SPIN_US";
    /// `0` turns ICRC checking and filling off (for experiments only).
    pub const ICRC: &str = "ERDMA_SOFT_ICRC";
    /// `0` keeps polling threads from doing the receive work themselves.
    pub const POLL_RX: &str = "ERDMA_SOFT_POLL_RX";
    /// `0` copies every request's payload into its packet instead of sending it from the
    /// memory region.
    pub const GATHER: &str = "ERDMA_SOFT_GATHER";
}

fn env_flag(name: &str, default: bool) -> bool {
    match std::env::var(name) {
        Ok(v) => !matches!(v.trim(), "0" | "false" | "off" | "no"),
        Err(_) => default,
    }
}

/// The profile numbers the soft device reports (eRDMA's, with the hardware-reported ones set
/// to what the soft device supports).
mod caps {
    pub const MAX_QP: u32 = 4095;
    pub const MAX_QP_WR: u32 = 8192;
    pub const MAX_CQE: u32 = 1 << 20;
    pub const MAX_MR_SIZE: u64 = 64 << 30;
    pub const MAX_PD: u32 = 128 * 1024;
    pub const MAX_CQ: u32 = 2 * MAX_QP - 1;
    pub const MAX_MR: u32 = 2 * MAX_QP;
    pub const MAX_MSG: u32 = 1 << 31;
    pub const PAGE_SIZE_CAP: u64 = 0x7FFF_F000;
    pub const GID_TABLE_LEN: u32 = 16;
}

/// The error for one object too many of a kind the device counts (`live` exist already).
fn too_many(limit: Limit, live: u32, max: u32) -> Error {
    Error::LimitExceeded {
        limit,
        requested: u64::from(live) + 1,
        max: u64::from(max),
    }
}

/// Live soft devices of this process, by address.
static REGISTRY: Mutex<Vec<(Ipv4Addr, Weak<Device>)>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A soft device: its core and the engine thread serving it.
pub(crate) struct Device {
    core: Arc<Core>,
    engine: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Device {
    fn drop(&mut self) {
        self.core.stop.store(true, Ordering::Release);
        self.core.wake.signal();
        if let Some(h) = lock(&self.engine).take() {
            let _ = h.join();
        }
        // Answers an application's last receive round held back still go out.
        self.core.send_held(true);
    }
}

/// Sends, at process exit, the answers receive rounds held back on every soft device still
/// open (a process that exits without closing its devices must not leave its peers without
/// acknowledgements for what it received). Never blocks: a device whose receive path is busy
/// is left to that thread, which sends them when it finishes.
extern "C" fn flush_held_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        let Ok(reg) = REGISTRY.try_lock() else {
            return;
        };
        for dev in reg.iter().filter_map(|(_, w)| w.upgrade()) {
            dev.core.send_held(false);
        }
    });
}

/// Opens (or joins) the soft device on `addr`.
fn open_device(addr: Ipv4Addr) -> Result<Arc<Device>> {
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    AT_EXIT.call_once(|| {
        // libc calls it once at exit; it catches panics and never blocks.
        // SAFETY: registers an `extern "C" fn()` that never unwinds.
        unsafe { libc::atexit(flush_held_at_exit) };
    });
    let mut reg = lock(&REGISTRY);
    reg.retain(|(_, w)| w.strong_count() > 0);
    if let Some(dev) = reg
        .iter()
        .find(|(a, _)| *a == addr)
        .and_then(|(_, w)| w.upgrade())
    {
        return Ok(dev);
    }
    let opts = SockOptions {
        gso: env_flag(env::GSO, true),
        gro: env_flag(env::GRO, true),
        buffer_bytes: 8 << 20,
    };
    let sock = UdpSock::bind(addr, ROCE_PORT, opts).map_err(|e| {
        let hint = match e.raw_os_error() {
            Some(libc::EADDRINUSE) => {
                " (another process, or a kernel rxe device, holds this address's RoCE port; \
                 pick another loopback address, 127.0.0.0/8 has plenty)"
            }
            Some(libc::EADDRNOTAVAIL) => " (the address is not assigned to this host)",
            _ => "",
        };
        Error::io(
            format!("soft device {addr}: binding UDP port {ROCE_PORT}{hint}"),
            e,
        )
    })?;
    let (gso_on, gro_on) = (sock.gso(), sock.gro());
    let wake = EventFd::new().map_err(|e| Error::io("soft device: creating an eventfd", e))?;
    let caps = if env_flag(env::ICRC, true) {
        ChecksumCapabilities::default()
    } else {
        ChecksumCapabilities::ignored()
    };
    let core = Arc::new(Core {
        addr,
        sock,
        wake,
        stop: AtomicBool::new(false),
        epoch: std::time::Instant::now(),
        caps,
        active_mtu: link_mtu(addr)
            .and_then(Mtu::for_link_mtu)
            .unwrap_or(Mtu::Mtu1024),
        spin: Duration::from_micros(
            std::env::var(env::SPIN_US)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        ),
        mrs: RwLock::new(MrTable::default()),
        qps: RwLock::new(HashMap::new()),
        next_qpn: Mutex::new(FIRST_QPN),
        next_pd: AtomicU32::new(1),
        live_pds: AtomicU32::new(0),
        live_cqs: AtomicU32::new(0),
        timers: Timers::new(),
        app_polled: AtomicU64::new(0),
        parked_for_app: AtomicBool::new(false),
        poll_rx: env_flag(env::POLL_RX, true),
        gather: env_flag(env::GATHER, true),
        tx_held: AtomicBool::new(false),
        rx: Mutex::new(RxState {
            // 8 messages per receive call: 2 or 4 measured no faster (docs/SOFT-DEVICE.md).
            rx: RxBatch::new(8, if gro_on { 65536 } else { 9216 }),
            tx: TxState::new(TxBatch::new(1 << 18, proto::MAX_DATAGRAM, gso_on)),
            touched: Vec::with_capacity(16),
            due: Vec::with_capacity(64),
            app_dry: false,
        }),
        drops: Mutex::new(proto::DropCounters::default()),
        rcvd_datagrams: AtomicU64::new(0),
        retired: Mutex::new(proto::QpCounters::default()),
        #[cfg(feature = "gpu")]
        unplaced: UnplacedWrites::default(),
    });
    let engine_core = core.clone();
    let handle = std::thread::Builder::new()
        .name(format!("erdma-soft-{addr}"))
        .spawn(move || engine(engine_core))
        .map_err(|e| Error::io("soft device: starting the engine thread", e))?;
    let dev = Arc::new(Device {
        core,
        engine: Mutex::new(Some(handle)),
    });
    reg.push((addr, Arc::downgrade(&dev)));
    Ok(dev)
}

/// The first QPN handed out (like rxe, which starts user QPs at 0x11).
const FIRST_QPN: u32 = 0x11;

/// The MTU of the interface holding `addr`, from sysfs.
fn link_mtu(addr: Ipv4Addr) -> Option<u32> {
    if addr.is_loopback() {
        return std::fs::read_to_string("/sys/class/net/lo/mtu")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .or(Some(65536));
    }
    let ifname = interface_of(addr)?;
    std::fs::read_to_string(format!("/sys/class/net/{ifname}/mtu"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Every local IPv4 address with its interface name.
fn local_ipv4() -> Vec<(String, Ipv4Addr)> {
    let mut out = Vec::new();
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `ifap` is a valid out-parameter; the list is freed below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return out;
    }
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // The sockaddr_in is read only for AF_INET.
            // SAFETY: `ifa_addr` is non-null and points at a sockaddr at least its family's size.
            let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
            if family == libc::AF_INET {
                // SAFETY: AF_INET addresses are sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                // SAFETY: `ifa_name` is a NUL-terminated string owned by the list.
                let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
                    .to_string_lossy()
                    .into_owned();
                out.push((name, ip));
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: frees the list getifaddrs returned, once.
    unsafe { libc::freeifaddrs(ifap) };
    out
}

fn interface_of(addr: Ipv4Addr) -> Option<String> {
    local_ipv4()
        .into_iter()
        .find(|(_, a)| *a == addr)
        .map(|(n, _)| n)
}

/// Soft devices that can be opened here: one per local IPv4 address (any 127.x.y.z works too).
pub(crate) fn list_devices() -> Vec<DeviceInfo> {
    let mut addrs: Vec<Ipv4Addr> = local_ipv4().into_iter().map(|(_, a)| a).collect();
    if !addrs.contains(&Ipv4Addr::LOCALHOST) {
        addrs.insert(0, Ipv4Addr::LOCALHOST);
    }
    addrs.sort_by_key(|a| (!a.is_loopback(), *a));
    addrs.dedup();
    addrs
        .into_iter()
        .map(|a| DeviceInfo {
            name: format!("soft:{a}"),
            provider: ProviderKind::Soft,
            transport: Transport::Ib,
            node_guid: node_guid(a),
        })
        .collect()
}

fn node_guid(addr: Ipv4Addr) -> u64 {
    let o = addr.octets();
    u64::from_be_bytes([0x02, 0x1d, 0xed, 0xff, o[0], o[1], o[2], o[3]])
}

/// The state one soft device shares between its engine and application threads.
struct Core {
    addr: Ipv4Addr,
    sock: UdpSock,
    wake: EventFd,
    stop: AtomicBool,
    epoch: std::time::Instant,
    caps: ChecksumCapabilities,
    active_mtu: Mtu,
    spin: Duration,
    mrs: RwLock<MrTable>,
    qps: RwLock<HashMap<u32, Arc<QpCell>>>,
    next_qpn: Mutex<u32>,
    next_pd: AtomicU32,
    live_pds: AtomicU32,
    live_cqs: AtomicU32,
    timers: Timers,
    /// The receive path, taken by the engine or by a polling application thread.
    rx: Mutex<RxState>,
    /// When an application thread last did the receive work itself (ns since epoch). While
    /// applications poll, the engine stops watching the socket, so it does not compete with them
    /// for the CPU on every datagram.
    app_polled: AtomicU64,
    /// Whether the engine sleeps leaving the socket to polling applications: an application
    /// thread that goes to sleep then wakes it ([`Core::app_sleeps`]).
    parked_for_app: AtomicBool,
    /// Whether polling threads may do the receive work.
    poll_rx: bool,
    /// Whether requests' payloads go to the socket straight from their memory regions (one
    /// iovec each) instead of being copied into the packets first.
    gather: bool,
    /// Whether an application thread's receive round held acknowledgements back (in `rx`'s
    /// batch). The engine sends them once applications stop polling ([`APP_POLL_GRACE_NS`]).
    tx_held: AtomicBool,
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

/// Device-memory regions with staged writes that nothing has reported as placed yet. They are
/// flushed before the device next emits anything (an acknowledgement or a completion reports
/// bytes as placed; a READ response stream emits nothing until its completion), so receiving
/// into device memory does not wait for copies at every batch.
#[cfg(feature = "gpu")]
#[derive(Default)]
struct UnplacedWrites {
    /// Whether `list` may be non-empty (cleared, under the lock, only after a flush finished).
    any: AtomicBool,
    list: Mutex<Vec<Arc<crate::gpu::stage::Stager>>>,
}

#[cfg(feature = "gpu")]
impl UnplacedWrites {
    fn add(&self, st: &Arc<crate::gpu::stage::Stager>) {
        let mut list = lock(&self.list);
        if !list.iter().any(|d| Arc::ptr_eq(d, st)) {
            list.push(st.clone());
        }
        self.any.store(true, Ordering::Release);
    }

    /// Waits until every staged write is in device memory. Holding the lock while flushing
    /// makes any other thread about to emit output wait for the same flush.
    fn place(&self) {
        if !self.any.load(Ordering::Acquire) {
            return;
        }
        let mut list = lock(&self.list);
        for st in list.drain(..) {
            if let Err(e) = st.flush() {
                // The region is now unusable: later accesses fail and the peer sees errors.
                eprintln!("erdma soft device: GPU region write failed: {e}");
            }
        }
        self.any.store(false, Ordering::Release);
    }

    /// Drops a region being deregistered (its memory is about to go).
    fn remove(&self, key: &Arc<crate::gpu::stage::Stager>) {
        lock(&self.list).retain(|d| !Arc::ptr_eq(d, key));
    }
}

/// One queue pair.
struct QpCell {
    qpn: u32,
    proto: Mutex<proto::Qp>,
    send_cq: Arc<CompletionRing>,
    recv_cq: Arc<CompletionRing>,
    /// Where the queue pair's asynchronous events go: its context's queue.
    events: Arc<dyn EventSink>,
    /// The deadline already in the timer heap (ns), `u64::MAX` for none.
    scheduled: AtomicU64,
    /// The transmit batch ([`TxState::id`]) holding this queue pair's requests or responses
    /// not yet handed to the kernel, 0 for none. While one batch holds some, no other batch
    /// takes more of them: the packets of a queue pair reach the wire in PSN order whichever
    /// threads emit them (a thread's batch leaves after it released the queue pair's lock; a
    /// later packet sent first by another thread would reach the peer out of sequence and cost
    /// a NAK and a go-back-N retry). [`GONE`] once the queue pair is destroyed: then no batch
    /// sends for it any more. Read and written under the queue pair's lock.
    tx_owner: AtomicU64,
    /// Whether a thread found packets to emit while another batch owned the queue pair: the
    /// owner emits them when it releases it ([`Core::release`]).
    tx_wanted: AtomicBool,
}

/// Memory as the protocol sees it: the region table, read-locked for the duration of one batch.
///
/// Lending: with [`Core::gather`], a request's payload is not copied into its packet; the packet
/// is committed to the transmit batch with the payload's address ([`TxBatch::commit_lent`]) and
/// the kernel reads the bytes from the region when the batch is sent. A region stays registered
/// only while the table is read-locked, so every scope that holds this lock and makes progress
/// into a batch sends that batch, or copies the lent payloads into it ([`TxBatch::own_lent`]),
/// before it lets the lock go: `with_app_tx`, `feed`, `fire_timers` and `release`.
struct DevMemory<'a> {
    table: &'a MrTable,
    /// Whether to accept [`proto::Memory::lend`] offers.
    gather: bool,
    /// The payload the protocol accepted to lend for the packet it is writing: address, bytes.
    lent: Option<(u64, usize)>,
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
            handle: key as u64,
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
    ) -> std::result::Result<(), proto::MemoryError> {
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
        memory::read(r, offset, dst)
            .then_some(())
            .ok_or(proto::MemoryError)
    }

    fn write(
        &mut self,
        region: &proto::Region,
        offset: u64,
        src: &[u8],
    ) -> std::result::Result<(), proto::MemoryError> {
        let r = self.live(region)?;
        let written = memory::write(r, offset, src);
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
    ) -> std::result::Result<u64, proto::MemoryError> {
        let r = self.live(region)?;
        let op = match op {
            proto::AtomicOp::CompareSwap { compare, swap } => {
                memory::AtomicOp::CompareSwap { compare, swap }
            }
            proto::AtomicOp::FetchAdd { add } => memory::AtomicOp::FetchAdd { add },
        };
        memory::atomic(r, offset, op).ok_or(proto::MemoryError)
    }

    /// Regions registered with `reg_mr` cannot be invalidated by a peer: IBTA reserves remote
    /// invalidation for memory windows and fast-registered regions, which this device does not
    /// have, and rxe refuses it the same way (the receive completes with `REM_INV_REQ_ERR`).
    fn invalidate(
        &mut self,
        region: &proto::Region,
    ) -> std::result::Result<(), proto::MemoryError> {
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
        #[cfg(feature = "gpu")]
        if r.kind.stager().is_some() {
            return false;
        }
        if len == 0 || offset.checked_add(len as u64).is_none_or(|end| end > r.len) {
            return false;
        }
        self.lent = Some((r.addr + offset, len));
        true
    }

    fn hash_lent(&mut self, hasher: &mut crc32fast::Hasher) {
        if let Some((addr, len)) = self.lent {
            // `lend` checked that `[addr, addr+len)` lies inside a live host region, and the
            // region stays registered (its memory allocated) while this table borrow lives. The
            // bytes are a posted request's source, which the application leaves alone until the
            // request completes; reading them is what the copy it replaces would do.
            // SAFETY: `len` readable bytes at `addr`, unchanged while borrowed (above).
            let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
            hasher.update(bytes);
        }
    }
}

impl<'a> DevMemory<'a> {
    fn new(table: &'a MrTable, core: &'a Core) -> DevMemory<'a> {
        DevMemory {
            table,
            gather: core.gather,
            lent: None,
            #[cfg(feature = "gpu")]
            unplaced: &core.unplaced,
            #[cfg(feature = "gpu")]
            qpn: None,
        }
    }

    /// Tells a device-memory region that queue pair `qpn` is about to read `[addr, addr+len)`
    /// of the region with `key`: a request reading it was posted, or (`read_request`) a READ
    /// request for it arrived.
    #[cfg(feature = "gpu")]
    fn expect_read(&self, qpn: u32, key: u32, addr: u64, len: u64, read_request: bool) {
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
    fn forget_qp(&self, qpn: u32) {
        #[cfg(feature = "gpu")]
        for r in self.table.regions() {
            if let Some(st) = r.kind.stager() {
                st.forget(qpn);
            }
        }
        let _ = qpn;
    }

    /// The payload lent for the packet just written, if any (forgotten here).
    fn take_lent(&mut self) -> Option<(u64, usize)> {
        self.lent.take()
    }

    /// The table's record for a region the protocol resolved, checked to be the same region.
    fn live(&self, region: &proto::Region) -> std::result::Result<&'a Region, proto::MemoryError> {
        let table: &'a MrTable = self.table;
        match table.get(region.key) {
            Some(r) if r.addr == region.iova && r.len == region.len && r.pd == region.pd => Ok(r),
            _ => Err(proto::MemoryError),
        }
    }
}

/// Per-thread transmit state for application threads making progress inline.
struct TxState {
    batch: TxBatch,
    solver: Ipv4IdSolver,
    /// Whether every packet in `batch` answers a peer's request (ACK, NAK, atomic ACK).
    answers_only: bool,
    /// This batch's identity for [`QpCell::tx_owner`] (never 0).
    id: u64,
    /// The queue pairs whose packets `batch` holds (it owns them until [`Core::release`]).
    owned: Vec<Arc<QpCell>>,
}

/// [`QpCell::tx_owner`] of a destroyed queue pair (no [`TxState::id`] reaches it).
const GONE: u64 = u64::MAX;

impl TxState {
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

    fn new(batch: TxBatch) -> TxState {
        // Plain std atomics: an identity counter, outside any model.
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        TxState {
            batch,
            solver: Ipv4IdSolver::new(),
            answers_only: true,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            owned: Vec::new(),
        }
    }
}

/// An application thread's transmit state.
struct AppTx {
    tx: TxState,
    /// The device whose packets `tx.batch` holds back while the thread coalesces sends
    /// ([`coalesce_sends`]); `None` when the batch is empty.
    deferred: Option<Arc<Core>>,
}

impl AppTx {
    /// See [`TxState::discard_stale_lent`]; a batch discarded had nothing left to defer.
    fn discard_stale_lent(&mut self) {
        if self.tx.discard_stale_lent() {
            self.deferred = None;
        }
    }
}

thread_local! {
    static APP_TX: RefCell<Option<AppTx>> = const { RefCell::new(None) };
    /// Nesting depth of [`coalesce_sends`] on this thread.
    static COALESCING: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f`; packets that application calls inside it make sendable on a soft device wait and
/// leave together when the outermost call returns (or unwinds), or earlier when the thread's
/// batch fills up or a call on another soft device needs it. Packets of different queue pairs
/// to one peer then share GSO messages (see [`TxBatch`]).
pub(crate) fn coalesce_sends<R>(f: impl FnOnce() -> R) -> R {
    struct Depth;
    impl Drop for Depth {
        fn drop(&mut self) {
            let depth = COALESCING.with(|d| {
                d.set(d.get() - 1);
                d.get()
            });
            if depth == 0 {
                send_deferred();
            }
        }
    }
    COALESCING.with(|d| d.set(d.get() + 1));
    let _depth = Depth;
    f()
}

/// Sends what this thread's batch holds back, then what the device's receive rounds held.
fn send_deferred() {
    let core = APP_TX.with(|cell| {
        let mut slot = cell.borrow_mut();
        let app = slot.as_mut()?;
        app.discard_stale_lent();
        let core = app.deferred.take()?;
        core.flush_app(&mut app.tx.batch);
        core.release(&mut app.tx);
        Some(core)
    });
    if let Some(core) = core {
        core.flush_held();
    }
}

impl Core {
    fn now(&self) -> proto::Instant {
        proto::Instant::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }

    fn new_tx(&self) -> TxState {
        TxState::new(TxBatch::new(1 << 18, proto::MAX_DATAGRAM, self.sock.gso()))
    }

    /// Runs `f` with the region table read-locked and a transmit batch, then sends what was
    /// queued (unless the thread coalesces sends: then it stays queued). For application
    /// threads.
    fn with_app_tx<R>(
        self: &Arc<Core>,
        f: impl FnOnce(&mut DevMemory<'_>, &mut TxState) -> R,
    ) -> R {
        let (out, sent) = APP_TX.with(|cell| {
            let mut slot = cell.borrow_mut();
            let app = slot.get_or_insert_with(|| AppTx {
                tx: self.new_tx(),
                deferred: None,
            });
            app.discard_stale_lent();
            // The batch is this device's from here on: another device's packets go first.
            if let Some(other) = app.deferred.take_if(|c| !Arc::ptr_eq(c, self)) {
                other.flush(&mut app.tx.batch);
                other.release(&mut app.tx);
            }
            let tx = &mut app.tx;
            let before = tx.batch.sent();
            let out = self.with_memory(|mem| {
                let out = f(mem, tx);
                // What stays queued (the thread coalesces sends) outlives the table lock.
                tx.batch.own_lent();
                out
            });
            // Also when a full batch went out midway and nothing followed: the queue pairs it
            // took stay owned until `send_deferred` releases them.
            if !tx.batch.is_empty() || !tx.owned.is_empty() {
                app.deferred = Some(self.clone());
            }
            (out, app.tx.batch.sent() != before)
        });
        // The answers the last receive round held back leave after this thread's own packets,
        // off the path of the request the peer is waiting for. A call that sent nothing (a
        // receive re-posted before the reply is sent) leaves them held for the next call.
        if sent {
            self.flush_held();
        }
        out
    }

    /// Sends what an application thread's receive round held back, if anything. When another
    /// thread has the receive path, that thread sends it (every round starts by doing so).
    fn flush_held(&self) {
        if self.tx_held.load(Ordering::Relaxed) {
            self.send_held(false);
        }
    }

    /// Sends whatever the receive path's batch holds. With `wait`, waits for the receive path
    /// if another thread has it; without, leaves the batch to that thread.
    fn send_held(&self, wait: bool) {
        let mut st = match self.rx.try_lock() {
            Ok(st) => st,
            Err(_) if wait => lock(&self.rx),
            Err(_) => return,
        };
        // A held batch carries answers only, so it owns no queue pair (see `service`).
        debug_assert!(st.tx.owned.is_empty());
        st.tx.discard_stale_lent();
        self.flush(&mut st.tx.batch);
        self.tx_held.store(false, Ordering::Relaxed);
    }

    /// Runs `f` with the region table read-locked.
    fn with_memory<R>(&self, f: impl FnOnce(&mut DevMemory<'_>) -> R) -> R {
        let table = self.mrs.read().unwrap_or_else(|e| e.into_inner());
        f(&mut DevMemory::new(&table, self))
    }

    /// Drains a queue pair's transmits into `tx`, its completions into its rings, and schedules
    /// its next deadline. The caller holds the queue pair's lock (`q`).
    fn progress(
        &self,
        cell: &Arc<QpCell>,
        q: &mut proto::Qp,
        mem: &mut DevMemory<'_>,
        tx: &mut TxState,
        now: proto::Instant,
    ) {
        #[cfg(feature = "gpu")]
        {
            mem.qpn = Some(cell.qpn);
        }
        // Whatever this emits may report bytes as placed: staged device-memory writes go first.
        #[cfg(feature = "gpu")]
        let mut placed = false;
        #[cfg_attr(not(feature = "gpu"), allow(unused_mut))]
        let mut place = || {
            #[cfg(feature = "gpu")]
            if !placed {
                self.unplaced.place();
                placed = true;
            }
        };
        // Another batch holds packets of this queue pair not yet sent: leave what is to be sent
        // now to that batch's owner, who sends it right behind them (see `QpCell::tx_owner`).
        let owner = cell.tx_owner.load(Ordering::Relaxed);
        let may_send = owner == 0 || owner == tx.id;
        let mut owns = owner == tx.id;
        if !may_send {
            cell.tx_wanted.store(true, Ordering::Relaxed);
        }
        let mut budget = TX_BUDGET;
        loop {
            if !may_send {
                break;
            }
            if budget == 0 {
                // More to send (a long READ reply): the rest goes a budget at a time, in later
                // rounds, taking turns with what the device receives and its other queue pairs.
                self.schedule(cell, now.as_nanos());
                break;
            }
            budget -= 1;
            if tx.batch.is_full() {
                self.flush(&mut tx.batch);
            }
            let sent = q.poll_transmit(now, tx.batch.space(), mem);
            let lent = mem.take_lent();
            // Space taken but not committed is simply reused by the next packet.
            let Some(t) = sent else {
                break;
            };
            let lent = match (t.lent, lent) {
                (None, _) => None,
                (Some(l), Some((addr, len))) if len == l.len => Some(LentBytes {
                    at: l.at,
                    len,
                    addr,
                }),
                (Some(_), _) => {
                    debug_assert!(false, "a packet names a lent payload that was not lent");
                    continue;
                }
            };
            place();
            let dst = match t.dst {
                SocketAddr::V4(v4) => v4,
                SocketAddr::V6(_) => continue,
            };
            if tx.batch.is_empty() {
                tx.answers_only = true;
            }
            let opcode = Opcode::from(tx.batch.pending_mut()[0]);
            let answer = matches!(opcode, Opcode::Acknowledge | Opcode::AtomicAcknowledge);
            tx.answers_only &= answer;
            // Requests and READ responses must keep their order on the wire: this batch owns
            // the queue pair until it has been sent. (A stale acknowledgement overtaken by a
            // newer one is only ignored by the peer, and held-back batches carry nothing else.)
            if !answer && !owns {
                owns = true;
                cell.tx_owner.store(tx.id, Ordering::Relaxed);
                tx.owned.push(cell.clone());
            }
            let out = Outgoing {
                len: t.len,
                dst,
                flow: cell.qpn,
                middle: opcode.has(OpFlags::MIDDLE),
            };
            let at = tx.batch.place(out);
            let k = at.segment_index();
            if k > 0 && self.caps.icrc.tx() {
                // The kernel numbers GSO segment k with IPv4 identification k, which the ICRC
                // covers: move the ICRC computed for identification 0 to identification k.
                let pkt = &mut tx.batch.pending_mut()[..t.len];
                if let Some(v) = icrc::read(pkt).and_then(|c| tx.solver.adjust(c, k, t.len)) {
                    pkt[t.len - 4..].copy_from_slice(&v.to_le_bytes());
                }
            }
            match lent {
                // The payload lies in a live region (checked by `DevMemory::lend`), outside the
                // batch, and stays registered while `mem`'s table lock is held; every caller of
                // `progress` sends the batch or copies lent payloads into it before it releases
                // that lock (see `DevMemory`).
                // SAFETY: `commit_lent`'s contract holds (above).
                Some(l) => unsafe { tx.batch.commit_lent(at, l) },
                None => tx.batch.commit(at),
            }
        }
        let mut overrun = false;
        while let Some(c) = q.poll_completion() {
            place();
            let ring = match c.queue() {
                WorkQueue::Send => &cell.send_cq,
                WorkQueue::Recv => &cell.recv_cq,
            };
            if !ring.push(c) {
                overrun = true;
            }
        }
        if let Some(e) = q.take_async_error() {
            let kind = match e {
                proto::QpAsyncError::InvalidRequest => AsyncEventKind::QpReqErr,
                proto::QpAsyncError::AccessViolation => AsyncEventKind::QpAccessErr,
                proto::QpAsyncError::Catastrophic => AsyncEventKind::QpFatal,
            };
            cell.events
                .report(AsyncEvent::new(kind, EventElement::Qp(cell.qpn)));
        }
        if overrun && q.state() != QpState::Err {
            // A completion queue overran: like hardware, the queue pair is moved to error.
            let _ = q.modify(&QpAttr::to_state(QpState::Err));
            while let Some(c) = q.poll_completion() {
                let ring = match c.queue() {
                    WorkQueue::Send => &cell.send_cq,
                    WorkQueue::Recv => &cell.recv_cq,
                };
                ring.push(c);
            }
        }
        if let Some(deadline) = q.poll_timeout() {
            self.schedule(cell, deadline.as_nanos());
        }
    }

    /// Ends an application call: sends what it queued, still under the queue pair's lock (so
    /// two threads posting to one queue pair cannot reorder its packets), unless the thread
    /// coalesces sends.
    fn end_call(&self, tx: &mut TxState) {
        if COALESCING.with(|d| d.get() == 0) {
            self.flush_app(&mut tx.batch);
            // Sent under the lock of the only queue pair this call emitted for: no other
            // thread can have looked at its ownership meanwhile.
            for cell in tx.owned.drain(..) {
                cell.tx_owner.store(0, Ordering::Relaxed);
            }
        }
    }

    /// After `tx`'s batch has been sent, gives back the queue pairs it owned, and sends what
    /// other threads left to it for them meanwhile, each under its queue pair's lock (so that
    /// it stays ahead of whatever they emit next). The caller holds no queue pair's lock.
    fn release(&self, tx: &mut TxState) {
        if tx.owned.is_empty() {
            return;
        }
        let owned = std::mem::take(&mut tx.owned);
        self.with_memory(|mem| {
            for cell in &owned {
                let mut q = lock(&cell.proto);
                // A queue pair destroyed meanwhile is `GONE`: it stays so and sends nothing.
                if cell.tx_owner.load(Ordering::Relaxed) != tx.id {
                    continue;
                }
                cell.tx_owner.store(0, Ordering::Relaxed);
                if cell.tx_wanted.swap(false, Ordering::Relaxed) {
                    self.progress(cell, &mut q, mem, tx, self.now());
                    self.flush(&mut tx.batch);
                    for c in tx.owned.drain(..) {
                        c.tx_owner.store(0, Ordering::Relaxed);
                    }
                }
            }
            // Each `progress` above was sent at once; this only keeps the rule local.
            tx.batch.own_lent();
        });
        // Keep the allocation.
        tx.owned = owned;
        tx.owned.clear();
    }

    /// Sends an application call's packets and, in the same system call, behind them, what
    /// its last receive round held back (when no other thread has the receive path; else
    /// that thread sends it). Answering a request then costs one `sendmmsg`, not two.
    fn flush_app(&self, batch: &mut TxBatch) {
        if batch.is_empty() {
            return;
        }
        if self.tx_held.load(Ordering::Relaxed)
            && let Ok(mut st) = self.rx.try_lock()
        {
            self.tx_held.store(false, Ordering::Relaxed);
            debug_assert!(st.tx.owned.is_empty());
            if let Err(e) = self.sock.send_batches(&mut [batch, &mut st.tx.batch]) {
                eprintln!("erdma soft device {}: send failed: {e}", self.addr);
            }
            return;
        }
        self.flush(batch);
    }

    fn flush(&self, batch: &mut TxBatch) {
        if batch.is_empty() {
            return;
        }
        if let Err(e) = self.sock.send_batch(batch) {
            // The protocol recovers lost packets; a broken socket shows as retries exhausted.
            eprintln!("erdma soft device {}: send failed: {e}", self.addr);
        }
    }

    /// Puts a queue pair's deadline in the timer heap and wakes the engine if it would sleep
    /// past it.
    fn schedule(&self, cell: &QpCell, deadline: u64) {
        let prev = cell.scheduled.load(Ordering::Acquire);
        if prev <= deadline {
            return;
        }
        cell.scheduled.store(deadline, Ordering::Release);
        if self.timers.schedule(deadline, cell.qpn) {
            self.wake.signal();
        }
    }

    fn qp(&self, qpn: u32) -> Option<Arc<QpCell>> {
        self.qps
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&qpn)
            .cloned()
    }
}

/// The engine thread: receive, feed, fire timers, transmit, sleep.
fn engine(core: Arc<Core>) {
    let mut idle_since: Option<std::time::Instant> = None;
    while !core.stop.load(Ordering::Acquire) {
        // While an application thread polls, its receive rounds do this thread's work
        // (datagrams and due timers): only watch for the polling to stop, without taking the
        // receive path from under it (blocking on its lock would make the application's next
        // unlock wake this thread, on the application's latency path).
        if core.app_polling(core.now().as_nanos()).is_some() {
            idle_since = None;
            sleep(&core);
            continue;
        }
        let worked = {
            let mut st = lock(&core.rx);
            core.service(&mut st, false, None)
        };
        if worked {
            idle_since = None;
            continue;
        }
        // Spin a while if asked, then sleep until a datagram, a deadline or a wake-up.
        let started = *idle_since.get_or_insert_with(std::time::Instant::now);
        if started.elapsed() < core.spin {
            std::hint::spin_loop();
            continue;
        }
        idle_since = None;
        sleep(&core);
    }
}

/// What receiving needs: the batch buffers, a transmit batch for the answers, scratch.
struct RxState {
    rx: RxBatch,
    tx: TxState,
    touched: Vec<Arc<QpCell>>,
    /// Timers due in this round (kept to reuse its allocation).
    due: Vec<(u64, u32)>,
    /// Whether the last application round received nothing.
    app_dry: bool,
}

impl Core {
    /// One round of the device's work: receive and feed every queued datagram, fire due timers,
    /// send. Returns whether anything happened. The caller holds the receive lock (`st`).
    ///
    /// `started`: the time the caller read just before (one clock read less per empty round of
    /// a polling thread); due timers are judged by it unless datagrams came.
    fn service(&self, st: &mut RxState, from_app: bool, started: Option<proto::Instant>) -> bool {
        // Whatever an application round held back goes first (answers only: it owns no queue
        // pair).
        debug_assert!(st.tx.owned.is_empty());
        st.tx.discard_stale_lent();
        self.flush(&mut st.tx.batch);
        let mut worked = false;
        // After a round that found nothing, an application's round takes one message and
        // returns: the datagram a ping-pong waits for then comes back without the kernel
        // trying a second slot first. Rounds that find data take whole batches.
        let narrow = from_app && st.app_dry;
        let want = if narrow { 1 } else { st.rx.slots() };
        loop {
            let n = match self.sock.recv_batch_up_to(&mut st.rx, want) {
                Ok(n) => n,
                Err(e) => {
                    eprintln!("erdma soft device {}: receive failed: {e}", self.addr);
                    0
                }
            };
            if n == 0 {
                break;
            }
            worked = true;
            feed(self, &st.rx, &mut st.tx, &mut st.touched);
            if narrow || st.rx.messages() < want {
                break;
            }
        }
        if from_app {
            st.app_dry = !worked;
        }
        let now = match started {
            Some(t) if !worked => t,
            _ => self.now(),
        };
        worked |= fire_timers(self, &mut st.tx, &mut st.due, now);
        if from_app && !st.tx.batch.is_empty() && st.tx.answers_only && st.tx.owned.is_empty() {
            // An application thread is waiting for what it just received: let it go now and
            // send the acknowledgements after whatever its next call sends, so that a request
            // the peer waits for does not queue behind them. They leave on every path the
            // thread can stop by: its next poll, arming a completion queue, destroying a queue
            // pair, closing the device, process exit, or the engine once calls stop coming
            // (see `sleep`). Anything else (data, READ responses) leaves now.
            self.tx_held.store(true, Ordering::Relaxed);
        } else {
            self.flush(&mut st.tx.batch);
            self.release(&mut st.tx);
            self.tx_held.store(false, Ordering::Relaxed);
        }
        worked
    }

    /// Lets a polling application thread do the device's receive work itself when the engine is
    /// not already doing it: a busy-polling application then never waits for the engine thread
    /// to be scheduled. Returns whether anything happened.
    ///
    /// `polling`: whether the thread goes on polling after this (it has not armed its
    /// completion queue to sleep); only then does the engine keep off the receive path.
    fn try_service(&self, polling: bool) -> bool {
        if !self.poll_rx {
            return false;
        }
        match self.rx.try_lock() {
            Ok(mut st) => {
                let now = self.now();
                if polling {
                    self.app_polled.store(now.as_nanos(), Ordering::Relaxed);
                }
                self.service(&mut st, true, Some(now))
            }
            Err(_) => false,
        }
    }

    /// An application thread stops polling to sleep on a completion queue: the engine takes the
    /// receive path and the timers back now, not at its next look (up to
    /// [`APP_POLL_GRACE_NS`] later, with datagrams waiting meanwhile).
    fn app_sleeps(&self) {
        // Pairs with `sleep`: the engine publishes that it parks, then reads `app_polled`; here
        // `app_polled` is cleared, then the parking read. One of the two sees the other.
        self.app_polled.store(0, Ordering::SeqCst);
        if self.parked_for_app.load(Ordering::SeqCst) {
            self.wake.signal();
        }
    }

    /// When an application thread did receive work within the last `APP_POLL_GRACE_NS` (so it
    /// is taken to be polling still): the time at which that stops being so. `None` otherwise.
    fn app_polling(&self, now: u64) -> Option<u64> {
        let polled = self.app_polled.load(Ordering::SeqCst);
        let recheck = polled.saturating_add(APP_POLL_GRACE_NS);
        (polled != 0 && now < recheck).then_some(recheck)
    }
}

/// Validates and routes one batch of datagrams, then lets each queue pair it touched make
/// progress once (so several AckReq packets are answered by one coalesced ACK).
fn feed(core: &Core, rx: &RxBatch, tx: &mut TxState, touched: &mut Vec<Arc<QpCell>>) {
    let now = core.now();
    let table = core.mrs.read().unwrap_or_else(|e| e.into_inner());
    let mut mem = DevMemory::new(&table, core);
    touched.clear();
    let local = IpAddr::V4(core.addr);
    core.rcvd_datagrams
        .fetch_add(rx.datagrams().len() as u64, Ordering::Relaxed);
    {
        let qps = core.qps.read().unwrap_or_else(|e| e.into_inner());
        let mut drops = lock(&core.drops);
        for d in rx.datagrams() {
            let data = rx.data(d);
            let meta = proto::RxMeta {
                src: IpAddr::V4(*d.src.ip()),
                src_port: d.src.port(),
                dst: local,
                dst_port: ROCE_PORT,
                ipv4_id: None,
            };
            let view = match proto::validate(data, &meta, &core.caps, &mut tx.solver) {
                Ok(v) => v,
                Err(why) => {
                    drops.count(why);
                    continue;
                }
            };
            let Some(cell) = qps.get(&view.dest_qpn()) else {
                drops.count(proto::DropReason::UnknownQp);
                continue;
            };
            #[cfg(feature = "gpu")]
            {
                mem.qpn = Some(cell.qpn);
                if view.opcode() == Opcode::ReadRequest
                    && let Some(reth) = view.reth()
                {
                    mem.expect_read(cell.qpn, reth.rkey, reth.va, reth.dma_len as u64, true);
                }
            }
            let mut q = lock(&cell.proto);
            // A rejected packet is counted in the queue pair's own counters.
            let _ = q.handle_packet(now, meta.src, &view, &mut mem);
            drop(q);
            if !touched.iter().any(|c| c.qpn == cell.qpn) {
                touched.push(cell.clone());
            }
        }
    }
    for cell in touched.iter() {
        let mut q = lock(&cell.proto);
        core.progress(cell, &mut q, &mut mem, tx, now);
    }
    // Requests the acknowledgements let go read their regions: they leave under the lock.
    if tx.batch.has_lent() {
        core.flush(&mut tx.batch);
    }
}

/// Runs the timers due now. Returns whether any fired.
fn fire_timers(
    core: &Core,
    tx: &mut TxState,
    due: &mut Vec<(u64, u32)>,
    now: proto::Instant,
) -> bool {
    due.clear();
    core.timers.take_due(now.as_nanos(), due);
    if due.is_empty() {
        return false;
    }
    let table = core.mrs.read().unwrap_or_else(|e| e.into_inner());
    let mut mem = DevMemory::new(&table, core);
    for &(at, qpn) in due.iter() {
        let Some(cell) = core.qp(qpn) else { continue };
        let mut q = lock(&cell.proto);
        // This heap entry is consumed; forget it so the next deadline gets scheduled.
        let _ = cell
            .scheduled
            .compare_exchange(at, u64::MAX, Ordering::AcqRel, Ordering::Acquire);
        q.handle_timeout(now);
        core.progress(&cell, &mut q, &mut mem, tx, now);
    }
    core.flush(&mut tx.batch);
    drop(table);
    core.release(tx);
    true
}

/// Sleeps until a datagram arrives, a wake-up is signalled, or the next timer is due.
fn sleep(core: &Core) {
    let now = core.now().as_nanos();
    if core.stop.load(Ordering::Acquire) {
        return;
    }
    // An application is polling: leave the socket and the timers to it (its rounds fire due
    // timers), and look again when it may have stopped. The published plan stays "running", so
    // no one signals this thread for a deadline meanwhile; a deadline that falls due after the
    // application's last round fires at the recheck, at most `APP_POLL_GRACE_NS` late.
    let mut app_recheck = core.app_polling(now);
    if app_recheck.is_some() {
        // Published before the second look, so that an application going to sleep now either
        // is seen here or sees this and wakes the engine (`Core::app_sleeps`).
        core.parked_for_app.store(true, Ordering::SeqCst);
        app_recheck = core.app_polling(now);
        if app_recheck.is_none() {
            core.parked_for_app.store(false, Ordering::Relaxed);
            return;
        }
    }
    let until = match app_recheck {
        Some(recheck) => Some(recheck),
        None => {
            let until = match core.timers.prepare_sleep(now) {
                Sleep::No => return,
                Sleep::Until(at) => at,
            };
            if core.stop.load(Ordering::Acquire) {
                core.timers.awake();
                return;
            }
            // Packets an application's receive round held back go out with its next call; if it
            // has stopped calling, the engine sends them now.
            if core.tx_held.load(Ordering::Relaxed) {
                core.timers.awake();
                return;
            }
            until
        }
    };
    let app_active = app_recheck.is_some();
    let timeout = until.map(|n| Duration::from_nanos(n.saturating_sub(now)));
    let mut fds = [
        libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&core.wake),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: core.sock.raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let nfds = if app_active { 1 } else { 2 };
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `nfds` valid pollfds; `tsp` is null or points at a live timespec.
    unsafe { libc::ppoll(fds.as_mut_ptr(), nfds, tsp, std::ptr::null()) };
    core.parked_for_app.store(false, Ordering::Relaxed);
    core.timers.awake();
    if fds[0].revents & libc::POLLIN != 0 {
        core.wake.consume();
    }
}

/// Packets one queue pair emits per [`Core::progress`] call. A requester never has more than
/// its window in flight; a responder's READ reply can be millions of packets, and streaming it
/// whole in one call would hold the queue pair's lock, the memory-region table and the device's
/// receive path for all of it.
const TX_BUDGET: usize = 256;

/// How long after an application thread's last receive work the engine keeps off the socket.
const APP_POLL_GRACE_NS: u64 = 1_000_000;

fn post_error(verb: &'static str, e: proto::PostError) -> Error {
    match e {
        proto::PostError::QueueFull { depth } => Error::QueueFull {
            queue: if verb == "post_recv" {
                WorkQueue::Recv
            } else {
                WorkQueue::Send
            },
            depth,
        },
        other => Error::Verb {
            verb,
            source: io::Error::new(io::ErrorKind::InvalidInput, other.to_string()),
        },
    }
}

// ---------------------------------------------------------------------------------------------
// Provider glue.

/// An open soft device.
pub(crate) struct SoftCtx {
    dev: Arc<Device>,
}

impl SoftCtx {
    pub(crate) fn open(addr: Ipv4Addr) -> Result<SoftCtx> {
        Ok(SoftCtx {
            dev: open_device(addr)?,
        })
    }

    fn core(&self) -> &Arc<Core> {
        &self.dev.core
    }

    pub(crate) fn query_device(&self) -> DeviceAttr {
        let guid = node_guid(self.core().addr);
        DeviceAttr {
            fw_ver: format!("soft-{}", env!("CARGO_PKG_VERSION")),
            node_guid: guid,
            sys_image_guid: guid,
            max_mr_size: caps::MAX_MR_SIZE,
            page_size_cap: caps::PAGE_SIZE_CAP,
            vendor_id: crate::limits::ERDMA_VENDOR_ID,
            vendor_part_id: crate::limits::ERDMA_PART_ID,
            hw_ver: 0,
            max_qp: caps::MAX_QP,
            max_qp_wr: caps::MAX_QP_WR,
            device_cap_flags: 0,
            max_sge: proto::MAX_SGE as u32,
            max_sge_rd: 1,
            max_cq: caps::MAX_CQ,
            max_cqe: caps::MAX_CQE,
            max_mr: caps::MAX_MR,
            max_pd: caps::MAX_PD,
            max_qp_rd_atom: proto::MAX_RD_ATOMIC as u32,
            max_qp_init_rd_atom: proto::MAX_RD_ATOMIC as u32,
            atomic_cap: AtomicCap::Global,
            max_srq: 0,
            max_mw: 0,
            max_ah: 0,
            phys_port_cnt: 1,
        }
    }

    pub(crate) fn query_port(&self) -> PortAttr {
        PortAttr {
            state: PortState::Active,
            max_mtu: Mtu::Mtu4096,
            active_mtu: self.core().active_mtu,
            gid_tbl_len: caps::GID_TABLE_LEN,
            port_cap_flags: 0,
            max_msg_sz: caps::MAX_MSG,
            lid: 0,
            link_layer: LinkLayer::Ethernet,
            active_width: 1,
            active_speed: 0,
        }
    }

    /// Index 0: a link-local GID made from the address (as RoCE devices put `fe80::` first);
    /// index 1: the IPv4-mapped GID every peer uses.
    pub(crate) fn gid_table(&self) -> Vec<GidEntry> {
        let o = self.core().addr.octets();
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        ll[8..12].copy_from_slice(&[0x02, 0x1d, 0xed, 0xff]);
        ll[12..].copy_from_slice(&o);
        vec![
            GidEntry {
                index: 0,
                gid: Gid(ll),
                gid_type: GidType::RoceV2,
            },
            GidEntry {
                index: 1,
                gid: Gid::from_ipv4(self.core().addr),
                gid_type: GidType::RoceV2,
            },
        ]
    }

    /// The port's counters: every queue pair's, destroyed ones included, and the device's own
    /// (datagrams received, drops before routing). See [`crate::device::counter`].
    pub(crate) fn port_counters(&self) -> PortCounters {
        use crate::device::counter as c;
        let core = self.core();
        let mut total = {
            // Held while the live queue pairs are read, so none moves to it meanwhile.
            let retired = lock(&core.retired);
            let cells: Vec<Arc<QpCell>> = core
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
        total.drops.add(&lock(&core.drops));
        let mut pairs: Vec<(String, u64)> = [
            (c::SENT_PKTS, total.packets_sent),
            (c::RCVD_PKTS, total.packets_received),
            (c::DUPLICATE_REQUEST, total.duplicates),
            (c::OUT_OF_SEQ_REQUEST, total.out_of_sequence),
            (c::RCVD_RNR_ERR, total.rnr_naks_received),
            (c::SEND_RNR_ERR, total.rnr_naks_sent),
            (c::COMPLETER_RETRY_ERR, total.retries),
            (c::RETRIES, total.retries),
            (c::RETRANSMITTED_PKTS, total.retransmits),
            (c::ACK_TIMEOUTS, total.timeouts),
            (c::ACKS_SENT, total.acks_sent),
            (c::NAKS_SENT, total.naks_sent),
            (c::NAKS_RCVD, total.naks_received),
            (
                c::RCVD_DATAGRAMS,
                core.rcvd_datagrams.load(Ordering::Relaxed),
            ),
            (c::DROPS, total.drops.total()),
            (c::SEND_REFUSED, core.sock.refused()),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_string(), v))
        .collect();
        if let Some(n) = core.sock.kernel_drops() {
            pairs.push((c::SOCKET_DROPS.to_string(), n));
        }
        pairs.extend(proto::DropReason::ALL.iter().map(|&r| {
            (
                format!("{}{}", c::DROP_PREFIX, r.name()),
                total.drops.get(r),
            )
        }));
        PortCounters::from_pairs(pairs)
    }

    pub(crate) fn alloc_pd(&self) -> Result<SoftPd> {
        let live = self.core().live_pds.fetch_add(1, Ordering::AcqRel);
        if live >= caps::MAX_PD {
            self.core().live_pds.fetch_sub(1, Ordering::AcqRel);
            return Err(too_many(Limit::MaxPd, live, caps::MAX_PD));
        }
        Ok(SoftPd {
            pdn: self.core().next_pd.fetch_add(1, Ordering::AcqRel),
        })
    }

    pub(crate) fn create_cq(
        &self,
        depth: u32,
        id: u64,
        events: &Arc<dyn EventSink>,
    ) -> Result<(SoftCq, u32)> {
        let live = self.core().live_cqs.fetch_add(1, Ordering::AcqRel);
        if live >= caps::MAX_CQ {
            self.core().live_cqs.fetch_sub(1, Ordering::AcqRel);
            return Err(too_many(Limit::MaxCq, live, caps::MAX_CQ));
        }
        let event = EventFd::new().map_err(|e| {
            self.core().live_cqs.fetch_sub(1, Ordering::AcqRel);
            Error::io("soft CQ: creating an eventfd", e)
        })?;
        Ok((
            SoftCq {
                ring: Arc::new(
                    CompletionRing::new(depth as usize, Some(event))
                        .with_report(events.clone(), id),
                ),
                core: self.dev.core.clone(),
                inline: AtomicBool::new(true),
            },
            depth,
        ))
    }
}

/// A protection domain.
pub(crate) struct SoftPd {
    pdn: u32,
}

impl SoftPd {
    pub(crate) fn dealloc(&self, ctx: &SoftCtx) {
        ctx.core().live_pds.fetch_sub(1, Ordering::AcqRel);
    }

    pub(crate) fn reg_mr(
        &self,
        ctx: &SoftCtx,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<(SoftMr, u32, u32)> {
        let mut table = ctx.core().mrs.write().unwrap_or_else(|e| e.into_inner());
        if table.len() >= caps::MAX_MR as usize {
            return Err(too_many(Limit::MaxMr, table.len() as u32, caps::MAX_MR));
        }
        let key = table
            .insert(self.pdn, addr as u64, len as u64, access)
            .ok_or_else(|| Error::Verb {
                verb: "ibv_reg_mr",
                source: io::Error::from_raw_os_error(libc::ENOMEM),
            })?;
        Ok((SoftMr { key }, key, key))
    }

    /// Registers device (GPU) memory at `addr`: the engine reaches it through `stager`.
    #[cfg(feature = "gpu")]
    pub(crate) fn reg_device_mr(
        &self,
        ctx: &SoftCtx,
        addr: u64,
        len: usize,
        access: Access,
        stager: Arc<crate::gpu::stage::Stager>,
    ) -> Result<(SoftMr, u32, u32)> {
        let mut table = ctx.core().mrs.write().unwrap_or_else(|e| e.into_inner());
        if table.len() >= 2 * caps::MAX_QP as usize {
            return Err(Error::Verb {
                verb: "ibv_reg_mr",
                source: io::Error::from_raw_os_error(libc::ENOMEM),
            });
        }
        let key = table
            .insert_kind(
                self.pdn,
                addr,
                len as u64,
                access,
                memory::RegionKind::Device(stager),
            )
            .ok_or_else(|| Error::Verb {
                verb: "ibv_reg_mr",
                source: io::Error::from_raw_os_error(libc::ENOMEM),
            })?;
        Ok((SoftMr { key }, key, key))
    }

    pub(crate) fn create_qp(
        &self,
        ctx: &SoftCtx,
        send_cq: &SoftCq,
        recv_cq: &SoftCq,
        caps: &QpCaps,
        sig_all: bool,
        events: &Arc<dyn EventSink>,
    ) -> Result<(SoftQp, u32, QpCaps)> {
        let core = ctx.core();
        let mut qps = core.qps.write().unwrap_or_else(|e| e.into_inner());
        if qps.len() >= caps::MAX_QP as usize {
            return Err(too_many(Limit::MaxQp, qps.len() as u32, caps::MAX_QP));
        }
        let qpn = {
            let mut next = lock(&core.next_qpn);
            loop {
                let n = *next;
                *next = if n >= 0xff_ffff { FIRST_QPN } else { n + 1 };
                if !qps.contains_key(&n) {
                    break n;
                }
            }
        };
        let mut cfg = proto::QpParams::new(self.pdn, IpAddr::V4(core.addr));
        cfg.caps = QpCaps {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_send_sge.min(proto::MAX_SGE as u32),
            max_recv_sge: caps.max_recv_sge.min(proto::MAX_SGE as u32),
            max_inline_data: caps.max_inline_data.min(proto::MAX_INLINE as u32),
        };
        cfg.sq_sig_all = sig_all;
        cfg.checksum = core.caps;
        let granted = cfg.caps;
        let cell = Arc::new(QpCell {
            qpn,
            proto: Mutex::new(proto::Qp::new(qpn, cfg)),
            send_cq: send_cq.ring.clone(),
            recv_cq: recv_cq.ring.clone(),
            events: events.clone(),
            scheduled: AtomicU64::new(u64::MAX),
            tx_owner: AtomicU64::new(0),
            tx_wanted: AtomicBool::new(false),
        });
        qps.insert(qpn, cell.clone());
        Ok((SoftQp { cell }, qpn, granted))
    }
}

/// A memory region.
pub(crate) struct SoftMr {
    key: u32,
}

impl SoftMr {
    pub(crate) fn deregister(&self, ctx: &SoftCtx) {
        // The write lock waits for any batch moving bytes; afterwards nothing reaches the memory.
        let mut table = ctx.core().mrs.write().unwrap_or_else(|e| e.into_inner());
        let region = table.remove(self.key);
        // A device-memory region's stager goes now too (its last copies finish as it drops),
        // before the memory behind it is freed.
        #[cfg(feature = "gpu")]
        if let Some(st) = region.as_ref().and_then(|r| r.kind.stager()) {
            ctx.core().unplaced.remove(st);
        }
        #[cfg(not(feature = "gpu"))]
        let _ = region;
    }
}

/// A completion queue.
pub(crate) struct SoftCq {
    ring: Arc<CompletionRing>,
    core: Arc<Core>,
    /// Whether a poll that finds the queue empty does the device's receive work itself
    /// ([`crate::Cq::set_inline_progress`]).
    inline: AtomicBool,
}

impl SoftCq {
    #[inline]
    pub(crate) fn poll(&self, out: &mut [crate::vocab::Completion]) -> Result<usize> {
        let mut n = self.ring.pop_into(out);
        if n == 0 && self.inline.load(Ordering::Relaxed) {
            // An armed queue's poll is the last look before its thread sleeps.
            if self.core.try_service(!self.ring.is_armed()) {
                n = self.ring.pop_into(out);
            }
        } else {
            // The thread is back for more: what its last receive round held back goes now
            // (a round would send it first), so a stream's ACKs do not wait while the thread
            // works through a full queue re-posting receives.
            self.core.flush_held();
        }
        if n == 0 && self.ring.take_overrun() {
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

    pub(crate) fn destroy(&self, ctx: &SoftCtx) {
        ctx.core().live_cqs.fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether polls that find the queue empty do the device's receive work (see
    /// [`crate::Cq::set_inline_progress`]). Turning it off hands the receive path back to the
    /// engine at once, as arming does (once: while it stays off, polls never take the path).
    pub(crate) fn set_inline(&self, on: bool) {
        if self.inline.swap(on, Ordering::Relaxed) && !on {
            self.core.flush_held();
            self.core.app_sleeps();
        }
    }

    pub(crate) fn inline(&self) -> bool {
        self.inline.load(Ordering::Relaxed)
    }

    pub(crate) fn arm(&self, solicited_only: bool) {
        // The application is about to sleep: what its last receive round held back goes now,
        // and the engine takes the receive path back.
        self.core.flush_held();
        self.ring.arm(solicited_only);
        self.core.app_sleeps();
    }

    pub(crate) fn event_fd(&self) -> std::os::fd::RawFd {
        self.ring
            .event()
            .map_or(-1, std::os::fd::AsRawFd::as_raw_fd)
    }

    pub(crate) fn consume_events(&self) -> u32 {
        self.ring.event().map_or(0, |e| e.consume() as u32)
    }
}

/// A queue pair.
pub(crate) struct SoftQp {
    cell: Arc<QpCell>,
}

impl SoftQp {
    pub(crate) fn state(&self) -> QpState {
        lock(&self.cell.proto).state()
    }

    pub(crate) fn modify(&self, ctx: &SoftCtx, a: &QpAttr) -> Result<()> {
        if let Some(av) = a.av
            && !av.dgid.is_ipv4_mapped()
        {
            return Err(Error::invalid(format!(
                "the soft device reaches peers over IPv4: GID {} is not IPv4-mapped",
                av.dgid
            )));
        }
        let core = ctx.core();
        core.with_app_tx(|mem, tx| {
            let mut q = lock(&self.cell.proto);
            q.modify(a).map_err(|e| Error::Verb {
                verb: "ibv_modify_qp",
                source: io::Error::new(io::ErrorKind::InvalidInput, e.to_string()),
            })?;
            if matches!(a.state, Some(QpState::Reset | QpState::Err)) {
                mem.forget_qp(self.cell.qpn);
            }
            core.progress(&self.cell, &mut q, mem, tx, core.now());
            core.end_call(tx);
            Ok(())
        })
    }

    pub(crate) fn post_send(&self, ctx: &SoftCtx, reqs: &[SendReq<'_>]) -> PostResult {
        let core = ctx.core();
        core.with_app_tx(|mem, tx| {
            let mut q = lock(&self.cell.proto);
            let mut result = Ok(());
            for (i, r) in reqs.iter().enumerate() {
                let wqe = match send_wqe(r) {
                    Ok(w) => w,
                    Err(e) => {
                        result = Err((i, e));
                        break;
                    }
                };
                if let Err(e) = q.post_send(wqe) {
                    result = Err((i, post_error("post_send", e)));
                    break;
                }
                // Device memory this request will read: announced once the request is posted.
                #[cfg(feature = "gpu")]
                if !r.flags.contains(SendFlags::INLINE) && !r.opcode.writes_local() {
                    for s in r.sges {
                        mem.expect_read(self.cell.qpn, s.lkey, s.addr, s.length as u64, false);
                    }
                }
            }
            core.progress(&self.cell, &mut q, mem, tx, core.now());
            core.end_call(tx);
            result
        })
    }

    pub(crate) fn post_recv(&self, ctx: &SoftCtx, reqs: &[RecvReq<'_>]) -> PostResult {
        let core = ctx.core();
        core.with_app_tx(|mem, tx| {
            let mut q = lock(&self.cell.proto);
            let mut result = Ok(());
            for (i, r) in reqs.iter().enumerate() {
                let sges = match sge_list(r.sges) {
                    Ok(s) => s,
                    Err(e) => {
                        result = Err((i, e));
                        break;
                    }
                };
                if let Err(e) = q.post_recv(proto::RecvWqe::new(r.wr_id, sges)) {
                    result = Err((i, post_error("post_recv", e)));
                    break;
                }
            }
            // A receive may unblock an RNR-waiting peer only through its retry, but posting in
            // ERR produces flush completions that must be delivered.
            core.progress(&self.cell, &mut q, mem, tx, core.now());
            core.end_call(tx);
            result
        })
    }

    pub(crate) fn destroy(&self, ctx: &SoftCtx) {
        let core = ctx.core();
        // Acknowledgements of what this queue pair received go out before it is gone.
        core.send_held(true);
        core.with_memory(|mem| mem.forget_qp(self.cell.qpn));
        // Its counts move to the port's retired totals in the same step as it leaves the
        // table, so that a concurrent `port_counters` sees them in exactly one of the two.
        let mut retired = lock(&core.retired);
        core.qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.cell.qpn);
        let q = lock(&self.cell.proto);
        self.cell.tx_owner.store(GONE, Ordering::Relaxed);
        retired.add(q.counters());
    }
}

fn sge_list(sges: &[Sge]) -> Result<proto::SgeList> {
    proto::SgeList::from_slice(sges).map_err(|e| post_error("post", e))
}

fn send_wqe(r: &SendReq<'_>) -> Result<proto::SendWqe> {
    let data = if r.flags.contains(SendFlags::INLINE) {
        let total: usize = r.sges.iter().map(|s| s.length as usize).sum();
        if total > proto::MAX_INLINE {
            return Err(post_error(
                "post_send",
                proto::PostError::InlineTooLong {
                    requested: total,
                    max: proto::MAX_INLINE,
                },
            ));
        }
        let mut bytes = [0u8; proto::MAX_INLINE];
        let mut at = 0;
        for s in r.sges {
            let n = s.length as usize;
            if n == 0 {
                continue;
            }
            // Borrowed slices on the safe path, the raw path's contract otherwise; and
            // `at + n <= total <= MAX_INLINE`.
            // SAFETY: inline SGEs name memory the poster guarantees readable during the post.
            let src = unsafe { std::slice::from_raw_parts(s.addr as *const u8, n) };
            bytes[at..at + n].copy_from_slice(src);
            at += n;
        }
        proto::SendData::Inline(
            proto::InlineData::new(&bytes[..at]).map_err(|e| post_error("post_send", e))?,
        )
    } else {
        proto::SendData::Sges(sge_list(r.sges)?)
    };
    Ok(proto::SendWqe {
        wr_id: r.wr_id,
        opcode: r.opcode,
        data,
        remote_addr: r.remote.addr,
        rkey: r.remote.rkey,
        imm: r.imm,
        invalidate_rkey: r.invalidate_rkey,
        compare_add: r.compare_add,
        swap: r.swap,
        flags: r.flags,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guid_and_listing() {
        let list = list_devices();
        assert!(list.iter().any(|d| d.name == "soft:127.0.0.1"));
        assert_eq!(
            node_guid(Ipv4Addr::new(10, 0, 0, 1)) & 0xffff_ffff,
            0x0a00_0001
        );
    }

    fn soft_cq(cq: &crate::Cq) -> &SoftCq {
        match &cq.inner.imp {
            crate::provider::CqImpl::Soft(q) => q,
            crate::provider::CqImpl::Verbs(_) => panic!("not a soft completion queue"),
        }
    }

    /// Whether an application thread's polls have the receive path.
    fn app_has_path(soft: &SoftCq) -> bool {
        soft.core.app_polling(soft.core.now().as_nanos()).is_some()
    }

    /// Polls an empty queue until the poll takes the receive path (it does only when the engine
    /// is not in a round of its own: `try_lock`); whether it did within two seconds.
    fn poll_until_taken(soft: &SoftCq, out: &mut [crate::vocab::Completion]) -> bool {
        for _ in 0..2000 {
            assert_eq!(soft.poll(out).unwrap(), 0);
            if app_has_path(soft) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        false
    }

    /// A thread that polls keeps the engine off the receive path; arming its completion queue
    /// to sleep hands the path back at once (else datagrams wait for the engine's next look,
    /// up to `APP_POLL_GRACE_NS`), and the last poll before sleeping does not take it again.
    #[test]
    fn arming_a_completion_queue_hands_the_receive_path_back_to_the_engine() {
        let ctx = crate::Context::open("soft:127.0.97.1").unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let (soft, mut out) = (soft_cq(&cq), [crate::vocab::Completion::default(); 4]);
        assert!(
            poll_until_taken(soft, &mut out),
            "a polling thread has the receive path"
        );
        soft.arm(false);
        assert!(!app_has_path(soft), "arming hands it back");
        assert_eq!(soft.poll(&mut out).unwrap(), 0);
        assert!(
            !app_has_path(soft),
            "the look before sleeping keeps it with the engine"
        );
        // Woken by a completion, the thread polls again and takes the path back.
        soft.ring.push(crate::vocab::Completion::default());
        assert_eq!(soft.poll(&mut out).unwrap(), 1);
        assert!(
            poll_until_taken(soft, &mut out),
            "polling again takes it back"
        );
    }

    /// With inline progress off, polls leave the receive path to the engine, and turning it
    /// off hands the path back at once (`erdma/tests/datapath.rs` checks that data still
    /// arrives).
    #[test]
    fn without_inline_progress_polls_leave_receiving_to_the_engine() {
        let ctx = crate::Context::open("soft:127.0.97.2").unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let (soft, mut out) = (soft_cq(&cq), [crate::vocab::Completion::default(); 4]);
        assert!(cq.inline_progress());
        assert!(
            poll_until_taken(soft, &mut out),
            "with it, a poll takes the path"
        );
        cq.set_inline_progress(false);
        assert!(!cq.inline_progress());
        assert!(!app_has_path(soft), "turning it off hands the path back");
        for _ in 0..200 {
            assert_eq!(soft.poll(&mut out).unwrap(), 0);
        }
        assert!(!app_has_path(soft), "polls without it leave the path alone");
        cq.set_inline_progress(true);
        assert!(
            poll_until_taken(soft, &mut out),
            "with it again, they take it"
        );
    }

    #[test]
    fn loopback_mtu_allows_4096() {
        assert_eq!(
            link_mtu(Ipv4Addr::LOCALHOST).and_then(Mtu::for_link_mtu),
            Some(Mtu::Mtu4096)
        );
    }
}

//! The soft device's driver: the UDP sockets, the engine threads, the clock, and the registry
//! of the devices this process has open. The protocol and the rules of who sends what are the
//! engine's ([`crate::soft::engine`]); the driver only connects it to the world.
//!
//! Owns one [`Device`] per local IPv4 address (shared by every context of this process that
//! opens it): an [`Engine`] on a [`UdpIo`] (one socket bound to `<addr>:4791` per engine lane,
//! in one `SO_REUSEPORT` group steered by destination QPN when there are several
//! (`reuseport.rs`); an eventfd per lane that wakes its thread; a monotonic clock) and one thread
//! per lane. Each thread follows the thin-driver shape: a round of its lane (receive → feed →
//! fire timers → send), then sleep until a datagram, the next deadline or a wake-up.

#![allow(unsafe_code)] // atexit and ppoll

mod edges;
mod faults;
mod iface;
mod reuseport;
mod shm;
pub(crate) mod socket;

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::soft::engine::batch::TxBatch;
use crate::soft::engine::timers::Sleep;
use crate::soft::engine::{self, Engine, Io, RxClaim, RxQueue, lock};
use crate::soft::proto;
use crate::soft::wire::ChecksumCapabilities;
use crate::sync::{AtomicBool, EventFd, Ordering};
use crate::vocab::Mtu;

pub(crate) use iface::{link_mtu, list_devices, node_guid};
use socket::{ROCE_PORT, RxBatch, SockOptions, UdpSock};

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
    /// `0` keeps polling threads from doing the receive work themselves; `share` lets them do
    /// it without taking the receive path from the engine thread; `adaptive` finds out which
    /// (see [`super::adapt_receive_work_by_default`]).
    pub const POLL_RX: &str = "ERDMA_SOFT_POLL_RX";
    /// `0` copies every request's payload into its packet instead of sending it from the
    /// memory region.
    pub const GATHER: &str = "ERDMA_SOFT_GATHER";
    /// Engine threads (each with its own socket, timers and transmit batches) a device spreads
    /// its queue pairs over, 1 to [`super::MAX_ENGINES`]; default [`super::DEFAULT_ENGINES`].
    pub const ENGINES: &str = "ERDMA_SOFT_ENGINES";
    /// `lane`: a queue pair's transmit work runs on its lane's engine thread; `inline`: in the
    /// thread that posts. Default: `lane` on a device of several engines, `inline` on one.
    pub const TX: &str = "ERDMA_SOFT_TX";
    /// `shm` (the default): soft devices of this host that prove it to each other move SEND
    /// and WRITE payloads longer than the MTU with one copy, out of the sender's memory
    /// (`process_vm_readv`), and their packets through shared-memory rings instead of the
    /// socket (`shm.rs`; devices of one engine); `cma`: payloads by reference, packets on the
    /// socket; `off`: every payload in the datagrams, as between hosts.
    pub const SAME_HOST: &str = "ERDMA_SOFT_SAME_HOST";
}

/// How a device treats soft devices of this host (`ERDMA_SOFT_SAME_HOST`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SameHostMode {
    Off,
    Cma,
    Shm,
}

/// `ERDMA_SOFT_SAME_HOST`.
///
/// # Errors
/// [`Error::Invalid`] for a value other than `cma`, `shm` or `off`.
fn same_host_from_env() -> Result<SameHostMode> {
    match std::env::var(env::SAME_HOST).as_deref().map(str::trim) {
        Ok("shm" | "") | Err(_) => Ok(SameHostMode::Shm),
        Ok("cma") => Ok(SameHostMode::Cma),
        Ok("off") => Ok(SameHostMode::Off),
        Ok(v) => Err(Error::invalid(format!(
            "{}={v:?}: expected `cma`, `shm` or `off`",
            env::SAME_HOST
        ))),
    }
}

/// The most engines a device runs.
pub(crate) const MAX_ENGINES: usize = 64;

/// Engines per device when `ERDMA_SOFT_ENGINES` does not say: one. Measured
/// (bench/results/multi-engine.md): several engines, their lanes transmitting, carry 2.5× as
/// much over many queue pairs on sixteen CPUs, but every packet then waits for a lane thread to
/// wake, which triples an 8-byte WRITE's round trip; on two CPUs a second engine only takes
/// turns with the first. Bandwidth across many queue pairs is the caller's choice to make.
pub(crate) const DEFAULT_ENGINES: usize = 1;

/// `ERDMA_SOFT_ENGINES`, or the default.
///
/// # Errors
/// [`Error::Invalid`] for a value that is not a number from 1 to [`MAX_ENGINES`].
fn engines_from_env() -> Result<usize> {
    match std::env::var(env::ENGINES) {
        Ok(v) if !v.trim().is_empty() => match v.trim().parse::<usize>() {
            Ok(n) if (1..=MAX_ENGINES).contains(&n) => Ok(n),
            _ => Err(Error::invalid(format!(
                "{}={v:?}: expected a number of engines from 1 to {MAX_ENGINES}",
                env::ENGINES
            ))),
        },
        _ => Ok(DEFAULT_ENGINES),
    }
}

/// Whether devices opened from now on find out how their program waits
/// ([`RxClaim::Adaptive`]) unless `ERDMA_SOFT_POLL_RX` says otherwise.
static ADAPT_RX_BY_DEFAULT: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Makes devices opened from now on find out how their program waits by default
/// (`ERDMA_SOFT_POLL_RX` still decides where it is set): for a C verbs library, whose programs
/// may wait by watching memory instead of polling a completion queue.
#[cfg_attr(not(feature = "raw-provider"), allow(dead_code))] // the C library's
pub(crate) fn adapt_receive_work_by_default() {
    ADAPT_RX_BY_DEFAULT.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// `ERDMA_SOFT_POLL_RX`: (poll_rx, claim_rx). With transmit work on the lanes, polling
/// threads leave the receive work to them too by default: an application thread that did it
/// would also transmit what the acknowledgements it reads let go, for every lane. The C
/// library's devices find out how their program waits (`RxClaim::Adaptive`).
fn poll_rx_mode(tx_on_lanes: bool) -> (bool, RxClaim) {
    match std::env::var(env::POLL_RX).as_deref().map(str::trim) {
        Ok("share") => (true, RxClaim::Share),
        Ok("adaptive") => (true, RxClaim::Adaptive),
        Ok("0" | "false" | "off" | "no") => (false, RxClaim::Share),
        Ok(_) => (true, RxClaim::Claim),
        Err(_) if tx_on_lanes => (false, RxClaim::Share),
        Err(_) if ADAPT_RX_BY_DEFAULT.load(std::sync::atomic::Ordering::Relaxed) => {
            (true, RxClaim::Adaptive)
        }
        Err(_) => (true, RxClaim::Claim),
    }
}

/// `ERDMA_SOFT_TX` for a device of `engines` engines: whether transmit work runs on the lanes.
///
/// # Errors
/// [`Error::Invalid`] for a value other than `lane` or `inline`.
fn tx_on_lanes(engines: usize) -> Result<bool> {
    match std::env::var(env::TX).as_deref().map(str::trim) {
        Ok("lane") => Ok(true),
        Ok("inline") => Ok(false),
        Ok(v) => Err(Error::invalid(format!(
            "{}={v:?}: expected `lane` or `inline`",
            env::TX
        ))),
        Err(_) => Ok(engines > 1),
    }
}

fn env_flag(name: &str, default: bool) -> bool {
    match std::env::var(name) {
        Ok(v) => !matches!(v.trim(), "0" | "false" | "off" | "no"),
        Err(_) => default,
    }
}

/// The sockets, the wake-ups and the clock an engine runs on in production: lane `i` receives
/// on `socks[i]` and sleeps on `wakes[i]`.
struct UdpIo {
    /// Set once every socket is bound (and steered); sends before are refused.
    bound: AtomicBool,
    socks: Vec<Arc<UdpSock>>,
    /// Wake each lane's thread from its sleep.
    wakes: Vec<EventFd>,
    /// Set when a lane's thread woke with datagrams on its socket (a receive round that also
    /// reads rings then reads the socket too).
    socket_ready: Vec<Arc<AtomicBool>>,
    /// Shared-memory rings to devices of this host (`ERDMA_SOFT_SAME_HOST=shm`).
    shm: Option<Arc<shm::Shm>>,
    /// Lane 0's socket, watched edge-triggered while an application polls the rings
    /// (`edges.rs`); with `shm` only.
    edges: Option<edges::Edges>,
    epoch: std::time::Instant,
    /// Injected faults (`ERDMA_SOFT_FAULTS`), if asked for.
    faults: Option<faults::Faults>,
    /// The claim on the address a device of several sockets holds (`reuseport.rs`), taken
    /// when it binds; the lock also serialises binding.
    claim: Mutex<Option<std::os::fd::OwnedFd>>,
    /// Send calls made (tests count them).
    #[cfg(test)]
    sends: std::sync::atomic::AtomicU64,
}

impl UdpIo {
    fn sock(&self, lane: usize) -> &UdpSock {
        &self.socks[lane % self.socks.len()]
    }
}

impl Io for UdpIo {
    fn now(&self) -> proto::Instant {
        proto::Instant::from_nanos(self.epoch.elapsed().as_nanos() as u64)
    }

    fn send(&self, lane: usize, batches: &mut [&mut TxBatch]) -> io::Result<()> {
        if !self.bound.load(Ordering::Acquire) {
            // Unreachable through the device (a queue pair binds it first); an unbound socket
            // would send from an ephemeral port.
            return Err(io::Error::from(io::ErrorKind::NotConnected));
        }
        let sock = self.sock(lane);
        #[cfg(test)]
        self.sends.fetch_add(1, Ordering::Relaxed);
        match (&self.faults, &self.shm) {
            (Some(f), _) => f.send(sock, batches),
            (None, Some(shm)) if shm.sends() => {
                thread_local! {
                    /// The sending thread's [`shm::Sent`], reused.
                    static SENT: std::cell::RefCell<shm::Sent> = Default::default();
                }
                let mut send = |sent: &mut shm::Sent| {
                    shm.send(batches, self.now().as_nanos(), sent);
                    if sent.dropped != 0 {
                        sock.count_refused(sent.dropped);
                    }
                    let wake = engine::same_host::wake_datagram();
                    for &dst in &sent.wake {
                        faults::send_one(sock, SocketAddrV4::new(dst, ROCE_PORT), &wake);
                    }
                    sock.send_batches_but(batches, &sent.taken)
                };
                // A fresh one where the thread's is borrowed, or gone: at process exit glibc
                // destroys the main thread's thread-locals before the exit handlers run, and
                // `flush_held_at_exit` sends from there (with `with`, it panicked and the
                // acknowledgements it was sending were lost).
                let mut fresh = shm::Sent::default();
                SENT.try_with(|sent| match sent.try_borrow_mut() {
                    Ok(mut sent) => send(&mut sent),
                    Err(_) => send(&mut fresh),
                })
                .unwrap_or_else(|_| send(&mut shm::Sent::default()))
            }
            (None, _) => sock.send_batches(batches),
        }
    }

    fn gso(&self) -> bool {
        self.socks[0].gso()
    }

    fn wake(&self, lane: usize) {
        self.wakes[lane % self.wakes.len()].signal();
    }

    fn lanes(&self) -> usize {
        self.socks.len()
    }

    fn receiver(&self, lane: usize) -> Box<dyn RxQueue> {
        let sock = self.socks[lane % self.socks.len()].clone();
        // 8 messages per receive call: 2 or 4 measured no faster (docs/SOFT-DEVICE.md).
        let batch = RxBatch::new(8, if sock.gro() { 65536 } else { 9216 });
        // Lane 0 reads the rings (a device of several lanes hands other lanes' packets on).
        let rings = (lane == 0)
            .then(|| self.shm.clone().map(shm::RingRx::new))
            .flatten();
        Box::new(UdpRx {
            sock,
            batch,
            rings,
            socket_ready: self.socket_ready[lane % self.socket_ready.len()].clone(),
            from_socket: false,
        })
    }

    fn refused(&self) -> u64 {
        self.socks.iter().map(|s| s.refused()).sum()
    }

    fn kernel_drops(&self) -> Option<u64> {
        self.socks.iter().map(|s| s.kernel_drops()).sum()
    }

    fn channels(&self) -> Option<&dyn engine::same_host::Channels> {
        self.shm
            .as_deref()
            .map(|s| s as &dyn engine::same_host::Channels)
    }
}

/// The socket's receive side, and the rings', as the engine's receive path takes them.
struct UdpRx {
    sock: Arc<UdpSock>,
    batch: RxBatch,
    rings: Option<shm::RingRx>,
    socket_ready: Arc<AtomicBool>,
    /// Whether the last fill read the socket (else `batch` holds nothing of it).
    from_socket: bool,
}

impl RxQueue for UdpRx {
    fn fill(&mut self, want: usize) -> io::Result<usize> {
        // A narrow round (`want` 1) spares the kernel a second slot's try; taking a packet from
        // a ring costs no call, so with rings it takes whatever waits there. A peer's request
        // and the acknowledgement sent out behind it then come in one round, not two (a thread
        // waiting for that acknowledgement's completion waited a round more).
        let want = if self.rings.is_some() {
            want.max(self.batch.slots())
        } else {
            want
        };
        let (got, read_socket) = match &mut self.rings {
            Some(r) => r.fill(want, self.socket_ready.swap(false, Ordering::Relaxed)),
            None => (0, true),
        };
        self.from_socket = read_socket;
        if !read_socket {
            return Ok(got);
        }
        self.sock.recv_batch_up_to(&mut self.batch, want - got)?;
        if self.rings.is_some() && self.batch.messages() == want - got {
            // More may wait, and their edges were told already: read again next round.
            self.socket_ready.store(true, Ordering::Relaxed);
        }
        Ok(got + self.batch.messages())
    }

    fn slots(&self) -> usize {
        self.batch.slots()
    }

    fn len(&self) -> usize {
        let socket = if self.from_socket {
            self.batch.datagrams().len()
        } else {
            0
        };
        socket + self.rings.as_ref().map_or(0, |r| r.len())
    }

    fn for_each(&self, f: &mut dyn FnMut(SocketAddrV4, &[u8])) {
        if let Some(r) = &self.rings {
            r.for_each(f);
        }
        if self.from_socket {
            for d in self.batch.datagrams() {
                f(d.src, self.batch.data(d));
            }
        }
    }
}

/// Live soft devices of this process, by address.
static REGISTRY: Mutex<Vec<(Ipv4Addr, Weak<Device>)>> = Mutex::new(Vec::new());

/// A soft device: its engine and the threads serving its lanes.
pub(crate) struct Device {
    engine: Arc<Engine>,
    io: Arc<UdpIo>,
    stop: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Device {
    /// The engine.
    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Binds the device's RoCE port, once: its first queue pair calls it (and the SDK's open,
    /// so that a taken address fails there). A device only opened, queried, or holding PDs,
    /// MRs and CQs leaves the address to other processes, as programs that open every device
    /// they list expect. A failed bind can be retried.
    ///
    /// # Errors
    /// [`Error::Io`] when the port cannot be bound, with the likely reason.
    pub(crate) fn bind(&self) -> Result<()> {
        if self.io.bound.load(Ordering::Acquire) {
            return Ok(());
        }
        let io = &self.io;
        let mut claim = lock(&io.claim);
        if io.bound.load(Ordering::Acquire) {
            return Ok(());
        }
        let (addr, several) = (self.engine.addr, io.socks.len() > 1);
        if several && claim.is_none() {
            // Several sockets share the port: claim the address for this process first.
            *claim = Some(reuseport::claim(addr).map_err(|e| bind_error(addr, e))?);
        }
        for (i, sock) in io.socks.iter().enumerate() {
            sock.bind_to(addr, ROCE_PORT)
                .map_err(|e| bind_error(addr, e))?;
            if i == 0 && several {
                // Steering is an optimisation: without it, lanes hand datagrams to their owners.
                if let Err(e) = reuseport::steer_by_qpn(sock.raw_fd(), io.socks.len() as u32) {
                    eprintln!(
                        "erdma soft device {addr}: steering datagrams by QPN is unavailable \
                         ({e}); engines hand them to each other"
                    );
                }
            }
        }
        io.bound.store(true, Ordering::Release);
        Ok(())
    }
}

/// The error of a device that cannot bind its address's RoCE port, with the likely reason.
fn bind_error(addr: Ipv4Addr, e: io::Error) -> Error {
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
}

impl Drop for Device {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for w in &self.io.wakes {
            w.signal();
        }
        for h in lock(&self.threads).drain(..) {
            let _ = h.join();
        }
        // Answers an application's last receive round held back still go out.
        self.engine.send_held(true);

        if let Some(f) = &self.io.faults {
            let (c, _) = self.engine.counters();
            eprintln!(
                "erdma soft device {}: {}={}: {}; {} packets retransmitted, {} timeouts",
                self.engine.addr,
                faults::ENV,
                std::env::var(faults::ENV).unwrap_or_default(),
                f.report(),
                c.retransmits,
                c.timeouts
            );
        }
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
            dev.engine.send_held(false);
        }
    });
}

/// Opens (or joins) the soft device on `addr`, with `ERDMA_SOFT_ENGINES` engines when it
/// opens it, and binds its RoCE port ([`Device::bind`]).
///
/// # Errors
/// [`Error::Io`] when the address's RoCE port cannot be bound (with the likely reason), or an
/// engine thread cannot start; [`Error::Invalid`] for a bad `ERDMA_SOFT_ENGINES`.
pub(crate) fn open_device(addr: Ipv4Addr) -> Result<Arc<Device>> {
    open_device_with(addr, engines_from_env()?)
}

/// [`open_device`] with `engines` engines (1 to [`MAX_ENGINES`]) if this call opens the
/// device; a device already open keeps its own.
///
/// # Errors
/// As [`open_device`].
pub(crate) fn open_device_with(addr: Ipv4Addr, engines: usize) -> Result<Arc<Device>> {
    let dev = open_unbound_with(addr, engines)?;
    dev.bind()?;
    Ok(dev)
}

/// [`open_device`] without binding: the device's first queue pair binds its RoCE port
/// ([`Device::bind`]).
///
/// # Errors
/// [`Error::Io`] when an engine thread or its sockets cannot start; [`Error::Invalid`] for a
/// bad `ERDMA_SOFT_ENGINES`.
#[cfg(feature = "raw-provider")]
pub(crate) fn open_unbound(addr: Ipv4Addr) -> Result<Arc<Device>> {
    open_unbound_with(addr, engines_from_env()?)
}

fn open_unbound_with(addr: Ipv4Addr, engines: usize) -> Result<Arc<Device>> {
    let engines = engines.clamp(1, MAX_ENGINES);
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
        reuseport: engines > 1,
    };
    let socks = (0..engines)
        .map(|_| UdpSock::unbound(opts).map(Arc::new))
        .collect::<io::Result<Vec<_>>>()
        .map_err(|e| Error::io(format!("soft device {addr}: creating a UDP socket"), e))?;
    let faults = faults::FaultSpec::from_env()
        .map_err(Error::invalid)?
        .map(|spec| faults::Faults::new(spec, addr));
    let wakes = (0..engines)
        .map(|_| EventFd::new())
        .collect::<io::Result<Vec<_>>>()
        .map_err(|e| Error::io("soft device: creating an eventfd", e))?;
    let same_host = same_host_from_env()?;
    // Rings carry no injected faults: with faults asked for, packets take the socket. One
    // lane reads them: a device of several engines keeps its packets steered to its lanes.
    let shm = (same_host == SameHostMode::Shm && faults.is_none() && engines == 1)
        .then(|| Arc::new(shm::Shm::new(addr)));
    let edges = shm
        .as_ref()
        .map(|_| edges::Edges::new(socks[0].raw_fd()))
        .transpose()
        .map_err(|e| Error::io("soft device: creating an epoll set", e))?;
    let io = Arc::new(UdpIo {
        bound: AtomicBool::new(false),
        faults,
        socks,
        socket_ready: (0..engines)
            .map(|_| Arc::new(AtomicBool::new(false)))
            .collect(),
        shm,
        edges,
        wakes,
        epoch: std::time::Instant::now(),
        claim: Mutex::new(None),
        #[cfg(test)]
        sends: std::sync::atomic::AtomicU64::new(0),
    });
    let checksum = if env_flag(env::ICRC, true) {
        ChecksumCapabilities::default()
    } else {
        ChecksumCapabilities::ignored()
    };
    let tx_on_lanes = tx_on_lanes(engines)?;
    let rx_mode = poll_rx_mode(tx_on_lanes);
    let engine = Engine::new(
        io.clone(),
        engine::Config {
            addr,
            checksum,
            active_mtu: link_mtu(addr)
                .and_then(Mtu::for_link_mtu)
                .unwrap_or(Mtu::Mtu1024),
            poll_rx: rx_mode.0,
            claim_rx: rx_mode.1,
            gather: env_flag(env::GATHER, true),
            tx_on_lanes,
            key_seed: None,
            same_host: same_host != SameHostMode::Off,
        },
    );
    let spin = Duration::from_micros(
        std::env::var(env::SPIN_US)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    );
    let stop = Arc::new(AtomicBool::new(false));
    // Built first, so that a thread that fails to start stops the ones already running.
    let dev = Arc::new(Device {
        engine,
        io,
        stop,
        threads: Mutex::new(Vec::with_capacity(engines)),
    });
    for lane in 0..engines {
        let (engine, io, stop) = (dev.engine.clone(), dev.io.clone(), dev.stop.clone());
        let name = if engines == 1 {
            format!("erdma-soft-{addr}")
        } else {
            format!("erdma-soft-{addr}/{lane}")
        };
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || run(&engine, &io, lane, &stop, spin))
            .map_err(|e| Error::io("soft device: starting an engine thread", e))?;
        lock(&dev.threads).push(thread);
    }
    reg.push((addr, Arc::downgrade(&dev)));
    Ok(dev)
}

/// Lane `lane`'s engine thread: rounds, and sleep between them.
fn run(engine: &Engine, io: &UdpIo, lane: usize, stop: &AtomicBool, spin: Duration) {
    let mut idle_since: Option<std::time::Instant> = None;
    let several = engine.lane_count() > 1;
    let mut yielded = false;
    let mut grace_over = false;
    while !stop.load(Ordering::Acquire) {
        // While an application thread polls, its receive rounds do this thread's work
        // (datagrams and due timers): only watch for the polling to stop, without taking the
        // receive path from under it (blocking on its lock would make the application's next
        // unlock wake this thread, on the application's latency path).
        if engine.app_polling(lane, engine.now().as_nanos()).is_some() {
            idle_since = None;
            grace_over = sleep(engine, io, lane, stop);
            continue;
        }
        // The first round after a polling application's grace ran out: did datagrams wait?
        let before = std::mem::take(&mut grace_over).then(|| engine.datagrams_received());
        let worked = engine.round(lane, before.is_some());
        if let Some(before) = before {
            engine.grace_ran_out(engine.datagrams_received() > before);
            // What that round held back waits for the application's answer: sleep (until
            // datagrams, or its hold is over) rather than start a round that sends it.
            if engine.lane(lane).tx_held.load(Ordering::Relaxed) {
                grace_over = sleep(engine, io, lane, stop);
                continue;
            }
        }
        if worked {
            idle_since = None;
            continue;
        }
        // With several lanes, an idle thread first lets another lane's thread that has work run
        // on this CPU, then looks once more: where the lanes outnumber the free CPUs, they then
        // take turns in longer rounds instead of each sleeping and being woken for every burst
        // (bench/results/multi-engine.md).
        if several && !yielded {
            yielded = true;
            std::thread::yield_now();
            continue;
        }
        yielded = false;
        // Spin a while if asked, then sleep until a datagram, a deadline or a wake-up.
        let started = *idle_since.get_or_insert_with(std::time::Instant::now);
        if started.elapsed() < spin {
            std::hint::spin_loop();
            continue;
        }
        idle_since = None;
        sleep(engine, io, lane, stop);
    }
}

/// Sleeps until a datagram for lane `lane` arrives, a wake-up is signalled, or its next timer
/// is due. `true` when it slept out a polling application's grace (nothing woke it).
fn sleep(engine: &Engine, io: &UdpIo, lane: usize, stop: &AtomicBool) -> bool {
    let now = engine.now().as_nanos();
    if stop.load(Ordering::Acquire) {
        return false;
    }
    let l = engine.lane(lane);
    let timers = &l.timers;
    // An application is polling: leave the socket and the timers to it (its rounds fire due
    // timers), and look again when it may have stopped. The published plan stays "running", so
    // no one signals this thread for a deadline meanwhile; a deadline that falls due after the
    // application's last round fires at the recheck, at most `APP_POLL_GRACE_NS` late.
    let mut app_recheck = engine.app_polling(lane, now);
    if app_recheck.is_some() {
        // Published before the second look, so that an application going to sleep now either
        // is seen here or sees this and wakes the engine (`Engine::app_sleeps`).
        l.parked_for_app.store(true, Ordering::SeqCst);
        app_recheck = engine.app_polling(lane, now);
        if app_recheck.is_none() {
            l.parked_for_app.store(false, Ordering::Relaxed);
            return false;
        }
    }
    let until = match app_recheck {
        Some(recheck) => Some(recheck),
        None => {
            let until = match timers.prepare_sleep(now, engine.hold_watch(lane, now)) {
                Sleep::No => return false,
                Sleep::Until(at) => at,
            };
            if stop.load(Ordering::Acquire) {
                timers.awake();
                return false;
            }
            // Packets held back go out with the application's next call; if it has stopped
            // calling, the engine sends them — now, or where this thread held them after a
            // grace ran out, once the application has had its time to answer.
            let mut until = until;
            // After the plan's fence: a hold made since either is seen here or sees the plan
            // and wakes this thread (`Engine::service`).
            if l.tx_held.load(Ordering::Relaxed) {
                match engine.held_until(lane, now) {
                    Some(at) => until = Some(until.map_or(at, |u: u64| u.min(at))),
                    None => {
                        timers.awake();
                        return false;
                    }
                }
            }
            // Datagrams another lane handed over (its wake-up may have been consumed by the
            // last sleep).
            if l.inbox.is_pending() {
                timers.awake();
                return false;
            }
            until
        }
    };
    let app_active = app_recheck.is_some();
    // Lane 0 reads the rings: producers wake it while it sleeps (`shm.rs`).
    let rings = io.shm.as_deref().filter(|_| lane == 0 && !app_active);
    // While the application polls rings, it reads the socket when told: watch for arrivals.
    let edges = io.edges.as_ref().filter(|_| {
        lane == 0 && app_active && io.shm.as_deref().is_some_and(shm::Shm::reads_rings)
    });
    if let Some(shm) = rings
        && !shm.park()
    {
        timers.awake();
        return false;
    }
    let timeout = until.map(|n| Duration::from_nanos(n.saturating_sub(now)));
    let mut fds = [
        libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&io.wakes[lane]),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: edges.map_or(io.socks[lane].raw_fd(), std::os::fd::AsRawFd::as_raw_fd),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    let nfds = if app_active && edges.is_none() { 1 } else { 2 };
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let tsp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `nfds` valid pollfds; `tsp` is null or points at a live timespec.
    let n = unsafe { libc::ppoll(fds.as_mut_ptr(), nfds, tsp, std::ptr::null()) };
    if let Some(shm) = rings {
        shm.unpark();
    }
    if nfds == 2 && fds[1].revents & libc::POLLIN != 0 && edges.is_none_or(edges::Edges::take) {
        io.socket_ready[lane].store(true, Ordering::Relaxed);
    }
    l.parked_for_app.store(false, Ordering::Relaxed);
    timers.awake();
    if fds[0].revents & libc::POLLIN != 0 {
        io.wakes[lane].consume();
    }
    app_active && n == 0
}

#[cfg(test)]
mod engines_tests;

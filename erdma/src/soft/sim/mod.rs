//! A deterministic simulation of soft devices on virtual time: the engines that ship, over a
//! modelled network.
//!
//! Owns what integration tests and fuzz targets need to run soft devices without sockets or
//! threads: a seeded PRNG ([`Rng`]), a network between any number of devices with seeded loss,
//! reordering, duplication, corruption, delay and link rate ([`NetConfig`]), and a loop that
//! runs until quiescent or a virtual deadline ([`Sim`]). Each [`Node`] is the soft device's
//! engine — its routing, receive rounds, transmit batches and ownership, held-back
//! acknowledgements, transmit slicing, timers and memory table — driven by the simulation
//! instead of the driver's thread and socket. A node takes its receive rounds as the engine
//! thread does, or as a polling application does ([`Node::set_polling`]: acknowledgements held
//! back until the next poll). The same seed gives the same run.
//!
//! It must stay a model: no sockets, no real time, no threads.

#![forbid(unsafe_code)]

mod vec_memory;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::Error;
use crate::soft::engine::batch::TxBatch;
use crate::soft::engine::notify::{CompletionRing, EventSink};
use crate::soft::engine::{self, Engine, Io, QpCell, RxQueue, lock};
use crate::soft::proto::{Instant, ModifyError, QpCounters, RecvWqe, SendWqe};
use crate::soft::wire::{ChecksumCapabilities, Psn, ROCE_PORT};
use crate::sync::{AtomicU64, EventFd, Ordering};
use crate::vocab::{Access, AsyncEvent, Completion, Gid, Mtu, QpAttr, QpCaps, QpState};

pub use vec_memory::{MrInfo, VecMemory};

/// A small, fast, seeded generator (splitmix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x6A09_E667_F3BC_C909)
    }

    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// `true` with probability `p` (clamped to 0..=1).
    pub fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        if p >= 1.0 {
            return true;
        }
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64) < p
    }

    /// Fills `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// The network's behaviour.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetConfig {
    /// One-way propagation delay.
    pub delay: Duration,
    /// Link rate of every device's transmitter, bits per second (serialization delay).
    pub bits_per_sec: u64,
    /// Probability a datagram is lost.
    pub loss: f64,
    /// Probability a datagram is held back by up to `reorder_window` (reordering it).
    pub reorder: f64,
    /// How long a reordered datagram may be held back.
    pub reorder_window: Duration,
    /// Probability a datagram is delivered twice.
    pub duplicate: f64,
    /// Probability one random bit of a datagram is flipped.
    pub corrupt: f64,
}

impl NetConfig {
    /// 5 µs, 10 Gb/s, no faults.
    pub fn ideal() -> NetConfig {
        NetConfig {
            delay: Duration::from_micros(5),
            bits_per_sec: 10_000_000_000,
            loss: 0.0,
            reorder: 0.0,
            reorder_window: Duration::from_micros(20),
            duplicate: 0.0,
            corrupt: 0.0,
        }
    }

    /// [`NetConfig::ideal`] with a fault rate of `p`: each datagram is hit with probability
    /// about `p`, the fault split evenly between loss, reordering, duplication and corruption
    /// (`p / 4` each).
    pub fn faulty(p: f64) -> NetConfig {
        NetConfig::each_fault(p / 4.0)
    }

    /// [`NetConfig::ideal`] with loss, reordering, duplication and corruption each at `p`,
    /// independently (at 0.3 a datagram survives loss and corruption only about half the time).
    pub fn each_fault(p: f64) -> NetConfig {
        NetConfig {
            loss: p,
            reorder: p,
            duplicate: p,
            corrupt: p,
            ..NetConfig::ideal()
        }
    }

    /// [`NetConfig::ideal`] with loss `p` and no other fault.
    pub fn lossy(p: f64) -> NetConfig {
        NetConfig {
            loss: p,
            ..NetConfig::ideal()
        }
    }
}

/// What the network did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Datagrams devices sent.
    pub sent: u64,
    /// Datagrams lost.
    pub lost: u64,
    /// Extra copies delivered.
    pub duplicated: u64,
    /// Datagrams with a flipped bit.
    pub corrupted: u64,
    /// Datagrams held back.
    pub reordered: u64,
    /// Datagrams delivered.
    pub delivered: u64,
    /// Datagrams addressed to no device.
    pub unroutable: u64,
}

/// A datagram: its source or destination, and its bytes.
type Datagram = (SocketAddrV4, Vec<u8>);

/// A node's side of the network: the virtual clock, what its engine sent, what waits for it.
struct SimIo {
    clock: Arc<AtomicU64>,
    outbound: Mutex<Vec<Datagram>>,
    inbound: Arc<Mutex<VecDeque<Datagram>>>,
    gso: bool,
}

impl Io for SimIo {
    fn now(&self) -> Instant {
        Instant::from_nanos(self.clock.load(Ordering::Relaxed))
    }

    fn send(&self, batches: &mut [&mut TxBatch]) -> io::Result<()> {
        let mut out = lock(&self.outbound);
        for b in batches.iter_mut() {
            b.drain_datagrams(|dst, bytes, _| out.push((dst, bytes.to_vec())));
        }
        Ok(())
    }

    fn gso(&self) -> bool {
        self.gso
    }

    fn wake(&self) {}

    fn receiver(&self) -> Box<dyn RxQueue> {
        Box::new(SimRx {
            inbound: self.inbound.clone(),
            taken: Vec::new(),
        })
    }

    fn refused(&self) -> u64 {
        0
    }

    fn kernel_drops(&self) -> Option<u64> {
        None
    }
}

/// The receive queue of a node's engine.
struct SimRx {
    inbound: Arc<Mutex<VecDeque<Datagram>>>,
    taken: Vec<Datagram>,
}

impl RxQueue for SimRx {
    fn fill(&mut self, want: usize) -> io::Result<usize> {
        self.taken.clear();
        let mut q = lock(&self.inbound);
        while self.taken.len() < want.max(1) {
            match q.pop_front() {
                Some(d) => self.taken.push(d),
                None => break,
            }
        }
        Ok(self.taken.len())
    }

    fn slots(&self) -> usize {
        8
    }

    fn len(&self) -> usize {
        self.taken.len()
    }

    fn for_each(&self, f: &mut dyn FnMut(SocketAddrV4, &[u8])) {
        for (src, bytes) in &self.taken {
            f(*src, bytes);
        }
    }
}

/// Asynchronous events a node's engine reported, in order.
#[derive(Default)]
struct Events(Mutex<Vec<AsyncEvent>>);

impl EventSink for Events {
    fn report(&self, ev: AsyncEvent) {
        lock(&self.0).push(ev);
    }
}

/// A node's registered memory, reached by copies.
pub struct NodeMem {
    engine: Arc<Engine>,
}

impl std::fmt::Debug for NodeMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeMem").finish_non_exhaustive()
    }
}

impl NodeMem {
    /// Registers `len` zeroed bytes the engine's table owns, in protection domain `pd`.
    ///
    /// # Panics
    /// When the device refuses (too many regions): a test set-up error.
    pub fn register(&self, pd: u32, len: usize, access: Access) -> MrInfo {
        let (key, iova) = self
            .engine
            .reg_owned(pd, len, access)
            .expect("registering a region");
        MrInfo {
            key,
            iova,
            len: len as u64,
        }
    }

    /// Deregisters a region; whether the key named one.
    pub fn deregister(&self, key: u32) -> bool {
        let live = self.is_valid(key);
        self.engine.dereg_mr(key);
        live
    }

    /// Whether the key names a live region.
    pub fn is_valid(&self, key: u32) -> bool {
        self.engine.read_region(key, 0, &mut [])
    }

    /// A copy of a region's bytes (`None` once it is deregistered).
    pub fn bytes(&self, key: u32) -> Option<Vec<u8>> {
        let len = usize::try_from(self.engine.owned_len(key)?).ok()?;
        let mut out = vec![0; len];
        self.engine.read_region(key, 0, &mut out).then_some(out)
    }

    /// Writes `data` into a region at `offset`; whether it fit.
    pub fn write(&self, key: u32, offset: usize, data: &[u8]) -> bool {
        self.engine.write_region(key, offset as u64, data)
    }

    /// Fills `[offset, offset+len)` of a region with random bytes from `rng`.
    pub fn fill(&self, key: u32, offset: usize, len: usize, rng: &mut Rng) -> bool {
        let mut b = vec![0; len];
        rng.fill(&mut b);
        self.write(key, offset, &b)
    }
}

/// One soft device in the simulation: its engine, its completions, its memory.
pub struct Node {
    engine: Arc<Engine>,
    io: Arc<SimIo>,
    addr: Ipv4Addr,
    /// The one completion queue every queue pair of the node completes into.
    cq: Arc<CompletionRing>,
    events: Arc<Events>,
    qps: HashMap<u32, Arc<QpCell>>,
    /// When its transmitter is free again.
    link_free: Instant,
    /// Rounds are taken as a polling application (acknowledgements held back until the next
    /// poll), not as the engine thread.
    polling: bool,
    /// How long the device takes to notice datagrams that arrive while it is idle (the engine
    /// thread's wake-up); those arriving meanwhile are taken in one round.
    wakeup: Duration,
    /// When the device takes its next receive round (datagrams are waiting).
    wake_at: Option<Instant>,
    /// Rounds of a polling node that held acknowledgements back.
    held_rounds: u64,
    /// Its memory.
    pub mem: NodeMem,
    /// Completions drained from the device, oldest first.
    pub completions: VecDeque<Completion>,
    /// Stops sending and receiving (a vanished peer).
    pub down: bool,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("addr", &self.addr)
            .field("qps", &self.qps.len())
            .field("completions", &self.completions.len())
            .field("down", &self.down)
            .finish()
    }
}

impl Node {
    /// The device's address.
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// Takes receive rounds as a polling application does (`true`: its receive round holds
    /// acknowledgements back until the next poll) or as the engine thread does.
    pub fn set_polling(&mut self, on: bool) {
        self.polling = on;
    }

    /// How long the device takes to notice datagrams arriving while it is idle (0 by default):
    /// those that arrive in that time are taken in one receive round, as a busy or sleeping
    /// engine thread takes them.
    pub fn set_wakeup(&mut self, wakeup: Duration) {
        self.wakeup = wakeup;
    }

    /// Creates a queue pair in RESET in protection domain `pd`; returns its number.
    ///
    /// # Panics
    /// When the device refuses: a test set-up error.
    pub fn create_qp(&mut self, pd: u32, caps: QpCaps) -> u32 {
        let events: Arc<dyn EventSink> = self.events.clone();
        let (cell, _) = self
            .engine
            .create_qp(pd, &self.cq, &self.cq, &caps, false, events)
            .expect("creating a queue pair");
        let qpn = cell.qpn;
        self.qps.insert(qpn, cell);
        qpn
    }

    /// Destroys a queue pair.
    pub fn destroy_qp(&mut self, qpn: u32) {
        if let Some(cell) = self.qps.remove(&qpn) {
            self.engine.destroy_qp(&cell);
        }
    }

    fn cell(&self, qpn: u32) -> &Arc<QpCell> {
        self.qps
            .get(&qpn)
            .unwrap_or_else(|| panic!("no queue pair {qpn:#x} on {}", self.addr))
    }

    /// Posts a send request.
    ///
    /// # Errors
    /// The device's refusal.
    pub fn post_send(&self, qpn: u32, wqe: SendWqe) -> Result<(), Error> {
        self.engine
            .post_send(self.cell(qpn), [Ok(wqe)])
            .map_err(|(_, e)| e)
    }

    /// Posts a receive request.
    ///
    /// # Errors
    /// The device's refusal.
    pub fn post_recv(&self, qpn: u32, wqe: RecvWqe) -> Result<(), Error> {
        self.engine
            .post_recv(self.cell(qpn), [Ok(wqe)])
            .map_err(|(_, e)| e)
    }

    /// Modifies a queue pair.
    ///
    /// # Errors
    /// The protocol's refusal.
    pub fn modify(&self, qpn: u32, attr: &QpAttr) -> Result<(), ModifyError> {
        self.engine.modify_qp(self.cell(qpn), attr)
    }

    /// A queue pair's state.
    pub fn state(&self, qpn: u32) -> QpState {
        self.engine.qp_state(self.cell(qpn))
    }

    /// A queue pair's attributes.
    pub fn attr(&self, qpn: u32) -> QpAttr {
        self.engine.qp_attr(self.cell(qpn))
    }

    /// A queue pair's counters.
    pub fn counters(&self, qpn: u32) -> QpCounters {
        self.engine.qp_counters(self.cell(qpn))
    }

    /// A handle on queue pair `qpn`.
    ///
    /// # Panics
    /// When the node has no such queue pair: a test error.
    pub fn qp(&self, qpn: u32) -> QpRef<'_> {
        self.cell(qpn);
        QpRef { node: self, qpn }
    }

    /// The device's counters: every queue pair's added up (drops before routing included), and
    /// the datagrams it received.
    pub fn totals(&self) -> (QpCounters, u64) {
        self.engine.counters()
    }

    /// Asynchronous events the device reported so far.
    pub fn events(&self) -> Vec<AsyncEvent> {
        lock(&self.events.0).clone()
    }

    /// Rounds of a polling node that held acknowledgements back (for its next poll).
    pub fn held_rounds(&self) -> u64 {
        self.held_rounds
    }

    /// Runs one round of the device's work now; whether anything happened.
    fn round(&mut self) -> bool {
        if self.polling {
            let worked = self.engine.app_round(true);
            if self.engine.tx_held.load(Ordering::Relaxed) {
                self.held_rounds += 1;
            }
            worked
        } else {
            self.engine.round()
        }
    }

    /// Moves what the device completed into [`Node::completions`]. An engine-thread node's
    /// application reads them as a sleeping application woken by its completion queue does; a
    /// polling node's application takes them without another look at the device (its next
    /// poll, the next round, sends what the last one held back).
    fn drain_completions(&mut self) {
        let mut out = [Completion::default(); 32];
        loop {
            let n = if self.polling {
                self.cq.pop_into(&mut out)
            } else {
                self.engine.poll_cq(&self.cq, &mut out, false).unwrap_or(0)
            };
            if n == 0 {
                break;
            }
            self.completions.extend(&out[..n]);
        }
    }
}

/// A queue pair of a [`Node`], for posting and inspecting.
#[derive(Debug, Clone, Copy)]
pub struct QpRef<'a> {
    node: &'a Node,
    qpn: u32,
}

impl QpRef<'_> {
    /// Posts a send request.
    ///
    /// # Errors
    /// The device's refusal.
    pub fn post_send(&self, wqe: SendWqe) -> Result<(), Error> {
        self.node.post_send(self.qpn, wqe)
    }

    /// Posts a receive request.
    ///
    /// # Errors
    /// The device's refusal.
    pub fn post_recv(&self, wqe: RecvWqe) -> Result<(), Error> {
        self.node.post_recv(self.qpn, wqe)
    }

    /// Modifies the queue pair.
    ///
    /// # Errors
    /// The protocol's refusal.
    pub fn modify(&self, attr: &QpAttr) -> Result<(), ModifyError> {
        self.node.modify(self.qpn, attr)
    }

    /// The queue pair's state.
    pub fn state(&self) -> QpState {
        self.node.state(self.qpn)
    }

    /// The queue pair's counters.
    pub fn counters(&self) -> QpCounters {
        self.node.counters(self.qpn)
    }

    /// The queue pair's attributes.
    pub fn attr(&self) -> QpAttr {
        self.node.attr(self.qpn)
    }
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: Instant,
    seq: u64,
    to: usize,
    from: SocketAddrV4,
    data: Vec<u8>,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The stop condition held.
    Done,
    /// Nothing left to do: no datagram in flight, no timer armed, nothing to send.
    Quiescent,
    /// The virtual deadline passed first.
    Deadline,
}

/// Parameters to connect two queue pairs (both sides get the same path MTU).
#[derive(Debug, Clone, Copy)]
pub struct ConnectOpts {
    /// Path MTU.
    pub mtu: Mtu,
    /// Remote rights each responder grants.
    pub access: Access,
    /// Local ACK timeout exponent.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7: forever).
    pub rnr_retry: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Initiator depth.
    pub max_rd_atomic: u8,
    /// Responder depth.
    pub max_dest_rd_atomic: u8,
    /// First PSN of side A's requests.
    pub psn_a: Psn,
    /// First PSN of side B's requests.
    pub psn_b: Psn,
    /// Protection domain of side A's queue pair.
    pub pd_a: u32,
    /// Protection domain of side B's queue pair.
    pub pd_b: u32,
    /// Queue depths.
    pub max_wr: u32,
}

impl Default for ConnectOpts {
    fn default() -> ConnectOpts {
        ConnectOpts {
            mtu: Mtu::Mtu1024,
            access: Access::ALL,
            timeout: 8,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            psn_a: Psn::new(0x100),
            psn_b: Psn::new(0x200),
            pd_a: 1,
            pd_b: 1,
            max_wr: 256,
        }
    }
}

/// The simulation: devices, a network, virtual time.
pub struct Sim {
    now: Instant,
    clock: Arc<AtomicU64>,
    nodes: Vec<Node>,
    rng: Rng,
    net: NetConfig,
    queue: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    stats: NetStats,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("now", &self.now)
            .field("nodes", &self.nodes)
            .field("in_flight", &self.queue.len())
            .field("stats", &self.stats)
            .finish()
    }
}

/// How long a polling application takes between two polls of its completion queue.
const POLL_INTERVAL: Duration = Duration::from_micros(1);

impl Sim {
    /// An empty simulation at time zero.
    pub fn new(seed: u64, net: NetConfig) -> Sim {
        Sim {
            now: Instant::ZERO,
            clock: Arc::new(AtomicU64::new(0)),
            nodes: Vec::new(),
            rng: Rng::new(seed),
            net,
            queue: BinaryHeap::new(),
            seq: 0,
            stats: NetStats::default(),
        }
    }

    /// Virtual now.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// Network statistics.
    pub fn stats(&self) -> &NetStats {
        &self.stats
    }

    /// Changes the network's behaviour from now on.
    pub fn set_net(&mut self, net: NetConfig) {
        self.net = net;
    }

    /// Adds a device at `addr` and returns its index. Its sends use GSO (segment `k` of a train
    /// carries IPv4 identification `k`, which its ICRC covers and the receiver solves for).
    ///
    /// # Panics
    /// For an IPv6 address: the soft device's engine speaks IPv4.
    pub fn add_node(&mut self, addr: IpAddr, caps: ChecksumCapabilities) -> usize {
        let IpAddr::V4(addr) = addr else {
            panic!("the soft device's engine speaks IPv4, not {addr}");
        };
        let io = Arc::new(SimIo {
            clock: self.clock.clone(),
            outbound: Mutex::new(Vec::new()),
            inbound: Arc::new(Mutex::new(VecDeque::new())),
            gso: true,
        });
        let engine = Engine::new(
            io.clone(),
            engine::Config {
                addr,
                checksum: caps,
                active_mtu: Mtu::Mtu4096,
                poll_rx: true,
                gather: true,
                key_seed: Some(self.rng.next_u64()),
            },
        );
        let events = Arc::new(Events::default());
        let sink: Arc<dyn EventSink> = events.clone();
        let cq = engine
            .create_cq(
                1 << 16,
                EventFd::new().expect("an eventfd for the simulated queue"),
                sink,
                self.nodes.len() as u64,
            )
            .expect("a completion queue");
        self.nodes.push(Node {
            mem: NodeMem {
                engine: engine.clone(),
            },
            engine,
            io,
            addr,
            cq,
            events,
            qps: HashMap::new(),
            link_free: Instant::ZERO,
            polling: false,
            wakeup: Duration::ZERO,
            wake_at: None,
            held_rounds: 0,
            completions: VecDeque::new(),
            down: false,
        });
        self.nodes.len() - 1
    }

    /// Device `i`.
    pub fn node(&self, i: usize) -> &Node {
        &self.nodes[i]
    }

    /// Device `i`, mutably.
    pub fn node_mut(&mut self, i: usize) -> &mut Node {
        &mut self.nodes[i]
    }

    /// Creates a queue pair on `a` and one on `b` and moves both to RTS, connected to each
    /// other. Returns `(qpn on a, qpn on b)`.
    ///
    /// # Panics
    /// If a transition fails (the options are out of range): a test set-up error.
    pub fn connect(&mut self, a: usize, b: usize, o: &ConnectOpts) -> (u32, u32) {
        let caps = QpCaps {
            max_send_wr: o.max_wr,
            max_recv_wr: o.max_wr,
            max_send_sge: crate::soft::proto::MAX_SGE as u32,
            max_recv_sge: crate::soft::proto::MAX_SGE as u32,
            max_inline_data: crate::soft::proto::MAX_INLINE as u32,
        };
        let qa = self.nodes[a].create_qp(o.pd_a, caps);
        let qb = self.nodes[b].create_qp(o.pd_b, caps);
        let (addr_a, addr_b) = (self.nodes[a].addr, self.nodes[b].addr);
        let sides = [
            (a, qa, addr_b, qb, o.psn_b, o.psn_a),
            (b, qb, addr_a, qa, o.psn_a, o.psn_b),
        ];
        for (node, qpn, peer, peer_qpn, rq_psn, sq_psn) in sides {
            let n = &self.nodes[node];
            n.modify(qpn, &QpAttr::init(o.access))
                .expect("RESET -> INIT");
            n.modify(
                qpn,
                &QpAttr::rtr(
                    Gid::from_ipv4(peer),
                    peer_qpn,
                    rq_psn,
                    o.mtu,
                    o.max_dest_rd_atomic,
                    o.min_rnr_timer,
                ),
            )
            .expect("INIT -> RTR");
            n.modify(
                qpn,
                &QpAttr::rts(sq_psn, o.timeout, o.retry_cnt, o.rnr_retry, o.max_rd_atomic),
            )
            .expect("RTR -> RTS");
        }
        self.pump();
        (qa, qb)
    }

    /// Takes what device `i` sent and has not yet been put on the wire (to capture packets).
    pub fn take_sent(&mut self, i: usize) -> Vec<(SocketAddrV4, Vec<u8>)> {
        std::mem::take(&mut *lock(&self.nodes[i].io.outbound))
    }

    /// Hands a datagram to device `to` as if it came from `from` (hostile or hand-built
    /// packets).
    pub fn inject(&mut self, to: usize, from: SocketAddrV4, data: Vec<u8>) {
        let now = self.now;
        let node = &mut self.nodes[to];
        lock(&node.io.inbound).push_back((from, data));
        node.wake_at.get_or_insert(now + node.wakeup);
    }

    fn serialization(&self, len: usize) -> Duration {
        let bits = (len as u128 + 42) * 8; // + Ethernet/IP/UDP headers
        let ns = bits * 1_000_000_000 / u128::from(self.net.bits_per_sec.max(1));
        Duration::from_nanos(ns as u64)
    }

    fn route(&self, dst: Ipv4Addr) -> Option<usize> {
        self.nodes.iter().position(|n| n.addr == dst)
    }

    /// Puts one datagram on the wire, leaving at `depart`, with the configured faults.
    fn transmit(&mut self, from: usize, dst: SocketAddrV4, depart: Instant, data: Vec<u8>) {
        self.stats.sent += 1;
        let Some(to) = self.route(*dst.ip()) else {
            self.stats.unroutable += 1;
            return;
        };
        if dst.port() != ROCE_PORT || self.rng.chance(self.net.loss) {
            self.stats.lost += 1;
            return;
        }
        let copies = if self.rng.chance(self.net.duplicate) {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        let base = depart + self.net.delay;
        let from_addr = SocketAddrV4::new(self.nodes[from].addr, ROCE_PORT);
        for _ in 0..copies {
            let mut data = data.clone();
            let len = data.len();
            if len > 0 && self.rng.chance(self.net.corrupt) {
                self.stats.corrupted += 1;
                let bit = self.rng.below(len as u64 * 8) as usize;
                data[bit / 8] ^= 1 << (bit % 8);
            }
            let mut at = base;
            if self.rng.chance(self.net.reorder) {
                self.stats.reordered += 1;
                let w = self.net.reorder_window.as_nanos() as u64;
                at = at + Duration::from_nanos(1 + self.rng.below(w.max(1)));
            }
            self.seq += 1;
            self.queue.push(Reverse(InFlight {
                at,
                seq: self.seq,
                to,
                from: from_addr,
                data,
            }));
        }
    }

    /// Puts on the wire what every device sent, each transmitter at its line rate, and moves
    /// their completions out.
    fn pump(&mut self) {
        for i in 0..self.nodes.len() {
            let sent: Vec<Datagram> = std::mem::take(&mut *lock(&self.nodes[i].io.outbound));
            if self.nodes[i].down {
                continue;
            }
            for (dst, data) in sent {
                let depart = self.nodes[i].link_free.max(self.now) + self.serialization(data.len());
                self.nodes[i].link_free = depart;
                self.transmit(i, dst, depart, data);
            }
        }
        for n in &mut self.nodes {
            n.drain_completions();
        }
    }

    /// The next moment something happens.
    fn next_event(&self) -> Option<Instant> {
        let mut next = self.queue.peek().map(|r| r.0.at);
        for n in &self.nodes {
            if n.down {
                continue;
            }
            let t = n.engine.timers().earliest().map(Instant::from_nanos);
            // A polling application that holds acknowledgements back polls again soon.
            let held = (n.polling && n.engine.tx_held.load(Ordering::Relaxed))
                .then(|| self.now + POLL_INTERVAL);
            for c in [t, held, n.wake_at].into_iter().flatten() {
                next = Some(next.map_or(c, |x: Instant| x.min(c)));
            }
        }
        next
    }

    /// Runs until `done` holds, nothing is left to do, or virtual time reaches `deadline`.
    pub fn run_until(&mut self, deadline: Instant, mut done: impl FnMut(&Sim) -> bool) -> Outcome {
        loop {
            self.pump();
            if done(self) {
                return Outcome::Done;
            }
            let Some(next) = self.next_event() else {
                return Outcome::Quiescent;
            };
            if next > deadline {
                self.set_now(self.now.max(deadline));
                return Outcome::Deadline;
            }
            self.set_now(self.now.max(next));
            let now = self.now;
            while self.queue.peek().is_some_and(|r| r.0.at <= now) {
                let Some(Reverse(p)) = self.queue.pop() else {
                    break;
                };
                let node = &mut self.nodes[p.to];
                if !node.down {
                    self.stats.delivered += 1;
                    lock(&node.io.inbound).push_back((p.from, p.data));
                    node.wake_at.get_or_insert(p.at + node.wakeup);
                }
            }
            for n in &mut self.nodes {
                if n.down {
                    lock(&n.io.inbound).clear();
                    n.wake_at = None;
                    continue;
                }
                let rx = n.wake_at.is_some_and(|t| t <= now);
                let due = n
                    .engine
                    .timers()
                    .earliest()
                    .is_some_and(|t| t <= now.as_nanos());
                let held = n.polling && n.engine.tx_held.load(Ordering::Relaxed);
                if !(rx || due || held) {
                    continue;
                }
                if rx {
                    n.wake_at = None;
                }
                // Rounds until the node has taken everything that arrived and fired what is
                // due (a round takes one batch of datagrams).
                while n.round() {
                    if lock(&n.io.inbound).is_empty() {
                        break;
                    }
                }
            }
        }
    }

    fn set_now(&mut self, now: Instant) {
        self.now = now;
        self.clock.store(now.as_nanos(), Ordering::Relaxed);
    }

    /// Runs until quiescent or `deadline`.
    pub fn run(&mut self, deadline: Instant) -> Outcome {
        self.run_until(deadline, |_| false)
    }

    /// Runs until device `node` has at least `n` completions (or quiescence / the deadline).
    pub fn run_until_completions(&mut self, node: usize, n: usize, deadline: Instant) -> Outcome {
        self.run_until(deadline, |s| s.nodes[node].completions.len() >= n)
    }
}

#[cfg(test)]
mod tests;

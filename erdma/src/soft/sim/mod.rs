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

mod net;
mod node;
mod vec_memory;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::soft::engine::notify::EventSink;
use crate::soft::engine::{self, Engine, lock};
use crate::soft::proto::Instant;
use crate::soft::wire::{ChecksumCapabilities, Psn, ROCE_PORT};
use crate::sync::{AtomicU64, EventFd, Ordering};
use crate::vocab::{Access, Gid, Mtu, QpAttr, QpCaps};

pub use net::{NetConfig, NetStats, Rng};
pub use node::{Node, NodeMem, QpRef, Steering};
pub use vec_memory::{MrInfo, VecMemory};

use node::{Datagram, Events, SimIo};

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
    /// carries IPv4 identification `k`, which its ICRC covers and the receiver solves for). It
    /// has one engine lane, or as many as `ERDMA_SOFT_ENGINES` says (the driver's variable: a
    /// suite runs on devices of several lanes with it set), datagrams landing in them by their
    /// source ([`Steering::Source`], so that most are handed between lanes).
    ///
    /// # Panics
    /// For an IPv6 address: the soft device's engine speaks IPv4.
    pub fn add_node(&mut self, addr: IpAddr, caps: ChecksumCapabilities) -> usize {
        let lanes = std::env::var("ERDMA_SOFT_ENGINES")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(1);
        self.add_node_with(addr, caps, lanes, Steering::Source)
    }

    /// [`Sim::add_node`] for a device of `lanes` engine lanes (one receive queue each, at least
    /// one), datagrams landing in them as `steering` says.
    ///
    /// # Panics
    /// As [`Sim::add_node`].
    pub fn add_node_with(
        &mut self,
        addr: IpAddr,
        caps: ChecksumCapabilities,
        lanes: usize,
        steering: Steering,
    ) -> usize {
        let IpAddr::V4(addr) = addr else {
            panic!("the soft device's engine speaks IPv4, not {addr}");
        };
        let io = Arc::new(SimIo {
            clock: self.clock.clone(),
            outbound: Mutex::new(Vec::new()),
            inbound: (0..lanes.clamp(1, 64))
                .map(|_| Arc::new(Mutex::new(VecDeque::new())))
                .collect(),
            steering,
            gso: true,
            wakes: AtomicU64::new(0),
        });
        let engine = Engine::new(
            io.clone(),
            engine::Config {
                addr,
                checksum: caps,
                active_mtu: Mtu::Mtu4096,
                poll_rx: true,
                claim_rx: engine::RxClaim::Claim,
                gather: true,
                tx_on_lanes: lanes > 1,
                same_host: false,
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
        node.io.deliver(from, data);
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
            let t = n.earliest_timer().map(Instant::from_nanos);
            // A polling application that holds acknowledgements back polls again soon.
            let held = (n.polling && n.any_held()).then(|| self.now + POLL_INTERVAL);
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
                    node.io.deliver(p.from, p.data);
                    node.wake_at.get_or_insert(p.at + node.wakeup);
                }
            }
            for n in &mut self.nodes {
                if n.down {
                    n.io.clear_inbound();
                    n.wake_at = None;
                    continue;
                }
                let rx = n.wake_at.is_some_and(|t| t <= now);
                let due = n.earliest_timer().is_some_and(|t| t <= now.as_nanos());
                let held = n.polling && n.any_held();
                if !(rx || due || held) {
                    continue;
                }
                if rx {
                    n.wake_at = None;
                }
                // Rounds until the node has taken everything that arrived and fired what is
                // due (a round takes one batch of datagrams).
                while n.round() {
                    if n.io.inbound_empty() {
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
mod lane_tests;
#[cfg(test)]
mod tests;

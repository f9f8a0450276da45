//! A deterministic network simulation of soft devices on virtual time.
//!
//! Owns what integration tests and fuzz targets need to run the protocol core without sockets:
//! a seeded PRNG ([`Rng`]), memory regions backed by `Vec`s ([`VecMemory`]), a network between
//! any number of devices with seeded loss, reordering, duplication, corruption, delay and link
//! rate ([`NetConfig`]), and a driver loop that runs until quiescent or a virtual deadline
//! ([`Sim`]). Nothing here reads a clock or spawns a thread: the same seed gives the same run.
//!
//! It must stay a model: no sockets, no unsafe, no real time.

#![forbid(unsafe_code)]

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::net::IpAddr;
use std::time::Duration;

use crate::soft::proto::{
    AtomicOp, Device, Instant, MAX_DATAGRAM, Memory, MemoryError, QpParams, Region, RxMeta,
};
use crate::soft::wire::{ChecksumCapabilities, Psn, ROCE_PORT};
use crate::vocab::{Access, Completion, Mtu, QpAttr};

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
    /// Receivers see the IPv4 identification (exact ICRC check); otherwise they solve for it,
    /// as a UDP-socket driver must.
    pub ipv4_id_known: bool,
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
            ipv4_id_known: true,
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

/// One device in the simulation with its memory and the completions it produced.
#[derive(Debug)]
pub struct Node {
    /// The device.
    pub dev: Device,
    /// Its memory.
    pub mem: VecMemory,
    /// Completions drained from the device, oldest first.
    pub completions: VecDeque<Completion>,
    /// When its transmitter is free again.
    link_free: Instant,
    /// Stops sending and receiving (a vanished peer).
    pub down: bool,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: Instant,
    seq: u64,
    to: usize,
    from: IpAddr,
    src_port: u16,
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
#[derive(Debug)]
pub struct Sim {
    now: Instant,
    nodes: Vec<Node>,
    rng: Rng,
    net: NetConfig,
    queue: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    buf: Vec<u8>,
    pool: Vec<Vec<u8>>,
    stats: NetStats,
}

impl Sim {
    /// An empty simulation at time zero.
    pub fn new(seed: u64, net: NetConfig) -> Sim {
        Sim {
            now: Instant::ZERO,
            nodes: Vec::new(),
            rng: Rng::new(seed),
            net,
            queue: BinaryHeap::new(),
            seq: 0,
            buf: vec![0; MAX_DATAGRAM],
            pool: Vec::new(),
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

    /// Adds a device at `addr` and returns its index.
    pub fn add_node(&mut self, addr: IpAddr, caps: ChecksumCapabilities) -> usize {
        self.nodes.push(Node {
            dev: Device::new(addr, caps),
            mem: VecMemory::new(),
            completions: VecDeque::new(),
            link_free: Instant::ZERO,
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
        let addr_a = self.nodes[a].dev.local_addr();
        let addr_b = self.nodes[b].dev.local_addr();
        let mut cfg_a = QpParams::new(o.pd_a, addr_a);
        cfg_a.caps.max_send_wr = o.max_wr;
        cfg_a.caps.max_recv_wr = o.max_wr;
        let mut cfg_b = QpParams {
            pd: o.pd_b,
            ..cfg_a
        };
        cfg_b.local_addr = addr_b;
        let qa = self.nodes[a].dev.create_qp(cfg_a);
        let qb = self.nodes[b].dev.create_qp(cfg_b);
        let sides = [
            (a, qa, addr_b, qb, o.psn_b, o.psn_a),
            (b, qb, addr_a, qa, o.psn_a, o.psn_b),
        ];
        for (node, qpn, peer, peer_qpn, rq_psn, sq_psn) in sides {
            let qp = self.nodes[node].dev.qp_mut(qpn).expect("just created");
            qp.modify(&QpAttr::init(o.access)).expect("RESET -> INIT");
            qp.modify(&QpAttr::rtr(
                peer,
                peer_qpn,
                rq_psn,
                o.mtu,
                o.max_dest_rd_atomic,
                o.min_rnr_timer,
            ))
            .expect("INIT -> RTR");
            qp.modify(&QpAttr::rts(
                sq_psn,
                o.timeout,
                o.retry_cnt,
                o.rnr_retry,
                o.max_rd_atomic,
            ))
            .expect("RTR -> RTS");
        }
        (qa, qb)
    }

    fn serialization(&self, len: usize) -> Duration {
        let bits = (len as u128 + 42) * 8; // + Ethernet/IP/UDP headers
        let ns = bits * 1_000_000_000 / u128::from(self.net.bits_per_sec.max(1));
        Duration::from_nanos(ns as u64)
    }

    fn route(&self, dst: IpAddr) -> Option<usize> {
        self.nodes.iter().position(|n| n.dev.local_addr() == dst)
    }

    /// Puts one datagram on the wire with the configured faults.
    fn transmit(&mut self, from: usize, dst: IpAddr, src_port: u16, len: usize) {
        self.stats.sent += 1;
        let Some(to) = self.route(dst) else {
            self.stats.unroutable += 1;
            return;
        };
        if self.rng.chance(self.net.loss) {
            self.stats.lost += 1;
            return;
        }
        let copies = if self.rng.chance(self.net.duplicate) {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        let base = self.now + self.serialization(len) + self.net.delay;
        for _ in 0..copies {
            let mut data = self.pool.pop().unwrap_or_default();
            data.clear();
            data.extend_from_slice(&self.buf[..len]);
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
            let from_addr = self.nodes[from].dev.local_addr();
            self.queue.push(Reverse(InFlight {
                at,
                seq: self.seq,
                to,
                from: from_addr,
                src_port,
                data,
            }));
        }
    }

    /// Lets every device with a free transmitter send until it has nothing or its link is busy.
    fn pump_transmit(&mut self) {
        for i in 0..self.nodes.len() {
            loop {
                let node = &mut self.nodes[i];
                if node.down || node.link_free > self.now {
                    break;
                }
                let Some(t) = node
                    .dev
                    .poll_transmit(self.now, &mut self.buf, &mut node.mem)
                else {
                    break;
                };
                let busy = self.serialization(t.len);
                self.nodes[i].link_free = self.now + busy;
                self.transmit(i, t.dst.ip(), t.src_port, t.len);
            }
        }
    }

    fn drain_completions(&mut self) {
        for n in &mut self.nodes {
            while let Some(c) = n.dev.poll_completion() {
                n.completions.push_back(c);
            }
        }
    }

    /// The next moment something happens.
    fn next_event(&self) -> Option<Instant> {
        let mut next = self.queue.peek().map(|r| r.0.at);
        for n in &self.nodes {
            if n.down {
                continue;
            }
            let t = n.dev.poll_timeout();
            let link = (n.link_free > self.now).then_some(n.link_free);
            for c in [t, link].into_iter().flatten() {
                next = Some(next.map_or(c, |x: Instant| x.min(c)));
            }
        }
        next
    }

    /// Runs until `done` holds, nothing is left to do, or virtual time reaches `deadline`.
    pub fn run_until(&mut self, deadline: Instant, mut done: impl FnMut(&Sim) -> bool) -> Outcome {
        loop {
            self.pump_transmit();
            self.drain_completions();
            if done(self) {
                return Outcome::Done;
            }
            let Some(next) = self.next_event() else {
                return Outcome::Quiescent;
            };
            if next > deadline {
                self.now = self.now.max(deadline);
                return Outcome::Deadline;
            }
            self.now = self.now.max(next);
            while self.queue.peek().is_some_and(|r| r.0.at <= self.now) {
                let Some(Reverse(p)) = self.queue.pop() else {
                    break;
                };
                let node = &mut self.nodes[p.to];
                if !node.down {
                    self.stats.delivered += 1;
                    let meta = RxMeta {
                        src: p.from,
                        src_port: p.src_port,
                        dst: node.dev.local_addr(),
                        dst_port: ROCE_PORT,
                        ipv4_id: self.net.ipv4_id_known.then_some(0),
                    };
                    let _ = node
                        .dev
                        .handle_datagram(self.now, &meta, &p.data, &mut node.mem);
                }
                self.pool.push(p.data);
            }
            for n in &mut self.nodes {
                if !n.down && n.dev.poll_timeout().is_some_and(|t| t <= self.now) {
                    n.dev.handle_timeout(self.now);
                }
            }
        }
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
#[path = "sim/tests.rs"]
mod tests;

#[cfg(test)]
#[path = "sim/slow_peer.rs"]
mod slow_peer;

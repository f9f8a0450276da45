//! One simulated device: its engine on a [`SimIo`] (the virtual clock and the node's side of the
//! network), its completion queue and memory, and what a test does with it.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::net::Rng;
use super::vec_memory::MrInfo;
use crate::error::Error;
use crate::soft::engine::batch::TxBatch;
use crate::soft::engine::lane::{lane_of, peek_dest_qpn};
use crate::soft::engine::notify::{CompletionRing, EventSink};
use crate::soft::engine::{Engine, Io, QpCell, RxQueue, lock};
use crate::soft::proto::{Instant, ModifyError, QpCounters, RecvWqe, SendWqe};
use crate::sync::{AtomicU64, Ordering};
use crate::vocab::{Access, AsyncEvent, Completion, QpAttr, QpCaps, QpState};

/// A datagram: its source or destination, and its bytes.
pub(super) type Datagram = (SocketAddrV4, Vec<u8>);

/// Which of a node's receive queues (engine lanes) a datagram arriving for it lands in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Steering {
    /// The lane serving its destination queue pair (the driver's reuseport program).
    #[default]
    Qpn,
    /// The lane chosen by its source address and port (the kernel's reuseport hash before the
    /// program is attached): one peer's datagrams all land in one lane.
    Source,
    /// Always a lane that does not serve its destination queue pair: every datagram is handed
    /// over between lanes.
    Wrong,
}

/// A node's side of the network: the virtual clock, what its engine sent, what waits for it
/// (one receive queue per lane).
pub(super) struct SimIo {
    pub(super) clock: Arc<AtomicU64>,
    pub(super) outbound: Mutex<Vec<Datagram>>,
    pub(super) inbound: Vec<Arc<Mutex<VecDeque<Datagram>>>>,
    pub(super) steering: Steering,
    pub(super) gso: bool,
    /// Wake-ups the engine signalled (to an engine thread the simulation does not have).
    pub(super) wakes: AtomicU64,
}

impl SimIo {
    /// Puts a datagram arriving from `from` in the receive queue its steering picks.
    pub(super) fn deliver(&self, from: SocketAddrV4, data: Vec<u8>) {
        let lanes = self.inbound.len();
        let lane = match (self.steering, peek_dest_qpn(&data)) {
            _ if lanes <= 1 => 0,
            (Steering::Qpn, Some(qpn)) => lane_of(qpn, lanes),
            (Steering::Wrong, Some(qpn)) => (lane_of(qpn, lanes) + 1) % lanes,
            (Steering::Source, _) | (_, None) => {
                (u32::from(*from.ip()) as usize ^ usize::from(from.port())) % lanes
            }
        };
        lock(&self.inbound[lane]).push_back((from, data));
    }

    /// Whether no datagram waits in any receive queue.
    pub(super) fn inbound_empty(&self) -> bool {
        self.inbound.iter().all(|q| lock(q).is_empty())
    }

    /// Drops every datagram waiting (a node gone down).
    pub(super) fn clear_inbound(&self) {
        for q in &self.inbound {
            lock(q).clear();
        }
    }
}

impl Io for SimIo {
    fn now(&self) -> Instant {
        Instant::from_nanos(self.clock.load(Ordering::Relaxed))
    }

    fn send(&self, _lane: usize, batches: &mut [&mut TxBatch]) -> io::Result<()> {
        let mut out = lock(&self.outbound);
        for b in batches.iter_mut() {
            b.drain_datagrams(|dst, bytes, _| out.push((dst, bytes.to_vec())));
        }
        Ok(())
    }

    fn gso(&self) -> bool {
        self.gso
    }

    // The simulation runs a node's lanes until none has work left (`Node::round`); the
    // wake-ups are only counted.
    fn wake(&self, _lane: usize) {
        self.wakes.fetch_add(1, Ordering::Relaxed);
    }

    fn lanes(&self) -> usize {
        self.inbound.len()
    }

    fn receiver(&self, lane: usize) -> Box<dyn RxQueue> {
        Box::new(SimRx {
            inbound: self.inbound[lane].clone(),
            taken: Vec::new(),
        })
    }

    fn refused(&self) -> u64 {
        0
    }

    fn kernel_drops(&self) -> Option<u64> {
        None
    }

    fn channels(&self) -> Option<&dyn crate::soft::engine::same_host::Channels> {
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
pub(super) struct Events(Mutex<Vec<AsyncEvent>>);

impl EventSink for Events {
    fn report(&self, ev: AsyncEvent) {
        lock(&self.0).push(ev);
    }
}

/// A node's registered memory, reached by copies.
pub struct NodeMem {
    pub(super) engine: Arc<Engine>,
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
    pub(super) engine: Arc<Engine>,
    pub(super) io: Arc<SimIo>,
    pub(super) addr: Ipv4Addr,
    /// The one completion queue every queue pair of the node completes into.
    pub(super) cq: Arc<CompletionRing>,
    pub(super) events: Arc<Events>,
    pub(super) qps: HashMap<u32, Arc<QpCell>>,
    /// When its transmitter is free again.
    pub(super) link_free: Instant,
    /// Rounds are taken as a polling application (acknowledgements held back until the next
    /// poll), not as the engine thread.
    pub(super) polling: bool,
    /// How long the device takes to notice datagrams that arrive while it is idle (the engine
    /// thread's wake-up); those arriving meanwhile are taken in one round.
    pub(super) wakeup: Duration,
    /// When the device takes its next receive round (datagrams are waiting).
    pub(super) wake_at: Option<Instant>,
    /// Rounds of a polling node that held acknowledgements back.
    pub(super) held_rounds: u64,
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
        self.engine.read_qp(self.cell(qpn), |q| q.attr())
    }

    /// A queue pair's counters.
    pub fn counters(&self, qpn: u32) -> QpCounters {
        self.engine
            .read_qp(self.cell(qpn), |q| q.counters().clone())
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

    /// The device's engine lanes.
    pub fn lanes(&self) -> usize {
        self.engine.lanes().len()
    }

    /// The lane serving queue pair `qpn`.
    pub fn lane_of(&self, qpn: u32) -> usize {
        lane_of(qpn, self.lanes())
    }

    /// Whether any lane's receive round held acknowledgements back.
    pub(super) fn any_held(&self) -> bool {
        self.engine
            .lanes()
            .iter()
            .any(|l| l.tx_held.load(Ordering::Relaxed))
    }

    /// The earliest deadline in any lane's timer table.
    pub(super) fn earliest_timer(&self) -> Option<u64> {
        self.engine
            .lanes()
            .iter()
            .filter_map(|l| l.timers.earliest())
            .min()
    }

    /// Runs one round of each lane's work now, and again while a lane handed another
    /// datagrams; whether anything happened.
    pub(super) fn round(&mut self) -> bool {
        let mut any = false;
        loop {
            let mut worked = false;
            if self.polling {
                worked |= self.engine.app_round(u64::MAX, true);
                if self.any_held() {
                    self.held_rounds += 1;
                }
            } else {
                for lane in 0..self.lanes() {
                    worked |= self.engine.round(lane, false);
                }
            }
            any |= worked;
            let handed = self.engine.lanes().iter().any(|l| l.inbox.is_pending());
            if !(worked && handed) {
                return any;
            }
        }
    }

    /// Moves what the device completed into [`Node::completions`]. An engine-thread node's
    /// application reads them as a sleeping application woken by its completion queue does; a
    /// polling node's application takes them without another look at the device (its next
    /// poll, the next round, sends what the last one held back).
    pub(super) fn drain_completions(&mut self) {
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

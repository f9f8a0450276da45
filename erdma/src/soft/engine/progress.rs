//! The engine's rounds: who transmits what, when.
//!
//! Owns [`Engine::progress`] (one queue pair's transmits into a batch, its completions into its
//! rings, its next deadline), the transmit ownership that keeps a queue pair's packets in PSN
//! order whichever thread emits them, acknowledgements held back by an application's receive
//! round, the receive round itself ([`Engine::round`], [`Engine::app_round`]: receive, route,
//! run due timers, send) and transmit slicing ([`TX_BUDGET`]).

#![allow(unsafe_code)] // commits lent payloads

use std::net::{IpAddr, SocketAddr, SocketAddrV4};
use std::sync::Arc;

use super::app_tx::COALESCING;
use super::batch::{LentBytes, Outgoing, TxBatch};
use super::lane::{Lane, lane_of, peek_dest_qpn};
use super::memory::DevMemory;
use super::{Engine, QpCell, RxState, TxState, lock, same_host};
use crate::soft::proto;
use crate::soft::wire::{OpFlags, Opcode, ROCE_PORT, icrc};
use crate::sync::{AtomicU32, AtomicU64, Ordering, fence};
use crate::vocab::{AsyncEvent, AsyncEventKind, EventElement, QpAttr, QpState, WorkQueue};

/// Packets one queue pair emits per [`Engine::progress`] call. A requester never has more than
/// its window in flight; a responder's READ reply can be millions of packets, and streaming it
/// whole in one call would hold the queue pair's lock, the memory-region table and the device's
/// receive path for all of it.
pub(crate) const TX_BUDGET: usize = 256;

/// How long after an application thread's last receive work the engine thread keeps off the
/// socket.
pub(crate) const APP_POLL_GRACE_NS: u64 = 1_000_000;

/// How long acknowledgements an application thread's receive round held back may wait for its
/// next call that sends, across its polls (those that find completions:
/// [`Engine::flush_held_aged`]; those that do receive work: [`Engine::service`]).
pub(crate) const HOLD_ON_POLL_NS: u64 = 50_000;

/// How long after an application round last held acknowledgements back its lane's engine
/// thread keeps its sleeps short ([`Engine::hold_watch`]).
const HOLD_WATCH_NS: u64 = 10_000_000;

/// Whether `lane` holds acknowledgements back that were first held under its `hold_ns`
/// ([`HOLD_ON_POLL_NS`]) before `now` (ns on the engine's clock).
fn holds_young(lane: &Lane, now: u64) -> bool {
    lane.tx_held.load(Ordering::Relaxed) && now < lane.hold_ends()
}

/// Whose round [`Engine::service`] runs.
#[derive(Debug, Clone, Copy)]
enum Caller {
    /// The lane's engine thread ([`Engine::round`]); `after_grace`: the first round after a
    /// polling application's grace ran out.
    Engine { after_grace: bool },
    /// A polling application thread ([`Engine::app_round`]) that read the clock at `started`.
    App { started: proto::Instant },
}

/// Who does a lane's receive work while an application thread polls ([`super::Config`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RxClaim {
    /// Polling threads do receive work when their queue is empty, and the engine thread serves
    /// the socket too.
    Share = 0,
    /// A polling thread takes the receive path over: the engine thread keeps off it until
    /// [`APP_POLL_GRACE_NS`] after the thread's last receive work.
    Claim = 1,
    /// `Claim` until the program is seen to wait for what datagrams carry some other way (it
    /// watches memory, as perftest's latency tests do): a grace runs out with datagrams
    /// waiting [`Engine::ADAPT_STRIKES`] times, each fewer than
    /// [`Engine::ADAPT_FORGIVE_DATAGRAMS`] datagrams and [`Engine::ADAPT_FORGIVE_POLLS`]
    /// application polls after the last — then `Share` for good.
    /// For the C library, which cannot know how its programs wait: those that poll keep
    /// claim's latency (a polling thread the scheduler held off the CPU past a grace or two is
    /// forgiven once it polls on), a memory watcher pays three graces.
    Adaptive = 2,
}

/// Who does the receive work now, as an [`RxClaim`], and an adaptive device's evidence.
#[derive(Debug)]
pub(crate) struct ClaimState {
    claim: AtomicU32,
    /// The device's datagram count when a grace last ran out with datagrams waiting;
    /// `u64::MAX` before the first time.
    strike: AtomicU64,
    /// Graces run out with datagrams waiting in a row, each within
    /// [`Engine::ADAPT_FORGIVE_DATAGRAMS`] and [`Engine::ADAPT_FORGIVE_POLLS`] of the last.
    strikes: AtomicU32,
    /// Polling application threads' rounds while the device adapts (counted without a locked
    /// instruction: two threads polling at once may lose a count, which does not matter here).
    polls: AtomicU64,
    /// `polls` when a grace last ran out with datagrams waiting.
    strike_polls: AtomicU64,
}

impl ClaimState {
    pub(super) fn new(claim: RxClaim) -> ClaimState {
        ClaimState {
            claim: AtomicU32::new(claim as u32),
            strike: AtomicU64::new(u64::MAX),
            strikes: AtomicU32::new(0),
            polls: AtomicU64::new(0),
            strike_polls: AtomicU64::new(0),
        }
    }
}

impl Engine {
    /// Datagrams an adaptive device must receive between two graces that ran out with
    /// datagrams waiting for the second not to count as one in a row with the first. A memory
    /// watcher's graces run out one round trip apart (a few datagrams); a polling thread that
    /// was merely preempted past a grace polls on for thousands first (about a hundred a
    /// millisecond).
    pub(crate) const ADAPT_FORGIVE_DATAGRAMS: u64 = 256;

    /// Missed graces in a row (each within [`Engine::ADAPT_FORGIVE_DATAGRAMS`] of the last) that
    /// turn an adaptive device to sharing. Two were not enough evidence: perftest's WRITE
    /// latency test, which polls, missed two in a row in a third of its runs on 16 idle CPUs
    /// (bench/results/dropin.md); a memory watcher misses one every round trip, so a third
    /// costs it one more millisecond, once.
    pub(crate) const ADAPT_STRIKES: u32 = 3;

    /// Application polls between two graces that ran out with datagrams waiting for the second
    /// not to count as one in a row with the first. A memory watcher polls only for its own
    /// request between two (tens of polls); a poller the scheduler took off the CPU polls
    /// thousands of times a millisecond first — on two CPUs, every few milliseconds, while few
    /// datagrams come to a bandwidth test's client (bench/results/dropin.md).
    pub(crate) const ADAPT_FORGIVE_POLLS: u64 = 1024;

    /// The driver's engine thread found the grace of a polling application over and took the
    /// receive path back; `waited`: datagrams were waiting for it. The
    /// [`Engine::ADAPT_STRIKES`]th such time in a row, each within
    /// [`Engine::ADAPT_FORGIVE_DATAGRAMS`] datagrams and [`Engine::ADAPT_FORGIVE_POLLS`]
    /// application polls of the last, turns an adaptive device to sharing.
    pub(crate) fn grace_ran_out(&self, waited: bool) {
        if !waited || self.rx_claim() != RxClaim::Adaptive {
            return;
        }
        let now = self.datagrams_received();
        let last = self.claim_rx.strike.swap(now, Ordering::Relaxed);
        let polls = self.claim_rx.polls.load(Ordering::Relaxed);
        let last_polls = self.claim_rx.strike_polls.swap(polls, Ordering::Relaxed);
        let strikes = if last != u64::MAX
            && now.saturating_sub(last) < Engine::ADAPT_FORGIVE_DATAGRAMS
            && polls.wrapping_sub(last_polls) < Engine::ADAPT_FORGIVE_POLLS
        {
            self.claim_rx.strikes.load(Ordering::Relaxed) + 1
        } else {
            1
        };
        self.claim_rx.strikes.store(strikes, Ordering::Relaxed);
        if strikes >= Engine::ADAPT_STRIKES {
            let _ = self.claim_rx.claim.compare_exchange(
                RxClaim::Adaptive as u32,
                RxClaim::Share as u32,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// Datagrams the lanes have taken off their sockets so far.
    pub(crate) fn datagrams_received(&self) -> u64 {
        self.rcvd_datagrams.load(Ordering::Relaxed)
    }

    /// Who does the receive work while an application thread polls, now.
    pub(crate) fn rx_claim(&self) -> RxClaim {
        match self.claim_rx.claim.load(Ordering::Relaxed) {
            0 => RxClaim::Share,
            1 => RxClaim::Claim,
            _ => RxClaim::Adaptive,
        }
    }

    #[cfg(test)]
    pub(crate) fn set_rx_claim(&self, claim: RxClaim) {
        self.claim_rx.claim.store(claim as u32, Ordering::Relaxed);
    }
}

impl Engine {
    /// Sends what application threads' receive rounds held back on any lane, if anything.
    /// When another thread has a lane's receive path, that thread sends it (every round starts
    /// by doing so).
    pub(crate) fn flush_held(&self) {
        for lane in self.lanes.iter() {
            if lane.tx_held.load(Ordering::Relaxed) {
                self.send_held_lane(lane.index, false);
            }
        }
    }

    /// [`Engine::flush_held`] for what was held back [`HOLD_ON_POLL_NS`] ago or earlier: a
    /// poll that found completions. A thread that polls its send queue's completion and then
    /// its receive queue's before it answers (perftest's latency loop) has its acknowledgements
    /// leave with the answer, in one system call, not in one of their own ahead of it.
    pub(crate) fn flush_held_aged(&self) {
        let mut now = None;
        for lane in self.lanes.iter() {
            if lane.tx_held.load(Ordering::Relaxed) {
                let now = *now.get_or_insert_with(|| self.now().as_nanos());
                if !holds_young(lane, now) {
                    self.send_held_lane(lane.index, false);
                }
            }
        }
    }

    /// [`Engine::flush_held`] for one lane.
    pub(crate) fn flush_held_lane(&self, lane: usize) {
        if self.lanes[lane].tx_held.load(Ordering::Relaxed) {
            self.send_held_lane(lane, false);
        }
    }

    /// Sends whatever every lane's receive batch holds. With `wait`, waits for a receive path
    /// another thread has; without, leaves its batch to that thread.
    pub(crate) fn send_held(&self, wait: bool) {
        for lane in 0..self.lanes.len() {
            self.send_held_lane(lane, wait);
        }
    }

    /// [`Engine::send_held`] for one lane.
    pub(crate) fn send_held_lane(&self, lane: usize, wait: bool) {
        let l = &self.lanes[lane];
        let mut st = match l.rx.try_lock() {
            Ok(st) => st,
            Err(_) if wait => lock(&l.rx),
            Err(_) => return,
        };
        // A held batch carries answers only, so it owns no queue pair (see `service`).
        debug_assert!(st.tx.owned.is_empty());
        st.tx.discard_stale_lent();
        self.flush(lane, &mut st.tx.batch);
        l.tx_held.store(false, Ordering::Relaxed);
    }

    /// Drains a queue pair's transmits into `tx`, its completions into its rings, and schedules
    /// its next deadline. The caller holds the queue pair's lock (`q`).
    pub(super) fn progress(
        &self,
        cell: &Arc<QpCell>,
        q: &mut proto::Qp,
        mem: &mut DevMemory<'_>,
        tx: &mut TxState,
        now: proto::Instant,
    ) {
        mem.set_qp(cell.qpn);
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
                self.flush(cell.lane, &mut tx.batch);
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
                // The network numbers GSO segment k with IPv4 identification k, which the ICRC
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
            if !ring_of(cell, c.queue()).push(c) {
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
                ring_of(cell, c.queue()).push(c);
            }
        }
        if let Some(deadline) = q.poll_timeout() {
            self.schedule(cell, deadline.as_nanos());
        }
    }

    /// Ends an application call: sends what it queued, still under the queue pair's lock (so
    /// two threads posting to one queue pair cannot reorder its packets), unless the thread
    /// coalesces sends.
    pub(super) fn end_call(&self, lane: usize, tx: &mut TxState) {
        if COALESCING.with(|d| d.get() == 0) {
            self.flush_app(lane, &mut tx.batch);
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
    pub(super) fn release(&self, tx: &mut TxState) {
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
                    self.flush(cell.lane, &mut tx.batch);
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
    /// its last receive round on lane `lane` held back (when no other thread has that receive
    /// path; else that thread sends it). Answering a request then costs one send, not two.
    pub(super) fn flush_app(&self, lane: usize, batch: &mut TxBatch) {
        if batch.is_empty() {
            return;
        }
        let l = &self.lanes[lane];
        if l.tx_held.load(Ordering::Relaxed)
            && let Ok(mut st) = l.rx.try_lock()
        {
            l.tx_held.store(false, Ordering::Relaxed);
            debug_assert!(st.tx.owned.is_empty());
            if let Err(e) = self.io.send(lane, &mut [batch, &mut st.tx.batch]) {
                eprintln!("erdma soft device {}: send failed: {e}", self.addr);
            }
            return;
        }
        self.flush(lane, batch);
    }

    /// A queue pair now points at its peer: references on if that peer takes them, and the
    /// peer asked if it should be ([`super::same_host::SameHost::want`]).
    pub(super) fn ask_same_host(&self, q: &mut proto::Qp, tx: &mut TxState) {
        if let (Some(sh), Some(IpAddr::V4(peer))) = (&self.same_host, q.peer_addr()) {
            let (token, hello) = sh.want(peer, self.now().as_nanos());
            q.set_peer_refs(token);
            if let Some(h) = hello {
                self.queue_exchange(tx, &h);
            }
        }
    }

    /// Queues a datagram of the same-host exchange ([`super::same_host`]) on `tx`'s batch.
    pub(super) fn queue_exchange(&self, tx: &mut TxState, r: &super::same_host::Reply) {
        if tx.batch.is_full() {
            self.flush(0, &mut tx.batch);
        }
        // Not held back with an application round's acknowledgements: the exchange is
        // between devices, and no call of the application's will carry it out.
        tx.answers_only = false;
        tx.batch.space()[..r.len].copy_from_slice(&r.bytes[..r.len]);
        let at = tx.batch.place(Outgoing {
            len: r.len,
            dst: SocketAddrV4::new(r.dst, ROCE_PORT),
            // No queue pair's flow: nothing orders it against their packets.
            flow: u32::MAX,
            middle: false,
        });
        tx.batch.commit(at);
    }

    /// Sends `batch` through lane `lane`'s side of the network.
    pub(super) fn flush(&self, lane: usize, batch: &mut TxBatch) {
        if batch.is_empty() {
            return;
        }
        if let Err(e) = self.io.send(lane, &mut [batch]) {
            // The protocol recovers lost packets; a broken link shows as retries exhausted.
            eprintln!("erdma soft device {}: send failed: {e}", self.addr);
        }
    }

    /// One round of lane `lane`'s engine thread (see [`Engine::service`]). Returns whether
    /// anything happened. `after_grace`: an application thread that polled stopped doing so
    /// while datagrams may wait (its grace ran out); this round's acknowledgements are then
    /// held back for that thread's next call (below).
    pub(crate) fn round(&self, lane: usize, after_grace: bool) -> bool {
        let l = &self.lanes[lane];
        let mut st = lock(&l.rx);
        self.service(l, &mut st, Caller::Engine { after_grace })
    }

    /// Every lane takes in what has arrived and sends what it holds, now. The drop-in
    /// librdmacm does this before it reports that a peer left, so that the program's completion
    /// queues show what the peer sent before it went, as a NIC's would.
    #[cfg(feature = "raw-provider")]
    pub(crate) fn take_in(&self) {
        for lane in 0..self.lanes.len() {
            self.round(lane, false);
        }
    }

    /// How long an engine thread of lane `lane` that finds nothing to do at `now` may sleep
    /// (ns on the engine's clock) beyond its deadlines: while application rounds held
    /// acknowledgements back within the last [`HOLD_WATCH_NS`], one grace
    /// ([`APP_POLL_GRACE_NS`]), so that the next hold need not wake it; `None` otherwise (the
    /// first hold after a quiet spell wakes it: [`Engine::service`]).
    pub(crate) fn hold_watch(&self, lane: usize, now: u64) -> Option<u64> {
        let held = self.lanes[lane].held_at.load(Ordering::Relaxed);
        (held != 0 && now.saturating_sub(held) < HOLD_WATCH_NS).then(|| now + APP_POLL_GRACE_NS)
    }

    /// When the acknowledgements lane `lane` holds back must leave without the application
    /// (ns on the engine's clock): its `hold_ns` after they were first held. `None`: nothing
    /// is held, or it is held longer than that already.
    pub(crate) fn held_until(&self, lane: usize, now: u64) -> Option<u64> {
        let l = &self.lanes[lane];
        holds_young(l, now).then(|| l.hold_ends())
    }

    /// One round of a lane's work: feed what other lanes handed it, receive and feed every
    /// queued datagram, fire due timers, send. Returns whether anything happened. The caller
    /// holds the lane's receive lock (`st`).
    ///
    /// An application's round ([`Caller::App`]) judges due timers by the time it read just
    /// before (one clock read less per empty round of a polling thread) unless datagrams came.
    ///
    /// `after_grace` (an engine thread's round, [`Caller::Engine`]): a polling application
    /// stopped polling with datagrams on their way — a ping-pong that polls for its own
    /// request's completion, then watches memory for the peer's (perftest's latency tests).
    /// Sent at once, this round's acknowledgement would reach the peer alone, end its poll
    /// before this side's answer arrives, and the peer's next request would wait out its own
    /// grace: each side in turn, every round trip. Held like an application round's, it
    /// leaves with the answer the application posts on seeing the data (or on its own,
    /// [`HOLD_ON_POLL_NS`] later), and the peer's poll finds both.
    fn service(&self, lane: &Lane, st: &mut RxState, caller: Caller) -> bool {
        let (from_app, started) = match caller {
            Caller::App { started } => (true, Some(started)),
            Caller::Engine { .. } => (false, None),
        };
        // Whatever an application round held back goes first (answers only: it owns no queue
        // pair) — unless this is an application's round and it was held back only just now:
        // then it stays with this round's answers for the thread's next send (a request and
        // its acknowledgement can come in two rounds, and the thread answers right after).
        debug_assert!(st.tx.owned.is_empty());
        st.tx.discard_stale_lent();
        let keep = from_app && started.is_some_and(|t| holds_young(lane, t.as_nanos()));
        if !keep {
            self.flush(lane.index, &mut st.tx.batch);
        }
        let mut worked = false;
        if lane.inbox.is_pending() {
            lane.inbox.take(&mut st.handed);
            if !st.handed.is_empty() {
                worked = true;
                self.feed(lane, st, true);
            }
        }
        // After a round that found nothing, an application's round takes one message and
        // returns: the datagram a ping-pong waits for then comes back without the kernel
        // trying a second slot first. Rounds that find data take whole batches.
        let narrow = from_app && st.app_dry;
        let want = if narrow { 1 } else { st.rx.slots() };
        loop {
            let messages = match st.rx.fill(want) {
                Ok(n) => n,
                Err(e) => {
                    eprintln!("erdma soft device {}: receive failed: {e}", self.addr);
                    0
                }
            };
            if st.rx.len() == 0 {
                break;
            }
            worked = true;
            self.feed(lane, st, false);
            if narrow || messages < want {
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
        worked |= self.fire_timers(lane, &mut st.tx, &mut st.due, now);
        // Same-host exchanges left unfinished (a datagram of theirs lost) start again.
        if let Some(sh) = &self.same_host {
            sh.retry(now.as_nanos(), |hello| {
                self.queue_exchange(&mut st.tx, &hello);
                worked = true;
            });
        }
        if matches!(
            caller,
            Caller::App { .. } | Caller::Engine { after_grace: true }
        ) && !st.tx.batch.is_empty()
            && st.tx.answers_only
            && st.tx.owned.is_empty()
        {
            // An application thread is waiting for what it just received: let it go now and
            // send the acknowledgements after whatever its next call sends, so that a request
            // the peer waits for does not queue behind them. They leave on every path the
            // thread can stop by: its next poll (one that finds completions, or any receive
            // round, only [`HOLD_ON_POLL_NS`] after they were first held), arming a completion
            // queue, destroying a queue pair, closing the device, process exit, or the engine
            // thread once calls stop coming.
            if !keep {
                lane.held_at.store(now.as_nanos(), Ordering::Relaxed);
            }
            // The lane's engine thread may be asleep already, on a plan made before this hold
            // (this round drained the socket under it): either its look at `tx_held` after
            // publishing the plan sees this store, or this sees the plan and wakes it, so that
            // held acknowledgements never wait for the peer's retransmission. While holds keep
            // coming its plans end within a grace ([`Engine::hold_watch`]) of its clock, read
            // perhaps a little after this round's: no wake-up for a plan within two.
            lane.tx_held.store(true, Ordering::Relaxed);
            if !keep {
                fence(Ordering::SeqCst);
                let within = now.as_nanos() + 2 * APP_POLL_GRACE_NS;
                if lane.timers.sleeps_past(within) {
                    self.io.wake(lane.index);
                }
            }
        } else {
            self.flush(lane.index, &mut st.tx.batch);
            self.release(&mut st.tx);
            lane.tx_held.store(false, Ordering::Relaxed);
        }
        worked
    }

    /// Lets a polling application thread do the receive work of the lanes in `lanes` (bit `i`:
    /// lane `i`; a completion queue's [`super::notify::CompletionRing::lanes`]) itself, each
    /// when no other thread is doing it: a busy-polling application then never waits for an
    /// engine thread to be scheduled. Returns whether anything happened.
    ///
    /// `polling`: whether the thread goes on polling after this (it has not armed its
    /// completion queue to sleep); only then does a lane's engine thread keep off its receive
    /// path.
    pub(crate) fn app_round(&self, lanes: u64, polling: bool) -> bool {
        if !self.poll_rx {
            return false;
        }
        let mut worked = false;
        // Read once a call: a poll is the hot path, and the claim changes once at most.
        let claim = self.rx_claim();
        if polling && claim == RxClaim::Adaptive {
            let polls = &self.claim_rx.polls;
            polls.store(
                polls.load(Ordering::Relaxed).wrapping_add(1),
                Ordering::Relaxed,
            );
        }
        for l in self.lanes_in(lanes) {
            if let Ok(mut st) = l.rx.try_lock() {
                let now = self.now();
                if polling && claim != RxClaim::Share {
                    l.app_polled.store(now.as_nanos(), Ordering::Relaxed);
                }
                worked |= self.service(l, &mut st, Caller::App { started: now });
            }
        }
        worked
    }

    /// The lanes named by the bits of `mask`.
    fn lanes_in(&self, mask: u64) -> impl Iterator<Item = &Lane> {
        self.lanes
            .iter()
            .filter(move |l| mask & (1 << l.index.min(63)) != 0)
    }

    /// An application thread stops polling to sleep on a completion queue served by the lanes
    /// in `lanes` (as [`Engine::app_round`]): their engine threads take the receive paths and
    /// the timers back now, not at their next look (up to [`APP_POLL_GRACE_NS`] later, with
    /// datagrams waiting meanwhile).
    pub(crate) fn app_sleeps(&self, lanes: u64) {
        for l in self.lanes_in(lanes) {
            // Pairs with the driver's sleep: the engine thread publishes that it parks, then
            // reads `app_polled`; here `app_polled` is cleared, then the parking read. One of
            // the two sees the other.
            l.app_polled.store(0, Ordering::SeqCst);
            if l.parked_for_app.load(Ordering::SeqCst) {
                self.io.wake(l.index);
            }
        }
    }

    /// When an application thread did lane `lane`'s receive work within the last
    /// `APP_POLL_GRACE_NS` (so it is taken to be polling still): the time at which that stops
    /// being so. `None` otherwise.
    pub(crate) fn app_polling(&self, lane: usize, now: u64) -> Option<u64> {
        let polled = self.lanes[lane].app_polled.load(Ordering::SeqCst);
        let recheck = polled.saturating_add(APP_POLL_GRACE_NS);
        (polled != 0 && now < recheck).then_some(recheck)
    }

    /// Validates and routes the datagrams the last fill took (`handed`: those other lanes
    /// handed over instead), then lets each queue pair they touched make progress once (so
    /// several AckReq packets are answered by one coalesced ACK). A datagram for a queue pair
    /// of another lane goes to that lane's inbox, unvalidated, and wakes it.
    fn feed(&self, lane: &Lane, st: &mut RxState, handed: bool) {
        let now = self.now();
        let table = self.mrs.read().unwrap_or_else(|e| e.into_inner());
        let mut mem = self.dev_memory(&table);
        let RxState {
            rx,
            tx,
            touched,
            handed: inbox,
            ..
        } = st;
        touched.clear();
        let local = IpAddr::V4(self.addr);
        let lanes = self.lanes.len();
        // Lanes this feed handed datagrams to (bit `i`: lane `i`; 64 lanes at most).
        let mut woken = 0u64;
        if !handed {
            self.rcvd_datagrams
                .fetch_add(rx.len() as u64, Ordering::Relaxed);
        }
        {
            let qps = self.qps.read().unwrap_or_else(|e| e.into_inner());
            // Counted here and added to the device's once at the end: the device's counters
            // under a lock for the whole feed would make the lanes take turns at their receive
            // work (copies included).
            let mut drops = proto::DropCounters::default();
            let (mut exchange, chan) = (Vec::new(), self.io.channels());
            let mut one = |src: SocketAddrV4, data: &[u8]| {
                if data.first() == Some(&same_host::OPCODE) {
                    // The same-host exchange, not RoCEv2: any lane answers it.
                    match &self.same_host {
                        // Most ask nothing back (a ring's WAKE, which comes in the steady
                        // state): only an outcome that does something is kept, so that such a
                        // round allocates nothing.
                        Some(sh) => {
                            let o = sh.on_datagram(*src.ip(), data, now.as_nanos(), chan);
                            if o != same_host::Outcome::default() {
                                exchange.push(o);
                            }
                        }
                        None => drops.count(proto::DropReason::UnknownOpcode),
                    }
                    return;
                }
                if lanes > 1
                    && let Some(qpn) = peek_dest_qpn(data)
                {
                    let owner = lane_of(qpn, lanes);
                    if owner != lane.index {
                        // The lane serving this queue pair feeds it, in the order it came.
                        if self.lanes[owner].inbox.push(src, data) {
                            woken |= 1 << owner.min(63);
                        }
                        return;
                    }
                }
                let meta = proto::RxMeta {
                    src: IpAddr::V4(*src.ip()),
                    src_port: src.port(),
                    dst: local,
                    dst_port: ROCE_PORT,
                    ipv4_id: None,
                };
                let view = match proto::validate(data, &meta, &self.caps, &mut tx.solver) {
                    Ok(v) => v,
                    Err(why) => {
                        drops.count(why);
                        return;
                    }
                };
                let Some(cell) = qps.get(&view.dest_qpn()) else {
                    drops.count(proto::DropReason::UnknownQp);
                    return;
                };
                // A reference payload is read out of its sender's process: only one that
                // proved it shares this host, and still runs.
                let peer = match (view.peer_ref(), &self.same_host) {
                    (false, _) => None,
                    (true, Some(sh)) => match sh.verified(*src.ip(), view.payload()) {
                        Some(pid) => Some(pid),
                        None => {
                            drops.count(proto::DropReason::PeerRefRefused);
                            // The sender is told, so that it asks again (a restarted device).
                            let reply = sh.refuse(*src.ip(), view.payload(), now.as_nanos());
                            if reply.is_some() {
                                exchange.push(same_host::Outcome {
                                    reply,
                                    ..Default::default()
                                });
                            }
                            return;
                        }
                    },
                    (true, None) => {
                        drops.count(proto::DropReason::PeerRefRefused);
                        return;
                    }
                };
                mem.set_peer(peer);
                mem.set_qp(cell.qpn);
                #[cfg(feature = "gpu")]
                if view.opcode() == Opcode::ReadRequest
                    && let Some(reth) = view.reth()
                {
                    mem.expect_read(cell.qpn, reth.rkey, reth.va, reth.dma_len as u64, true);
                }
                let mut q = lock(&cell.proto);
                // A rejected packet is counted in the queue pair's own counters.
                let _ = q.handle_packet(now, meta.src, &view, &mut mem);
                drop(q);
                if !touched.iter().any(|c| c.qpn == cell.qpn) {
                    touched.push(cell.clone());
                }
            };
            if handed {
                for (src, data) in inbox.drain(..) {
                    one(src, &data);
                }
            } else {
                rx.for_each(&mut one);
            }
            if drops.total() != 0 {
                lock(&self.drops).add(&drops);
            }
            for o in exchange {
                for r in [o.reply, o.again].iter().flatten() {
                    self.queue_exchange(tx, r);
                }
                // References on (accepted) or off (refused), for every queue pair pointed at
                // that peer.
                let turn = o.accepted.map(|(p, t)| (p, Some(t)));
                if let Some((peer, token)) = turn.or(o.refused.map(|p| (p, None))) {
                    for cell in qps.values() {
                        let mut q = lock(&cell.proto);
                        if q.peer_addr() == Some(IpAddr::V4(peer)) {
                            q.set_peer_refs(token);
                        }
                    }
                }
            }
        }
        for l in self.lanes_in(woken) {
            self.io.wake(l.index);
        }
        for cell in touched.iter() {
            let mut q = lock(&cell.proto);
            self.progress(cell, &mut q, &mut mem, tx, now);
        }
        // Requests the acknowledgements let go read their regions: they leave under the lock.
        if tx.batch.has_lent() {
            self.flush(lane.index, &mut tx.batch);
        }
    }

    /// Runs lane `lane`'s timers due now. Returns whether any fired.
    fn fire_timers(
        &self,
        lane: &Lane,
        tx: &mut TxState,
        due: &mut Vec<(u64, u32)>,
        now: proto::Instant,
    ) -> bool {
        due.clear();
        lane.timers.take_due(now.as_nanos(), due);
        if due.is_empty() {
            return false;
        }
        let table = self.mrs.read().unwrap_or_else(|e| e.into_inner());
        let mut mem = self.dev_memory(&table);
        for &(at, qpn) in due.iter() {
            let Some(cell) = self.qp(qpn) else { continue };
            let mut q = lock(&cell.proto);
            // This heap entry is consumed; forget it so the next deadline gets scheduled.
            let _ =
                cell.scheduled
                    .compare_exchange(at, u64::MAX, Ordering::AcqRel, Ordering::Acquire);
            q.handle_timeout(now);
            self.progress(&cell, &mut q, &mut mem, tx, now);
        }
        self.flush(lane.index, &mut tx.batch);
        drop(table);
        self.release(tx);
        true
    }
}

/// The completion ring of a queue pair's work queue.
fn ring_of(cell: &QpCell, queue: WorkQueue) -> &super::notify::CompletionRing {
    match queue {
        WorkQueue::Send => &cell.send_cq,
        WorkQueue::Recv => &cell.recv_cq,
    }
}

//! An engine's lanes: the receive paths a device spreads its queue pairs over.
//!
//! Owns [`Lane`] (one receive queue, its transmit batch for answers, its timer table, its
//! application-polling state) and [`Inbox`] (datagrams another lane received for one of this
//! lane's queue pairs). A device has one lane per receive queue its [`super::Io`] offers (one
//! per engine thread and UDP socket in the driver); queue pair `qpn` belongs to lane
//! `qpn % lanes` ([`lane_of`]), the rule the driver's reuseport steering program applies to the
//! BTH's destination QPN. A datagram that reaches another lane anyway (before the steering
//! program is attached, on a kernel without one, or from an injected source) is handed to its
//! owner's inbox, never fed by the lane that received it: a queue pair is served by one lane, so
//! the order its datagrams arrive in on that lane is the order they are fed in.
//!
//! The hand-off keeps every datagram exactly once and in the order each lane handed it over;
//! `loom` checks this (`cfg(loom)` tests below).

use std::net::SocketAddrV4;

use super::timers::Timers;
use super::{RxState, TxState};
use crate::sync::{AtomicBool, AtomicU64, Mutex};

/// At most this many datagrams wait in one lane's inbox; more are dropped (and counted), as a
/// full socket buffer drops them: the protocol retransmits.
pub(crate) const INBOX_CAP: usize = 4096;
/// At most this many bytes wait in one lane's inbox (a socket's receive buffer's worth).
pub(crate) const INBOX_BYTES: usize = 8 << 20;

/// The lane serving queue pair `qpn` on a device of `lanes` lanes.
#[inline]
pub(crate) fn lane_of(qpn: u32, lanes: usize) -> usize {
    if lanes <= 1 {
        0
    } else {
        (qpn as usize) % lanes
    }
}

/// The destination QPN of a datagram, read from its BTH without validating anything (the low
/// 24 bits of the big-endian word at offset 4); `None` when it is too short to hold a BTH.
#[inline]
pub(crate) fn peek_dest_qpn(data: &[u8]) -> Option<u32> {
    let b = data.get(4..8)?;
    Some(u32::from_be_bytes([0, b[1], b[2], b[3]]))
}

/// A datagram handed from one lane to another: its source and bytes.
pub(crate) type Handed = (SocketAddrV4, Vec<u8>);

/// What waits in an inbox, and its size in bytes.
#[derive(Default)]
struct Queue {
    items: Vec<Handed>,
    bytes: usize,
}

/// Datagrams handed to a lane by the others.
pub(crate) struct Inbox {
    queue: Mutex<Queue>,
    /// Whether `queue` may hold datagrams (written under its lock; read without it, so an empty
    /// inbox costs its lane one load per round).
    pending: AtomicBool,
    /// Datagrams refused because the inbox was full.
    dropped: AtomicU64,
    /// Datagrams handed over so far.
    handed: AtomicU64,
}

impl Inbox {
    pub(crate) fn new() -> Inbox {
        Inbox {
            queue: Mutex::new(Queue::default()),
            pending: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
            handed: AtomicU64::new(0),
        }
    }

    fn queue(&self) -> impl std::ops::DerefMut<Target = Queue> + '_ {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands a datagram over; `false` when the inbox was full ([`INBOX_CAP`] datagrams or
    /// [`INBOX_BYTES`] bytes) and it was dropped.
    pub(crate) fn push(&self, src: SocketAddrV4, data: &[u8]) -> bool {
        let mut q = self.queue();
        if q.items.len() >= INBOX_CAP || q.bytes + data.len() > INBOX_BYTES {
            self.dropped.fetch_add(1, crate::sync::Ordering::Relaxed);
            return false;
        }
        q.bytes += data.len();
        q.items.push((src, data.to_vec()));
        self.handed.fetch_add(1, crate::sync::Ordering::Relaxed);
        self.pending.store(true, crate::sync::Ordering::Release);
        true
    }

    /// Whether datagrams may be waiting.
    #[inline]
    pub(crate) fn is_pending(&self) -> bool {
        self.pending.load(crate::sync::Ordering::Acquire)
    }

    /// Moves every waiting datagram, oldest first, to the end of `out`.
    pub(crate) fn take(&self, out: &mut Vec<Handed>) {
        if !self.is_pending() {
            return;
        }
        let mut q = self.queue();
        self.pending.store(false, crate::sync::Ordering::Relaxed);
        q.bytes = 0;
        out.append(&mut q.items);
    }

    /// Datagrams handed over so far (dropped ones not included).
    #[cfg_attr(not(test), allow(dead_code))] // the driver's tests'
    pub(crate) fn handed(&self) -> u64 {
        self.handed.load(crate::sync::Ordering::Relaxed)
    }

    /// Datagrams dropped because the inbox was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(crate::sync::Ordering::Relaxed)
    }
}

/// One lane: a receive path and what serves it.
pub(crate) struct Lane {
    /// Its index among the device's lanes.
    pub(crate) index: usize,
    /// Deadlines of its queue pairs.
    pub(crate) timers: Timers,
    /// The receive path, taken by the lane's engine thread or by a polling application thread.
    pub(super) rx: std::sync::Mutex<RxState>,
    /// Datagrams other lanes received for its queue pairs.
    pub(crate) inbox: Inbox,
    /// When an application thread last did this lane's receive work itself (ns on the engine's
    /// clock). While applications poll, the lane's engine thread stops watching its socket, so
    /// it does not compete with them for the CPU on every datagram.
    pub(super) app_polled: AtomicU64,
    /// Whether the lane's engine thread sleeps leaving its socket to polling applications: an
    /// application thread that goes to sleep then wakes it ([`super::Engine::app_sleeps`]).
    pub(crate) parked_for_app: AtomicBool,
    /// Whether an application thread's receive round held acknowledgements back (in `rx`'s
    /// batch). The lane's engine thread sends them once applications stop polling.
    pub(crate) tx_held: AtomicBool,
    /// When `tx_held` was last set (ns on the engine's clock).
    pub(crate) held_at: AtomicU64,
    /// How long held acknowledgements may wait for the application's answer (ns):
    /// [`super::progress::HOLD_ON_POLL_NS`]; a test that counts send calls lengthens it, so that
    /// the test thread's scheduling cannot spoil the count.
    pub(crate) hold_ns: AtomicU64,
}

impl Lane {
    /// When what is held back now must leave without the application: `hold_ns` after
    /// `held_at` (ns on the engine's clock).
    pub(crate) fn hold_ends(&self) -> u64 {
        let held_at = self.held_at.load(crate::sync::Ordering::Relaxed);
        held_at.saturating_add(self.hold_ns.load(crate::sync::Ordering::Relaxed))
    }

    pub(super) fn new(index: usize, rx: Box<dyn super::RxQueue>, gso: bool) -> Lane {
        Lane {
            index,
            timers: Timers::new(),
            rx: std::sync::Mutex::new(RxState {
                rx,
                tx: TxState::new(gso),
                touched: Vec::with_capacity(16),
                due: Vec::with_capacity(64),
                handed: Vec::new(),
                app_dry: false,
            }),
            inbox: Inbox::new(),
            app_polled: AtomicU64::new(0),
            parked_for_app: AtomicBool::new(false),
            tx_held: AtomicBool::new(false),
            held_at: AtomicU64::new(0),
            hold_ns: AtomicU64::new(super::progress::HOLD_ON_POLL_NS),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn lanes_follow_the_qpn() {
        assert_eq!(lane_of(0x11, 1), 0);
        assert_eq!(lane_of(0x11, 4), 1);
        assert_eq!(lane_of(0x14, 4), 0);
        assert_eq!(lane_of(0xff_ffff, 2), 1);
        // A BTH: opcode, flags, P_Key, then reserved byte + destination QPN.
        let bth = [4, 0, 0xff, 0xff, 0xaa, 0x12, 0x34, 0x56, 0, 0, 0, 1];
        assert_eq!(peek_dest_qpn(&bth), Some(0x12_3456));
        assert_eq!(peek_dest_qpn(&bth[..7]), None);
        assert_eq!(peek_dest_qpn(&[]), None);
    }

    #[test]
    fn an_inbox_keeps_order_and_bounds_itself() {
        let inbox = Inbox::new();
        let src = SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 4791);
        let mut out = Vec::new();
        inbox.take(&mut out);
        assert!(out.is_empty() && !inbox.is_pending());
        for i in 0..INBOX_CAP + 3 {
            let fits = inbox.push(src, &(i as u32).to_be_bytes());
            assert_eq!(fits, i < INBOX_CAP);
        }
        assert_eq!(inbox.dropped(), 3);
        inbox.take(&mut out);
        assert!(!inbox.is_pending());
        assert_eq!(out.len(), INBOX_CAP);
        for (i, (_, d)) in out.iter().enumerate() {
            assert_eq!(d[..], (i as u32).to_be_bytes());
        }
        // Bytes bound it too; taking empties it.
        let big = vec![7u8; 64 * 1024];
        let fit = INBOX_BYTES / big.len();
        for _ in 0..fit {
            assert!(inbox.push(src, &big));
        }
        assert!(!inbox.push(src, &big), "past the byte bound");
        assert!(!inbox.push(src, &[1, 2, 3]), "full to the byte");
        out.clear();
        inbox.take(&mut out);
        assert_eq!(out.len(), fit);
        assert!(inbox.push(src, &big), "room again once taken");
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// Two lanes hand datagrams to a third while it takes its inbox in a round: every datagram
    /// is fed exactly once, each sender's in the order it sent them, and one that is still
    /// waiting after the round is announced by the pending flag (so the owner's next round,
    /// which the sender's wake-up causes, takes it).
    #[test]
    fn handed_datagrams_arrive_once_and_in_order() {
        loom::model(|| {
            let inbox = Arc::new(Inbox::new());
            let senders: Vec<_> = (0..2u8)
                .map(|lane| {
                    let inbox = inbox.clone();
                    loom::thread::spawn(move || {
                        let src = SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 4791);
                        for k in 0..2u8 {
                            assert!(inbox.push(src, &[lane, k]));
                        }
                    })
                })
                .collect();
            let mut fed = Vec::new();
            inbox.take(&mut fed);
            for s in senders {
                s.join().unwrap();
            }
            // The senders are done: whatever the round missed is announced.
            if fed.len() < 4 {
                assert!(
                    inbox.is_pending(),
                    "a handed datagram is waiting unannounced"
                );
            }
            inbox.take(&mut fed);
            assert_eq!(fed.len(), 4, "a handed datagram was lost or fed twice");
            for lane in 0..2u8 {
                let ks: Vec<u8> = fed
                    .iter()
                    .filter(|(_, d)| d[0] == lane)
                    .map(|(_, d)| d[1])
                    .collect();
                assert_eq!(ks, [0, 1], "lane {lane}'s datagrams out of order");
            }
        });
    }
}

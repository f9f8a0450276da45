//! The soft device's completion ring and its arm/notify handshake.
//!
//! Owns [`CompletionRing`]: a bounded lock-free queue of completions ([`Ring`]; producers: the
//! engine thread and application threads making progress inline; consumers: pollers), an overrun
//! flag, and the notification state behind the completion queue's eventfd.
//!
//! The handshake, so no wake-up is ever lost:
//! - producer: push the completion, `fence(SeqCst)`, then take the armed state; if it was armed
//!   (for this kind of completion), signal the eventfd.
//! - consumer: arm, `fence(SeqCst)`, poll again; only if that poll is empty, wait on the fd.
//!
//! With both fences, either the producer sees the arm (and signals) or the consumer's second poll
//! sees the completion: the two cannot both miss. `loom` checks this (`cfg(loom)` tests below).

use std::sync::Arc;

use super::ring::Ring;
use crate::sync::{AtomicBool, AtomicU8, AtomicU64, EventFd, Ordering, fence};
use crate::vocab::{AsyncEvent, AsyncEventKind, Completion, EventElement};

/// Where the soft device reports asynchronous events (a context's event queue, in the SDK).
pub(crate) trait EventSink: Send + Sync {
    /// Takes one event.
    fn report(&self, ev: AsyncEvent);
}

const DISARMED: u8 = 0;
const ARMED_ANY: u8 = 1;
const ARMED_SOLICITED: u8 = 2;

/// Completions waiting to be polled, and who to wake when one arrives.
pub(crate) struct CompletionRing {
    queue: Ring<Completion>,
    overrun: AtomicBool,
    armed: AtomicU8,
    /// Signalled when an armed ring gets a completion (what the completion queue's descriptor
    /// waits on).
    event: EventFd,
    /// Where an overrun is reported as an asynchronous event (`CqErr`), and the queue's id.
    report: Option<(Arc<dyn EventSink>, u64)>,
    /// The device lanes (bit `i`: lane `i`; a device has at most 64) serving the queue pairs
    /// that complete here: a poll that does receive work does theirs.
    lanes: AtomicU64,
}

impl std::fmt::Debug for CompletionRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionRing")
            .field("capacity", &self.queue.capacity())
            .finish()
    }
}

impl CompletionRing {
    /// A ring of `depth` entries signalling `event` when armed.
    pub(crate) fn new(depth: usize, event: EventFd) -> CompletionRing {
        CompletionRing {
            queue: Ring::new(depth),
            overrun: AtomicBool::new(false),
            armed: AtomicU8::new(DISARMED),
            event,
            report: None,
            lanes: AtomicU64::new(0),
        }
    }

    /// Reports each overrun to `events` as a `CqErr` naming queue `id`, as rxe does.
    pub(crate) fn with_report(mut self, events: Arc<dyn EventSink>, id: u64) -> Self {
        self.report = Some((events, id));
        self
    }

    /// Adds a completion. Returns `false` on overrun (the ring was full): the completion is lost
    /// and the ring stays marked, as a CQ overrun is on hardware.
    pub(crate) fn push(&self, wc: Completion) -> bool {
        let solicited = wc.solicited;
        if self.queue.push(wc).is_err() {
            if !self.overrun.swap(true, Ordering::AcqRel)
                && let Some((events, id)) = &self.report
            {
                events.report(AsyncEvent::new(
                    AsyncEventKind::CqErr,
                    EventElement::Cq(*id),
                ));
            }
            return false;
        }
        fence(Ordering::SeqCst);
        self.notify(solicited);
        true
    }

    fn notify(&self, solicited: bool) {
        let state = self.armed.load(Ordering::Relaxed);
        let wake = match state {
            ARMED_ANY => true,
            ARMED_SOLICITED => solicited,
            _ => false,
        };
        if wake
            && self
                .armed
                .compare_exchange(state, DISARMED, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            self.event.signal();
        }
    }

    /// Notes that a queue pair of lane `lane` completes here.
    pub(crate) fn add_lane(&self, lane: usize) {
        self.lanes.fetch_or(1 << (lane % 64), Ordering::Relaxed);
    }

    /// The lanes whose queue pairs complete here ([`CompletionRing::add_lane`]); every lane
    /// while none has been added (a poll of a queue no queue pair uses yet still does the
    /// device's receive work, as on a device of one lane).
    pub(crate) fn lanes(&self) -> u64 {
        match self.lanes.load(Ordering::Relaxed) {
            0 => u64::MAX,
            m => m,
        }
    }

    /// Takes up to `out.len()` completions.
    pub(crate) fn pop_into(&self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        while n < out.len() {
            match self.queue.pop() {
                Some(wc) => {
                    out[n] = wc;
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Whether a completion was lost to a full ring (cleared by reading).
    pub(crate) fn take_overrun(&self) -> bool {
        self.overrun.swap(false, Ordering::AcqRel)
    }

    /// Arms the ring: the next completion (or the next solicited one) signals the eventfd once.
    /// Follow with a poll before waiting. Arming for solicited completions leaves a ring armed
    /// for any as it is: the waiter that asked for any would otherwise sleep past the next.
    pub(crate) fn arm(&self, solicited_only: bool) {
        if solicited_only {
            let _ = self.armed.compare_exchange(
                DISARMED,
                ARMED_SOLICITED,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        } else {
            self.armed.store(ARMED_ANY, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
    }

    /// Whether the ring is armed (its consumer is about to sleep or sleeps).
    pub(crate) fn is_armed(&self) -> bool {
        self.armed.load(Ordering::Relaxed) != DISARMED
    }

    /// The eventfd.
    pub(crate) fn event(&self) -> &EventFd {
        &self.event
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn wc(id: u64, solicited: bool) -> Completion {
        Completion {
            wr_id: id,
            solicited,
            ..Completion::default()
        }
    }

    #[test]
    fn overrun_is_reported_once() {
        let r = CompletionRing::new(2, EventFd::new().unwrap());
        assert!(r.push(wc(1, false)));
        assert!(r.push(wc(2, false)));
        assert!(!r.push(wc(3, false)));
        assert!(r.take_overrun());
        assert!(!r.take_overrun());
        let mut out = [Completion::default(); 4];
        assert_eq!(r.pop_into(&mut out), 2);
        assert_eq!((out[0].wr_id, out[1].wr_id), (1, 2));
    }

    /// Arming for solicited completions does not narrow an arming for any: the next plain
    /// completion still signals.
    #[test]
    fn a_solicited_arming_keeps_an_arming_for_any() {
        let r = CompletionRing::new(8, EventFd::new().unwrap());
        r.arm(false);
        r.arm(true);
        r.push(wc(1, false));
        assert_eq!(r.event().consume(), 1);
        r.arm(true);
        r.push(wc(2, false));
        assert_eq!(
            r.event().consume(),
            0,
            "solicited only: a plain one is silent"
        );
        r.push(wc(3, true));
        assert_eq!(r.event().consume(), 1);
    }

    #[test]
    fn armed_ring_signals_once() {
        let r = CompletionRing::new(8, EventFd::new().unwrap());
        r.push(wc(1, false));
        assert_eq!(r.event().consume(), 0, "not armed: no signal");
        r.arm(false);
        r.push(wc(2, false));
        r.push(wc(3, false));
        assert_eq!(r.event().consume(), 1, "armed: one signal");
        r.arm(true);
        r.push(wc(4, false));
        assert_eq!(r.event().consume(), 0, "solicited-only ignores others");
        r.push(wc(5, true));
        assert_eq!(r.event().consume(), 1);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// A producer pushes and notifies while the consumer arms and polls again: either the
    /// consumer's second poll finds the completion or the producer saw the arm and signalled.
    /// Never neither (a lost wake-up), never a completion lost.
    #[test]
    fn arm_then_poll_never_loses_a_wakeup() {
        loom::model(|| {
            let ring = Arc::new(CompletionRing::new(4, EventFd::new().unwrap()));
            let producer = {
                let ring = ring.clone();
                loom::thread::spawn(move || {
                    assert!(ring.queue.push(Completion::default()).is_ok());
                    fence(Ordering::SeqCst);
                    let s = ring.armed.load(Ordering::Relaxed);
                    s == ARMED_ANY
                        && ring
                            .armed
                            .compare_exchange(s, DISARMED, Ordering::AcqRel, Ordering::Relaxed)
                            .is_ok()
                })
            };
            // Consumer: first poll found nothing (it is about to sleep), so it arms and re-polls.
            ring.arm(false);
            let seen = ring.queue.pop().is_some();
            let signalled = producer.join().unwrap();
            assert!(seen || signalled, "lost wake-up");
            if !seen {
                assert!(ring.queue.pop().is_some(), "completion lost");
            }
        });
    }
}

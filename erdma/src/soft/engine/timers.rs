//! The soft device's timer table and the handshake that keeps the engine from oversleeping.
//!
//! Owns [`Timers`]: queue-pair deadlines (earliest first; entries may be stale — a spurious
//! timeout is harmless) and the engine's published wake-up time. Any thread that schedules a
//! deadline earlier than the engine's planned wake-up must wake it; the engine publishes its plan
//! *before* it looks at the table a last time, so a deadline added concurrently is either seen by
//! that look or sees the plan and signals. `loom` checks this (`cfg(loom)` tests below).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::sync::{AtomicU64, Mutex, Ordering, fence};

/// Deadlines (nanoseconds) of queue pairs, and when the engine plans to wake.
pub(crate) struct Timers {
    heap: Mutex<BinaryHeap<Reverse<(u64, u32)>>>,
    /// The heap's earliest deadline (`u64::MAX`: none), written under the heap's lock: a round
    /// with nothing due reads it instead of taking the lock.
    earliest: AtomicU64,
    /// 0 while the engine runs; otherwise the time it will wake by itself.
    wake_at: AtomicU64,
}

/// What the engine should do instead of a busy loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sleep {
    /// A deadline is already due: run the timers now.
    No,
    /// Sleep until this time (`None`: until woken).
    Until(Option<u64>),
}

impl Timers {
    pub(crate) fn new() -> Timers {
        Timers {
            heap: Mutex::new(BinaryHeap::new()),
            earliest: AtomicU64::new(u64::MAX),
            wake_at: AtomicU64::new(0),
        }
    }

    fn heap(&self) -> impl std::ops::DerefMut<Target = BinaryHeap<Reverse<(u64, u32)>>> + '_ {
        self.heap.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a deadline. Returns whether the engine must be woken to honour it.
    pub(crate) fn schedule(&self, at: u64, qpn: u32) -> bool {
        {
            let mut heap = self.heap();
            heap.push(Reverse((at, qpn)));
            self.earliest.fetch_min(at, Ordering::Release);
        }
        self.sleeps_past(at)
    }

    /// Whether the engine sleeps (or is about to) with a plan to wake later than `at`: then
    /// whoever needs it awake by `at` must signal it. A caller that published what it needs,
    /// then issued a `SeqCst` fence, either is answered `true` or is seen by the engine's looks
    /// after it published its plan ([`Timers::prepare_sleep`]).
    pub(crate) fn sleeps_past(&self, at: u64) -> bool {
        let wake_at = self.wake_at.load(Ordering::SeqCst);
        wake_at != 0 && at < wake_at
    }

    /// Removes and returns every deadline due at `now`.
    /// A deadline being scheduled concurrently may be left for the next call.
    pub(crate) fn take_due(&self, now: u64, out: &mut Vec<(u64, u32)>) {
        if self.earliest.load(Ordering::Acquire) > now {
            return;
        }
        let mut heap = self.heap();
        while let Some(Reverse((at, qpn))) = heap.peek().copied() {
            if at > now {
                break;
            }
            heap.pop();
            out.push((at, qpn));
        }
        let next = heap.peek().map_or(u64::MAX, |Reverse((at, _))| *at);
        self.earliest.store(next, Ordering::Release);
    }

    /// The earliest deadline in the table (it may be stale: its queue pair may no longer need
    /// it), `None` when there is none.
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))] // the simulation's
    pub(crate) fn earliest(&self) -> Option<u64> {
        self.heap().peek().map(|Reverse((at, _))| *at)
    }

    /// The engine is about to sleep at `now`, at most until `cap` (`None`: no limit but its
    /// deadlines): publishes its plan, then looks once more.
    pub(crate) fn prepare_sleep(&self, now: u64, cap: Option<u64>) -> Sleep {
        let earliest = |next: Option<u64>| match (next, cap) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let next = self.heap().peek().map(|Reverse((at, _))| *at);
        self.wake_at.store(
            earliest(next).unwrap_or(u64::MAX).max(now + 1),
            Ordering::SeqCst,
        );
        // Orders the looks after publishing (the table's below, the caller's at what else may
        // need it awake) after the plan: a thread that stores what it needs, fences, then asks
        // [`Timers::sleeps_past`] either is answered `true` or is seen by those looks.
        fence(Ordering::SeqCst);
        let next = self.heap().peek().map(|Reverse((at, _))| *at);
        match next {
            Some(at) if at <= now => {
                self.wake_at.store(0, Ordering::SeqCst);
                Sleep::No
            }
            other => Sleep::Until(earliest(other)),
        }
    }

    /// The engine is running again.
    pub(crate) fn awake(&self) {
        self.wake_at.store(0, Ordering::SeqCst);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn due_deadlines_come_out_in_order() {
        let t = Timers::new();
        assert!(!t.schedule(30, 1), "engine running: no wake-up needed");
        t.schedule(10, 2);
        t.schedule(20, 3);
        let mut due = Vec::new();
        t.take_due(20, &mut due);
        assert_eq!(due, vec![(10, 2), (20, 3)]);
        assert_eq!(t.prepare_sleep(25, None), Sleep::Until(Some(30)));
        assert!(t.schedule(27, 4), "earlier than the plan: wake the engine");
        assert!(!t.schedule(40, 5), "later than the plan: no wake-up");
        t.awake();
        assert_eq!(t.prepare_sleep(28, None), Sleep::No, "27 is due");
        t.take_due(28, &mut due);
        assert_eq!(
            t.prepare_sleep(29, Some(35)),
            Sleep::Until(Some(30)),
            "deadline first"
        );
        t.take_due(30, &mut due);
        assert_eq!(
            t.prepare_sleep(31, Some(35)),
            Sleep::Until(Some(35)),
            "cap first"
        );
        assert!(
            !t.sleeps_past(35) && t.sleeps_past(34),
            "the plan published is the cap"
        );
    }

    /// A round with nothing due skips the heap's lock by a cached earliest deadline; the cache
    /// follows every deadline added (earlier or later) and every one taken.
    #[test]
    fn nothing_is_missed_behind_the_cached_earliest_deadline() {
        let t = Timers::new();
        let mut due = Vec::new();
        t.take_due(u64::MAX - 1, &mut due);
        assert!(due.is_empty(), "no deadlines");
        t.schedule(50, 1);
        t.take_due(49, &mut due);
        assert!(due.is_empty());
        t.schedule(20, 2);
        t.take_due(20, &mut due);
        assert_eq!(due, vec![(20, 2)], "an earlier deadline lowers the cache");
        due.clear();
        t.take_due(49, &mut due);
        assert!(due.is_empty(), "the cache rose to the next deadline, 50");
        t.schedule(60, 3);
        t.take_due(60, &mut due);
        assert_eq!(due, vec![(50, 1), (60, 3)]);
        due.clear();
        t.schedule(70, 4);
        t.take_due(70, &mut due);
        assert_eq!(
            due,
            vec![(70, 4)],
            "after the heap emptied, a new deadline is seen"
        );
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// An application thread schedules a deadline that is already due while the engine goes to
    /// sleep: either the engine sees it and does not sleep, or the scheduler is told to wake it.
    #[test]
    fn a_concurrent_deadline_never_oversleeps_the_engine() {
        loom::model(|| {
            let t = Arc::new(Timers::new());
            let app = {
                let t = t.clone();
                loom::thread::spawn(move || t.schedule(5, 1))
            };
            let plan = t.prepare_sleep(10, None);
            let signalled = app.join().unwrap();
            let covered = match plan {
                Sleep::No => true,
                Sleep::Until(Some(at)) => at <= 5,
                Sleep::Until(None) => false,
            };
            assert!(
                covered || signalled,
                "engine would oversleep a due deadline"
            );
        });
    }

    /// An application round holds acknowledgements back (publishes the hold, then asks
    /// [`Timers::sleeps_past`]) while the engine plans a sleep with no deadline and then looks
    /// at the hold: either the engine sees the hold and bounds its sleep by it, or the holder is
    /// told to wake it (the engine thread's `sleep` and `Engine::service`).
    #[test]
    fn a_concurrent_hold_never_oversleeps_the_engine() {
        loom::model(|| {
            let t = Arc::new(Timers::new());
            let held = Arc::new(crate::sync::AtomicBool::new(false));
            let app = {
                let (t, held) = (t.clone(), held.clone());
                loom::thread::spawn(move || {
                    held.store(true, Ordering::Relaxed);
                    fence(Ordering::SeqCst);
                    t.sleeps_past(15)
                })
            };
            let plan = t.prepare_sleep(10, None);
            let seen = held.load(Ordering::Relaxed);
            let signalled = app.join().unwrap();
            assert_eq!(plan, Sleep::Until(None));
            assert!(
                seen || signalled,
                "a held acknowledgement would wait out the sleep"
            );
        });
    }
}

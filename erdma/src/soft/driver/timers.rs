//! The soft device's timer table and the handshake that keeps the engine from oversleeping.
//!
//! Owns [`Timers`]: queue-pair deadlines (earliest first; entries may be stale — a spurious
//! timeout is harmless) and the engine's published wake-up time. Any thread that schedules a
//! deadline earlier than the engine's planned wake-up must wake it; the engine publishes its plan
//! *before* it looks at the table a last time, so a deadline added concurrently is either seen by
//! that look or sees the plan and signals. `loom` checks this (`cfg(loom)` tests below).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::sync::{AtomicU64, Mutex, Ordering};

/// Deadlines (nanoseconds) of queue pairs, and when the engine plans to wake.
pub(crate) struct Timers {
    heap: Mutex<BinaryHeap<Reverse<(u64, u32)>>>,
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
            wake_at: AtomicU64::new(0),
        }
    }

    fn heap(&self) -> impl std::ops::DerefMut<Target = BinaryHeap<Reverse<(u64, u32)>>> + '_ {
        self.heap.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a deadline. Returns whether the engine must be woken to honour it.
    pub(crate) fn schedule(&self, at: u64, qpn: u32) -> bool {
        self.heap().push(Reverse((at, qpn)));
        let wake_at = self.wake_at.load(Ordering::SeqCst);
        wake_at != 0 && at < wake_at
    }

    /// Removes and returns every deadline due at `now`.
    pub(crate) fn take_due(&self, now: u64, out: &mut Vec<(u64, u32)>) {
        let mut heap = self.heap();
        while let Some(Reverse((at, qpn))) = heap.peek().copied() {
            if at > now {
                break;
            }
            heap.pop();
            out.push((at, qpn));
        }
    }

    /// The engine is about to sleep at `now`: publishes its plan, then looks once more.
    pub(crate) fn prepare_sleep(&self, now: u64) -> Sleep {
        let next = self.heap().peek().map(|Reverse((at, _))| *at);
        self.wake_at
            .store(next.unwrap_or(u64::MAX).max(now + 1), Ordering::SeqCst);
        let next = self.heap().peek().map(|Reverse((at, _))| *at);
        match next {
            Some(at) if at <= now => {
                self.wake_at.store(0, Ordering::SeqCst);
                Sleep::No
            }
            other => Sleep::Until(other),
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
        assert_eq!(t.prepare_sleep(25), Sleep::Until(Some(30)));
        assert!(t.schedule(27, 4), "earlier than the plan: wake the engine");
        assert!(!t.schedule(40, 5), "later than the plan: no wake-up");
        t.awake();
        assert_eq!(t.prepare_sleep(28), Sleep::No, "27 is due");
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
            let plan = t.prepare_sleep(10);
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
}

//! The queue pair's timers, in one table.
//!
//! A deadline is only a hint to wake up: every handler re-checks whether its condition still
//! holds, so a spurious or early timeout does nothing.

use super::Instant;

/// The timers a queue pair runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Timer {
    /// The local ACK timeout: no response to outstanding requests for `4.096 µs · 2^timeout`.
    Retransmit = 0,
    /// The wait an RNR NAK asked for before resending.
    RnrRetry = 1,
}

impl Timer {
    /// Every timer, in the order `handle_timeout` visits them.
    pub const VALUES: [Timer; 2] = [Timer::Retransmit, Timer::RnrRetry];
}

/// Deadlines, one slot per [`Timer`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TimerTable {
    deadlines: [Option<Instant>; 2],
}

impl TimerTable {
    /// Arms `timer` for `at` (replacing any earlier deadline).
    pub fn set(&mut self, timer: Timer, at: Instant) {
        self.deadlines[timer as usize] = Some(at);
    }

    /// Disarms `timer`.
    pub fn stop(&mut self, timer: Timer) {
        self.deadlines[timer as usize] = None;
    }

    /// The deadline of `timer`, if armed.
    pub fn get(&self, timer: Timer) -> Option<Instant> {
        self.deadlines[timer as usize]
    }

    /// Whether `timer` is armed.
    pub fn is_armed(&self, timer: Timer) -> bool {
        self.get(timer).is_some()
    }

    /// The earliest deadline.
    pub fn next_timeout(&self) -> Option<Instant> {
        self.deadlines.iter().flatten().min().copied()
    }

    /// Whether `timer` is armed and due at `now`.
    pub fn is_expired(&self, timer: Timer, now: Instant) -> bool {
        self.get(timer).is_some_and(|t| t <= now)
    }

    /// Disarms every timer.
    pub fn clear(&mut self) {
        self.deadlines = [None; 2];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn earliest_deadline_wins() {
        let mut t = TimerTable::default();
        assert_eq!(t.next_timeout(), None);
        t.set(Timer::Retransmit, Instant::from_nanos(50));
        t.set(Timer::RnrRetry, Instant::from_nanos(20));
        assert_eq!(t.next_timeout(), Some(Instant::from_nanos(20)));
        assert!(t.is_expired(Timer::RnrRetry, Instant::from_nanos(20)));
        assert!(!t.is_expired(Timer::Retransmit, Instant::from_nanos(49)));
        t.stop(Timer::RnrRetry);
        assert_eq!(t.next_timeout(), Some(Instant::from_nanos(50)));
        t.clear();
        assert!(!t.is_armed(Timer::Retransmit));
    }
}

//! A bounded lock-free multi-producer multi-consumer queue of `Copy` values.
//!
//! The soft device's completion rings: producers are the engine thread and application threads
//! making progress inline, consumers are pollers. Each slot carries a sequence number that says
//! whether it is free for the producer of lap `n` or full for the consumer of lap `n`; a producer
//! claims a position with one compare-and-swap, writes the value, then publishes it with a
//! release store of the slot's sequence (and a consumer mirrors that). Built on `crate::sync`, so
//! `loom` model-checks it (`cfg(loom)` tests below).

#![allow(unsafe_code)] // the lock-free ring's slots

use std::mem::MaybeUninit;

use crate::sync::{AtomicUsize, Ordering, UnsafeCell};

struct Slot<T> {
    seq: AtomicUsize,
    value: UnsafeCell<MaybeUninit<T>>,
}

/// The queue. Capacity is a power of two.
pub(crate) struct Ring<T: Copy> {
    slots: Box<[Slot<T>]>,
    mask: usize,
    head: AtomicUsize,
    tail: AtomicUsize,
}

// SAFETY: a value is written by exactly one producer (the one whose CAS claimed its position)
// before the slot's release store publishes it, and read by exactly one consumer (the one whose
// CAS claimed it) after the matching acquire load; `T: Send` values may so cross threads.
unsafe impl<T: Copy + Send> Send for Ring<T> {}
// SAFETY: as above: all shared access goes through the per-slot sequence protocol.
unsafe impl<T: Copy + Send> Sync for Ring<T> {}

impl<T: Copy> Ring<T> {
    /// A queue holding at least `capacity` values (rounded up to a power of two, at least 2).
    pub(crate) fn new(capacity: usize) -> Ring<T> {
        let cap = capacity.max(2).next_power_of_two();
        let slots = (0..cap)
            .map(|i| Slot {
                seq: AtomicUsize::new(i),
                value: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        Ring {
            slots,
            mask: cap - 1,
            head: AtomicUsize::new(0),
            tail: AtomicUsize::new(0),
        }
    }

    /// The capacity.
    pub(crate) fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Adds a value; gives it back when the queue is full.
    pub(crate) fn push(&self, value: T) -> Result<(), T> {
        let mut pos = self.tail.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[pos & self.mask];
            let seq = slot.seq.load(Ordering::Acquire);
            let diff = seq.wrapping_sub(pos) as isize;
            if diff == 0 {
                match self.tail.compare_exchange_weak(
                    pos,
                    pos.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // The CAS gave this thread position `pos`; the slot's sequence equals
                        // `pos`, so no consumer reads it until the release store below, and no
                        // other producer can claim it until a consumer frees it.
                        // SAFETY: this thread alone may write the slot now, as above.
                        slot.value.with_mut(|p| unsafe { (*p).write(value) });
                        slot.seq.store(pos.wrapping_add(1), Ordering::Release);
                        return Ok(());
                    }
                    Err(now) => pos = now,
                }
            } else if diff < 0 {
                return Err(value);
            } else {
                pos = self.tail.load(Ordering::Relaxed);
            }
        }
    }

    /// Takes the oldest value, if any.
    pub(crate) fn pop(&self) -> Option<T> {
        let mut pos = self.head.load(Ordering::Relaxed);
        loop {
            let slot = &self.slots[pos & self.mask];
            let seq = slot.seq.load(Ordering::Acquire);
            let diff = seq.wrapping_sub(pos.wrapping_add(1)) as isize;
            if diff == 0 {
                match self.head.compare_exchange_weak(
                    pos,
                    pos.wrapping_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // The CAS gave this thread position `pos`, whose value the producer
                        // published (sequence `pos + 1`, acquired above); no other consumer can
                        // claim it, and producers wait for the store below.
                        // SAFETY: the slot holds an initialised value only this thread reads.
                        let v = slot.value.with(|p| unsafe { (*p).assume_init() });
                        slot.seq
                            .store(pos.wrapping_add(self.mask + 1), Ordering::Release);
                        return Some(v);
                    }
                    Err(now) => pos = now,
                }
            } else if diff < 0 {
                return None;
            } else {
                pos = self.head.load(Ordering::Relaxed);
            }
        }
    }

    /// Whether the queue looks empty (a snapshot).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn is_empty(&self) -> bool {
        let head = self.head.load(Ordering::Acquire);
        let slot = &self.slots[head & self.mask];
        slot.seq.load(Ordering::Acquire) != head.wrapping_add(1)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn fifo_and_full() {
        let r = Ring::new(3);
        assert_eq!(r.capacity(), 4);
        for i in 0..4 {
            r.push(i).unwrap();
        }
        assert_eq!(r.push(9), Err(9));
        assert!(!r.is_empty());
        for i in 0..4 {
            assert_eq!(r.pop(), Some(i));
        }
        assert_eq!(r.pop(), None);
        assert!(r.is_empty());
        // Many laps.
        for i in 0..1000 {
            r.push(i).unwrap();
            assert_eq!(r.pop(), Some(i));
        }
    }

    #[test]
    fn threads_lose_and_duplicate_nothing() {
        let r = Arc::new(Ring::new(64));
        let per = 50_000u64;
        let producers: Vec<_> = (0..3u64)
            .map(|t| {
                let r = r.clone();
                std::thread::spawn(move || {
                    for i in 0..per {
                        let v = t * per + i;
                        while r.push(v).is_err() {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let consumers: Vec<_> = (0..2)
            .map(|_| {
                let r = r.clone();
                std::thread::spawn(move || {
                    let mut got = Vec::new();
                    let mut idle = 0;
                    while idle < 200_000 {
                        match r.pop() {
                            Some(v) => {
                                got.push(v);
                                idle = 0;
                            }
                            None => {
                                idle += 1;
                                std::thread::yield_now();
                            }
                        }
                    }
                    got
                })
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
        let mut all: Vec<u64> = consumers
            .into_iter()
            .flat_map(|c| c.join().unwrap())
            .collect();
        all.sort_unstable();
        assert_eq!(all, (0..3 * per).collect::<Vec<_>>());
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// Two producers and a consumer racing on a ring of two slots: every value arrives exactly
    /// once, and a full ring refuses rather than overwrites.
    #[test]
    fn mpmc_ring_loses_and_duplicates_nothing() {
        loom::model(|| {
            let r = Arc::new(Ring::new(2));
            let ps: Vec<_> = (0..2u32)
                .map(|t| {
                    let r = r.clone();
                    loom::thread::spawn(move || r.push(t).is_ok())
                })
                .collect();
            let mut got = Vec::new();
            if let Some(v) = r.pop() {
                got.push(v);
            }
            let pushed: Vec<bool> = ps.into_iter().map(|p| p.join().unwrap()).collect();
            while let Some(v) = r.pop() {
                got.push(v);
            }
            got.sort_unstable();
            let expect: Vec<u32> = (0..2u32).filter(|&t| pushed[t as usize]).collect();
            assert_eq!(got, expect);
        });
    }
}

//! Completion queues and completions.
//!
//! Owns: [`Cq`] (a cloneable handle). A completion queue translates what the device reports into what
//! the application posted: the device sees per-queue sequence numbers, the application gets back
//! its own `wr_id`s, and completions the SDK asked for on its own (to keep an unsignaled send
//! queue moving) are retired silently.
//!
//! Polling is thread-safe. Completions reaped while a [`crate::Scope`] drains its requests are
//! kept and returned by the next poll: nothing is lost.

#![allow(unsafe_code)] // borrows the completion queue's descriptor, polls it

use std::collections::VecDeque;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::provider::CqImpl;
use crate::qp::QpShared;
use crate::vocab::Completion;

impl Completion {
    /// Turns an unsuccessful completion into an error naming the request and its status.
    ///
    /// # Errors
    /// [`Error::Completion`] carrying this completion when `status` is not success.
    pub fn ok(self) -> Result<Completion> {
        if self.status.is_success() {
            Ok(self)
        } else {
            Err(Error::Completion(self))
        }
    }
}

/// Which queue a device-level `wr_id` belongs to: the top bit marks receives.
pub(crate) const RECV_TAG: u64 = 1 << 63;

/// A completion queue. Cheap to clone; the queue lives until the last handle and the last queue
/// pair using it are gone.
#[derive(Clone)]
pub struct Cq {
    pub(crate) inner: Arc<CqInner>,
}

pub(crate) struct CqInner {
    pub(crate) ctx: Context,
    pub(crate) imp: CqImpl,
    pub(crate) depth: u32,
    id: u64,
    /// Queue pairs whose completions land here, to translate `wr_id`s.
    qps: RwLock<Vec<(u32, Weak<QpShared>)>>,
    /// Completions reaped on someone else's behalf, returned first by the next poll.
    stash: Mutex<VecDeque<Completion>>,
    stash_len: AtomicUsize,
    /// Serialises reaping, so completions are translated in the order the device gave them
    /// (a queue pair's requests retire in order; two pollers translating concurrently could
    /// otherwise retire a later request before an earlier one is looked up). Holds the raw
    /// entries' buffer ([`POLL_BATCH`] long), so a poll does not clear one on its stack.
    reap: Mutex<Vec<Completion>>,
    /// Whether a thread sleeps on the event descriptor ([`Cq::wait_hybrid`]). One at a time
    /// does; the others wait on `sleeper_woke` and look again when it wakes. Several sleeping
    /// on the descriptor at once lost wake-ups: the first to wake consumed the event and the
    /// queue was disarmed, so the others slept on beside the next completion.
    sleeper: Mutex<bool>,
    sleeper_woke: Condvar,
}

/// The sleeper's role in [`Cq::wait_hybrid`], handed on when dropped.
struct Sleeper<'a>(&'a CqInner);

impl Drop for Sleeper<'_> {
    fn drop(&mut self) {
        *self.0.sleeper.lock().unwrap_or_else(|e| e.into_inner()) = false;
        self.0.sleeper_woke.notify_one();
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: Drop runs once and the queue is not used after; its queue pairs hold it alive.
        unsafe { self.imp.destroy(&self.ctx.inner.imp) };
    }
}

/// How many raw completions one provider call fetches.
const POLL_BATCH: usize = 32;

impl Cq {
    pub(crate) fn new(ctx: Context, imp: CqImpl, depth: u32, id: u64) -> Cq {
        Cq {
            inner: Arc::new(CqInner {
                ctx,
                imp,
                depth,
                id,
                qps: RwLock::new(Vec::new()),
                stash: Mutex::new(VecDeque::new()),
                stash_len: AtomicUsize::new(0),
                reap: Mutex::new(vec![Completion::default(); POLL_BATCH]),
                sleeper: Mutex::new(false),
                sleeper_woke: Condvar::new(),
            }),
        }
    }

    /// The number of entries the queue really holds (after the device's rounding).
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// A process-unique number for this queue: the one asynchronous events about it carry
    /// ([`crate::EventElement::Cq`]).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    pub(crate) fn register_qp(&self, qp_num: u32, qp: Weak<QpShared>) {
        let mut qps = self.inner.qps.write().unwrap_or_else(|e| e.into_inner());
        qps.retain(|(n, w)| *n != qp_num && w.strong_count() > 0);
        qps.push((qp_num, qp));
    }

    /// Forgets a dropped queue pair. Only a dead entry goes: a device may already have given
    /// its number to a queue pair created since, whose entry stays.
    pub(crate) fn unregister_qp(&self, qp_num: u32) {
        let mut qps = self.inner.qps.write().unwrap_or_else(|e| e.into_inner());
        qps.retain(|(n, w)| *n != qp_num || w.strong_count() > 0);
    }

    /// Fills `out` with finished work requests, returning how many. Never blocks. Fewer than
    /// `out.len()` means the queue held no more at that moment; it does not wait for more.
    ///
    /// # Errors
    /// [`Error::Verb`] when the device reports a failure of the queue itself (an overrun, or
    /// the device's fatal error): once, by the first poll that finds the queue empty after the
    /// failure. Completions that were queued before it are returned first; those lost are the
    /// reason to fail. A thread or task asleep on the queue is woken to meet it.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        // Completions a scope's drain stashed come first, inside `poll_device`.
        let mut n = 0;
        while n < out.len() {
            let room = out.len() - n;
            let got = self.poll_device(
                &mut |c| {
                    out[n] = c;
                    n += 1;
                },
                room,
                true,
            )?;
            // Fewer than asked for: the queue is empty. Asking again would make the soft
            // device run another receive round, which first sends the acknowledgements the
            // last one held back, ahead of the reply the caller is about to post.
            if got < room.min(POLL_BATCH) {
                break;
            }
        }
        Ok(n)
    }

    /// One finished work request, if there is one. Never blocks.
    ///
    /// # Errors
    /// As [`Cq::poll`].
    pub fn poll_one(&self) -> Result<Option<Completion>> {
        let mut one = [Completion::default()];
        Ok((self.poll(&mut one)? == 1).then_some(one[0]))
    }

    /// Busy-polls until at least one completion arrives or `timeout` passes; fills `out` with
    /// what is there. Returns 0 on timeout.
    ///
    /// # Errors
    /// As [`Cq::poll`].
    pub fn poll_wait(&self, out: &mut [Completion], timeout: Duration) -> Result<usize> {
        let deadline = crate::sync::deadline(timeout);
        let mut spins = 0u32;
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            if Instant::now() >= deadline {
                return Ok(0);
            }
            backoff(&mut spins);
        }
    }

    /// Waits for one completion, failing with [`Error::Timeout`] after `timeout`.
    ///
    /// # Errors
    /// [`Error::Timeout`], or as [`Cq::poll`].
    pub fn wait_one(&self, timeout: Duration) -> Result<Completion> {
        let mut one = [Completion::default()];
        match self.poll_wait(&mut one, timeout)? {
            0 => Err(Error::Timeout {
                what: format!("a completion on CQ ({timeout:?})"),
            }),
            _ => Ok(one[0]),
        }
    }

    /// Arms the queue: the next completion (with `solicited_only`, the next solicited one or any
    /// error) makes [`Cq::as_fd`]'s descriptor readable, once. The race-free way to sleep is
    /// arm → poll again → wait on the descriptor, which is what [`Cq::wait`] does.
    ///
    /// # Errors
    /// [`Error::Verb`] when the device refuses.
    pub fn arm(&self, solicited_only: bool) -> Result<()> {
        self.inner.imp.arm(solicited_only)
    }

    /// Soft devices: whether a thread that polls this queue and finds it empty does the
    /// device's receive work itself (on by default). On, a polling thread never waits for the
    /// device's engine thread to be scheduled, and the engine keeps off the socket while it
    /// polls: best where threads outnumber CPUs. Off, polls only read the queue and the engine
    /// thread receives, on a CPU of its own where the host has one to spare: there it runs
    /// beside the polling thread instead of taking turns with it. Turning it off hands the
    /// receive path back to the engine at once. Verbs devices: no effect (their hardware
    /// receives).
    pub fn set_inline_progress(&self, on: bool) {
        self.inner.imp.set_inline_progress(on);
    }

    /// Whether polls do the device's receive work ([`Cq::set_inline_progress`]); always
    /// `false` on verbs devices.
    pub fn inline_progress(&self) -> bool {
        self.inner.imp.inline_progress()
    }

    /// Clears the descriptor's readiness (taking and acknowledging every pending event, so one
    /// readiness never hides another) and returns how many notifications it held.
    ///
    /// # Errors
    /// [`Error::Verb`] when reading the completion channel fails.
    pub fn consume_events(&self) -> Result<u32> {
        self.inner.imp.consume_events()
    }

    /// Waits for completions, sleeping in the kernel while there are none (no CPU is used).
    /// Returns how many were put in `out`; 0 after `timeout`.
    ///
    /// Any number of threads may wait on one queue: one at a time sleeps on its descriptor and
    /// the others wait for it to wake, so no completion waits beside a sleeping waiter. Waiting
    /// on the same queue through an `AsyncCq` or a reactor of one's own (the descriptor of
    /// `as_fd`) at the same time is not supported: those arm and consume the queue's events on
    /// their own.
    ///
    /// # Errors
    /// As [`Cq::poll`] and [`Cq::arm`].
    pub fn wait(&self, out: &mut [Completion], timeout: Duration) -> Result<usize> {
        self.wait_hybrid(out, Duration::ZERO, timeout)
    }

    /// Busy-polls for up to `spin`, then arms and sleeps: busy-poll latency while completions
    /// come quickly, no CPU while they do not.
    ///
    /// CPU cost: each wait that finds nothing at once keeps one core fully busy for up to
    /// `spin` (a thread that waits a thousand times a second with a 50 µs spin spends up to 5 %
    /// of a core on it; one that waits back to back, all of it). On a machine with fewer cores
    /// than busy threads, the spinning takes time from the threads that would produce the
    /// completion — on a soft device, from the device itself — and can cost throughput: there,
    /// leave `spin` at zero ([`Cq::wait`]).
    ///
    /// # Errors
    /// As [`Cq::wait`].
    pub fn wait_hybrid(
        &self,
        out: &mut [Completion],
        spin: Duration,
        timeout: Duration,
    ) -> Result<usize> {
        let start = Instant::now();
        let deadline = crate::sync::deadline_from(start, timeout);
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(0);
            }
            if now.duration_since(start) < spin {
                std::hint::spin_loop();
                continue;
            }
            // One thread sleeps on the descriptor; another waits until it wakes, then looks.
            {
                let mut busy = self.inner.sleeper.lock().unwrap_or_else(|e| e.into_inner());
                if *busy {
                    let woke = self.inner.sleeper_woke.wait_timeout(busy, deadline - now);
                    drop(woke.unwrap_or_else(|e| e.into_inner()));
                    continue;
                }
                *busy = true;
            }
            let _sleeper = Sleeper(&self.inner);
            self.arm(false)?;
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            wait_readable(self.inner.imp.event_fd(), deadline - now)?;
            self.consume_events()?;
        }
    }

    /// Moves stashed completions (the oldest first) into `out`; returns how many.
    fn take_stashed(&self, out: &mut [Completion]) -> usize {
        if self.inner.stash_len.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let mut stash = self.inner.stash.lock().unwrap_or_else(|e| e.into_inner());
        let n = out.len().min(stash.len());
        for (slot, c) in out.iter_mut().zip(stash.drain(..n)) {
            *slot = c;
        }
        self.inner.stash_len.store(stash.len(), Ordering::Release);
        n
    }

    /// Reaps from the device into the stash (used while a scope drains). Returns how many raw
    /// entries the device gave.
    pub(crate) fn reap_into_stash(&self) -> Result<usize> {
        // Each entry goes into the stash while the reap lock is held (inside `poll_device`), so
        // a poller that takes the lock next finds it there: see `poll_device`.
        self.poll_device(
            &mut |c| {
                let mut stash = self.inner.stash.lock().unwrap_or_else(|e| e.into_inner());
                stash.push_back(c);
                self.inner.stash_len.store(stash.len(), Ordering::Release);
            },
            POLL_BATCH,
            false,
        )
    }

    /// Polls the device once for up to `max` entries, translating each; returns the number of
    /// raw entries reaped (some may have been retired silently).
    ///
    /// With `stashed_first`, completions a scope's drain stashed meanwhile are emitted first,
    /// under the reap lock. The drain stashes under that lock, so whatever it reaped before
    /// this call took the lock is emitted here, ahead of the newer entries this call reaps.
    /// A poll therefore never misses one that was reaped while it waited for the lock, which
    /// would leave a waiter asleep beside a completion, and never reorders them.
    fn poll_device(
        &self,
        emit: &mut dyn FnMut(Completion),
        max: usize,
        stashed_first: bool,
    ) -> Result<usize> {
        let mut want = max.clamp(1, POLL_BATCH);
        let mut raw = self.inner.reap.lock().unwrap_or_else(|e| e.into_inner());
        let mut stashed = 0;
        if stashed_first && self.inner.stash_len.load(Ordering::Acquire) > 0 {
            let mut taken = [Completion::default(); POLL_BATCH];
            stashed = self.take_stashed(&mut taken[..want]);
            for c in &taken[..stashed] {
                emit(*c);
            }
            want -= stashed;
            if want == 0 {
                return Ok(stashed);
            }
        }
        let got = self.inner.imp.poll(&mut raw[..want])?;
        if got == 0 {
            return Ok(stashed);
        }
        let qps = self.inner.qps.read().unwrap_or_else(|e| e.into_inner());
        let mut last: Option<(u32, Arc<QpShared>)> = None;
        for wc in &raw[..got] {
            let qp = match &last {
                Some((n, qp)) if *n == wc.qp_num => Some(qp.clone()),
                _ => qps
                    .iter()
                    .find(|(n, _)| *n == wc.qp_num)
                    .and_then(|(_, w)| w.upgrade()),
            };
            let Some(qp) = qp else {
                // A queue pair destroyed with completions still queued: nobody can want them.
                continue;
            };
            if let Some(c) = qp.translate(wc) {
                emit(c);
            }
            last = Some((wc.qp_num, qp));
        }
        Ok(stashed + got)
    }
}

/// The descriptor that becomes readable when an armed queue gets a completion, or when the
/// queue fails (on verbs devices an epoll set of the completion channel and of the failure's
/// wake-up, which the SDK's event thread signals on an overrun; an eventfd on the soft device).
/// Register it with any reactor (epoll, tokio, io_uring `POLL_ADD`); on readiness call
/// [`Cq::consume_events`], then [`Cq::poll`], then [`Cq::arm`] and poll once more before
/// waiting again.
impl AsFd for Cq {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // The descriptor is the CQ's epoll set or eventfd.
        // SAFETY: the descriptor belongs to the CQ, which lives at least as long as `self`.
        unsafe { BorrowedFd::borrow_raw(self.inner.imp.event_fd()) }
    }
}

fn wait_readable(fd: std::os::fd::RawFd, timeout: Duration) -> Result<()> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::io("waiting on a completion queue", e));
        }
    }
    Ok(())
}

impl fmt::Debug for Cq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cq")
            .field("depth", &self.inner.depth)
            .field("device", &self.inner.ctx.name())
            .finish()
    }
}

/// Spin, then yield, then sleep briefly: keeps waits cheap on a shared machine.
pub(crate) fn backoff(spins: &mut u32) {
    *spins = spins.saturating_add(1);
    if *spins < 64 {
        std::hint::spin_loop();
    } else if *spins < 256 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

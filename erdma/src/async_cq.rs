//! Async completions on tokio: `cq.next().await`, a `Stream`, and waiting for one request.
//!
//! Owns [`AsyncCq`]: a completion queue driven by its event descriptor through tokio's
//! `AsyncFd`, shared by any number of tasks (many queue pairs on one CQ, many CQs on one thread —
//! no thread per connection). Completions are dispatched: one a task registered for with
//! [`AsyncCq::expect`] goes to that task, every other one to [`AsyncCq::next`] in order.
//!
//! No wake-up is lost: a task that finds nothing arms the queue and polls once more before it
//! waits (the race-free sequence); readiness drains every pending event (one readiness never hides
//! another); and whichever task reaps completions wakes every other waiting task, so a reaper that
//! was cancelled cannot strand the rest. With a spin budget ([`AsyncCq::with_spin`]) a task
//! busy-polls that long before it sleeps — busy-poll latency for hot connections, zero CPU for
//! idle ones.
//!
//! Other runtimes: [`Cq`] implements `AsFd`; the loop is arm → poll → wait for readable →
//! [`Cq::consume_events`] → poll.

#![allow(unsafe_code)] // registers the completion queue's descriptor with tokio

use std::collections::{HashMap, VecDeque};
use std::future::poll_fn;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::{Pin, pin};
use std::sync::{Mutex, MutexGuard};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use crate::cq::Cq;
use crate::error::{Error, Result};
use crate::owned::{OwnedBuf, is_owned_id};
use crate::vocab::Completion;

/// The CQ as tokio's event source: owning a handle keeps the descriptor open for as long as the
/// `AsyncFd` lives.
struct EventSource(Cq);

impl AsRawFd for EventSource {
    fn as_raw_fd(&self) -> RawFd {
        self.0.inner.imp.event_fd()
    }
}

/// A registration made with [`AsyncCq::expect`]: the completion of one posted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "await it with AsyncCq::completion"]
pub struct Ticket {
    qp_num: u32,
    wr_id: u64,
}

/// Where an owned request (see [`crate::AsyncQp`]) stands.
pub(crate) enum OwnedSlot {
    /// Posted; its future waits for the completion.
    Waiting,
    /// Completed; its future has not taken the completion yet.
    Done(Completion),
    /// Its future was dropped first: the SDK holds the buffer until the completion says the
    /// device is done with it.
    Parked(Option<OwnedBuf>),
}

#[derive(Default)]
pub(crate) struct Dispatch {
    ready: VecDeque<Completion>,
    claimed: HashMap<(u32, u64), Option<Completion>>,
    /// Owned requests by (queue pair, request number): their completions go here, never to
    /// [`AsyncCq::next`] or a ticket.
    pub(crate) owned: HashMap<(u32, u64), OwnedSlot>,
    /// Set when reaping failed (a completion queue overrun: completions were lost). Every
    /// waiter sees it, not only the task that reaped it: a waiter whose completion was lost
    /// would otherwise wait for ever.
    failed: Option<String>,
}

/// A completion queue for async code, shared by any number of tasks.
///
/// Driven by the completion queue's event descriptor through tokio's `AsyncFd` (no thread per
/// connection). Completions are dispatched: one a task registered for with [`AsyncCq::expect`]
/// goes to that task, one of an owned request ([`crate::AsyncQp`]) to its future, every other
/// one to [`AsyncCq::next`] in order. No wake-up is lost: a task that finds nothing arms the
/// queue and polls once more before it sleeps, and whichever task reaps wakes the others.
///
/// Other runtimes: [`Cq`] implements `AsFd`; the loop is arm → poll → wait for readable →
/// [`Cq::consume_events`] → poll. One `AsyncCq` per completion queue (a second registration of
/// the same descriptor fails).
pub struct AsyncCq {
    fd: AsyncFd<EventSource>,
    spin: Duration,
    dispatch: Mutex<Dispatch>,
    notify: Notify,
}

impl std::fmt::Debug for AsyncCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCq")
            .field("cq", self.cq())
            .field("spin", &self.spin)
            .finish()
    }
}

impl AsyncCq {
    /// Wraps a completion queue. Must be called inside a tokio runtime (with I/O enabled).
    ///
    /// # Errors
    /// [`Error::Io`] when the descriptor cannot be registered with the runtime.
    pub fn new(cq: Cq) -> Result<AsyncCq> {
        AsyncCq::with_spin(cq, Duration::ZERO)
    }

    /// Like [`AsyncCq::new`], busy-polling up to `spin` before each sleep (hybrid mode).
    ///
    /// **CPU cost**: a waiting task holds its runtime thread, and a whole CPU, for up to `spin`
    /// each time it finds nothing, whether or not a completion then comes; with several such
    /// tasks per thread the spins add up. It lowers latency only where a CPU is to spare: on a
    /// host whose CPUs are shared with the soft device's engine or other work, the spinning
    /// delays the very work it waits for (50 µs halved 4 KiB READ throughput on 2 CPUs). The
    /// default ([`AsyncCq::new`]) uses no CPU while nothing is there.
    ///
    /// # Errors
    /// As [`AsyncCq::new`].
    pub fn with_spin(cq: Cq, spin: Duration) -> Result<AsyncCq> {
        // The descriptor belongs to the CQ the source owns, so it stays open and the same for
        // as long as the AsyncFd holds the source (even if the AsyncFd is forgotten).
        // SAFETY: the descriptor outlives its registration (above).
        let fd = unsafe { AsyncFd::register_with_interest(EventSource(cq), Interest::READABLE) }
            .map_err(|e| {
                let (_, e) = e.into_parts();
                Error::io("registering a completion queue with tokio", e)
            })?;
        Ok(AsyncCq {
            fd,
            spin,
            dispatch: Mutex::new(Dispatch::default()),
            notify: Notify::new(),
        })
    }

    #[doc(hidden)]
    pub fn debug_state(&self) -> String {
        let d = self.dispatch();
        let done = d.claimed.values().filter(|v| v.is_some()).count();
        let parked = d
            .owned
            .values()
            .filter(|v| matches!(v, OwnedSlot::Parked(_)))
            .count();
        format!(
            "ready {} claimed {} (done {}) owned {} (parked {})",
            d.ready.len(),
            d.claimed.len(),
            done,
            d.owned.len(),
            parked
        )
    }

    /// The completion queue.
    pub fn cq(&self) -> &Cq {
        &self.fd.get_ref().0
    }

    pub(crate) fn dispatch(&self) -> MutexGuard<'_, Dispatch> {
        self.dispatch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers interest in the completion of request `wr_id` of queue pair `qp_num`. Call it
    /// before posting the request; then await [`AsyncCq::completion`]. The request must be
    /// signaled (or fail): an unsignaled success produces no completion.
    ///
    /// A completion that already arrived for the same request number and was not yet redeemed
    /// stays: the tickets for it share it, and redeeming one takes it.
    pub fn expect(&self, qp_num: u32, wr_id: u64) -> Ticket {
        self.dispatch()
            .claimed
            .entry((qp_num, wr_id))
            .or_insert(None);
        Ticket { qp_num, wr_id }
    }

    /// Posts `wr` on `qp` and returns the ticket for its completion, in one step: a ticket that
    /// cannot wait for ever. A request that is not signaled (on a queue pair that does not
    /// signal every request) produces no completion when it succeeds, so it is refused here;
    /// take tickets with [`AsyncCq::expect`] only for requests you know are signaled.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unsignaled request or a queue pair whose sends complete
    /// into another queue; otherwise as [`crate::Qp::post_send`] (the ticket is given up when the
    /// post fails).
    pub fn post_send(
        &self,
        qp: &crate::Qp<crate::qp::Rts>,
        wr: crate::SendWr<'static, '_>,
    ) -> Result<Ticket> {
        if !std::sync::Arc::ptr_eq(&qp.send_cq().inner, &self.cq().inner) {
            return Err(Error::invalid(
                "AsyncCq::post_send: the queue pair's sends complete into another completion queue",
            ));
        }
        if !wr.flags.contains(crate::vocab::SendFlags::SIGNALED) && !qp.shared.sig_all {
            return Err(Error::invalid(format!(
                "AsyncCq::post_send: request {:#x} is unsignaled, so its success would produce \
                 no completion to wait for; make it signaled (SendWr::signaled)",
                wr.wr_id
            )));
        }
        let ticket = self.expect(qp.qp_num(), wr.wr_id);
        if let Err(e) = qp.post_send(wr) {
            self.cancel(ticket);
            return Err(e);
        }
        Ok(ticket)
    }

    /// Gives up a ticket that will not be awaited (its task was cancelled, say): its entry goes,
    /// so it does not stay in the table for ever. Returns its completion if that had arrived;
    /// one arriving later goes to [`AsyncCq::next`] like any other.
    pub fn cancel(&self, ticket: Ticket) -> Option<Completion> {
        self.dispatch()
            .claimed
            .remove(&(ticket.qp_num, ticket.wr_id))
            .flatten()
    }

    /// The completion a [`Ticket`] names.
    ///
    /// **Cancel safety**: cancel-safe. Dropped before it resolves, it takes nothing: the ticket
    /// (which is `Copy`) may be awaited again, or given up with [`AsyncCq::cancel`].
    ///
    /// # Errors
    /// As [`Cq::poll`]; [`Error::InvalidArgument`] for a ticket already redeemed.
    pub async fn completion(&self, ticket: Ticket) -> Result<Completion> {
        let key = (ticket.qp_num, ticket.wr_id);
        self.wait_until(|d| match d.claimed.get(&key) {
            Some(Some(_)) => d.claimed.remove(&key).flatten().map(Ok),
            Some(None) => None,
            None => Some(Err(Error::invalid(format!(
                "no pending ticket for request {:#x} of queue pair {:#x}",
                ticket.wr_id, ticket.qp_num
            )))),
        })
        .await
    }

    /// The next completion nobody registered for, oldest first.
    ///
    /// **Cancel safety**: cancel-safe. Dropped before it resolves, it takes nothing: the
    /// completion stays for the next call.
    ///
    /// # Errors
    /// As [`Cq::poll`].
    pub async fn next(&self) -> Result<Completion> {
        self.wait_until(|d| d.ready.pop_front().map(Ok)).await
    }

    /// Up to `out.len()` completions nobody registered for, waiting for at least one.
    ///
    /// **Cancel safety**: cancel-safe (as [`AsyncCq::next`]): it takes completions only in the
    /// poll that resolves it.
    ///
    /// # Errors
    /// As [`Cq::poll`].
    pub async fn next_batch(&self, out: &mut [Completion]) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let first = self.next().await?;
        out[0] = first;
        let mut n = 1;
        let mut d = self.dispatch();
        while n < out.len() {
            match d.ready.pop_front() {
                Some(c) => {
                    out[n] = c;
                    n += 1;
                }
                None => break,
            }
        }
        Ok(n)
    }

    /// A `Stream` of the completions nobody registered for. Cancel-safe like
    /// [`AsyncCq::next`]: an item not yet yielded stays in the queue.
    pub fn stream(&self) -> CompletionStream<'_> {
        CompletionStream {
            cq: self,
            pending: None,
        }
    }

    /// Moves what the device has into the dispatch table; returns how many arrived.
    ///
    /// The table stays locked from the first poll to the last entry placed: two tasks reaping
    /// at once then place their batches in the order the queue gave them (a queue pair's
    /// receives stay in order in `ready`). A failure is kept for every waiter, and wakes them.
    pub(crate) fn reap(&self) -> Result<usize> {
        let mut buf = [Completion::default(); 32];
        let mut total = 0;
        // Buffers of dropped futures whose requests completed: freed once the lock is gone.
        let mut released: Vec<OwnedBuf> = Vec::new();
        let mut d = self.dispatch();
        let outcome = loop {
            let n = match self.cq().poll(&mut buf) {
                Ok(n) => n,
                Err(e) => break Err(e),
            };
            if n == 0 {
                break Ok(());
            }
            total += n;
            for c in &buf[..n] {
                let key = (c.qp_num, c.wr_id);
                if is_owned_id(c.wr_id) {
                    match d.owned.get_mut(&key) {
                        Some(slot @ OwnedSlot::Waiting) => *slot = OwnedSlot::Done(*c),
                        Some(OwnedSlot::Parked(_)) => {
                            if let Some(OwnedSlot::Parked(Some(b))) = d.owned.remove(&key) {
                                released.push(b);
                            }
                        }
                        // Nobody owns it (cannot happen: the slot is made before the post).
                        _ => {}
                    }
                    continue;
                }
                match d.claimed.get_mut(&key) {
                    Some(slot @ None) => *slot = Some(*c),
                    _ => d.ready.push_back(*c),
                }
            }
            if n < buf.len() {
                break Ok(());
            }
        };
        if let Err(e) = &outcome {
            d.failed.get_or_insert_with(|| e.to_string());
        }
        drop(d);
        drop(released);
        if total > 0 || outcome.is_err() {
            self.notify.notify_waiters();
        }
        outcome.map(|()| total)
    }

    /// Waits for the completion of owned request `key`, taking it from the table.
    pub(crate) async fn wait_owned(&self, key: (u32, u64)) -> Result<Completion> {
        self.wait_until(|d| match d.owned.get(&key) {
            Some(OwnedSlot::Done(_)) => match d.owned.remove(&key) {
                Some(OwnedSlot::Done(c)) => Some(Ok(c)),
                _ => None,
            },
            Some(OwnedSlot::Waiting) => None,
            _ => Some(Err(Error::invalid(format!(
                "no owned request {:#x} of queue pair {:#x} is pending",
                key.1, key.0
            )))),
        })
        .await
    }

    /// Waits until `take` finds what the caller wants in the dispatch table.
    async fn wait_until<T>(
        &self,
        mut take: impl FnMut(&mut Dispatch) -> Option<Result<T>>,
    ) -> Result<T> {
        let mut reaped = 0u32;
        loop {
            // Register for other reapers' wake-ups before looking, so none is missed.
            let mut notified = pin!(self.notify.notified());
            notified.as_mut().enable();
            {
                let mut d = self.dispatch();
                if let Some(r) = take(&mut d) {
                    return r;
                }
                if let Some(why) = &d.failed {
                    return Err(Error::Verb {
                        verb: "ibv_poll_cq",
                        source: std::io::Error::other(why.clone()),
                    });
                }
            }
            if self.reap()? > 0 {
                // Completions keep coming but not the one wanted: let the other tasks of this
                // thread (those that want them) run now and then.
                reaped += 1;
                if reaped % YIELD_EVERY == 0 {
                    yield_once().await;
                }
                continue;
            }
            if !self.spin.is_zero() {
                let until = crate::sync::deadline(self.spin);
                let mut got = false;
                while Instant::now() < until {
                    if self.reap()? > 0 {
                        got = true;
                        break;
                    }
                    std::hint::spin_loop();
                }
                if got {
                    continue;
                }
            }
            // Race-free sleep: arm, then look once more before waiting.
            self.cq().arm(false)?;
            if self.reap()? > 0 {
                continue;
            }
            let mut readable = pin!(self.fd.readable());
            let woke = poll_fn(|cx: &mut TaskContext<'_>| {
                if notified.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Ok(None));
                }
                match readable.as_mut().poll(cx) {
                    Poll::Ready(Ok(guard)) => Poll::Ready(Ok(Some(guard))),
                    Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await
            .map_err(|e| Error::io("waiting for a completion queue event", e))?;
            if let Some(mut guard) = woke {
                self.cq().consume_events()?;
                guard.clear_ready();
            }
        }
    }
}

/// Rounds of reaping without finding what a task waits for, between two yields to the runtime.
const YIELD_EVERY: u32 = 16;

/// Returns to the runtime once (the task is woken at once and runs again in its turn).
async fn yield_once() {
    let mut yielded = false;
    poll_fn(|cx: &mut TaskContext<'_>| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}

type NextFuture<'a> = Pin<Box<dyn std::future::Future<Output = Result<Completion>> + Send + 'a>>;

/// A `Stream` over an [`AsyncCq`]'s unregistered completions (see [`AsyncCq::stream`]).
pub struct CompletionStream<'a> {
    cq: &'a AsyncCq,
    pending: Option<NextFuture<'a>>,
}

impl std::fmt::Debug for CompletionStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionStream")
            .field("cq", self.cq)
            .finish()
    }
}

impl futures_core::Stream for CompletionStream<'_> {
    type Item = Result<Completion>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        let cq = self.cq;
        let fut = self.pending.get_or_insert_with(|| Box::pin(cq.next()));
        match fut.as_mut().poll(cx) {
            Poll::Ready(r) => {
                self.pending = None;
                Poll::Ready(Some(r))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

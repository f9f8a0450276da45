//! Scoped posting: work requests over borrowed memory, proven safe by the borrow checker.
//!
//! [`scope`] works like `std::thread::scope`. Requests posted through the [`Scope`] may use any
//! memory that outlives the scope; the borrows they take last until the scope ends, and the scope
//! does not return until the device is done with every request posted in it. So safe code cannot
//! free, move or mutate memory a posted request may still touch — the compiler refuses, and
//! `tests/ui/` holds the programs it refuses.
//!
//! Ending a scope waits for each request's completion (polling its queue pair's completion
//! queues; completions reaped on the application's behalf are kept for its next poll). If they do
//! not come within [`ScopeOptions::drain_timeout`] — or at once with [`ScopeEnd::Flush`] — the
//! scope moves the queue pairs to the error state, which flushes every outstanding request, and
//! waits for those flushes. When the flushes do not come either within
//! [`ScopeOptions::flush_timeout`] — or a completion queue fails (an overrun loses completions)
//! — the scope resets the queue pairs: a queue pair in the reset state holds no requests, so
//! the device touches none of their memory again. The queue pairs are then unusable until
//! connected anew. Only a device that refuses the reset leaves the process no sound way on: the
//! scope aborts with a message rather than return memory the device may still write.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::cq::backoff;
use crate::error::Result;
use crate::owned::check_user_wr_id;
use crate::qp::{CanRecv, Qp, QpShared, Rts};
use crate::wr::{RecvWr, SendWr};

/// What a scope does with requests still outstanding when its closure returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScopeEnd {
    /// Wait for them to complete (up to the drain timeout).
    #[default]
    Wait,
    /// Move their queue pairs to the error state at once and wait only for the flushes: for
    /// teardown, and for receives that will never be matched.
    Flush,
}

/// How a scope ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScopeOptions {
    /// What to do with outstanding requests.
    pub end: ScopeEnd,
    /// How long to wait for them before forcing the queue pairs to error.
    pub drain_timeout: Duration,
    /// How long to wait for the flushes after that.
    pub flush_timeout: Duration,
}

impl Default for ScopeOptions {
    fn default() -> Self {
        ScopeOptions {
            end: ScopeEnd::Wait,
            drain_timeout: Duration::from_secs(30),
            flush_timeout: Duration::from_secs(10),
        }
    }
}

impl ScopeOptions {
    /// Flush instead of waiting.
    pub fn flush() -> Self {
        ScopeOptions {
            end: ScopeEnd::Flush,
            ..Self::default()
        }
    }
}

struct Touched {
    qp: Arc<QpShared>,
    sq_hi: Option<u64>,
    rq_hi: Option<u64>,
}

/// A posting scope; see [`scope`].
pub struct Scope<'scope, 'env: 'scope> {
    touched: Mutex<Vec<Touched>>,
    options: ScopeOptions,
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl std::fmt::Debug for Scope<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.touched.lock().map(|t| t.len()).unwrap_or(0);
        f.debug_struct("Scope")
            .field("queue_pairs", &n)
            .field("options", &self.options)
            .finish()
    }
}

/// Runs `f` with a [`Scope`] for posting requests over borrowed memory, and returns once every
/// request posted in it has completed.
///
/// ```no_run
/// # fn demo(qp: &erdma::Qp, mr: &mut erdma::Mr<'_>, peer: erdma::RemoteMr) -> erdma::Result<()> {
/// erdma::scope(|s| {
///     let src = mr.slice(0..64);
///     s.post_send(qp, erdma::SendWr::write(1, &[src], peer))?;
///     let done = qp.send_cq().wait_one(std::time::Duration::from_secs(5))?;
///     done.ok().map(|_| ())
/// })?; // the device is done with `mr` here; it may be mutated again
/// mr.as_mut_slice()[0] = 1;
/// # Ok(()) }
/// ```
pub fn scope<'env, F, T>(f: F) -> T
where
    F: for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> T,
{
    scope_with(ScopeOptions::default(), f)
}

/// [`scope`] with explicit [`ScopeOptions`].
pub fn scope_with<'env, F, T>(options: ScopeOptions, f: F) -> T
where
    F: for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> T,
{
    let scope = Scope {
        touched: Mutex::new(Vec::new()),
        options,
        _scope: PhantomData,
        _env: PhantomData,
    };
    // The guard drains on every way out of `f`, unwinding included.
    let guard = DrainGuard(&scope);
    let out = f(&scope);
    drop(guard);
    out
}

struct DrainGuard<'a, 'scope, 'env>(&'a Scope<'scope, 'env>);

impl Drop for DrainGuard<'_, '_, '_> {
    fn drop(&mut self) {
        self.0.drain();
    }
}

impl<'scope, 'env> Scope<'scope, 'env> {
    /// Posts a send request whose memory outlives the scope.
    ///
    /// # Errors
    /// Limits, [`crate::Error::QueueFull`], or the device's refusal; [`crate::Error::InvalidArgument`]
    /// for a `wr_id` in the range reserved for owned requests (top 16 bits `0xE4D3`).
    pub fn post_send<'m: 'scope>(&'scope self, qp: &Qp<Rts>, wr: SendWr<'m, '_>) -> Result<()> {
        self.post_send_batch(qp, std::iter::once(wr))
    }

    /// Posts several send requests as one chain (one doorbell).
    ///
    /// # Errors
    /// As [`Scope::post_send`]. A request the SDK refuses (a limit, a full queue) posts none of
    /// the chain; one the device refuses leaves the requests before it posted.
    pub fn post_send_batch<'m: 'scope + 'i, 'i>(
        &'scope self,
        qp: &Qp<Rts>,
        wrs: impl IntoIterator<Item = SendWr<'m, 'i>>,
    ) -> Result<()> {
        let wrs: SmallVec<[SendWr<'m, 'i>; 4]> = wrs.into_iter().collect();
        for wr in &wrs {
            check_user_wr_id(wr.wr_id)?;
        }
        let (last, posted) = qp.shared.post_send_wrs(wrs, true);
        // Record what made it to the device even when a later request failed.
        if let Some(seq) = last {
            self.record(&qp.shared, true, seq);
        }
        posted
    }

    /// Posts a receive whose memory outlives the scope.
    ///
    /// # Errors
    /// Limits, [`crate::Error::QueueFull`], or the device's refusal; [`crate::Error::InvalidArgument`]
    /// for a `wr_id` in the range reserved for owned requests (top 16 bits `0xE4D3`).
    pub fn post_recv<'m: 'scope, S: CanRecv>(
        &'scope self,
        qp: &Qp<S>,
        wr: RecvWr<'m>,
    ) -> Result<()> {
        self.post_recv_batch(qp, std::iter::once(wr))
    }

    /// Posts several receives.
    ///
    /// # Errors
    /// As [`Scope::post_recv`], and as [`Scope::post_send_batch`] for a refusal part-way.
    pub fn post_recv_batch<'m: 'scope, S: CanRecv>(
        &'scope self,
        qp: &Qp<S>,
        wrs: impl IntoIterator<Item = RecvWr<'m>>,
    ) -> Result<()> {
        let wrs: SmallVec<[RecvWr<'m>; 4]> = wrs.into_iter().collect();
        for wr in &wrs {
            check_user_wr_id(wr.wr_id)?;
        }
        let (last, posted) = qp.shared.post_recv_wrs(wrs);
        if let Some(seq) = last {
            self.record(&qp.shared, false, seq);
        }
        posted
    }

    /// Notes that the drain must wait for the queue's request `hi` (this scope's latest on it)
    /// and everything before it.
    fn record(&self, qp: &Arc<QpShared>, send: bool, hi: u64) {
        let mut touched = self.touched.lock().unwrap_or_else(|e| e.into_inner());
        let entry = match touched.iter_mut().position(|t| Arc::ptr_eq(&t.qp, qp)) {
            Some(i) => &mut touched[i],
            None => {
                touched.push(Touched {
                    qp: qp.clone(),
                    sq_hi: None,
                    rq_hi: None,
                });
                touched.last_mut().expect("just pushed")
            }
        };
        let slot = if send {
            &mut entry.sq_hi
        } else {
            &mut entry.rq_hi
        };
        *slot = Some(slot.map_or(hi, |old| old.max(hi)));
    }

    fn drain(&self) {
        let touched = std::mem::take(&mut *self.touched.lock().unwrap_or_else(|e| e.into_inner()));
        if touched.is_empty() {
            return;
        }
        let opts = self.options;
        if opts.end == ScopeEnd::Flush {
            for t in &touched {
                let _ =
                    t.qp.modify(&crate::vocab::QpAttr::to_state(crate::vocab::QpState::Err));
            }
        }
        let first_wait = match opts.end {
            ScopeEnd::Wait => opts.drain_timeout,
            ScopeEnd::Flush => opts.flush_timeout,
        };
        let mut waited = wait_all(&touched, first_wait);
        if waited == Drain::TimedOut && opts.end == ScopeEnd::Wait {
            for t in &touched {
                let _ =
                    t.qp.modify(&crate::vocab::QpAttr::to_state(crate::vocab::QpState::Err));
            }
            waited = wait_all(&touched, opts.flush_timeout);
        }
        if waited == Drain::Done {
            return;
        }
        // Completions that will never come (lost to an overrun, or a device that does not
        // flush): a queue pair in RESET holds no requests, so once the device has taken it
        // there, it touches none of their memory again.
        let reset = touched.iter().all(|t| {
            let done = t.qp.modify(&crate::vocab::QpAttr::to_state(
                crate::vocab::QpState::Reset,
            ));
            if done.is_ok() {
                t.qp.abandon_outstanding();
            }
            done.is_ok()
        });
        if reset {
            return;
        }
        // The device still owns memory whose borrow ends when we return: returning would let
        // safe code free memory under a DMA. Nothing sound remains but to stop.
        eprintln!(
            "erdma: a scope's work requests did not complete or flush within {:?} and the device \
             refused to reset their queue pairs; it may still access their memory, aborting",
            opts.drain_timeout + opts.flush_timeout
        );
        std::process::abort();
    }
}

/// How waiting for a scope's requests ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drain {
    /// Every request completed.
    Done,
    /// The timeout passed first.
    TimedOut,
    /// A completion queue failed: completions were lost, so waiting longer cannot help.
    CqFailed,
}

fn wait_all(touched: &[Touched], timeout: Duration) -> Drain {
    let deadline = crate::sync::deadline(timeout);
    let mut spins = 0u32;
    loop {
        let mut all = true;
        for t in touched {
            if t.qp.retired_past(t.sq_hi, t.rq_hi) {
                continue;
            }
            all = false;
            let send = t.qp.send_cq.reap_into_stash();
            let recv = if Arc::ptr_eq(&t.qp.send_cq.inner, &t.qp.recv_cq.inner) {
                Ok(0)
            } else {
                t.qp.recv_cq.reap_into_stash()
            };
            match (send, recv) {
                (Ok(a), Ok(b)) if a + b > 0 => spins = 0,
                (Ok(_), Ok(_)) => {}
                _ => return Drain::CqFailed,
            }
        }
        if all {
            return Drain::Done;
        }
        if Instant::now() >= deadline {
            return Drain::TimedOut;
        }
        backoff(&mut spins);
    }
}

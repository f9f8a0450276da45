//! Owned-buffer posting from async code: a registered buffer moves into the request and comes
//! back with its completion.
//!
//! Owns [`AsyncQp`] (a connected queue pair with its [`AsyncCq`]s), [`Posted`] (a posted
//! request: a `'static` future of its completion), [`Received`] and [`RecvPool`] (receive
//! buffers kept posted, zero-copy).
//!
//! Soundness: an [`OwnedBuf`] in flight is held by its [`Posted`], never by the application,
//! so nothing reads, writes or frees it while the device may touch it. Each request carries a
//! request number from a range reserved for owned requests (every other posting path refuses
//! it), so only its own completion can release the buffer. Dropping an [`Posted`] before the
//! completion parks the buffer in the [`AsyncCq`]'s table; the completion, when it is reaped,
//! frees it. A completion queue that fails (an overrun loses completions) keeps parked buffers
//! for as long as the [`AsyncCq`] lives: the device might still be using them. When the
//! [`AsyncCq`] itself goes (no [`Posted`] and no [`AsyncQp`] holds it any more), parked buffers
//! go with it: the last part of a region deregisters it before its memory is freed, so the
//! device cannot reach freed memory, and no application value can reach the bytes.
//!
//! It must not: post a request whose buffer it does not hold until the completion, nor give a
//! buffer back on any other completion than the request's own.

#![allow(unsafe_code)] // posts through the queue pair's provider-level path

use std::collections::VecDeque;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use crate::async_cq::{AsyncCq, OwnedSlot};
use crate::error::{Error, Result};
use crate::mr::RemoteMr;
use crate::owned::{OwnedBuf, next_owned_id};
use crate::provider::{RecvReq, SendReq};
use crate::qp::{Qp, Rts};
use crate::vocab::{Access, Completion, SendFlags, WrOpcode};

/// A connected queue pair for async code, posting requests that own their buffers.
///
/// Each method posts its request at once and returns an [`Posted`]: a `'static`, `Send`
/// future that resolves with the buffer when the request completes. Await it in place, keep
/// several in flight (a `VecDeque`, `join!`), or hand it to another task. Cheap to clone.
///
/// ```no_run
/// # async fn demo(qp: erdma::AsyncQp, peer: erdma::RemoteMr) -> erdma::Result<()> {
/// let mut buf = erdma::OwnedBuf::alloc(qp.qp().pd(), 4096, erdma::Access::LOCAL_WRITE)?;
/// buf.copy_from_slice(&[7; 4096]);
/// let buf = qp.write(buf, peer).await?;      // the bytes are at the peer; `buf` is back
/// let buf = qp.read(buf, peer).await?;       // and read back into it
/// assert_eq!(buf[0], 7);
/// # Ok(()) }
/// ```
///
/// **Cancel safety**: the requests are posted when the methods are called; dropping the
/// returned [`Posted`] never cancels them and never frees their buffers early (see [`Posted`]).
///
/// Completions of the queue pair's queues must be reaped only through its [`AsyncCq`]s (their
/// [`AsyncCq::next`] and tickets may be used as well): one reaped elsewhere is lost to its
/// request, whose buffer then never comes back.
#[derive(Clone)]
pub struct AsyncQp {
    inner: Arc<AsyncQpInner>,
}

struct AsyncQpInner {
    qp: Qp<Rts>,
    send: Arc<AsyncCq>,
    recv: Arc<AsyncCq>,
}

impl std::fmt::Debug for AsyncQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncQp")
            .field("qp", &self.inner.qp)
            .finish()
    }
}

/// What a completed receive gives back.
#[derive(Debug)]
pub struct Received {
    /// The buffer, its length set to the bytes received.
    pub buf: OwnedBuf,
    /// Bytes received (for a WRITE_WITH_IMM: the length the peer wrote, not placed here).
    pub len: usize,
    /// The immediate data, when the message carried one.
    pub imm: Option<u32>,
}

type Finish<T> = fn(Option<OwnedBuf>, Completion) -> Result<T>;
type Wait = Pin<Box<dyn Future<Output = Result<Completion>> + Send>>;

/// A posted owned request: a future of its completion that owns the request's buffer.
///
/// Resolves to the buffer (or [`Received`]) once the device is done with it; an unsuccessful
/// completion resolves to [`Error::Completion`] (the buffer is then freed: the device is done
/// with it).
///
/// **Cancel safety**: dropping it does not cancel the request, which the device carries out
/// anyway; the buffer is parked in the SDK until the completion arrives and then freed, never
/// returned to the allocator while the device may touch it. Polling it again after it resolved
/// is an error, not a panic.
///
/// # Errors
/// What posting refused, on the first poll (the buffer was never posted and is dropped): limits
/// ([`Error::LimitExceeded`], [`Error::OutOfBounds`] for a remote region shorter than the
/// buffer), [`Error::QueueFull`] (keep at most the queue's depth in flight),
/// [`Error::InvalidArgument`] for a buffer the device must write without `LOCAL_WRITE`, or the
/// device's refusal. [`Error::Completion`] when the request completed unsuccessfully (a flush:
/// the queue pair is in the error state). As [`AsyncCq::next`] when the completion queue fails;
/// the buffer then stays parked.
#[must_use = "the request is posted; dropping this only gives up its buffer when it completes"]
pub struct Posted<T> {
    /// Keeps the queue pair alive while its request may complete.
    _qp: AsyncQp,
    cq: Arc<AsyncCq>,
    key: (u32, u64),
    buf: Option<OwnedBuf>,
    /// Posted and not yet resolved: the device may hold the buffer.
    pending: bool,
    /// Why posting failed, for the first poll.
    refused: Option<Error>,
    wait: Option<Wait>,
    finish: Finish<T>,
}

impl<T> std::fmt::Debug for Posted<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Posted")
            .field("qp_num", &format_args!("{:#x}", self.key.0))
            .field("wr_id", &format_args!("{:#x}", self.key.1))
            .field("pending", &self.pending)
            .finish()
    }
}

impl AsyncQp {
    /// Pairs a connected queue pair with the [`AsyncCq`] over its completion queue (both of its
    /// queues complete into it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `cq` is not the queue pair's send and receive queue.
    pub fn new(qp: Qp<Rts>, cq: Arc<AsyncCq>) -> Result<AsyncQp> {
        AsyncQp::with_cqs(qp, cq.clone(), cq)
    }

    /// Like [`AsyncQp::new`] for a queue pair whose sends and receives complete into different
    /// queues.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a queue is not the queue pair's.
    pub fn with_cqs(qp: Qp<Rts>, send: Arc<AsyncCq>, recv: Arc<AsyncCq>) -> Result<AsyncQp> {
        let same = |a: &crate::Cq, b: &crate::Cq| Arc::ptr_eq(&a.inner, &b.inner);
        if !same(qp.send_cq(), send.cq()) || !same(qp.recv_cq(), recv.cq()) {
            return Err(Error::invalid(
                "an AsyncQp needs the AsyncCqs over its queue pair's own completion queues",
            ));
        }
        Ok(AsyncQp {
            inner: Arc::new(AsyncQpInner { qp, send, recv }),
        })
    }

    /// The queue pair (for its number, its protection domain, raw or scoped posting).
    pub fn qp(&self) -> &Qp<Rts> {
        &self.inner.qp
    }

    /// SENDs `buf`'s bytes (its [`OwnedBuf::len`]) into the peer's next receive.
    pub fn send(&self, buf: OwnedBuf) -> Posted<OwnedBuf> {
        self.post_send(WrOpcode::Send, buf, RemoteMr::default(), 0, [0, 0])
    }

    /// SEND with immediate data.
    pub fn send_with_imm(&self, buf: OwnedBuf, imm: u32) -> Posted<OwnedBuf> {
        self.post_send(WrOpcode::SendWithImm, buf, RemoteMr::default(), imm, [0, 0])
    }

    /// RDMA WRITEs `buf`'s bytes to `remote` (at least as long).
    pub fn write(&self, buf: OwnedBuf, remote: RemoteMr) -> Posted<OwnedBuf> {
        self.post_send(WrOpcode::RdmaWrite, buf, remote, 0, [0, 0])
    }

    /// RDMA WRITE that also consumes a receive at the peer, completing there with `imm`.
    pub fn write_with_imm(&self, buf: OwnedBuf, remote: RemoteMr, imm: u32) -> Posted<OwnedBuf> {
        self.post_send(WrOpcode::RdmaWriteWithImm, buf, remote, imm, [0, 0])
    }

    /// RDMA READs `buf.len()` bytes from `remote` into `buf`.
    pub fn read(&self, buf: OwnedBuf, remote: RemoteMr) -> Posted<OwnedBuf> {
        self.post_send(WrOpcode::RdmaRead, buf, remote, 0, [0, 0])
    }

    /// Atomic compare-and-swap of the 8 bytes at `remote.addr`; the original value lands in
    /// `buf` (8 bytes long, in the peer's byte order).
    pub fn compare_swap(
        &self,
        buf: OwnedBuf,
        remote: RemoteMr,
        compare: u64,
        swap: u64,
    ) -> Posted<OwnedBuf> {
        self.post_send(WrOpcode::AtomicCmpAndSwp, buf, remote, 0, [compare, swap])
    }

    /// Atomic fetch-and-add of `add` to the 8 bytes at `remote.addr`; the original value lands
    /// in `buf` (8 bytes long).
    pub fn fetch_add(&self, buf: OwnedBuf, remote: RemoteMr, add: u64) -> Posted<OwnedBuf> {
        self.post_send(WrOpcode::AtomicFetchAndAdd, buf, remote, 0, [add, 0])
    }

    /// Posts a receive into `buf`'s whole capacity; resolves with the bytes received.
    pub fn recv(&self, buf: OwnedBuf) -> Posted<Received> {
        let (key, cq) = self.claim(&self.inner.recv);
        let shared = &self.inner.qp.shared;
        let sge = self.check_buf(&buf, true).and_then(|()| buf.full_sge());
        let posted = sge.and_then(|sge| {
            let sges = [sge];
            shared.validate_recv(&sges)?;
            shared
                .post_recv_reqs(&[RecvReq {
                    wr_id: key.1,
                    sges: &sges,
                }])
                .1
        });
        self.in_flight(cq, key, buf, posted, finish_recv)
    }

    fn post_send(
        &self,
        opcode: WrOpcode,
        buf: OwnedBuf,
        remote: RemoteMr,
        imm: u32,
        [compare_add, swap]: [u64; 2],
    ) -> Posted<OwnedBuf> {
        let (key, cq) = self.claim(&self.inner.send);
        let sge = self
            .check_buf(&buf, opcode.writes_local())
            .and_then(|()| buf.sge());
        let sge = match sge {
            Ok(sge) => sge,
            Err(e) => return self.in_flight(cq, key, buf, Err(e), finish_send),
        };
        let sges = [sge];
        let mut req = [SendReq {
            wr_id: key.1,
            opcode,
            flags: SendFlags::SIGNALED,
            sges: &sges,
            remote_addr: remote.addr,
            rkey: remote.rkey,
            imm,
            invalidate_rkey: 0,
            compare_add,
            swap,
        }];
        let shared = &self.inner.qp.shared;
        let mut posted = shared.validate_send(&req[0], Some((buf.len() as u64, remote.len)));
        if posted.is_ok() {
            // No request is inline, so the provider reads no bytes during the call. The memory
            // the request names is `buf`'s, which the returned `Posted` (or the table it
            // parks in) holds until this request's own completion.
            // SAFETY: `post_reqs`'s contract (inline bytes readable during the call) holds.
            posted = unsafe { shared.post_reqs(&mut req, false) }.1;
        }
        self.in_flight(cq, key, buf, posted, finish_send)
    }

    /// Checks that `buf` may be used by this queue pair (its protection domain; `LOCAL_WRITE`
    /// where the device writes it).
    fn check_buf(&self, buf: &OwnedBuf, device_writes: bool) -> Result<()> {
        if !buf.in_pd(self.inner.qp.pd()) {
            return Err(Error::invalid(
                "the buffer's region belongs to another protection domain than the queue pair",
            ));
        }
        if device_writes {
            writable(buf)?;
        }
        Ok(())
    }

    /// Makes the table slot of a fresh owned request on `cq`.
    fn claim(&self, cq: &Arc<AsyncCq>) -> ((u32, u64), Arc<AsyncCq>) {
        let key = (self.inner.qp.qp_num(), next_owned_id());
        cq.dispatch().owned.insert(key, OwnedSlot::Waiting);
        (key, cq.clone())
    }

    fn in_flight<T>(
        &self,
        cq: Arc<AsyncCq>,
        key: (u32, u64),
        buf: OwnedBuf,
        posted: Result<()>,
        finish: Finish<T>,
    ) -> Posted<T> {
        let refused = posted.err();
        if refused.is_some() {
            cq.dispatch().owned.remove(&key);
        }
        Posted {
            _qp: self.clone(),
            cq,
            key,
            buf: Some(buf),
            pending: refused.is_none(),
            refused,
            wait: None,
            finish,
        }
    }
}

/// The device writes this buffer: its region must allow it.
fn writable(buf: &OwnedBuf) -> Result<()> {
    if buf.access().contains(Access::LOCAL_WRITE) {
        Ok(())
    } else {
        Err(Error::invalid(
            "the device writes this buffer (a receive, READ or atomic target): register it \
             with Access::LOCAL_WRITE",
        ))
    }
}

fn finish_send(buf: Option<OwnedBuf>, c: Completion) -> Result<OwnedBuf> {
    c.ok()?;
    buf.ok_or_else(|| Error::invalid("an owned request without its buffer"))
}

fn finish_recv(buf: Option<OwnedBuf>, c: Completion) -> Result<Received> {
    let c = c.ok()?;
    let mut buf = buf.ok_or_else(|| Error::invalid("an owned request without its buffer"))?;
    let len = c.byte_len as usize;
    buf.set_len(len.min(buf.capacity()));
    Ok(Received {
        buf,
        len,
        imm: c.imm,
    })
}

impl<T> Posted<T> {
    fn resolve(&mut self, c: Completion) -> Result<T> {
        self.pending = false;
        self.wait = None;
        (self.finish)(self.buf.take(), c)
    }

    /// The request's completion, if it has arrived, without waiting or reaping.
    fn take_done(&self) -> Option<Completion> {
        let mut d = self.cq.dispatch();
        match d.owned.get(&self.key) {
            Some(OwnedSlot::Done(_)) => match d.owned.remove(&self.key) {
                Some(OwnedSlot::Done(c)) => Some(c),
                _ => None,
            },
            _ => None,
        }
    }

    /// Hands the buffer of a request that has not completed to the table, or frees it when the
    /// completion is already there.
    fn park(&mut self) {
        if !self.pending {
            return;
        }
        self.pending = false;
        let buf = self.buf.take();
        let mut d = self.cq.dispatch();
        match d.owned.get_mut(&self.key) {
            Some(OwnedSlot::Done(_)) => {
                d.owned.remove(&self.key);
                drop(d);
                drop(buf);
            }
            Some(slot) => *slot = OwnedSlot::Parked(buf),
            None => {
                // No slot means no completion will tell when the device is done: keep the
                // memory for ever rather than free it under a transfer.
                std::mem::forget(buf);
            }
        }
    }
}

impl<T> Future for Posted<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<T>> {
        let this = self.get_mut();
        if let Some(e) = this.refused.take() {
            return Poll::Ready(Err(e));
        }
        if !this.pending {
            return Poll::Ready(Err(Error::invalid(
                "an owned request's future polled after it resolved",
            )));
        }
        if this.wait.is_none() {
            if let Some(c) = this.take_done() {
                return Poll::Ready(this.resolve(c));
            }
            // Reap once before setting up a wait: in a full pipeline the completion is often
            // there already. (A failure is kept in the table, for the wait below to report.)
            if this.cq.reap().unwrap_or(0) > 0 {
                if let Some(c) = this.take_done() {
                    return Poll::Ready(this.resolve(c));
                }
            }
            let cq = this.cq.clone();
            let key = this.key;
            this.wait = Some(Box::pin(async move { cq.wait_owned(key).await }));
        }
        let wait = this.wait.as_mut().expect("made above");
        match wait.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(c)) => Poll::Ready(this.resolve(c)),
            Poll::Ready(Err(e)) => {
                // The queue failed: the completion may be lost, so the buffer stays parked.
                this.wait = None;
                this.park();
                Poll::Ready(Err(e))
            }
        }
    }
}

impl<T> Drop for Posted<T> {
    fn drop(&mut self) {
        self.park();
    }
}

/// Receive buffers kept posted on one queue pair: take each message where it landed
/// (zero-copy), then give the buffer back with [`RecvPool::repost`].
///
/// Receives complete in the order they were posted, so [`RecvPool::next`] awaits the oldest.
#[derive(Debug)]
pub struct RecvPool {
    qp: AsyncQp,
    posted: VecDeque<Posted<Received>>,
}

impl RecvPool {
    /// Allocates `count` buffers of `size` bytes in one registered region and posts a receive
    /// into each.
    ///
    /// # Errors
    /// As [`OwnedBuf::alloc`] (for `count * size` bytes) and [`RecvPool::repost`];
    /// [`Error::InvalidArgument`] when `count` or `size` is zero.
    pub fn new(qp: &AsyncQp, count: usize, size: usize) -> Result<RecvPool> {
        if count == 0 || size == 0 {
            return Err(Error::invalid(
                "a receive pool needs buffers of at least one byte",
            ));
        }
        let total = count
            .checked_mul(size)
            .ok_or_else(|| Error::invalid("receive pool size overflows"))?;
        let region = OwnedBuf::alloc(qp.qp().pd(), total, Access::LOCAL_WRITE)?;
        RecvPool::from_bufs(qp, region.chunks(size))
    }

    /// Posts a receive into each of `bufs`.
    ///
    /// # Errors
    /// As [`RecvPool::repost`].
    pub fn from_bufs(qp: &AsyncQp, bufs: impl IntoIterator<Item = OwnedBuf>) -> Result<RecvPool> {
        let mut pool = RecvPool {
            qp: qp.clone(),
            posted: VecDeque::new(),
        };
        for b in bufs {
            pool.repost(b)?;
        }
        Ok(pool)
    }

    /// Receives posted and not yet taken.
    pub fn posted(&self) -> usize {
        self.posted.len()
    }

    /// Posts a receive into `buf` (its whole capacity).
    ///
    /// # Errors
    /// Limits, [`Error::QueueFull`] when the receive queue is full, or the device's refusal;
    /// the buffer is then dropped.
    pub fn repost(&mut self, buf: OwnedBuf) -> Result<()> {
        let mut f = self.qp.recv(buf);
        if let Some(e) = f.refused.take() {
            return Err(e);
        }
        self.posted.push_back(f);
        Ok(())
    }

    /// The next message, in the order the receives were posted.
    ///
    /// **Cancel safety**: cancel-safe. Dropped before it resolves, it takes nothing: the
    /// message stays for the next call.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when no receive is posted; [`Error::Completion`] when the
    /// receive failed (a flush: the queue pair is in the error state); as [`AsyncCq::next`].
    pub async fn next(&mut self) -> Result<Received> {
        poll_fn(|cx| {
            let Some(front) = self.posted.front_mut() else {
                return Poll::Ready(Err(Error::invalid("no receive is posted in this pool")));
            };
            match Pin::new(front).poll(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(r) => {
                    self.posted.pop_front();
                    Poll::Ready(r)
                }
            }
        })
        .await
    }
}

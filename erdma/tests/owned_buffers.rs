//! Owned-buffer posting from async code: every operation moves its buffer in and gets it back
//! with the completion, bytes checked; a dropped future parks its buffer until the completion;
//! request numbers reserved for owned requests are refused elsewhere; a flushed request fails.
#![cfg(feature = "tokio")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{PairOptions, Side, connect_pair, device_pair, pattern};
use erdma::{Access, AsyncCq, AsyncQp, Error, OwnedBuf, RecvPool, RecvWr, SendWr};

const WAIT: Duration = Duration::from_secs(20);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn pair() -> (Side, Side) {
    let (a, b) = device_pair();
    connect_pair(&a, &b, &PairOptions::default()).unwrap()
}

fn async_qp(s: &Side) -> AsyncQp {
    let cq = Arc::new(AsyncCq::new(s.cq.clone()).unwrap());
    AsyncQp::new(s.qp.clone(), cq).unwrap()
}

async fn timed<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f).await.expect("timed out")
}

#[test]
fn every_operation_returns_its_buffer_with_the_bytes() {
    let (a, b) = pair();
    rt().block_on(async {
        let (qa, qb) = (async_qp(&a), async_qp(&b));
        let pd = qa.qp().pd().clone();
        // SEND with and without immediate into a receive pool, sizes 1 B .. 64 KiB.
        let mut pool = RecvPool::new(&qb, 4, 65536).unwrap();
        let mut src = OwnedBuf::alloc(&pd, 65536, Access::LOCAL_WRITE).unwrap();
        for (i, len) in [1usize, 100, 4096, 4097, 65536].into_iter().enumerate() {
            let data = pattern(i as u32, len);
            src.set_len(len);
            src.copy_from_slice(&data);
            let sent = if i % 2 == 0 {
                qa.send(src)
            } else {
                qa.send_with_imm(src, i as u32)
            };
            let got = timed(pool.next()).await.unwrap();
            src = timed(sent).await.unwrap();
            assert_eq!(got.len, len);
            assert_eq!(&got.buf[..], &data[..], "message {i}");
            assert_eq!(got.imm, (i % 2 == 1).then_some(i as u32));
            pool.repost(got.buf).unwrap();
        }
        assert_eq!(pool.posted(), 4);
        // WRITE then READ back from the peer's granted region.
        let remote = b.mr.remote().slice(4096, 8192).unwrap();
        let data = pattern(99, 8192);
        src.set_len(8192);
        src.copy_from_slice(&data);
        let src = timed(qa.write(src, remote)).await.unwrap();
        assert_eq!(b.mr.to_vec(4096..4096 + 8192), data);
        let mut dst = OwnedBuf::alloc(&pd, 8192, Access::LOCAL_WRITE).unwrap();
        dst.fill(0);
        let dst = timed(qa.read(dst, remote)).await.unwrap();
        assert_eq!(&dst[..], &data[..]);
        // WRITE_WITH_IMM consumes a pool receive at the peer.
        let _src = timed(qa.write_with_imm(src, remote, 77)).await.unwrap();
        let note = timed(pool.next()).await.unwrap();
        assert_eq!(note.imm, Some(77));
        // Atomics on the peer's first word.
        if a.ctx.limits().atomics {
            let word = b.mr.remote().slice(0, 8).unwrap();
            let (w8, _) = OwnedBuf::alloc(&pd, 4096, Access::LOCAL_WRITE)
                .unwrap()
                .split_at(8);
            let w8 = timed(qa.fetch_add(w8, word, 5)).await.unwrap();
            let w8 = timed(qa.compare_swap(w8, word, 5, 9)).await.unwrap();
            assert_eq!(u64::from_ne_bytes(w8[..].try_into().unwrap()), 5);
            assert_eq!(b.mr.to_vec(0..8), 9u64.to_ne_bytes());
        }
    });
}

/// A receive whose future is dropped keeps its buffer parked in the SDK until the message
/// lands; the completion then frees it, and nothing else sees it.
#[test]
fn a_dropped_future_parks_its_buffer_until_the_completion() {
    let (a, b) = pair();
    rt().block_on(async {
        let qa = async_qp(&a);
        let cq_b = Arc::new(AsyncCq::new(b.cq.clone()).unwrap());
        let qb = AsyncQp::new(b.qp.clone(), cq_b.clone()).unwrap();
        let buf = OwnedBuf::alloc(qb.qp().pd(), 4096, Access::LOCAL_WRITE).unwrap();
        let posted = qb.recv(buf);
        drop(posted);
        assert!(
            cq_b.debug_state().ends_with("owned 1 (parked 1)"),
            "{}",
            cq_b.debug_state()
        );
        // The message lands in the parked buffer; reaping it (while waiting for another
        // request) frees the buffer and leaves the table empty.
        let mut src = OwnedBuf::alloc(qa.qp().pd(), 64, Access::LOCAL_WRITE).unwrap();
        src.fill(3);
        timed(qa.send(src)).await.unwrap();
        let next = OwnedBuf::alloc(qb.qp().pd(), 64, Access::LOCAL_WRITE).unwrap();
        let waiting = qb.recv(next);
        let mut src = OwnedBuf::alloc(qa.qp().pd(), 8, Access::LOCAL_WRITE).unwrap();
        src.fill(4);
        timed(qa.send(src)).await.unwrap();
        let got = timed(waiting).await.unwrap();
        assert_eq!(&got.buf[..], &[4; 8]);
        assert!(
            cq_b.debug_state().ends_with("owned 0 (parked 0)"),
            "{}",
            cq_b.debug_state()
        );
        // A future cancelled by a timeout behaves the same.
        let buf = OwnedBuf::alloc(qb.qp().pd(), 64, Access::LOCAL_WRITE).unwrap();
        let r = tokio::time::timeout(Duration::from_millis(20), qb.recv(buf)).await;
        assert!(r.is_err());
        assert!(
            cq_b.debug_state().ends_with("owned 1 (parked 1)"),
            "{}",
            cq_b.debug_state()
        );
    });
}

#[test]
fn reserved_request_numbers_are_refused_elsewhere() {
    let (a, _b) = pair();
    let reserved = 0xE4D3_0000_0000_0001u64;
    let e =
        a.qp.post_send(SendWr::send_inline(reserved, b"x"))
            .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = a.qp.post_recv(RecvWr::empty(reserved)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = erdma::scope(|s| s.post_recv(&a.qp, RecvWr::empty(reserved))).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // Neighbouring numbers are the application's.
    a.qp.post_recv(RecvWr::empty(reserved ^ (1 << 48))).unwrap();
}

#[test]
fn requests_on_a_dead_queue_pair_fail_and_misuse_is_refused() {
    let (a, _b) = pair();
    rt().block_on(async {
        let qa = async_qp(&a);
        let pd = qa.qp().pd().clone();
        // A READ target must be writable by the device.
        let ro = OwnedBuf::alloc(&pd, 64, Access::empty()).unwrap();
        let e = timed(qa.read(ro, a.mr.remote().slice(0, 64).unwrap()))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        // A buffer of another protection domain (here: of the other device).
        let foreign = OwnedBuf::alloc(_b.qp.pd(), 64, Access::LOCAL_WRITE).unwrap();
        let e = timed(qa.send(foreign)).await.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        // A WRITE longer than the remote region.
        let big = OwnedBuf::alloc(&pd, 128, Access::LOCAL_WRITE).unwrap();
        let e = timed(qa.write(big, a.mr.remote().slice(0, 64).unwrap()))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { .. }), "{e}");
        // A receive pending when the queue pair goes to ERROR completes with a flush.
        let buf = OwnedBuf::alloc(&pd, 64, Access::LOCAL_WRITE).unwrap();
        let pending = qa.recv(buf);
        qa.qp().to_error().unwrap();
        match timed(pending).await {
            Err(Error::Completion(c)) => assert!(!c.status.is_success()),
            other => panic!("expected a flushed receive, got {other:?}"),
        }
    });
}

/// `RecvPool::next` dropped before a message arrives takes nothing: the next call gets it.
/// And a `Posted` is a `'static + Send` future: it can be handed to another task.
#[test]
fn recv_pool_next_is_cancel_safe_and_posted_requests_can_be_spawned() {
    fn is_static_send<T: Send + 'static>(_: &T) {}
    let (a, b) = pair();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (qa, qb) = (async_qp(&a), async_qp(&b));
        let mut pool = RecvPool::new(&qb, 2, 256).unwrap();
        let early = tokio::time::timeout(Duration::from_millis(30), pool.next()).await;
        assert!(early.is_err(), "nothing was sent yet");
        let mut src = OwnedBuf::alloc(qa.qp().pd(), 16, Access::LOCAL_WRITE).unwrap();
        src.copy_from_slice(b"after the cancel");
        let sent = qa.send(src);
        is_static_send(&sent);
        let task = tokio::spawn(sent);
        let got = timed(pool.next()).await.unwrap();
        assert_eq!(&got.buf[..], b"after the cancel");
        assert_eq!(pool.posted(), 1);
        let back = timed(task).await.unwrap().unwrap();
        assert_eq!(&back[..], b"after the cancel");
    });
}

/// Synchronous code posts the same buffers through a scope, borrowing them.
#[test]
fn owned_buffers_serve_scoped_posting_too() {
    let (a, b) = pair();
    let mut inbox = OwnedBuf::alloc(b.qp.pd(), 64, Access::LOCAL_WRITE).unwrap();
    let mut msg = OwnedBuf::alloc(a.qp.pd(), 5, Access::LOCAL_WRITE).unwrap();
    msg.copy_from_slice(b"scope");
    erdma::scope(|s| {
        s.post_recv(&b.qp, RecvWr::new(1, inbox.as_mr_slice_mut()))
            .unwrap();
        s.post_send(&a.qp, SendWr::send(2, &[msg.as_mr_slice()]))
            .unwrap();
        assert!(a.cq.wait_one(WAIT).unwrap().is_ok());
        assert_eq!(b.cq.wait_one(WAIT).unwrap().byte_len, 5);
    });
    assert_eq!(&inbox[..5], b"scope");
}

//! Event-driven completions: blocking waits, tokio tasks, tickets, io_uring, and a stress test
//! with many tasks, many queue pairs and one CQ — no completion lost or duplicated, no stall.
#![cfg(feature = "tokio")]

mod common;

use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{PairOptions, connect_pair, device_pair};
use erdma::{
    Access, AsyncCq, AsyncEventKind, Completion, ConnectOptions, Context, Error, EventElement,
    InitOptions, Qp, QpConfig, RecvWr, SendWr, WcStatus,
};

#[test]
fn blocking_wait_sleeps_until_a_completion_arrives() {
    let (a, b) = device_pair();
    let (a, b) = connect_pair(&a, &b, &PairOptions::default()).unwrap();
    let mut out = [Completion::default(); 4];
    // Nothing posted: the wait times out with nothing.
    assert_eq!(b.cq.wait(&mut out, Duration::from_millis(50)).unwrap(), 0);
    // A receive posted now, a send from another thread later: the sleeping waiter wakes.
    b.qp.post_recv(RecvWr::empty(11)).unwrap();
    let qa = a.qp.clone();
    let sender = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        qa.post_send(SendWr::send_inline(1, b"")).unwrap();
    });
    let n = b.cq.wait(&mut out, Duration::from_secs(20)).unwrap();
    assert_eq!(n, 1);
    assert_eq!((out[0].wr_id, out[0].status), (11, WcStatus::Success));
    sender.join().unwrap();
    // Hybrid: the same with a spin budget.
    b.qp.post_recv(RecvWr::empty(12)).unwrap();
    a.qp.post_send(SendWr::send_inline(2, b"x")).unwrap();
    let n =
        b.cq.wait_hybrid(
            &mut out,
            Duration::from_micros(200),
            Duration::from_secs(20),
        )
        .unwrap();
    assert_eq!((n, out[0].wr_id), (1, 12));
}

#[test]
fn io_uring_can_poll_the_completion_queue() {
    let (a, b) = device_pair();
    let (a, b) = connect_pair(&a, &b, &PairOptions::default()).unwrap();
    let mut ring = io_uring::IoUring::new(4).unwrap();
    b.qp.post_recv(RecvWr::empty(5)).unwrap();
    b.cq.arm(false).unwrap();
    assert!(b.cq.poll_one().unwrap().is_none());
    let poll =
        io_uring::opcode::PollAdd::new(io_uring::types::Fd(b.cq.as_fd_raw()), libc::POLLIN as u32)
            .build()
            .user_data(77);
    // SAFETY: the PollAdd entry references only a descriptor that outlives the submission.
    unsafe { ring.submission().push(&poll).unwrap() };
    ring.submit().unwrap();
    a.qp.post_send(SendWr::send_inline(1, b"hi")).unwrap();
    ring.submit_and_wait(1).unwrap();
    let cqe = ring.completion().next().unwrap();
    assert_eq!(cqe.user_data(), 77);
    assert!(cqe.result() > 0, "the descriptor became readable");
    b.cq.consume_events().unwrap();
    assert_eq!(b.cq.wait_one(Duration::from_secs(20)).unwrap().wr_id, 5);
}

trait RawFdExt {
    fn as_fd_raw(&self) -> i32;
}

impl RawFdExt for erdma::Cq {
    fn as_fd_raw(&self) -> i32 {
        std::os::fd::AsFd::as_fd(self).as_raw_fd()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_await_next_and_their_own_tickets() {
    let (a, b) = device_pair();
    let (a, b) = connect_pair(&a, &b, &PairOptions::default()).unwrap();
    let acq = Arc::new(AsyncCq::new(a.cq.clone()).unwrap());
    let bcq = Arc::new(AsyncCq::new(b.cq.clone()).unwrap());
    for k in 0..8u64 {
        b.qp.post_recv(RecvWr::empty(100 + k)).unwrap();
    }
    // Tickets for the sends, registered before posting.
    let mut tasks = Vec::new();
    for k in 0..8u64 {
        let t = acq.expect(a.qp.qp_num(), k);
        let acq = acq.clone();
        tasks.push(tokio::spawn(async move { acq.completion(t).await }));
    }
    let qa = a.qp.clone();
    tokio::spawn(async move {
        for k in 0..8u64 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            qa.post_send(SendWr::send_inline(k, b"")).unwrap();
        }
    });
    for (k, t) in tasks.into_iter().enumerate() {
        let c = tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("no stall")
            .unwrap()
            .unwrap();
        assert_eq!((c.wr_id, c.status), (k as u64, WcStatus::Success));
    }
    let mut seen = Vec::new();
    for _ in 0..8 {
        let c = tokio::time::timeout(Duration::from_secs(20), bcq.next())
            .await
            .expect("no stall")
            .unwrap();
        seen.push(c.wr_id);
    }
    assert_eq!(seen, (100..108).collect::<Vec<_>>());
    // Redeeming twice is an error, not a hang.
    let t = acq.expect(a.qp.qp_num(), 999);
    a.qp.post_send(SendWr::send_inline(999, b"")).ok();
    b.qp.post_recv(RecvWr::empty(1)).unwrap();
    acq.completion(t).await.unwrap();
    assert!(acq.completion(t).await.is_err());
}

fn qp_pair(
    ctx_a: &Context,
    ctx_b: &Context,
    cq_a: &erdma::Cq,
    cq_b: &erdma::Cq,
    depth: u32,
) -> (Qp, Qp) {
    let mk = |ctx: &Context, cq: &erdma::Cq| {
        ctx.alloc_pd()
            .unwrap()
            .create_qp(&QpConfig::new(cq).max_send_wr(depth).max_recv_wr(depth))
            .unwrap()
            .init(&InitOptions {
                access: Access::ALL,
                ..InitOptions::default()
            })
            .unwrap()
    };
    let qa = mk(ctx_a, cq_a);
    let qb = mk(ctx_b, cq_b);
    common::connect_qps(qa, qb, None, &ConnectOptions::default()).unwrap()
}

/// Many tasks, many queue pairs, one CQ per side, randomized pacing, a large number of
/// completions: every one arrives exactly once, and a watchdog bounds the whole run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_many_tasks_many_qps_one_cq() {
    let total: u64 = std::env::var("ERDMA_STRESS_COMPLETIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if cfg!(debug_assertions) {
            40_000
        } else {
            1_000_000
        });
    let qps = 16u64;
    let per_task = total / qps;
    let (na, nb) = device_pair();
    let ctx_a = Context::open(&na).unwrap();
    let ctx_b = Context::open(&nb).unwrap();
    let cq_a = ctx_a.create_cq(4096).unwrap();
    let cq_b = ctx_b.create_cq(4096).unwrap();
    let acq = Arc::new(AsyncCq::new(cq_a.clone()).unwrap());
    let bcq = Arc::new(AsyncCq::with_spin(cq_b.clone(), Duration::from_micros(20)).unwrap());
    let window = 32u64;
    let prefill = 96u64;
    let started = Instant::now();
    let mut tasks = Vec::new();
    let mut receivers = std::collections::HashMap::new();
    for t in 0..qps {
        let (qa, qb) = qp_pair(&ctx_a, &ctx_b, &cq_a, &cq_b, 128);
        for k in 0..prefill {
            qb.post_recv(RecvWr::empty(k)).unwrap();
        }
        receivers.insert(qb.qp_num(), qb);
        let acq = acq.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ t;
            let mut sent = 0u64;
            let mut tickets = std::collections::VecDeque::new();
            while sent < per_task || !tickets.is_empty() {
                while sent < per_task && tickets.len() < window as usize {
                    let id = t << 40 | sent;
                    tickets.push_back(acq.expect(qa.qp_num(), id));
                    qa.post_send(SendWr::send_inline(id, b"")).unwrap();
                    sent += 1;
                }
                let tk = tickets.pop_front().unwrap();
                let c = acq.completion(tk).await.unwrap();
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                if rng % 64 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            qa
        }));
    }
    // The receiving side: one task drains every receive completion of every queue pair and
    // reposts a receive for each, as a server does.
    let expected = per_task * qps;
    let receiver = tokio::spawn(async move {
        let mut count = 0u64;
        let mut next_id: std::collections::HashMap<u32, u64> =
            receivers.keys().map(|&q| (q, prefill)).collect();
        let mut seen = HashSet::with_capacity(expected as usize);
        let mut buf = [Completion::default(); 64];
        while count < expected {
            let n = bcq.next_batch(&mut buf).await.unwrap();
            for c in &buf[..n] {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                assert!(seen.insert((c.qp_num, c.wr_id)), "duplicate {c:?}");
                count += 1;
                let id = next_id.get_mut(&c.qp_num).expect("a known queue pair");
                receivers[&c.qp_num].post_recv(RecvWr::empty(*id)).unwrap();
                *id += 1;
            }
        }
        (count, receivers)
    });
    let watchdog = Duration::from_secs(240);
    let mut keep = Vec::new();
    for t in tasks {
        keep.push(
            tokio::time::timeout(watchdog, t)
                .await
                .expect("a sender stalled")
                .unwrap(),
        );
    }
    let (received, _receivers) = tokio::time::timeout(watchdog, receiver)
        .await
        .expect("the receiver stalled")
        .unwrap();
    assert_eq!(received, expected);
    eprintln!(
        "{expected} completions each way over {qps} queue pairs in {:?}",
        started.elapsed()
    );
}

/// Side A's queue pair sends on a 2-entry completion queue, side B's has `total` receives
/// posted: `total` SENDs overrun side A's queue. Returns side A's context, queue and queue pair,
/// then side B's.
fn overrun_pair(total: u64) -> (Context, erdma::Cq, Qp, Context, erdma::Cq, Qp) {
    let (na, nb) = device_pair();
    let ctx_a = Context::open(&na).unwrap();
    let ctx_b = Context::open(&nb).unwrap();
    let cq_a = ctx_a.create_cq(2).unwrap();
    let cq_b = ctx_b.create_cq(512).unwrap();
    let (qa, qb) = qp_pair(&ctx_a, &ctx_b, &cq_a, &cq_b, 256);
    assert!(u64::from(cq_a.depth()) < total, "the queue must overrun");
    for k in 0..total {
        qb.post_recv(RecvWr::empty(k)).unwrap();
    }
    (ctx_a, cq_a, qa, ctx_b, cq_b, qb)
}

/// The context's next asynchronous event is `CqErr` naming `cq`.
fn assert_overrun_event(ctx: &Context, cq: &erdma::Cq) {
    let ev = ctx
        .next_async_event(Duration::from_secs(10))
        .expect("no asynchronous event for the overrun");
    assert_eq!(ev.kind, AsyncEventKind::CqErr, "{ev}");
    assert_eq!(ev.element, EventElement::Cq(cq.id()), "{ev}");
}

/// A completion queue overrun loses completions: every task waiting on a ticket learns it,
/// with an error, instead of the one task whose reap met the error. Before, the other tasks
/// waited for ever (here 137 of 200). The overrun is also an asynchronous event naming the
/// queue.
///
/// Kernel devices report the overrun only as an asynchronous event (`IBV_EVENT_CQ_ERR`), not
/// through the poll: the SDK's event thread passes it on to the queue's pollers and wakes its
/// waiters. Before it did, this test failed on rxe (the lost tickets waited out the timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overrun_reaches_every_waiting_task() {
    let total = 200u64;
    let (ctx_a, cq_a, qa, _ctx_b, _cq_b, _qb) = overrun_pair(total);
    let acq = Arc::new(AsyncCq::new(cq_a.clone()).unwrap());
    let tickets: Vec<_> = (0..total).map(|k| acq.expect(qa.qp_num(), k)).collect();
    for k in 0..total {
        qa.post_send(SendWr::send_inline(k, b"")).unwrap();
    }
    // Nothing polls until the device has overrun the queue.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let tasks: Vec<_> = tickets
        .into_iter()
        .map(|t| {
            let acq = acq.clone();
            tokio::spawn(async move {
                tokio::time::timeout(Duration::from_secs(10), acq.completion(t)).await
            })
        })
        .collect();
    let (mut ok, mut failed) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(Ok(c)) => {
                assert_eq!(c.status, WcStatus::Success);
                ok += 1;
            }
            Ok(Err(e)) => {
                assert!(e.to_string().contains("overrun"), "{e}");
                failed += 1;
            }
            Err(_) => panic!(
                "a task still waits after the overrun ({})",
                acq.debug_state()
            ),
        }
    }
    assert!(
        failed > 0 && ok + failed == total,
        "ok {ok}, failed {failed}"
    );
    let ev = tokio::time::timeout(Duration::from_secs(10), ctx_a.recv_async_event())
        .await
        .expect("no asynchronous event for the overrun");
    assert_eq!(
        (ev.kind, ev.element),
        (AsyncEventKind::CqErr, EventElement::Cq(cq_a.id()))
    );
}

/// The same overrun met by a blocking waiter: once it has the completions the queue kept, its
/// next wait fails with the overrun at once instead of sleeping until its timeout beside
/// completions that were lost. A queue that did not overrun (side B's) sees no event.
#[test]
fn an_overrun_fails_a_blocking_wait_instead_of_sleeping_out_its_timeout() {
    let total = 100u64;
    let (ctx_a, cq_a, qa, ctx_b, cq_b, _qb) = overrun_pair(total);
    for k in 0..total {
        qa.post_send(SendWr::send_inline(k, b"")).unwrap();
    }
    // The SENDs arrive until side B has them all or its queue is quiet for a second (a soft
    // device moves side A's queue pair to ERROR at the overrun, as hardware does, and flushes
    // the rest; rxe goes on): by then side A's completions were produced, most into a full
    // queue.
    let mut got_b = 0;
    let mut out = [Completion::default(); 64];
    let t = Instant::now();
    while got_b < total as usize && t.elapsed() < Duration::from_secs(20) {
        match cq_b.wait(&mut out, Duration::from_secs(1)).unwrap() {
            0 => break,
            n => got_b += n,
        }
    }
    assert!(
        got_b > cq_a.depth() as usize,
        "side B got {got_b} SENDs: too few to overrun side A's queue"
    );
    // Nothing polls side A meanwhile: its device takes the acknowledgements on its own and
    // overruns the queue (a poller would take them at its own pace).
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    let mut kept = 0;
    let err = loop {
        match cq_a.wait(&mut out, Duration::from_secs(30)) {
            Ok(0) => panic!(
                "the wait timed out after {:?} (kept {kept}, side B got {got_b})",
                started.elapsed()
            ),
            Ok(n) => kept += n,
            Err(e) => break e,
        }
    };
    assert!(err.to_string().contains("overrun"), "{err}");
    assert!(kept < total as usize, "kept {kept}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the failure took {:?}",
        started.elapsed()
    );
    assert_overrun_event(&ctx_a, &cq_a);
    assert_eq!(ctx_b.next_async_event(Duration::ZERO), None);
    assert_eq!(ctx_a.async_events_dropped(), 0);
}

/// Lets other waits (here: short ones on `next`) reap until one ticketed completion has
/// arrived in the table, unredeemed.
async fn until_one_arrived(acq: &AsyncCq) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !acq.debug_state().contains("(done 1)") {
        assert!(
            Instant::now() < deadline,
            "never reaped: {}",
            acq.debug_state()
        );
        let _ = tokio::time::timeout(Duration::from_millis(20), acq.next()).await;
    }
}

/// `expect` for a request number whose completion already arrived, unredeemed, keeps it: the
/// first ticket still gets it. Before, the second `expect` wiped it and the first waited for
/// ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expecting_a_request_again_keeps_its_arrived_completion() {
    let (a, b) = device_pair();
    let (a, b) = connect_pair(&a, &b, &PairOptions::default()).unwrap();
    let acq = AsyncCq::new(a.cq.clone()).unwrap();
    b.qp.post_recv(RecvWr::empty(1)).unwrap();
    let first = acq.expect(a.qp.qp_num(), 7);
    a.qp.post_send(SendWr::send_inline(7, b"")).unwrap();
    until_one_arrived(&acq).await;
    let _again = acq.expect(a.qp.qp_num(), 7);
    let c = tokio::time::timeout(Duration::from_secs(10), acq.completion(first))
        .await
        .expect("the arrived completion was lost")
        .unwrap();
    assert_eq!((c.wr_id, c.status), (7, WcStatus::Success));
}

/// Several tasks reaping at once (each waiting for its own ticket) place what they reap in
/// the order the queue gave it: one queue pair's receives reach `next` in order. Before, a
/// task could place its batch ahead of an earlier one reaped by another task.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reapers_keep_a_queue_pairs_receives_in_order() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let (na, nb) = device_pair();
    let ctx_a = Context::open(&na).unwrap();
    let ctx_b = Context::open(&nb).unwrap();
    let cq_a = ctx_a.create_cq(4096).unwrap();
    let cq_b = ctx_b.create_cq(4096).unwrap();
    let pairs: Vec<(Qp, Qp)> = (0..4)
        .map(|_| qp_pair(&ctx_a, &ctx_b, &cq_a, &cq_b, 256))
        .collect();
    let (qas, qbs): (Vec<Qp>, Vec<Qp>) = pairs.into_iter().unzip();
    let acq = Arc::new(AsyncCq::new(cq_a.clone()).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    for k in 0..200 {
        qas[0].post_recv(RecvWr::empty(k)).unwrap();
        for q in &qbs[1..] {
            q.post_recv(RecvWr::empty(k)).unwrap();
        }
    }
    // Side B streams SENDs to queue pair 0 of side A and answers the ticket tasks' SENDs.
    let b_stop = stop.clone();
    let sender = std::thread::spawn(move || {
        let mut out = [Completion::default(); 64];
        let (mut in_flight, mut id) = (0u64, 0u64);
        let mut next_recv = std::collections::HashMap::new();
        while !b_stop.load(Ordering::Relaxed) {
            while in_flight < 64 && qbs[0].post_send(SendWr::send_inline(id, b"")).is_ok() {
                id += 1;
                in_flight += 1;
            }
            let n = cq_b.poll(&mut out).unwrap();
            for c in &out[..n] {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
                if c.opcode.is_recv() {
                    let q = qbs.iter().find(|q| q.qp_num() == c.qp_num).unwrap();
                    let k = next_recv.entry(c.qp_num).or_insert(200u64);
                    q.post_recv(RecvWr::empty(*k)).unwrap();
                    *k += 1;
                } else {
                    in_flight -= 1;
                }
            }
            if n == 0 {
                std::thread::yield_now();
            }
        }
    });
    // Side A: three ticket tasks on each of queue pairs 1..3 reap concurrently.
    let mut reapers = Vec::new();
    for (i, qa) in qas.iter().enumerate().skip(1) {
        for t in 0..3u64 {
            let (acq, qa, stop) = (acq.clone(), qa.clone(), stop.clone());
            reapers.push(tokio::spawn(async move {
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let id = (i as u64) << 48 | t << 40 | k;
                    let ticket = acq.expect(qa.qp_num(), id);
                    qa.post_send(SendWr::send_inline(id, b"")).unwrap();
                    acq.completion(ticket).await.unwrap();
                    k += 1;
                }
            }));
        }
    }
    // The consumer: queue pair 0's receives, in posting order.
    let until = Instant::now() + Duration::from_secs(3);
    let (mut last, mut next_id, mut count) = (None, 200u64, 0u64);
    let mut out_of_order = Vec::new();
    while Instant::now() < until {
        let c = tokio::time::timeout(Duration::from_secs(10), acq.next())
            .await
            .expect("no completion for 10 s")
            .unwrap();
        if c.qp_num != qas[0].qp_num() || !c.opcode.is_recv() {
            continue;
        }
        count += 1;
        if last.is_some_and(|l: u64| c.wr_id != l + 1) {
            out_of_order.push((last, c.wr_id));
        }
        last = Some(c.wr_id);
        qas[0].post_recv(RecvWr::empty(next_id)).unwrap();
        next_id += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for r in reapers {
        let _ = tokio::time::timeout(Duration::from_secs(10), r).await;
    }
    sender.join().unwrap();
    assert!(count > 1000, "only {count} receives");
    let first: Vec<_> = out_of_order.iter().take(5).collect();
    assert!(
        out_of_order.is_empty(),
        "{} out of order, the first {first:?}",
        out_of_order.len()
    );
}

/// A ticket given up with `cancel` leaves the table: a completion that had arrived comes back
/// from `cancel`; one that arrives later goes to `next`; the ticket itself is no longer known.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_ticket_leaves_the_table() {
    let (a, b) = device_pair();
    let (a, b) = connect_pair(&a, &b, &PairOptions::default()).unwrap();
    let acq = AsyncCq::new(a.cq.clone()).unwrap();
    for k in 0..2 {
        b.qp.post_recv(RecvWr::empty(k)).unwrap();
    }
    let arrived = acq.expect(a.qp.qp_num(), 1);
    a.qp.post_send(SendWr::send_inline(1, b"")).unwrap();
    until_one_arrived(&acq).await;
    let c = acq.cancel(arrived).expect("the arrived completion");
    assert_eq!((c.wr_id, c.status), (1, WcStatus::Success));
    assert!(acq.completion(arrived).await.is_err(), "the ticket is gone");
    let later = acq.expect(a.qp.qp_num(), 2);
    assert!(acq.cancel(later).is_none());
    a.qp.post_send(SendWr::send_inline(2, b"")).unwrap();
    let c = tokio::time::timeout(Duration::from_secs(10), acq.next())
        .await
        .expect("the completion of a cancelled ticket goes to next")
        .unwrap();
    assert_eq!(c.wr_id, 2);
    assert!(
        acq.debug_state().starts_with("ready 0 claimed 0"),
        "{}",
        acq.debug_state()
    );
}

/// `AsyncCq::post_send` posts and takes the ticket in one step, and refuses a request whose
/// success would produce no completion (an unsignaled one) instead of leaving a ticket that
/// waits for ever; a refused request is not posted and leaves no ticket behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_is_never_taken_on_an_unsignaled_request() {
    let (a, b) = device_pair();
    let (a, b) = connect_pair(&a, &b, &PairOptions::default()).unwrap();
    let acq = AsyncCq::new(a.cq.clone()).unwrap();
    b.qp.post_recv(RecvWr::empty(1)).unwrap();
    let e = acq
        .post_send(&a.qp, SendWr::send_inline(5, b"").unsignaled())
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    assert!(e.to_string().contains("unsignaled"), "{e}");
    assert!(
        acq.debug_state().starts_with("ready 0 claimed 0"),
        "{}",
        acq.debug_state()
    );
    let t = acq.post_send(&a.qp, SendWr::send_inline(6, b"")).unwrap();
    let c = tokio::time::timeout(Duration::from_secs(10), acq.completion(t))
        .await
        .expect("the signaled request completes")
        .unwrap();
    assert_eq!((c.wr_id, c.status), (6, WcStatus::Success));
    // The receiver got exactly the signaled request: the refused one was never posted.
    let r = b.cq.wait_one(Duration::from_secs(10)).unwrap();
    assert_eq!((r.wr_id, r.status), (1, WcStatus::Success));
    assert!(b.cq.poll_one().unwrap().is_none(), "one message arrived");
}

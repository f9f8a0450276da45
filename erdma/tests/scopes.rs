//! The rules around posted memory.
//!
//! How a posting scope ends when things go wrong around it: a post that fails, a request posted
//! outside the scope, a completion queue that overruns. A scope must wait for exactly what it
//! posted, and never abort the process while a sound way on exists. An abort kills this test
//! binary, which fails every test in it.
//!
//! And what a region a peer may write hands out: copies, never a reference whose bytes a WRITE
//! could change while it lives.

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use erdma::{
    Access, Context, Cq, Error, InitOptions, Limit, Pd, Qp, QpConfig, QpState, RecvWr, ScopeEnd,
    ScopeOptions, SendWr, scope_with,
};

/// A fresh soft device address per test (tests in this binary run in parallel).
fn addr() -> String {
    static NEXT: AtomicU8 = AtomicU8::new(1);
    format!("soft:127.78.{}.1", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// One queue pair connected to itself.
fn looped(cq_depth: u32, cfg: impl FnOnce(QpConfig) -> QpConfig) -> (Context, Pd, Cq, Qp) {
    let ctx = Context::open(&addr()).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(cq_depth).unwrap();
    let qp = pd
        .create_qp(&cfg(QpConfig::new(&cq)))
        .unwrap()
        .init(&InitOptions {
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            ..InitOptions::default()
        })
        .unwrap();
    let ep = qp.endpoint().unwrap();
    let qp = qp.connect(&ep, &Default::default()).unwrap();
    (ctx, pd, cq, qp)
}

/// Short enough that a scope waiting for the wrong request shows within seconds.
fn short(end: ScopeEnd) -> ScopeOptions {
    ScopeOptions {
        end,
        drain_timeout: Duration::from_secs(2),
        flush_timeout: Duration::from_secs(2),
    }
}

/// The queue pair still works: it was neither moved to the error state nor reset.
fn still_works(qp: &Qp, cq: &Cq, target: &erdma::Mr<'static>) {
    assert_eq!(qp.state().unwrap(), QpState::Rts);
    qp.post_send(SendWr::write_inline(99, b"ok", target.remote()))
        .unwrap();
    let c = cq.wait_one(Duration::from_secs(20)).unwrap();
    assert_eq!((c.wr_id, c.ok().is_ok()), (99, true), "{c:?}");
    assert_eq!(&target.to_vec(..2), b"ok");
}

/// A request posted outside the scope without a signal completes without a completion entry.
/// A scope post that then fails must not adopt it as its own and wait for it (which ended in
/// the scope moving the queue pair to the error state, and an abort).
#[test]
fn a_failed_scope_post_waits_for_nothing() {
    let (_ctx, pd, cq, qp) = looped(256, |c| c);
    let target = pd.alloc(4096, Access::ALL).unwrap();
    qp.post_send(SendWr::write_inline(1, b"x", target.remote()).unsignaled())
        .unwrap();
    let big = [0u8; 200];
    let posted = scope_with(short(ScopeEnd::Wait), |s| {
        s.post_send(&qp, SendWr::write_inline(2, &big, target.remote()))
    });
    assert!(
        matches!(
            posted,
            Err(Error::QpCapacityExceeded {
                limit: Limit::MaxInlineData,
                ..
            })
        ),
        "{posted:?}"
    );
    let empty = scope_with(short(ScopeEnd::Wait), |s| {
        s.post_send_batch(&qp, std::iter::empty())
    });
    empty.unwrap();
    still_works(&qp, &cq, &target);
}

/// A scope's batch whose later request the SDK refuses posts nothing, so the scope has nothing
/// to wait for either.
#[test]
fn a_refused_batch_posts_none_of_its_requests() {
    let (_ctx, pd, cq, qp) = looped(256, |c| c.max_send_sge(0));
    let target = pd.alloc(4096, Access::ALL).unwrap();
    let src = pd.alloc(64, Access::LOCAL_WRITE).unwrap();
    let posted = scope_with(short(ScopeEnd::Wait), |s| {
        s.post_send_batch(
            &qp,
            [
                SendWr::write_inline(1, b"abc", target.remote()).unsignaled(),
                SendWr::write(2, &[src.slice(0..8)], target.remote()),
            ],
        )
    });
    // The queue pair has no send SGEs: the SDK refuses the second request by name.
    assert!(
        matches!(
            posted,
            Err(Error::QpCapacityExceeded {
                limit: Limit::MaxSendSge,
                requested: 1,
                capacity: 0,
                ..
            })
        ),
        "{posted:?}"
    );
    assert_eq!(&target.to_vec(..3), &[0, 0, 0], "nothing was posted");
    still_works(&qp, &cq, &target);
}

/// A receive longer than the largest message is refused by the SDK, as a send is.
#[test]
fn a_receive_longer_than_a_message_is_refused_by_name() {
    let (ctx, pd, _cq, qp) = looped(256, |c| c);
    let max = ctx.limits().max_msg_size;
    let len = usize::try_from(max).unwrap() + 4096;
    // Untouched zero pages: only address space is used.
    let mut mem = vec![0u8; len];
    let mut mr = pd.register_slice(&mut mem, Access::LOCAL_WRITE).unwrap();
    let posted = scope_with(short(ScopeEnd::Flush), |s| {
        s.post_recv(&qp, RecvWr::new(1, mr.slice_mut(..)))
    });
    match posted {
        Err(Error::LimitExceeded {
            limit: Limit::MaxMsgSize,
            requested,
            max: m,
        }) => assert_eq!((requested, m), (len as u64, max)),
        other => panic!("{other:?}"),
    }
}

/// More receives than the completion queue holds, flushed at the scope's end: the overrun
/// loses completions, so the flushes can never all be seen. The scope resets the queue pair
/// (which drops every request) and returns, instead of aborting the process.
#[test]
fn a_completion_queue_overrun_resets_the_queue_pair_instead_of_aborting() {
    let (_ctx, pd, cq, qp) = looped(1, |c| c.max_recv_wr(256));
    assert!(
        cq.depth() < 256,
        "the queue must be smaller than the receives"
    );
    let mut mr = pd.alloc(256 * 64, Access::LOCAL_WRITE).unwrap();
    let posted: erdma::Result<()> = scope_with(short(ScopeEnd::Flush), |s| {
        for (i, c) in mr.slice_mut(..).chunks(64).into_iter().enumerate() {
            s.post_recv(&qp, RecvWr::new(i as u64, c))?;
        }
        Ok(())
    });
    posted.unwrap();
    assert_eq!(qp.state().unwrap(), QpState::Reset);
    // The memory is the application's again.
    mr.as_mut_slice()[0] = 1;
}

/// A `&[u8]` over a region is a promise that its bytes do not change while it lives, and the
/// compiler acts on it: a slice held across a WRITE into the region (here by the process's own
/// queue pair, through the region's remote key) read the old byte after the WRITE completed.
/// A region a peer may write therefore refuses the slice, and its copies see the WRITE.
#[test]
fn a_region_a_peer_may_write_hands_out_copies_not_references() {
    let (_ctx, pd, cq, qp) = looped(256, |c| c);
    let mut target = pd.alloc(4096, Access::ALL).unwrap();
    let mut src = pd.alloc(64, Access::LOCAL_WRITE).unwrap();
    src.as_mut_slice()[0] = 0x5a;
    assert!(target.peer_writable() && !src.peer_writable());
    let before = target.to_vec(..1)[0];
    erdma::scope(|s| {
        let source = [src.slice(0..1)];
        s.post_send(&qp, SendWr::write(7, &source, target.remote()))
            .unwrap();
        cq.wait_one(Duration::from_secs(20)).unwrap().ok().unwrap();
    });
    let mut after = [0u8; 1];
    target.read_at(0, &mut after).unwrap();
    assert_eq!((before, after[0]), (0, 0x5a));
    target.write_at(4090, b"edge!!").unwrap();
    assert_eq!(target.to_vec(4090..), b"edge!!");
    assert!(matches!(
        target.write_at(4091, b"edge!!"),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(target.read_at(usize::MAX, &mut after).is_err());
    target.fill(..16, 7);
    assert_eq!(target.to_vec(..17), [[7u8; 16].as_slice(), &[0]].concat());
    let refused =
        |f: &mut dyn FnMut()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
    assert!(refused(&mut || {
        let _ = target.as_slice();
    }));
    assert!(refused(&mut || {
        let _ = target.as_mut_slice();
    }));
    assert!(refused(&mut || {
        let _ = target.slice(..8).len() + target.slice(..8)[0] as usize;
    }));
    assert!(refused(&mut || {
        let mut seg = target.slice_mut(..8);
        seg[0] = 1;
    }));
    // MrSlice-only memory still gives references.
    assert_eq!(src.as_slice()[0], 0x5a);
    assert_eq!(src.slice(0..1)[0], 0x5a);
}

/// A scope's drain and a thread polling the same completion queue share it: the drain reaps
/// whatever the queue holds, its own requests' entries and everyone else's, into the queue's
/// stash, and the poller gets the others from there. Nothing is lost, nothing comes twice, and a
/// queue pair's completions keep their order, however the two interleave.
#[test]
fn a_scope_draining_beside_a_poller_loses_and_reorders_nothing() {
    const ROUNDS: u64 = 300;
    const PER_SCOPE: u64 = 8;
    const OUTSIDE: u64 = 2000;
    let ctx = Context::open(&addr()).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4096).unwrap();
    let mk = || {
        let qp = pd
            .create_qp(&QpConfig::new(&cq).max_send_wr(256))
            .unwrap()
            .init(&InitOptions {
                access: Access::ALL,
                ..InitOptions::default()
            })
            .unwrap();
        let ep = qp.endpoint().unwrap();
        qp.connect(&ep, &Default::default()).unwrap()
    };
    let (scoped, outside) = (mk(), mk());
    let target = pd.alloc(4096, Access::ALL).unwrap();
    let src = pd.alloc(64, Access::ALL).unwrap();
    let remote = target.remote();
    // Completions the poller saw, per queue pair, in the order it saw them.
    let (mut seen_scoped, mut seen_outside) = (Vec::new(), Vec::new());
    std::thread::scope(|t| {
        let scoper = t.spawn(|| {
            for round in 0..ROUNDS {
                scope_with(ScopeOptions::default(), |s| {
                    let sges = [src.slice(..8)];
                    for k in 0..PER_SCOPE {
                        let wr = SendWr::write(round * PER_SCOPE + k, &sges, remote);
                        s.post_send(&scoped, wr).unwrap();
                    }
                });
            }
        });
        // Posts signaled WRITEs outside any scope while it polls, a few in flight at a time.
        let mut posted = 0;
        let mut buf = [erdma::Completion::default(); 16];
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while (seen_outside.len() as u64) < OUTSIDE
            || (seen_scoped.len() as u64) < ROUNDS * PER_SCOPE
        {
            assert!(
                std::time::Instant::now() < deadline,
                "after 60 s: {} of {OUTSIDE} outside, {} of {} scoped",
                seen_outside.len(),
                seen_scoped.len(),
                ROUNDS * PER_SCOPE
            );
            if posted < OUTSIDE && posted - seen_outside.len() as u64 <= 16 {
                outside
                    .post_send(SendWr::write_inline(posted, b"x", remote))
                    .unwrap();
                posted += 1;
            }
            let n = cq.poll(&mut buf).unwrap();
            for c in &buf[..n] {
                assert!(c.ok().is_ok(), "{c:?}");
                if c.qp_num == outside.qp_num() {
                    seen_outside.push(c.wr_id);
                } else {
                    assert_eq!(c.qp_num, scoped.qp_num(), "{c:?}");
                    seen_scoped.push(c.wr_id);
                }
            }
            if scoper.is_finished() && posted == OUTSIDE {
                std::thread::yield_now();
            }
        }
        scoper.join().unwrap();
    });
    in_order_once(&seen_outside, OUTSIDE, "outside the scopes");
    in_order_once(&seen_scoped, ROUNDS * PER_SCOPE, "posted in scopes");
    assert_eq!(cq.poll(&mut [erdma::Completion::default(); 4]).unwrap(), 0);
}

/// `seen` is exactly `0..n`, in order; the message names the first place it is not.
fn in_order_once(seen: &[u64], n: u64, what: &str) {
    if let Some(i) = (0..seen.len()).find(|&i| seen[i] != i as u64) {
        let near = &seen[i.saturating_sub(2)..(i + 3).min(seen.len())];
        panic!(
            "{what}: entry {i} is request {} (around it: {near:?})",
            seen[i]
        );
    }
    assert_eq!(
        seen.len() as u64,
        n,
        "{what}: {} of {n} completions",
        seen.len()
    );
}

//! Resource exhaustion on the soft device: full work queues, an overrun completion queue, more
//! queue pairs / regions / protection domains / completion queues than the profile allows, and
//! regions of illegal size. Each gives a typed error, and the device is consistent afterwards
//! (what was refused can be retried once room is made).

mod common;

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use common::{WAIT, soft_pair};
use erdma::{
    Access, ConnectOptions, Context, Error, Gid, InitOptions, Limit, Mtu, Qp, QpCaps, QpConfig,
    QpEndpoint, QpState, RecvWr, Rts, SendWr, WcStatus, WorkQueue,
};

/// A soft device of its own for each test (these tests fill device-wide tables).
fn device() -> Context {
    static NEXT: AtomicU8 = AtomicU8::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    Context::open(&format!("soft:127.78.{n}.1")).unwrap()
}

/// A queue pair connected to an address where nobody answers: what it sends stays outstanding.
fn connected_to_nobody(ctx: &Context, depth: u32, timeout: u8) -> (erdma::Cq, Qp<Rts>) {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let caps = QpCaps {
        max_send_wr: depth,
        max_recv_wr: depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let qp = pd
        .create_qp(&QpConfig::new(&cq).caps(caps))
        .unwrap()
        .init(&InitOptions {
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            ..InitOptions::default()
        })
        .unwrap();
    let nobody = QpEndpoint {
        qp_num: 0x99,
        psn: 0,
        gid: Gid::from_ipv4(Ipv4Addr::new(127, 78, 255, 254)),
        lid: 0,
        mtu: Mtu::Mtu1024,
    };
    let opts = ConnectOptions {
        timeout,
        retry_cnt: 1,
        ..ConnectOptions::default()
    };
    (cq, qp.connect(&nobody, &opts).unwrap())
}

#[test]
fn full_send_and_receive_queues_refuse_with_the_depth() {
    let ctx = device();
    let (cq, qp) = connected_to_nobody(&ctx, 4, 20);
    let granted = qp.caps();
    let depth = granted.max_send_wr;
    for i in 0..depth {
        qp.post_send(SendWr::send_inline(u64::from(i), b"x"))
            .unwrap();
    }
    match qp.post_send(SendWr::send_inline(99, b"x")) {
        Err(Error::QueueFull {
            queue: WorkQueue::Send,
            depth: d,
        }) => assert_eq!(d, depth),
        other => panic!("expected a full send queue, got {other:?}"),
    }
    let rdepth = granted.max_recv_wr;
    for i in 0..rdepth {
        qp.post_recv(RecvWr::empty(100 + u64::from(i))).unwrap();
    }
    match qp.post_recv(RecvWr::empty(999)) {
        Err(Error::QueueFull {
            queue: WorkQueue::Recv,
            depth: d,
        }) => assert_eq!(d, rdepth),
        other => panic!("expected a full receive queue, got {other:?}"),
    }
    // Consistent afterwards: moving to error flushes exactly what was accepted.
    qp.to_error().unwrap();
    let mut ids = Vec::new();
    while ids.len() < (depth + rdepth) as usize {
        let c = cq.wait_one(WAIT).expect("flush completions");
        assert_eq!(c.status, WcStatus::WrFlushErr);
        ids.push(c.wr_id);
    }
    ids.sort_unstable();
    let want: Vec<u64> = (0..u64::from(depth))
        .chain((0..u64::from(rdepth)).map(|i| 100 + i))
        .collect();
    assert_eq!(ids, want);
    assert!(
        cq.poll_one().unwrap().is_none(),
        "nothing refused completes"
    );
    assert_eq!(qp.state().unwrap(), QpState::Err);
}

#[test]
fn an_overrun_completion_queue_is_reported_and_errors_the_queue_pair() {
    let (da, db) = soft_pair();
    let (a, b) = (Context::open(&da).unwrap(), Context::open(&db).unwrap());
    let (pa, pb) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    // A's CQ is far smaller than its send queue: the application sized it wrong.
    let small = a.create_cq(16).unwrap();
    let cq_depth = small.depth();
    let cq_b = b.create_cq(64).unwrap();
    let target = pb.alloc(4096, Access::ALL).unwrap();
    let caps = |sq| QpCaps {
        max_send_wr: sq,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let qa = pa
        .create_qp(&QpConfig::new(&small).caps(caps(4 * cq_depth)))
        .unwrap()
        .init(&InitOptions {
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            ..InitOptions::default()
        })
        .unwrap();
    let qb = pb
        .create_qp(&QpConfig::new(&cq_b).caps(caps(1)))
        .unwrap()
        .init(&InitOptions {
            access: Access::ALL,
            ..InitOptions::default()
        })
        .unwrap();
    let (qa, _qb) = common::connect_qps(qa, qb, None, &ConnectOptions::default()).unwrap();
    let remote = target.remote();
    let total = 3 * cq_depth as usize;
    for i in 0..total {
        match qa.post_send(SendWr::write_inline(i as u64, b"overrun!", remote)) {
            Ok(()) => {}
            Err(Error::QpInError { .. }) => break,
            Err(e) => panic!("post {i}: {e}"),
        }
    }
    // Nothing polls the CQ until the device has overrun it: an application that drains as fast
    // as completions arrive never overruns (polling services the device inline), so draining
    // early would race the device. The overrun moves the queue pair to error without any poll.
    let end = Instant::now() + WAIT;
    while qa.state().unwrap() != QpState::Err && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    // The overrun is reported as an error (once), after at most a CQ's worth of completions.
    let mut seen = 0usize;
    let mut overrun = false;
    let mut buf = [erdma::Completion::default(); 64];
    while Instant::now() < end && !overrun {
        match small.poll(&mut buf) {
            Ok(0) => std::thread::sleep(Duration::from_millis(2)),
            Ok(n) => seen += n,
            Err(e) => {
                assert!(e.to_string().contains("overrun"), "{e}");
                overrun = true;
            }
        }
    }
    assert!(
        overrun,
        "an overrun CQ is reported ({seen} completions seen)"
    );
    assert!(
        seen <= cq_depth as usize,
        "a {cq_depth}-entry CQ returned {seen}"
    );
    assert_eq!(
        qa.state().unwrap(),
        QpState::Err,
        "the queue pair moved to error"
    );
    // Posting afterwards is a typed error or a flush, never a hang.
    match qa.post_send(SendWr::write_inline(7, b"after", remote)) {
        Err(Error::QpInError { .. }) | Err(Error::QueueFull { .. }) | Ok(()) => {}
        Err(e) => panic!("post after overrun: {e}"),
    }
}

/// Creates objects with `make` until it fails; returns how many were made and the error.
fn exhaust<T>(mut make: impl FnMut() -> erdma::Result<T>, cap: usize) -> (Vec<T>, Error) {
    let mut made = Vec::new();
    loop {
        match make() {
            Ok(x) => made.push(x),
            Err(e) => return (made, e),
        }
        assert!(made.len() <= cap, "more than {cap} created");
    }
}

fn assert_limit(e: &Error, want: Limit, max: u64) {
    match e {
        Error::LimitExceeded {
            limit,
            requested,
            max: m,
        } => {
            assert_eq!(*limit, want, "{e}");
            assert_eq!(*m, max, "{e}");
            assert_eq!(*requested, max + 1, "{e}");
        }
        other => panic!("expected LimitExceeded({want:?}), got {other}"),
    }
}

#[test]
fn too_many_queue_pairs_is_a_typed_error_and_room_can_be_made() {
    let ctx = device();
    let max = ctx.limits().max_qp;
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let caps = QpCaps {
        max_send_wr: 1,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let cfg = QpConfig::new(&cq).caps(caps);
    let (mut qps, e) = exhaust(|| pd.create_qp(&cfg), max as usize);
    assert_eq!(qps.len(), max as usize);
    assert_limit(&e, Limit::MaxQp, u64::from(max));
    qps.pop();
    let again = pd.create_qp(&cfg).expect("a freed slot is reusable");
    assert!(
        qps.iter().all(|q| q.qp_num() != again.qp_num()),
        "QPNs unique"
    );
}

#[test]
fn too_many_memory_regions_is_a_typed_error_and_room_can_be_made() {
    let ctx = device();
    let max = ctx.limits().max_mr;
    let pd = ctx.alloc_pd().unwrap();
    let (mut mrs, e) = exhaust(|| pd.alloc(4096, Access::LOCAL_WRITE), max as usize);
    assert_eq!(mrs.len(), max as usize);
    assert_limit(&e, Limit::MaxMr, u64::from(max));
    mrs.truncate(10);
    let mr = pd
        .alloc(4096, Access::ALL)
        .expect("room after deregistration");
    assert!(mrs.iter().all(|m| m.rkey() != mr.rkey()), "keys unique");
}

#[test]
fn too_many_protection_domains_is_a_typed_error() {
    let ctx = device();
    let max = ctx.limits().max_pd;
    let (mut pds, e) = exhaust(|| ctx.alloc_pd(), max as usize);
    assert_eq!(pds.len(), max as usize);
    assert_limit(&e, Limit::MaxPd, u64::from(max));
    pds.pop();
    ctx.alloc_pd().expect("room after a free");
}

#[test]
fn too_many_completion_queues_is_a_typed_error() {
    let ctx = device();
    let max = ctx.limits().max_cq;
    let (mut cqs, e) = exhaust(|| ctx.create_cq(1), max as usize);
    if let Error::Io { .. } = e {
        // Each soft CQ holds an eventfd: a low descriptor limit ends the loop first.
        eprintln!("skipped: {e} after {} CQs (raise `ulimit -n`)", cqs.len());
        return;
    }
    assert_eq!(cqs.len(), max as usize);
    assert_limit(&e, Limit::MaxCq, u64::from(max));
    cqs.pop();
    ctx.create_cq(1).expect("room after a destroy");
}

#[test]
fn regions_of_zero_bytes_or_over_the_cap_are_refused() {
    let ctx = device();
    let pd = ctx.alloc_pd().unwrap();
    let cap = ctx.limits().max_mr_size;
    match pd.alloc(0, Access::LOCAL_WRITE) {
        Err(Error::LimitBelowMinimum {
            limit: Limit::MaxMrSize,
            requested: 0,
            min: 1,
        }) => {}
        other => panic!("0-byte region: {other:?}"),
    }
    match pd.alloc(cap as usize + 1, Access::LOCAL_WRITE) {
        Err(Error::LimitExceeded {
            limit: Limit::MaxMrSize,
            requested,
            max,
        }) => assert_eq!((requested, max), (cap + 1, cap)),
        other => panic!("region over the cap: {other:?}"),
    }
    let mut empty: [u8; 0] = [];
    assert!(matches!(
        pd.register_slice(&mut empty, Access::LOCAL_WRITE),
        Err(Error::LimitBelowMinimum { .. })
    ));
    // Nothing was registered: the device still hands out regions normally.
    let mr = pd.alloc(4096, Access::ALL).unwrap();
    assert_eq!(mr.len(), 4096);
}

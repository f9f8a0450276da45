//! Teardown in every order: handles dropped in any permutation (queue pair before or after its
//! completion queue, a protection domain while its regions live, the context first), and a
//! process that exits with requests still posted. Nothing may crash, hang or leak a use of freed
//! memory into the device; what remains usable must keep working.

mod common;

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, Instant};

use common::{PairOptions, WAIT, connect_pair, soft_pair};
use erdma::{
    Access, ConnectOptions, Context, Gid, InitOptions, Mtu, QpConfig, QpEndpoint, QpState, RecvWr,
    SendWr, WcStatus, scope,
};

/// Held by the tests that reopen an address right after releasing it, and by the test that
/// spawns child processes: between fork and exec a child holds copies of every descriptor of this
/// process (close-on-exec only closes them at the exec), so a socket released meanwhile stays
/// bound until the child execs.
static SPAWN_OR_REOPEN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serialized() -> std::sync::MutexGuard<'static, ()> {
    SPAWN_OR_REOPEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn addr() -> String {
    static NEXT: AtomicU8 = AtomicU8::new(1);
    format!("soft:127.79.{}.1", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Every permutation of `0..n`.
fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut out = Vec::new();
    for p in permutations(n - 1) {
        for at in 0..=p.len() {
            let mut q = p.clone();
            q.insert(at, n - 1);
            out.push(q);
        }
    }
    out
}

#[test]
fn handles_dropped_in_every_order() {
    let _serial = serialized();
    let name = addr();
    let orders = permutations(5);
    assert_eq!(orders.len(), 120);
    for order in orders {
        let ctx = Context::open(&name).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let mr = pd.alloc(4096, Access::ALL).unwrap();
        let qp = pd
            .create_qp(&QpConfig::new(&cq))
            .unwrap()
            .init(&InitOptions {
                access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                ..InitOptions::default()
            })
            .unwrap();
        let mut slots: [Option<Box<dyn std::any::Any>>; 5] = [
            Some(Box::new(ctx)),
            Some(Box::new(pd)),
            Some(Box::new(cq)),
            Some(Box::new(mr)),
            Some(Box::new(qp)),
        ];
        for i in order {
            slots[i] = None;
        }
    }
    // Everything was released: the device's address can be opened again at once.
    Context::open(&name).expect("the device is free again");
}

#[test]
fn a_region_outlives_its_dropped_protection_domain_and_still_works() {
    let (da, db) = soft_pair();
    let (a, b) = connect_pair(&da, &db, &PairOptions::default()).unwrap();
    // Drop every handle of B except the queue pair and the region.
    let pd_b = b.qp.pd().clone();
    drop(pd_b);
    let remote = b.mr.remote();
    scope(|s| {
        let src = [a.mr.slice(0..64)];
        s.post_send(&a.qp, SendWr::write(1, &src, remote)).unwrap();
        let c = a.cq.wait_one(WAIT).unwrap();
        assert_eq!(c.status, WcStatus::Success);
    });
    assert_eq!(b.mr.to_vec(..64), a.mr.to_vec(..64));
}

#[test]
fn destroying_a_queue_pair_with_requests_outstanding_flushes_or_drops_them() {
    let _serial = serialized();
    let name = addr();
    let ctx = Context::open(&name).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let mut mr = pd.alloc(4096, Access::LOCAL_WRITE).unwrap();
    let qp = pd
        .create_qp(&QpConfig::new(&cq))
        .unwrap()
        .init(&InitOptions {
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            ..InitOptions::default()
        })
        .unwrap();
    let nobody = QpEndpoint {
        qp_num: 0x42,
        psn: 0,
        gid: Gid::from_ipv4(Ipv4Addr::new(127, 79, 255, 254)),
        lid: 0,
        mtu: Mtu::Mtu1024,
    };
    let qp = qp.connect(&nobody, &ConnectOptions::default()).unwrap();
    let started = Instant::now();
    scope(|s| {
        let (r, w) = mr.slice_mut(..).split_at(2048);
        s.post_recv(&qp, RecvWr::new(1, r)).unwrap();
        s.post_send(&qp, SendWr::send(2, &[w.into_local()]))
            .unwrap();
        // Ending the scope must not wait for a peer that never answers longer than its
        // drain timeout; forcing the error flushes both requests.
        qp.to_error().unwrap();
    });
    assert!(started.elapsed() < Duration::from_secs(30));
    let mut ids = Vec::new();
    while let Some(c) = cq.poll_one().unwrap() {
        assert_eq!(c.status, WcStatus::WrFlushErr);
        ids.push(c.wr_id);
    }
    ids.sort_unstable();
    assert_eq!(ids, [1, 2]);
    assert_eq!(qp.state().unwrap(), QpState::Err);
    drop(qp);
    drop(cq);
    drop(mr);
    drop(pd);
    drop(ctx);
    Context::open(&name).expect("the device is free again");
}

/// The child half of [`process_exit_with_posted_requests_is_clean`]: posts work to a peer that
/// never answers, and exits without tearing anything down.
#[test]
fn child_exits_with_requests_posted() {
    let Ok(mode) = std::env::var("ERDMA_TEARDOWN_CHILD") else {
        return; // only meaningful as the child process
    };
    // Addresses of the children's own (one child runs at a time).
    let (a, b) = connect_pair(
        "soft:127.79.200.1",
        "soft:127.79.200.2",
        &PairOptions::default(),
    )
    .unwrap();
    let remote = b.mr.remote();
    // B stops answering: its device is gone, A's requests stay outstanding.
    drop(b);
    for i in 0..64 {
        a.qp.post_send(SendWr::write_inline(i, b"in flight", remote))
            .unwrap();
        a.qp.post_recv(RecvWr::empty(1000 + i)).unwrap();
    }
    eprintln!("child: 64 requests of each kind outstanding; mode {mode}");
    match mode.as_str() {
        "exit" => std::process::exit(0),
        "abort" => std::process::abort(),
        _ => {
            // Dropping everything with the requests outstanding.
            drop(a);
            std::process::exit(0);
        }
    }
}

#[test]
fn process_exit_with_posted_requests_is_clean() {
    let _serial = serialized();
    let me = std::env::current_exe().unwrap();
    for mode in ["exit", "drop"] {
        let start = Instant::now();
        let out = Command::new(&me)
            .args(["--exact", "child_exits_with_requests_posted", "--nocapture"])
            .env("ERDMA_TEARDOWN_CHILD", mode)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{mode}: child failed: {:?}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{mode}: exit took {:?}",
            start.elapsed()
        );
    }
    // An abort leaves nothing behind that stops the next process from opening the same devices.
    let out = Command::new(&me)
        .args(["--exact", "child_exits_with_requests_posted", "--nocapture"])
        .env("ERDMA_TEARDOWN_CHILD", "abort")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let out = Command::new(&me)
        .args(["--exact", "child_exits_with_requests_posted", "--nocapture"])
        .env("ERDMA_TEARDOWN_CHILD", "exit")
        .output()
        .unwrap();
    assert!(out.status.success(), "after an abort: {:?}", out.status);
    assert!(String::from_utf8_lossy(&out.stderr).contains("64 requests of each kind outstanding"));
}

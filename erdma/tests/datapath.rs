//! Every opcode, many sizes, and the error paths, between two devices.
//!
//! By default the two devices are soft devices on fresh loopback addresses (real UDP over the
//! host's loopback). With `ERDMA_TEST_DEV_A` / `ERDMA_TEST_DEV_B` set (for example both `rxe0`
//! inside the test guest) the same tests run through the verbs provider.

mod common;

use common::{PairOptions, Side, WAIT, connect_pair, device_pair, pattern};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use erdma::{
    Access, Completion, Error, Limit, Mtu, ProviderKind, QpConfig, RecvWr, SendWr, WcOpcode,
    WcStatus, scope,
};

const SIZES: &[usize] = &[
    0,
    1,
    3,
    255,
    1023,
    1024,
    1025,
    4095,
    4096,
    4097,
    5 * 4096 + 3,
    65536 + 7,
    1 << 20,
];

fn pair() -> (Side, Side) {
    let (a, b) = device_pair();
    connect_pair(&a, &b, &PairOptions::default()).expect("connecting two devices")
}

fn pair_with(o: PairOptions) -> (Side, Side) {
    let (a, b) = device_pair();
    connect_pair(&a, &b, &o).expect("connecting two devices")
}

fn wait(cq: &erdma::Cq) -> Completion {
    cq.wait_one(WAIT).expect("a completion in time")
}

#[test]
fn send_and_receive_every_size() {
    let (mut a, mut b) = pair();
    for (i, &len) in SIZES.iter().enumerate() {
        let data = pattern(i as u32, len);
        a.mr.write_at(0, &data).unwrap();
        b.mr.fill(..len + 16, 0xEE);
        let with_imm = i % 2 == 1;
        scope(|s| {
            s.post_recv(
                &b.qp,
                RecvWr::new(100 + i as u64, b.mr.slice_mut(..len + 16)),
            )
            .unwrap();
            let src = [a.mr.slice(..len)];
            let mut wr = SendWr::send(i as u64, &src);
            if with_imm {
                wr = wr.with_imm(0xA5A5_0000 + i as u32);
            }
            s.post_send(&a.qp, wr).unwrap();
            let sent = wait(&a.cq);
            assert_eq!(sent.status, WcStatus::Success, "size {len}: {sent:?}");
            assert_eq!(sent.wr_id, i as u64);
            assert_eq!(sent.opcode, WcOpcode::Send);
            let got = wait(&b.cq);
            assert_eq!(got.status, WcStatus::Success, "size {len}: {got:?}");
            assert_eq!(got.wr_id, 100 + i as u64);
            assert_eq!(got.opcode, WcOpcode::Recv);
            assert_eq!(got.byte_len as usize, len);
            assert_eq!(got.imm, with_imm.then_some(0xA5A5_0000 + i as u32));
            assert_eq!(got.qp_num, b.qp.qp_num());
        });
        assert_eq!(&b.mr.to_vec(..len), &data[..], "size {len}: payload");
        assert!(
            b.mr.to_vec(len..len + 16).iter().all(|&x| x == 0xEE),
            "size {len}: nothing written past the message"
        );
    }
}

/// Two threads blocked in `Cq::wait` on one queue each get one of two completions, long before
/// their timeout. With both asleep on the queue's descriptor, the first to wake consumed the
/// event, the queue was disarmed, and the other slept on beside the second completion until
/// its 10 s timeout ran out.
#[test]
fn two_threads_waiting_on_one_queue_each_get_a_completion() {
    let (a, b) = pair();
    for round in 0..3u64 {
        for i in 0..2 {
            b.qp.post_recv(RecvWr::empty(round * 2 + i)).unwrap();
        }
        let (sent, got) = std::thread::scope(|t| {
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    t.spawn(|| {
                        let mut one = [Completion::default()];
                        let n = b.cq.wait(&mut one, Duration::from_secs(10)).unwrap();
                        (n, one[0], Instant::now())
                    })
                })
                .collect();
            // Both asleep before anything arrives.
            std::thread::sleep(Duration::from_millis(100));
            let sent = Instant::now();
            for i in 0..2 {
                let wr = SendWr::send_inline(round * 2 + i, b"").unsignaled();
                a.qp.post_send(wr).unwrap();
            }
            let got: Vec<_> = waiters.into_iter().map(|w| w.join().unwrap()).collect();
            (sent, got)
        });
        let mut ids = Vec::new();
        for (n, c, at) in &got {
            assert_eq!((*n, c.status), (1, WcStatus::Success), "round {round}");
            let late = at.duration_since(sent);
            assert!(
                late < Duration::from_secs(5),
                "round {round}: woke after {late:?}"
            );
            ids.push(c.wr_id);
        }
        ids.sort_unstable();
        assert_eq!(ids, [round * 2, round * 2 + 1], "round {round}");
    }
}

/// A receiver that only polls, with inline progress off (the device's engine thread receives):
/// every WRITE WITH IMM still arrives, intact, with its immediate.
#[test]
fn polling_without_inline_progress_still_receives() {
    let (mut a, b) = pair();
    b.cq.set_inline_progress(false);
    let remote = b.mr.remote();
    for i in 0..32u32 {
        let len = 1 + (i as usize * 7919) % 100_000;
        let data = pattern(2000 + i, len);
        a.mr.write_at(0, &data).unwrap();
        scope(|s| {
            s.post_recv(&b.qp, RecvWr::empty(u64::from(i))).unwrap();
            let src = [a.mr.slice(..len)];
            let target = remote.slice(0, len as u64).unwrap();
            let wr = SendWr::write(u64::from(i), &src, target).with_imm(i);
            s.post_send(&a.qp, wr).unwrap();
            assert_eq!(wait(&a.cq).status, WcStatus::Success, "WRITE {i}");
            let deadline = std::time::Instant::now() + WAIT;
            let got = loop {
                if let Some(c) = b.cq.poll_one().unwrap() {
                    break c;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "WRITE {i} never arrived"
                );
                std::hint::spin_loop();
            };
            assert_eq!((got.status, got.wr_id), (WcStatus::Success, u64::from(i)));
            assert_eq!((got.opcode, got.imm), (WcOpcode::RecvRdmaWithImm, Some(i)));
        });
        assert_eq!(&b.mr.to_vec(..len), &data[..], "WRITE {i}: payload");
    }
}

/// `Duration::MAX` is a timeout too: waits with it return what arrives instead of overflowing
/// the clock's deadline.
#[test]
fn waits_take_a_timeout_without_limit() {
    let (a, b) = pair();
    let remote = b.mr.remote();
    for (i, how) in ["wait_one", "wait", "wait_hybrid", "poll_wait"]
        .iter()
        .enumerate()
    {
        let wr = SendWr::write_inline(i as u64, b"no limit", remote.slice(0, 8).unwrap());
        a.qp.post_send(wr.signaled()).unwrap();
        let mut out = [Completion::default(); 4];
        let got = match *how {
            "wait_one" => a.cq.wait_one(Duration::MAX).unwrap(),
            "wait" => {
                assert_eq!(a.cq.wait(&mut out, Duration::MAX).unwrap(), 1);
                out[0]
            }
            "wait_hybrid" => {
                let n = a.cq.wait_hybrid(&mut out, Duration::MAX, Duration::MAX);
                assert_eq!(n.unwrap(), 1);
                out[0]
            }
            _ => {
                assert_eq!(a.cq.poll_wait(&mut out, Duration::MAX).unwrap(), 1);
                out[0]
            }
        };
        assert_eq!(
            (got.wr_id, got.status),
            (i as u64, WcStatus::Success),
            "{how}"
        );
    }
    assert_eq!(&b.mr.to_vec(..8), b"no limit");
}

#[test]
fn write_read_and_write_with_imm_every_size() {
    let (mut a, b) = pair();
    let remote = b.mr.remote();
    for (i, &len) in SIZES.iter().enumerate() {
        let data = pattern(1000 + i as u32, len);
        a.mr.write_at(0, &data).unwrap();
        let off = (i * 64) as u64;
        // WRITE a → b, then READ it back into another part of a.
        scope(|s| {
            let src = [a.mr.slice(..len)];
            let target = remote.slice(off, len as u64).unwrap();
            s.post_send(&a.qp, SendWr::write(1, &src, target)).unwrap();
            let w = wait(&a.cq);
            assert_eq!(
                (w.status, w.opcode),
                (WcStatus::Success, WcOpcode::RdmaWrite),
                "{w:?}"
            );
        });
        assert_eq!(&b.mr.to_vec(off as usize..off as usize + len), &data[..]);
        let half = a.mr.len() / 2;
        a.mr.fill(half..half + len, 0);
        scope(|s| {
            let dest = a.mr.slice_mut(half..half + len);
            let src = remote.slice(off, len as u64).unwrap();
            s.post_send(&a.qp, SendWr::read(2, dest, src)).unwrap();
            let r = wait(&a.cq);
            assert_eq!(
                (r.status, r.opcode),
                (WcStatus::Success, WcOpcode::RdmaRead),
                "{r:?}"
            );
            assert_eq!(r.byte_len as usize, len);
        });
        assert_eq!(&a.mr.to_vec(half..half + len), &data[..], "READ of {len}");
        // WRITE_WITH_IMM consumes a receive (with no buffer) and reports the immediate.
        scope(|s| {
            s.post_recv(&b.qp, RecvWr::empty(7)).unwrap();
            let src = [a.mr.slice(..len)];
            let target = remote.slice(off, len as u64).unwrap();
            s.post_send(
                &a.qp,
                SendWr::write(3, &src, target).with_imm(42 + i as u32),
            )
            .unwrap();
            assert!(wait(&a.cq).status.is_success());
            let got = wait(&b.cq);
            assert_eq!(got.status, WcStatus::Success);
            assert_eq!(got.opcode, WcOpcode::RecvRdmaWithImm);
            assert_eq!(got.imm, Some(42 + i as u32));
            assert_eq!(got.wr_id, 7);
        });
    }
}

#[test]
fn atomics_return_the_original_value() {
    let (mut a, b) = pair();
    if !a.ctx.limits().atomics {
        eprintln!("skipped: device {} has no atomics", a.ctx.name());
        return;
    }
    let word = b.mr.remote().slice(64, 8).unwrap();
    for k in 0..3u64 {
        scope(|s| {
            s.post_send(&a.qp, SendWr::fetch_add(k, a.mr.slice_mut(0..8), word, 10))
                .unwrap();
            let c = wait(&a.cq);
            assert_eq!(
                (c.status, c.opcode),
                (WcStatus::Success, WcOpcode::FetchAdd),
                "{c:?}"
            );
        });
        assert_eq!(
            u64::from_ne_bytes(a.mr.to_vec(..8).try_into().unwrap()),
            10 * k
        );
    }
    scope(|s| {
        s.post_send(
            &a.qp,
            SendWr::compare_swap(9, a.mr.slice_mut(8..16), word, 30, 777),
        )
        .unwrap();
        assert!(wait(&a.cq).status.is_success());
    });
    assert_eq!(
        u64::from_ne_bytes(a.mr.to_vec(8..16).try_into().unwrap()),
        30
    );
    scope(|s| {
        s.post_send(
            &a.qp,
            SendWr::compare_swap(10, a.mr.slice_mut(8..16), word, 30, 1),
        )
        .unwrap();
        assert!(wait(&a.cq).status.is_success());
    });
    assert_eq!(
        u64::from_ne_bytes(a.mr.to_vec(8..16).try_into().unwrap()),
        777,
        "a failed compare returns the current value"
    );
    assert_eq!(
        u64::from_ne_bytes(b.mr.to_vec(64..72).try_into().unwrap()),
        777
    );
}

#[test]
fn inline_and_unsignaled_batches() {
    let (mut a, mut b) = pair();
    scope(|s| {
        s.post_recv(&b.qp, RecvWr::new(1, b.mr.slice_mut(..64)))
            .unwrap();
        s.post_send(&a.qp, SendWr::send_inline(5, b"inline bytes"))
            .unwrap();
        assert!(wait(&a.cq).status.is_success());
        let got = wait(&b.cq);
        assert_eq!(got.byte_len, 12);
    });
    assert_eq!(&b.mr.to_vec(..12), b"inline bytes");

    // 50 unsignaled writes, then one signaled: exactly one completion, every byte there.
    let remote = b.mr.remote();
    a.mr.write_at(0, &pattern(7, 51 * 100)).unwrap();
    scope(|s| {
        let wrs: Vec<_> = (0..51u64)
            .map(|k| {
                let off = (k * 100) as usize;
                (off, remote.slice(off as u64, 100).unwrap())
            })
            .collect();
        let srcs: Vec<[erdma::MrSlice<'_>; 1]> = wrs
            .iter()
            .map(|(off, _)| [a.mr.slice(*off..*off + 100)])
            .collect();
        let batch = wrs.iter().zip(&srcs).enumerate().map(|(k, ((_, r), src))| {
            let wr = SendWr::write(k as u64, src, *r);
            if k == 50 { wr } else { wr.unsignaled() }
        });
        s.post_send_batch(&a.qp, batch).unwrap();
        let c = wait(&a.cq);
        assert_eq!((c.wr_id, c.status), (50, WcStatus::Success));
        assert!(
            a.cq.poll_one().unwrap().is_none(),
            "unsignaled requests stay silent"
        );
    });
    assert_eq!(&b.mr.to_vec(..51 * 100), &pattern(7, 51 * 100)[..]);
}

#[test]
fn write_without_remote_write_right_is_a_remote_access_error() {
    let (a, b) = pair();
    let pd = b.qp.pd().clone();
    let ro = pd
        .alloc(4096, Access::LOCAL_WRITE | Access::REMOTE_READ)
        .unwrap();
    scope(|s| {
        let src = [a.mr.slice(..64)];
        s.post_send(
            &a.qp,
            SendWr::write(1, &src, ro.remote().slice(0, 64).unwrap()),
        )
        .unwrap();
        let c = wait(&a.cq);
        assert_eq!(c.status, WcStatus::RemAccessErr, "{c:?}");
        assert_eq!(c.wr_id, 1);
    });
    assert!(ro.to_vec(..).iter().all(|&x| x == 0), "memory untouched");
    // The requester's queue pair is now in error: later requests are flushed.
    scope(|s| {
        s.post_send(&a.qp, SendWr::send_inline(2, b"x")).ok();
        if let Ok(c) = a.cq.wait_one(WAIT) {
            assert_eq!(c.status, WcStatus::WrFlushErr, "{c:?}");
        }
    });
}

/// Whether `fd` becomes readable within `timeout`.
fn readable_within(fd: std::os::fd::RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) };
    r == 1 && p.revents & libc::POLLIN != 0
}

/// Each refusal is also the responder's business: its queue pair went to error with no receive
/// request to say so, so its context gets `QpAccessErr` naming it (IBTA C9-222.1.1). Checked on
/// the soft device: the test guest's rxe (Linux 6.1) raises no event here.
#[test]
fn out_of_bounds_and_wrong_rkey_are_refused() {
    // Each refusal moves the requester to error, so every case gets a fresh pair.
    for case in 0..3 {
        let (a, b) = pair();
        let r = b.mr.remote();
        let bad = match case {
            0 => erdma::RemoteMr {
                addr: r.addr + r.len - 8,
                len: 64,
                rkey: r.rkey,
            },
            1 => erdma::RemoteMr {
                addr: r.addr,
                len: 64,
                rkey: r.rkey ^ 0x5500,
            },
            _ => erdma::RemoteMr {
                addr: r.addr.wrapping_sub(64),
                len: 64,
                rkey: r.rkey,
            },
        };
        scope(|s| {
            let src = [a.mr.slice(..64)];
            s.post_send(&a.qp, SendWr::write(1, &src, bad)).unwrap();
            let c = wait(&a.cq);
            assert_eq!(c.status, WcStatus::RemAccessErr, "case {case}: {c:?}");
        });
        assert!(
            b.mr.to_vec(..).iter().all(|&x| x == 0),
            "case {case}: memory untouched"
        );
        if b.ctx.provider() == ProviderKind::Soft {
            // An event loop of one's own sees it on the context's descriptor.
            let fd = b.ctx.async_event_fd().unwrap().as_raw_fd();
            assert!(
                readable_within(fd, WAIT),
                "case {case}: the descriptor stayed quiet"
            );
            let ev = b
                .ctx
                .next_async_event(Duration::ZERO)
                .expect("an event for the responder's queue pair");
            assert_eq!(
                ev.kind,
                erdma::AsyncEventKind::QpAccessErr,
                "case {case}: {ev}"
            );
            assert_eq!(
                ev.element,
                erdma::EventElement::Qp(b.qp.qp_num()),
                "case {case}: {ev}"
            );
            assert_eq!(b.ctx.next_async_event(Duration::ZERO), None, "case {case}");
            assert!(
                !readable_within(fd, Duration::ZERO),
                "case {case}: all read"
            );
            // The requester heard through its completion: no event there.
            assert_eq!(a.ctx.next_async_event(Duration::ZERO), None, "case {case}");
        }
    }
}

#[test]
fn forcing_error_flushes_outstanding_receives() {
    let (_a, mut b) = pair();
    erdma::scope_with(erdma::ScopeOptions::flush(), |s| {
        let bufs = b.mr.slice_mut(..4 * 64).chunks(64);
        for (k, buf) in bufs.into_iter().enumerate() {
            s.post_recv(&b.qp, RecvWr::new(k as u64, buf)).unwrap();
        }
        b.qp.to_error().unwrap();
        let mut seen = Vec::new();
        for _ in 0..4 {
            let c = wait(&b.cq);
            assert_eq!(c.status, WcStatus::WrFlushErr, "{c:?}");
            // The flush names why: the application moved the queue pair to ERROR.
            assert_eq!(c.cause(), Some(erdma::QpFailure::Local), "{c:?}");
            seen.push(c.wr_id);
        }
        assert_eq!(seen, vec![0, 1, 2, 3], "flushed in order");
    });
    assert_eq!(b.qp.state().unwrap(), erdma::QpState::Err);
    // A later post fails at once, naming the cause, and nothing completes for it.
    match b.qp.post_recv(RecvWr::empty(9)) {
        Err(Error::QpInError { qp_num, cause }) => {
            assert_eq!(qp_num, b.qp.qp_num());
            assert_eq!(cause, Some(erdma::QpFailure::Local));
        }
        other => panic!("expected QpInError, got {other:?}"),
    }
    assert_eq!(b.qp.failure(), Some(erdma::QpFailure::Local));
    assert!(
        b.cq.poll_one().unwrap().is_none(),
        "the refused post completes"
    );
}

#[test]
fn send_with_invalidate_of_a_registered_region_is_refused_like_rxe() {
    // Remote invalidation is for memory windows and fast-registered regions (IBTA); a region
    // from reg_mr cannot be invalidated by a peer, on rxe or on the soft device: the receive
    // completes with REM_INV_REQ_ERR (after the sender got its positive ACK).
    let (a, mut b) = pair();
    let victim = b.qp.pd().alloc(4096, Access::ALL).unwrap();
    let key = victim.rkey();
    scope(|s| {
        s.post_recv(&b.qp, RecvWr::new(1, b.mr.slice_mut(..64)))
            .unwrap();
        let src = [a.mr.slice(..8)];
        s.post_send(&a.qp, SendWr::send_with_invalidate(2, &src, key))
            .unwrap();
        assert!(wait(&a.cq).status.is_success());
        let got = wait(&b.cq);
        assert_eq!(got.status, WcStatus::RemInvReqErr, "{got:?}");
        assert_eq!(got.invalidated_rkey, None);
    });
    // The receiver's queue pair has moved to error, as rxe's does.
    assert_eq!(b.qp.state().unwrap(), erdma::QpState::Err);
}

#[test]
fn limits_are_typed_errors_before_the_device_is_called() {
    let (a, _b) = pair();
    let ctx = a.ctx.clone();
    let l = ctx.limits().clone();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    // Zero-length and oversized regions.
    assert!(matches!(
        pd.alloc(0, Access::LOCAL_WRITE),
        Err(Error::LimitBelowMinimum {
            limit: Limit::MaxMrSize,
            ..
        })
    ));
    // Queue pair capacities beyond the profile.
    let too_many_sges = QpConfig::new(&cq).max_send_sge(l.max_send_sge + 1);
    match pd.create_qp(&too_many_sges) {
        Err(Error::LimitExceeded {
            limit: Limit::MaxSendSge,
            requested,
            max,
        }) => assert_eq!(
            (requested, max),
            (l.max_send_sge as u64 + 1, l.max_send_sge as u64)
        ),
        other => panic!("expected MaxSendSge, got {other:?}"),
    }
    if l.max_inline_data != u32::MAX {
        assert!(matches!(
            pd.create_qp(&QpConfig::new(&cq).max_inline_data(l.max_inline_data + 1)),
            Err(Error::LimitExceeded {
                limit: Limit::MaxInlineData,
                ..
            })
        ));
    }
    // Work requests beyond the queue pair's capacities.
    let big = vec![0u8; a.qp.caps().max_inline_data as usize + 1];
    match a.qp.post_send(SendWr::send_inline(1, &big)) {
        Err(Error::QpCapacityExceeded {
            limit: Limit::MaxInlineData,
            ..
        }) => {}
        other => panic!("expected MaxInlineData, got {other:?}"),
    }
    scope(|s| {
        let sges: Vec<_> = (0..a.qp.caps().max_send_sge as usize + 1)
            .map(|i| a.mr.slice(i * 8..i * 8 + 8))
            .collect();
        match s.post_send(&a.qp, SendWr::send(1, &sges)) {
            Err(
                e @ Error::QpCapacityExceeded {
                    limit: Limit::MaxSendSge,
                    ..
                },
            ) => {
                // Whose limit, and how to raise it.
                let msg = e.to_string();
                assert!(msg.contains("this queue pair was created with"), "{msg}");
                assert!(msg.contains("QpConfig::max_send_sge"), "{msg}");
                assert!(msg.contains("the device allows"), "{msg}");
            }
            other => panic!("expected MaxSendSge, got {other:?}"),
        }
    });
    if l.atomics {
        let mut m = pd.alloc(64, Access::LOCAL_WRITE).unwrap();
        let target = erdma::RemoteMr {
            addr: 0x1004,
            len: 8,
            rkey: 1,
        };
        scope(|s| {
            assert!(matches!(
                s.post_send(&a.qp, SendWr::fetch_add(1, m.slice_mut(0..8), target, 1)),
                Err(Error::InvalidArgument(_))
            ));
        });
    }
    // A CQ beyond max_cqe.
    assert!(matches!(
        ctx.create_cq(l.max_cqe + 1),
        Err(Error::LimitExceeded {
            limit: Limit::MaxCqe,
            ..
        })
    ));
    // Borrowed memory cannot be exposed to peers.
    let mut local = vec![0u8; 64];
    assert!(matches!(
        pd.register_slice(&mut local, Access::ALL),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn every_path_mtu_moves_the_same_bytes() {
    for mtu in [Mtu::Mtu256, Mtu::Mtu1024, Mtu::Mtu4096] {
        let (mut a, b) = pair_with(PairOptions {
            mtu: Some(mtu),
            ..PairOptions::default()
        });
        let len = 3 * mtu.bytes() as usize + 5;
        let data = pattern(mtu.bytes(), len);
        a.mr.write_at(0, &data).unwrap();
        scope(|s| {
            let src = [a.mr.slice(..len)];
            s.post_send(&a.qp, SendWr::write(1, &src, b.mr.remote()))
                .unwrap();
            assert!(wait(&a.cq).status.is_success());
        });
        assert_eq!(&b.mr.to_vec(..len), &data[..], "MTU {mtu}");
    }
}

/// Four queue pairs between the same two devices, each with its own buffers.
fn pairs_between_two_devices() -> Vec<(Side, Side)> {
    let (a, b) = device_pair();
    (0..4)
        .map(|_| connect_pair(&a, &b, &PairOptions::default()).expect("connecting two devices"))
        .collect()
}

/// Posts a WRITE WITH IMM of `sizes[i]` bytes on pair `i` (its receive already posted) and
/// checks every completion and every byte once `post` has returned.
fn write_on_every_pair(
    pairs: &mut [(Side, Side)],
    sizes: &[usize],
    post: impl FnOnce(&mut dyn FnMut()),
) {
    for (i, (a, b)) in pairs.iter_mut().enumerate() {
        let len = sizes[i];
        a.mr.write_at(0, &pattern(500 + i as u32, len)).unwrap();
        b.mr.fill(..len + 16, 0xEE);
    }
    scope(|s| {
        for (i, (_, b)) in pairs.iter().enumerate() {
            s.post_recv(&b.qp, RecvWr::empty(i as u64)).unwrap();
        }
        let srcs: Vec<[erdma::MrSlice<'_>; 1]> = pairs
            .iter()
            .zip(sizes)
            .map(|((a, _), &len)| [a.mr.slice(..len)])
            .collect();
        let mut post_all = || {
            for (i, ((a, b), src)) in pairs.iter().zip(&srcs).enumerate() {
                let target = b.mr.remote().slice(0, sizes[i] as u64).unwrap();
                let wr = SendWr::write(i as u64, src, target).with_imm(0x100 + i as u32);
                s.post_send(&a.qp, wr).unwrap();
            }
        };
        // A `post` that panics after posting still has its writes delivered.
        let posting = std::panic::AssertUnwindSafe(move || post(&mut post_all));
        let _ = std::panic::catch_unwind(posting);
        for (i, (a, b)) in pairs.iter().enumerate() {
            let w = wait(&a.cq);
            assert_eq!(
                (w.wr_id, w.status, w.opcode),
                (i as u64, WcStatus::Success, WcOpcode::RdmaWrite),
                "{w:?}"
            );
            let r = wait(&b.cq);
            assert_eq!(
                (r.wr_id, r.status, r.opcode, r.imm),
                (
                    i as u64,
                    WcStatus::Success,
                    WcOpcode::RecvRdmaWithImm,
                    Some(0x100 + i as u32)
                ),
                "{r:?}"
            );
            assert_eq!(r.byte_len as usize, sizes[i]);
        }
    });
    for (i, (_, b)) in pairs.iter().enumerate() {
        let len = sizes[i];
        assert_eq!(
            &b.mr.to_vec(..len),
            &pattern(500 + i as u32, len)[..],
            "pair {i}: {len} bytes"
        );
        assert!(
            b.mr.to_vec(len..len + 16).iter().all(|&x| x == 0xEE),
            "pair {i}: nothing written past the message"
        );
    }
}

#[test]
fn coalesced_posts_to_several_queue_pairs_leave_together_when_the_closure_returns() {
    let mut pairs = pairs_between_two_devices();
    // Held back only where the posting thread transmits (see `erdma::soft::coalesce_sends`).
    let soft = pairs[0].0.ctx.provider() == ProviderKind::Soft && common::soft_transmits_inline();
    let receivers: Vec<erdma::Cq> = pairs.iter().map(|(_, b)| b.cq.clone()).collect();
    // Sizes of one, several and many packets (middle packets of several queue pairs share GSO
    // messages on a soft device), and an empty one.
    let sizes = [3 * 4096 + 5, 65536 + 7, 0, 1];
    write_on_every_pair(&mut pairs, &sizes, move |post_all| {
        erdma::soft::coalesce_sends(|| {
            post_all();
            if soft {
                // Held in this thread's batch: nothing reaches the peer until the closure ends.
                std::thread::sleep(Duration::from_millis(30));
                let mut none = [Completion::default(); 4];
                for cq in &receivers {
                    assert_eq!(cq.poll(&mut none).unwrap(), 0, "a write left early");
                }
            }
        })
    });
    // Nested calls send at the end of the outermost; the pairs keep working afterwards.
    write_on_every_pair(&mut pairs, &[1, 2, 4097, 8192], |post_all| {
        erdma::soft::coalesce_sends(|| erdma::soft::coalesce_sends(post_all))
    });
}

#[test]
fn coalesced_posts_leave_when_the_closure_unwinds() {
    let mut pairs = pairs_between_two_devices();
    write_on_every_pair(&mut pairs, &[100, 5000, 20000, 7], |post_all| {
        erdma::soft::coalesce_sends(|| {
            post_all();
            panic!("the caller fails after posting");
        })
    });
}

#[test]
fn port_counters_count_the_packets_of_a_write() {
    let (mut a, b) = pair();
    // The soft device and rxe name these counters so (rxe's ib device may sit on the
    // network device's driver in sysfs, so its name tells it too).
    let named = |c: &erdma::Context| {
        c.provider() == ProviderKind::Soft
            || c.driver().as_deref() == Some("rdma_rxe")
            || c.name().starts_with("rxe")
    };
    if !named(&a.ctx) || !named(&b.ctx) {
        eprintln!(
            "skipped: {} / {} may name their counters otherwise",
            a.ctx.name(),
            b.ctx.name()
        );
        return;
    }
    let before_a = a.ctx.port_counters(1).unwrap();
    let before_b = b.ctx.port_counters(1).unwrap();
    let len = 64 << 10;
    let data = pattern(77, len);
    a.mr.write_at(0, &data).unwrap();
    let remote = b.mr.remote();
    scope(|s| {
        let src = [a.mr.slice(..len)];
        s.post_send(
            &a.qp,
            SendWr::write(1, &src, remote.slice(0, len as u64).unwrap()),
        )
        .unwrap();
        assert!(wait(&a.cq).status.is_success());
    });
    assert_eq!(&b.mr.to_vec(..len), &data[..]);
    // At least one packet per 4 KiB went out of a's port and into b's (the same port when both
    // are one device); one in all where soft devices pass references (a packet then stands for
    // up to 64 KiB). The kernel refreshes a verbs port's counters at most every `lifespan` ms:
    // read until they move.
    let min = if common::soft_same_host_refs() && a.ctx.provider() == ProviderKind::Soft {
        1
    } else {
        (len / 4096) as u64
    };
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let da = a.ctx.port_counters(1).unwrap().since(&before_a);
        let db = b.ctx.port_counters(1).unwrap().since(&before_b);
        let sent = da.get("sent_pkts").expect("a sent_pkts counter");
        let rcvd = db.get("rcvd_pkts").expect("a rcvd_pkts counter");
        if sent >= min && rcvd >= min {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a WRITE of {len} bytes: sent_pkts grew by {sent}, rcvd_pkts by {rcvd}; want {min}+"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn port_counters_keep_what_destroyed_queue_pairs_counted() {
    let (mut a, b) = pair();
    if a.ctx.provider() != ProviderKind::Soft {
        eprintln!("skipped: only the soft device's counting is this test's business");
        return;
    }
    let ctx = a.ctx.clone();
    let before = ctx.port_counters(1).unwrap();
    a.mr.fill(..4096, 3);
    let remote = b.mr.remote();
    scope(|s| {
        let src = [a.mr.slice(..4096)];
        s.post_send(
            &a.qp,
            SendWr::write(1, &src, remote.slice(0, 4096).unwrap()),
        )
        .unwrap();
        assert!(wait(&a.cq).status.is_success());
    });
    let sent = ctx
        .port_counters(1)
        .unwrap()
        .since(&before)
        .get("sent_pkts");
    assert!(sent >= Some(1), "{sent:?}");
    drop(a);
    drop(b);
    let after = ctx
        .port_counters(1)
        .unwrap()
        .since(&before)
        .get("sent_pkts");
    assert_eq!(after, sent, "a destroyed queue pair's packets still count");
}

/// One queue pair, two threads: the first posts a WRITE inside `coalesce_sends` (its packet
/// waits in the thread's batch), the second posts the next WRITE meanwhile. The second packet
/// must not reach the peer first: that would be out of sequence there, cost a NAK and a
/// go-back-N retry (which the port counters would show), and on a real network reorder data.
#[test]
fn packets_of_one_queue_pair_leave_in_order_across_threads() {
    let (a, b) = pair();
    if a.ctx.provider() != ProviderKind::Soft {
        eprintln!("skipped: coalescing is the soft device's");
        return;
    }
    let remote = b.mr.remote();
    let before_a = a.ctx.port_counters(1).unwrap();
    let before_b = b.ctx.port_counters(1).unwrap();
    for round in 0..20u64 {
        let posted = std::sync::Barrier::new(2);
        let second_done = std::sync::Barrier::new(2);
        std::thread::scope(|s| {
            s.spawn(|| {
                erdma::soft::coalesce_sends(|| {
                    a.qp.post_send(SendWr::write_inline(2 * round, b"first", remote))
                        .unwrap();
                    posted.wait();
                    second_done.wait();
                });
            });
            s.spawn(|| {
                posted.wait();
                let target = remote.slice(64, 6).unwrap();
                a.qp.post_send(SendWr::write_inline(2 * round + 1, b"second", target))
                    .unwrap();
                second_done.wait();
            });
        });
        for _ in 0..2 {
            let c = wait(&a.cq);
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
        }
    }
    assert_eq!(&b.mr.to_vec(..5), b"first");
    assert_eq!(&b.mr.to_vec(64..70), b"second");
    let da = a.ctx.port_counters(1).unwrap().since(&before_a);
    let db = b.ctx.port_counters(1).unwrap().since(&before_b);
    assert_eq!(db.get("out_of_seq_request"), Some(0), "{db}");
    assert_eq!(da.get("retries"), Some(0), "{da}");
    assert_eq!(da.get("retransmitted_pkts"), Some(0), "{da}");
}

/// Coalesced posts that fill the thread's batch exactly (8 queue pairs × 128 one-packet WRITEs:
/// 1024 packets, the batch's packet limit, and each queue pair's whole window): the full batch
/// leaves inside the last post and nothing follows it. The queue pairs it took must still be
/// given back when the scope ends, or another thread's next post on them would never leave.
#[test]
fn a_coalesced_batch_that_filled_up_exactly_still_gives_its_queue_pairs_back() {
    let (da, db) = device_pair();
    let first = connect_pair(&da, &db, &PairOptions::default()).unwrap();
    if first.0.ctx.provider() != ProviderKind::Soft {
        eprintln!("skipped: coalescing is the soft device's");
        return;
    }
    let mut pairs = vec![first];
    for _ in 1..8 {
        pairs.push(connect_pair(&da, &db, &PairOptions::default()).unwrap());
    }
    erdma::soft::coalesce_sends(|| {
        for (a, b) in &pairs {
            let remote = b.mr.remote();
            for i in 0..128u64 {
                a.qp.post_send(SendWr::write_inline(i, b"x", remote))
                    .unwrap();
            }
        }
    });
    // Another thread posts one more WRITE on each queue pair.
    std::thread::scope(|s| {
        s.spawn(|| {
            for (a, b) in &pairs {
                a.qp.post_send(SendWr::write_inline(1000, b"y", b.mr.remote()))
                    .unwrap();
            }
        });
    });
    for (a, _) in &pairs {
        for _ in 0..129 {
            let c = wait(&a.cq);
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
        }
    }
    for (_, b) in &pairs {
        assert_eq!(b.mr.to_vec(..)[0], b'y');
    }
}

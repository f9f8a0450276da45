//! Devices of several engine lanes in the simulation: queue pairs spread over the lanes keep
//! their bytes and completions whichever lane their datagrams land in; a datagram landing in a
//! lane that does not serve its queue pair is handed over, once; queue pairs created and
//! destroyed while their lane is busy leave the others' traffic intact; a post only queues, and
//! the lane transmits it.

use super::tests::{ip, secs, sgl};
use super::*;
use crate::soft::proto::*;
use crate::vocab::*;
use std::net::Ipv4Addr;

const LANES: usize = 4;

/// Two devices of [`LANES`] lanes each.
fn two_nodes(seed: u64, net: NetConfig, steering: Steering) -> (Sim, usize, usize) {
    two_nodes_with(seed, net, steering, ChecksumCapabilities::default())
}

fn two_nodes_with(
    seed: u64,
    net: NetConfig,
    steering: Steering,
    caps: ChecksumCapabilities,
) -> (Sim, usize, usize) {
    let mut sim = Sim::new(seed, net);
    let a = sim.add_node_with(ip(1), caps, LANES, steering);
    let b = sim.add_node_with(ip(2), caps, LANES, steering);
    (sim, a, b)
}

/// What one connected pair of queue pairs carries in [`spread`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Send,
    Write,
    WriteImm,
    Read,
}

const SIZES: [usize; 4] = [1, 1000, 5000, 70_000];
/// Bytes each pair's messages take in a region (the sizes, 64-byte aligned, with gaps).
const SLICE: usize = 80 * 1024;

fn offsets() -> [usize; 4] {
    let mut offs = [0; 4];
    let mut at = 64;
    for (o, s) in offs.iter_mut().zip(SIZES) {
        *o = at;
        at = (at + s + 64 + 63) & !63;
    }
    offs
}

/// `pairs` connected pairs of queue pairs between two devices of four lanes, each carrying
/// four messages of one opcode at once; checks every byte and every completion.
fn spread(seed: u64, net: NetConfig, steering: Steering, polling: bool, pairs: usize) {
    let ctx = format!(
        "seed {seed} steering {steering:?} polling {polling} loss {}",
        net.loss
    );
    let (mut sim, a, b) = two_nodes(seed, net, steering);
    sim.node_mut(a).set_polling(polling);
    sim.node_mut(b).set_polling(polling);
    let conns: Vec<(u32, u32)> = (0..pairs)
        .map(|_| sim.connect(a, b, &ConnectOpts::default()))
        .collect();
    let mut lanes_used: Vec<usize> = conns
        .iter()
        .map(|&(_, qb)| sim.node(b).lane_of(qb))
        .collect();
    lanes_used.sort_unstable();
    lanes_used.dedup();
    assert_eq!(
        lanes_used.len(),
        LANES.min(pairs),
        "{ctx}: queue pairs on every lane"
    );
    let total = SLICE * pairs;
    let ma = sim.node_mut(a).mem.register(1, total, Access::ALL);
    let mb = sim.node_mut(b).mem.register(1, total, Access::ALL);
    let mut rng = Rng::new(seed ^ 0x1a7e);
    let offs = offsets();
    let ops = [Op::Send, Op::Write, Op::WriteImm, Op::Read];
    for (k, &(qa, qb)) in conns.iter().enumerate() {
        let op = ops[k % ops.len()];
        let base = k * SLICE;
        let (src, key) = if op == Op::Read {
            (b, mb.key)
        } else {
            (a, ma.key)
        };
        for (&o, &s) in offs.iter().zip(&SIZES) {
            assert!(sim.node(src).mem.fill(key, base + o, s, &mut rng));
        }
        for (i, (&o, &s)) in offs.iter().zip(&SIZES).enumerate() {
            match op {
                Op::Send => sim
                    .node(b)
                    .qp(qb)
                    .post_recv(RecvWqe::new(1000 + i as u64, sgl(mb, base + o, s)))
                    .unwrap(),
                Op::WriteImm => sim
                    .node(b)
                    .qp(qb)
                    .post_recv(RecvWqe::new(1000 + i as u64, SgeList::new()))
                    .unwrap(),
                Op::Write | Op::Read => {}
            }
        }
        for (i, (&o, &s)) in offs.iter().zip(&SIZES).enumerate() {
            let (local, remote) = (sgl(ma, base + o, s), mb.iova + (base + o) as u64);
            let wqe = match op {
                Op::Send => SendWqe::send(i as u64, SendData::Sges(local)),
                Op::Write => SendWqe::write(i as u64, SendData::Sges(local), remote, mb.key),
                Op::WriteImm => SendWqe::write(i as u64, SendData::Sges(local), remote, mb.key)
                    .with_imm(0x7000 + i as u32),
                Op::Read => SendWqe::read(i as u64, local, remote, mb.key),
            };
            sim.node(a).qp(qa).post_send(wqe).unwrap();
        }
    }
    let want_a = pairs * SIZES.len();
    let want_b = (0..pairs)
        .filter(|k| matches!(ops[k % ops.len()], Op::Send | Op::WriteImm))
        .count()
        * SIZES.len();
    let out = sim.run_until(secs(600), |s| {
        s.node(a).completions.len() >= want_a && s.node(b).completions.len() >= want_b
    });
    assert_eq!(out, Outcome::Done, "{ctx}: {:?}", sim.stats());
    assert_eq!(
        sim.run(sim.now() + Duration::from_secs(10)),
        Outcome::Quiescent,
        "{ctx}"
    );
    let ca: Vec<Completion> = sim.node_mut(a).completions.drain(..).collect();
    let cb: Vec<Completion> = sim.node_mut(b).completions.drain(..).collect();
    assert_eq!((ca.len(), cb.len()), (want_a, want_b), "{ctx}");
    for (k, &(qa, qb)) in conns.iter().enumerate() {
        let op = ops[k % ops.len()];
        let wc_op = match op {
            Op::Send => WcOpcode::Send,
            Op::Write | Op::WriteImm => WcOpcode::RdmaWrite,
            Op::Read => WcOpcode::RdmaRead,
        };
        let mine: Vec<_> = ca.iter().filter(|c| c.qp_num == qa).collect();
        assert_eq!(mine.len(), SIZES.len(), "{ctx}: pair {k}");
        for (i, c) in mine.iter().enumerate() {
            assert_eq!(
                (c.wr_id, c.status, c.opcode, c.byte_len),
                (i as u64, WcStatus::Success, wc_op, SIZES[i] as u32),
                "{ctx}: pair {k} send completion {i}"
            );
        }
        let theirs: Vec<_> = cb.iter().filter(|c| c.qp_num == qb).collect();
        if matches!(op, Op::Send | Op::WriteImm) {
            assert_eq!(theirs.len(), SIZES.len(), "{ctx}: pair {k}");
            for (i, c) in theirs.iter().enumerate() {
                let (opcode, imm) = if op == Op::Send {
                    (WcOpcode::Recv, None)
                } else {
                    (WcOpcode::RecvRdmaWithImm, Some(0x7000 + i as u32))
                };
                assert_eq!(
                    (c.wr_id, c.status, c.opcode, c.byte_len, c.src_qp, c.imm),
                    (
                        1000 + i as u64,
                        WcStatus::Success,
                        opcode,
                        SIZES[i] as u32,
                        qa,
                        imm
                    ),
                    "{ctx}: pair {k} receive completion {i}"
                );
            }
        } else {
            assert!(theirs.is_empty(), "{ctx}: pair {k}");
        }
        assert_eq!(sim.node(a).qp(qa).state(), QpState::Rts, "{ctx}: pair {k}");
        assert_eq!(sim.node(b).qp(qb).state(), QpState::Rts, "{ctx}: pair {k}");
    }
    let da = sim.node(a).mem.bytes(ma.key).unwrap();
    let db = sim.node(b).mem.bytes(mb.key).unwrap();
    assert!(da == db, "{ctx}: data differs");
    // Nothing a lane handed over was lost for want of its queue pair.
    let (totals, _) = sim.node(b).totals();
    assert_eq!(totals.drops.get(DropReason::UnknownQp), 0, "{ctx}");
}

#[test]
fn queue_pairs_spread_over_four_lanes_keep_their_bytes_and_completions() {
    for steering in [Steering::Qpn, Steering::Source, Steering::Wrong] {
        for polling in [false, true] {
            spread(1, NetConfig::ideal(), steering, polling, 8);
        }
    }
}

#[test]
fn four_lanes_recover_from_faults() {
    for steering in [Steering::Qpn, Steering::Source, Steering::Wrong] {
        for seed in 1..=3 {
            spread(seed, NetConfig::faulty(0.05), steering, seed == 2, 6);
        }
    }
}

/// A datagram that lands in a lane not serving its queue pair is fed once, by the lane that
/// does; one for no queue pair is counted once as such; one too short to name a queue pair is
/// dropped where it landed. Nothing panics.
#[test]
fn a_datagram_in_the_wrong_lane_is_handed_to_its_queue_pairs_lane() {
    // ICRCs ignored, so that a hand-made QPN reaches routing.
    let (mut sim, a, b) = two_nodes_with(
        7,
        NetConfig::ideal(),
        Steering::Wrong,
        ChecksumCapabilities::ignored(),
    );
    let (qa, qb) = sim.connect(a, b, &ConnectOpts::default());
    let ma = sim.node_mut(a).mem.register(1, 4096, Access::ALL);
    let mb = sim.node_mut(b).mem.register(1, 4096, Access::ALL);
    let mut rng = Rng::new(3);
    assert!(sim.node(a).mem.fill(ma.key, 0, 3000, &mut rng));
    sim.node(a)
        .qp(qa)
        .post_send(SendWqe::write(
            9,
            SendData::Sges(sgl(ma, 0, 3000)),
            mb.iova,
            mb.key,
        ))
        .unwrap();
    // Capture the request (sent by its lane's round where lanes transmit), then deliver it
    // into a lane that does not serve `qb`.
    sim.node_mut(a).round();
    let sent = sim.take_sent(a);
    assert!(!sent.is_empty());
    let from = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 1), ROCE_PORT);
    for (_, d) in &sent {
        sim.inject(b, from, d.clone());
    }
    // A request for a queue pair that does not exist, in a lane it would not be served by.
    let mut stray = sent[0].1.clone();
    let ghost = qb + 1 + LANES as u32 * 100;
    stray[5..8].copy_from_slice(&ghost.to_be_bytes()[1..]);
    sim.inject(b, from, stray);
    // Too short to name a queue pair: dropped where it landed.
    sim.inject(b, from, vec![0x0a, 0, 0xff]);
    let out = sim.run_until(secs(10), |s| !s.node(a).completions.is_empty());
    assert_eq!(out, Outcome::Done, "{:?}", sim.stats());
    let c = sim.node_mut(a).completions.pop_front().unwrap();
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len),
        (9, WcStatus::Success, WcOpcode::RdmaWrite, 3000)
    );
    assert_eq!(
        sim.node(a).mem.bytes(ma.key).unwrap()[..3000],
        sim.node(b).mem.bytes(mb.key).unwrap()[..3000]
    );
    let (totals, rcvd) = sim.node(b).totals();
    assert_eq!(totals.drops.get(DropReason::UnknownQp), 1);
    assert_eq!(totals.drops.get(DropReason::Truncated), 1);
    // Each datagram counted once, where it first landed (the connect's and the write's).
    assert!(rcvd >= sent.len() as u64 + 2);
    assert_eq!(sim.node(b).qp(qb).state(), QpState::Rts);
}

/// While one queue pair streams, queue pairs of the same lane are created, used and destroyed
/// with their datagrams still on the wire: the stream completes intact, the destroyed queue
/// pairs' late datagrams are dropped as for no queue pair, and the device goes on serving.
#[test]
fn queue_pairs_come_and_go_while_their_lane_is_busy() {
    for steering in [Steering::Qpn, Steering::Source] {
        let (mut sim, a, b) = two_nodes(11, NetConfig::lossy(0.01), steering);
        let (qa, qb) = sim.connect(a, b, &ConnectOpts::default());
        let busy_lane = sim.node(b).lane_of(qb);
        const MSGS: usize = 48;
        const LEN: usize = 64 * 1024;
        let ma = sim
            .node_mut(a)
            .mem
            .register(1, MSGS * LEN + 65536, Access::ALL);
        let mb = sim
            .node_mut(b)
            .mem
            .register(1, MSGS * LEN + 65536, Access::ALL);
        let mut rng = Rng::new(5);
        assert!(sim.node(a).mem.fill(ma.key, 0, MSGS * LEN, &mut rng));
        for i in 0..MSGS {
            let off = i * LEN;
            let wqe = SendWqe::write(
                i as u64,
                SendData::Sges(sgl(ma, off, LEN)),
                mb.iova + off as u64,
                mb.key,
            );
            sim.node(a).qp(qa).post_send(wqe).unwrap();
        }
        let out = sim.run_until(secs(60), |s| s.node(a).completions.len() >= 8);
        assert_eq!(out, Outcome::Done);
        // New pairs until one lands in the busy lane on B.
        let mut extra = Vec::new();
        loop {
            let (xa, xb) = sim.connect(a, b, &ConnectOpts::default());
            extra.push((xa, xb));
            if sim.node(b).lane_of(xb) == busy_lane {
                break;
            }
            assert!(extra.len() <= LANES, "the lanes follow the QPN");
        }
        let &(xa, xb) = extra.last().unwrap();
        let scratch = MSGS * LEN;
        for i in 0..8u64 {
            sim.node(b)
                .qp(xb)
                .post_recv(RecvWqe::new(i, sgl(mb, scratch, 4096)))
                .unwrap();
            sim.node(a)
                .qp(xa)
                .post_send(SendWqe::send(100 + i, SendData::Sges(sgl(ma, 0, 4096))))
                .unwrap();
        }
        // Some of its sends complete, then both sides go with datagrams still in flight.
        let out = sim.run_until(secs(60), |s| {
            s.node(a).completions.iter().any(|c| c.qp_num == xa)
        });
        assert_eq!(out, Outcome::Done);
        for &(ea, eb) in &extra {
            sim.node_mut(b).destroy_qp(eb);
            sim.node_mut(a).destroy_qp(ea);
        }
        let out = sim.run_until(secs(600), |s| {
            s.node(a)
                .completions
                .iter()
                .filter(|c| c.qp_num == qa)
                .count()
                >= MSGS
        });
        assert_eq!(out, Outcome::Done, "{steering:?}: {:?}", sim.stats());
        let ca: Vec<Completion> = sim.node_mut(a).completions.drain(..).collect();
        let stream: Vec<_> = ca.iter().filter(|c| c.qp_num == qa).collect();
        for (i, c) in stream.iter().enumerate() {
            assert_eq!(
                (c.wr_id, c.status, c.byte_len),
                (i as u64, WcStatus::Success, LEN as u32),
                "{steering:?}: stream completion {i}"
            );
        }
        for c in ca.iter().filter(|c| c.qp_num == xa) {
            assert_eq!(c.status, WcStatus::Success, "{steering:?}: before it went");
        }
        let da = sim.node(a).mem.bytes(ma.key).unwrap();
        let db = sim.node(b).mem.bytes(mb.key).unwrap();
        assert!(
            da[..MSGS * LEN] == db[..MSGS * LEN],
            "{steering:?}: data differs"
        );
        assert_eq!(sim.node(a).qp(qa).state(), QpState::Rts);
        assert_eq!(sim.node(b).qp(qb).state(), QpState::Rts);
        // A queue pair made afterwards in the same lane works from a clean slate.
        let (na, nb) = sim.connect(a, b, &ConnectOpts::default());
        sim.node(b)
            .qp(nb)
            .post_recv(RecvWqe::new(1, sgl(mb, scratch, 4096)))
            .unwrap();
        sim.node(a)
            .qp(na)
            .post_send(SendWqe::send(2, SendData::Sges(sgl(ma, 0, 64))))
            .unwrap();
        let out = sim.run_until(secs(60), |s| {
            s.node(b).completions.iter().any(|c| c.qp_num == nb)
        });
        assert_eq!(out, Outcome::Done);
        let c = sim
            .node(b)
            .completions
            .iter()
            .find(|c| c.qp_num == nb)
            .copied()
            .unwrap();
        assert_eq!((c.wr_id, c.status, c.byte_len), (1, WcStatus::Success, 64));
    }
}

/// On a device whose lanes transmit, a post only queues: nothing leaves in the posting call,
/// the queue pair's lane sends it in its next round, and the transfer completes with its bytes.
/// A receive wakes the lane only in ERR, for its flush completion. A queue pair destroyed while its post waits for the lane sends nothing afterwards, and the
/// lane's round for it passes without a panic.
#[test]
fn the_lane_transmits_what_a_post_queued() {
    let (mut sim, a, b) = two_nodes(13, NetConfig::ideal(), Steering::Qpn);
    let (qa, qb) = sim.connect(a, b, &ConnectOpts::default());
    let ma = sim.node_mut(a).mem.register(1, 16384, Access::ALL);
    let mb = sim.node_mut(b).mem.register(1, 16384, Access::ALL);
    let mut rng = Rng::new(9);
    assert!(sim.node(a).mem.fill(ma.key, 0, 10_000, &mut rng));
    sim.take_sent(a);
    let write = |id| SendWqe::write(id, SendData::Sges(sgl(ma, 0, 10_000)), mb.iova, mb.key);
    sim.node(a).qp(qa).post_send(write(1)).unwrap();
    assert!(
        sim.take_sent(a).is_empty(),
        "the posting call sent packets itself"
    );
    sim.node_mut(a).round();
    let sent = sim.take_sent(a);
    assert_eq!(
        sent.len(),
        10_000usize.div_ceil(1024),
        "10,000 bytes at MTU 1024: ten packets from the lane"
    );
    for (_, d) in sent {
        sim.inject(
            b,
            SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 1), ROCE_PORT),
            d,
        );
    }
    let out = sim.run_until_completions(a, 1, secs(10));
    assert_eq!(out, Outcome::Done, "{:?}", sim.stats());
    let c = sim.node_mut(a).completions.pop_front().unwrap();
    assert_eq!((c.wr_id, c.status), (1, WcStatus::Success));
    let (da, db) = (
        sim.node(a).mem.bytes(ma.key).unwrap(),
        sim.node(b).mem.bytes(mb.key).unwrap(),
    );
    assert!(da[..10_000] == db[..10_000], "data differs");
    // A receive makes nothing sendable: posting one leaves the lane's timers as they were. In
    // ERR it completes as flushed, delivered by the lane's round.
    let before = sim.node(b).earliest_timer();
    let recv = |id| RecvWqe::new(id, sgl(mb, 12_000, 64));
    sim.node(b).qp(qb).post_recv(recv(7)).unwrap();
    assert_eq!(
        sim.node(b).earliest_timer(),
        before,
        "a receive scheduled its lane"
    );
    sim.node(b)
        .qp(qb)
        .modify(&QpAttr::to_state(QpState::Err))
        .unwrap();
    sim.node(b).qp(qb).post_recv(recv(8)).unwrap();
    let out = sim.run_until_completions(b, 2, secs(20));
    assert_eq!(out, Outcome::Done, "{:?}", sim.stats());
    let flushed: Vec<_> = sim
        .node_mut(b)
        .completions
        .drain(..)
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        flushed,
        [(7, WcStatus::WrFlushErr), (8, WcStatus::WrFlushErr)]
    );
    // Destroyed with a post waiting for its lane: the lane's round finds no queue pair.
    sim.node(a).qp(qa).post_send(write(2)).unwrap();
    sim.node_mut(a).destroy_qp(qa);
    sim.node_mut(a).round();
    assert!(sim.take_sent(a).is_empty(), "a destroyed queue pair sent");
}

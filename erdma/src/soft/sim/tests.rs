//! Two-device simulations on virtual time with seeded faults: every opcode and size under loss,
//! reordering, duplication and corruption; bounded failure; RNR; hostile peers.
//!
//! Seeds are fixed, so every run is reproducible. Run in release mode.

use super::*;
use crate::soft::proto::*;
use crate::vocab::*;
use std::net::{Ipv4Addr, SocketAddrV4};

pub(super) fn ip(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, n))
}

pub(super) fn secs(s: u64) -> Instant {
    Instant::from_nanos(s * 1_000_000_000)
}

/// One registered buffer as a one-entry list.
pub(super) fn sgl(m: MrInfo, off: usize, len: usize) -> SgeList {
    SgeList::from_slice(&[Sge::new(m.iova + off as u64, len as u32, m.key)]).unwrap()
}

/// `len` bytes at `off` split over two entries (when there are at least `min` bytes).
fn split(m: MrInfo, off: usize, len: usize, at: usize) -> SgeList {
    if at == 0 || at >= len {
        return sgl(m, off, len);
    }
    SgeList::from_slice(&[
        Sge::new(m.iova + off as u64, at as u32, m.key),
        Sge::new(m.iova + (off + at) as u64, (len - at) as u32, m.key),
    ])
    .unwrap()
}

/// Message offsets: each message 64-byte aligned with a 64-byte gap after it.
fn layout(sizes: &[usize]) -> (Vec<usize>, usize) {
    let mut offs = Vec::new();
    let mut at = 64;
    for &s in sizes {
        offs.push(at);
        at = (at + s + 64 + 63) & !63;
    }
    (offs, at)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Send,
    SendImm,
    Write,
    WriteImm,
    Read,
}

const OPS: [Op; 5] = [Op::Send, Op::SendImm, Op::Write, Op::WriteImm, Op::Read];

impl Op {
    fn consumes_recv(self) -> bool {
        matches!(self, Op::Send | Op::SendImm | Op::WriteImm)
    }
}

/// Two devices, one connected queue pair each.
struct Pair {
    sim: Sim,
    a: usize,
    b: usize,
    qa: u32,
    qb: u32,
}

impl Pair {
    fn new(seed: u64, net: NetConfig, opts: &ConnectOpts) -> Pair {
        let mut sim = Sim::new(seed, net);
        let a = sim.add_node(ip(1), ChecksumCapabilities::default());
        let b = sim.add_node(ip(2), ChecksumCapabilities::default());
        let (qa, qb) = sim.connect(a, b, opts);
        Pair { sim, a, b, qa, qb }
    }

    fn qp(&self, node: usize) -> QpRef<'_> {
        let q = if node == self.a { self.qa } else { self.qb };
        self.sim.node(node).qp(q)
    }

    fn state(&self, node: usize) -> QpState {
        self.qp(node).state()
    }

    fn completions(&mut self, node: usize) -> Vec<Completion> {
        self.sim.node_mut(node).completions.drain(..).collect()
    }
}

/// PSNs for a seed: every third seed starts just before the wrap.
fn psns(rng: &mut Rng, seed: u64) -> (Psn, Psn) {
    if seed % 3 == 0 {
        (
            Psn::new(0xFF_FFF0 + rng.below(8) as u32),
            Psn::new(0xFF_FFFA),
        )
    } else {
        (
            Psn::new(rng.next_u64() as u32),
            Psn::new(rng.next_u64() as u32),
        )
    }
}

/// Runs `sizes.len()` messages of `op` from A to B and checks data and completions.
fn run_case(op: Op, mtu: Mtu, net: NetConfig, seed: u64, sizes: &[usize]) {
    run_case_with(op, mtu, net, seed, sizes, false);
}

/// [`run_case`], with both devices' rounds taken as polling applications take them
/// (`polling`): acknowledgements held back until the next poll.
fn run_case_with(op: Op, mtu: Mtu, net: NetConfig, seed: u64, sizes: &[usize], polling: bool) {
    let ctx = format!(
        "{op:?} mtu {} loss {:.3} reorder {:.3} dup {:.3} corrupt {:.3} seed {seed}",
        mtu.bytes(),
        net.loss,
        net.reorder,
        net.duplicate,
        net.corrupt
    );
    let mut rng = Rng::new(seed.wrapping_mul(0x9E37_79B9) ^ mtu.bytes() as u64);
    let (psn_a, psn_b) = psns(&mut rng, seed);
    let opts = ConnectOpts {
        mtu,
        psn_a,
        psn_b,
        ..ConnectOpts::default()
    };
    let mut p = Pair::new(seed, net, &opts);
    let (a, b) = (p.a, p.b);
    p.sim.node_mut(a).set_polling(polling);
    p.sim.node_mut(b).set_polling(polling);
    let (offs, total) = layout(sizes);
    let ma = p.sim.node_mut(a).mem.register(1, total, Access::ALL);
    let mb = p.sim.node_mut(b).mem.register(1, total, Access::ALL);
    let (src_node, src_key) = if op == Op::Read {
        (b, mb.key)
    } else {
        (a, ma.key)
    };
    for (&o, &s) in offs.iter().zip(sizes) {
        assert!(p.sim.node(src_node).mem.fill(src_key, o, s, &mut rng));
    }
    if op.consumes_recv() {
        for (i, (&o, &s)) in offs.iter().zip(sizes).enumerate() {
            let sges = if op == Op::WriteImm {
                SgeList::new()
            } else {
                split(mb, o, s, s / 2)
            };
            p.qp(b)
                .post_recv(RecvWqe::new(1000 + i as u64, sges))
                .unwrap();
        }
    }
    for (i, (&o, &s)) in offs.iter().zip(sizes).enumerate() {
        let inline = s <= MAX_INLINE && seed % 2 == 1 && op != Op::Read;
        let data = if inline {
            let bytes = p.sim.node(a).mem.bytes(ma.key).unwrap()[o..o + s].to_vec();
            SendData::Inline(InlineData::new(&bytes).unwrap())
        } else {
            SendData::Sges(split(ma, o, s, s / 3))
        };
        let raddr = mb.iova + o as u64;
        let wqe = match op {
            Op::Send => SendWqe::send(i as u64, data),
            Op::SendImm => SendWqe::send(i as u64, data).with_imm(0x1000_0000 + i as u32),
            Op::Write => SendWqe::write(i as u64, data, raddr, mb.key),
            Op::WriteImm => {
                SendWqe::write(i as u64, data, raddr, mb.key).with_imm(0x2000_0000 + i as u32)
            }
            Op::Read => SendWqe::read(i as u64, split(ma, o, s, s / 3), raddr, mb.key),
        };
        p.qp(a).post_send(wqe).unwrap();
    }
    let n = sizes.len();
    let want_b = if op.consumes_recv() { n } else { 0 };
    let out = p.sim.run_until(secs(600), |s| {
        s.node(a).completions.len() >= n && s.node(b).completions.len() >= want_b
    });
    assert_eq!(
        out,
        Outcome::Done,
        "{ctx}: {:?} {:?}\nA {:?}\nB {:?}",
        p.sim.node(a).completions.back(),
        p.sim.stats(),
        p.sim.node(a).qp(p.qa).counters(),
        p.sim.node(b).qp(p.qb).counters()
    );
    // Nothing else happens afterwards (no late error, no extra completion).
    assert_eq!(
        p.sim.run(p.sim.now() + Duration::from_secs(10)),
        Outcome::Quiescent,
        "{ctx}"
    );

    let ca = p.completions(a);
    assert_eq!(ca.len(), n, "{ctx}");
    let wc_op = match op {
        Op::Send | Op::SendImm => WcOpcode::Send,
        Op::Write | Op::WriteImm => WcOpcode::RdmaWrite,
        Op::Read => WcOpcode::RdmaRead,
    };
    for (i, c) in ca.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len, c.qp_num, c.queue()),
            (
                i as u64,
                WcStatus::Success,
                wc_op,
                sizes[i] as u32,
                p.qa,
                WorkQueue::Send
            ),
            "{ctx}: send completion {i}"
        );
    }
    let cb = p.completions(b);
    assert_eq!(cb.len(), want_b, "{ctx}");
    for (i, c) in cb.iter().enumerate() {
        let (opcode, imm) = match op {
            Op::SendImm => (WcOpcode::Recv, Some(0x1000_0000 + i as u32)),
            Op::WriteImm => (WcOpcode::RecvRdmaWithImm, Some(0x2000_0000 + i as u32)),
            _ => (WcOpcode::Recv, None),
        };
        assert_eq!(
            (
                c.wr_id,
                c.status,
                c.opcode,
                c.byte_len,
                c.qp_num,
                c.src_qp,
                c.imm,
                c.queue()
            ),
            (
                1000 + i as u64,
                WcStatus::Success,
                opcode,
                sizes[i] as u32,
                p.qb,
                p.qa,
                imm,
                WorkQueue::Recv
            ),
            "{ctx}: receive completion {i}"
        );
        assert_eq!(c.invalidated_rkey, None);
    }
    // Byte-exact data, and nothing written outside the messages.
    let da = p.sim.node(a).mem.bytes(ma.key).unwrap();
    let db = p.sim.node(b).mem.bytes(mb.key).unwrap();
    if op == Op::WriteImm || op == Op::Write || op.consumes_recv() || op == Op::Read {
        assert!(da == db, "{ctx}: data differs");
    }
    let dst = if op == Op::Read { da } else { db };
    let mut covered = vec![false; total];
    for (&o, &s) in offs.iter().zip(sizes) {
        covered[o..o + s].fill(true);
    }
    assert!(
        dst.iter().zip(&covered).all(|(&v, &c)| c || v == 0),
        "{ctx}: bytes outside the messages changed"
    );
    assert_eq!(
        (p.state(a), p.state(b)),
        (QpState::Rts, QpState::Rts),
        "{ctx}"
    );
    if polling && op != Op::Read && net.loss == 0.0 {
        assert!(
            p.sim.node(b).held_rounds() > 0,
            "{ctx}: the responder's polls held acknowledgements back"
        );
    }
}

fn sizes_for(mtu: Mtu, big: bool) -> Vec<usize> {
    let m = mtu.bytes() as usize;
    let mut v = vec![0, 1, 3, m - 1, m, m + 1, 5 * m + 3];
    if big {
        v.push(1 << 20);
    }
    v
}

const MTUS: [Mtu; 3] = [Mtu::Mtu256, Mtu::Mtu1024, Mtu::Mtu4096];

/// Every opcode × size (1 MiB included) × MTU at one fault rate, seeds 1–3.
fn matrix(p: f64) {
    for mtu in MTUS {
        for op in OPS {
            for seed in 1..=3u64 {
                run_case(op, mtu, NetConfig::faulty(p), seed, &sizes_for(mtu, true));
            }
        }
    }
}

/// The receive rounds of polling applications hold acknowledgements back for their next call
/// (`Engine::app_round`): every opcode still completes, byte-exact, with and without faults.
#[test]
fn polling_applications_hold_acknowledgements_and_lose_nothing() {
    for net in [
        NetConfig::ideal(),
        NetConfig::faulty(0.01),
        NetConfig::faulty(0.1),
    ] {
        for op in OPS {
            for seed in 1..=3u64 {
                for mtu in [Mtu::Mtu256, Mtu::Mtu4096] {
                    run_case_with(op, mtu, net, seed, &sizes_for(mtu, false), true);
                }
            }
        }
    }
}

/// A long READ reply leaves a budget of packets at a time (`TX_BUDGET`), taking turns with the
/// device's other queue pairs: a small WRITE on a second queue pair, posted after the READ and
/// taken in the same round, completes before the reply ends. Sent whole, the reply's thousands
/// of packets would leave ahead of the WRITE's acknowledgement.
#[test]
fn a_long_read_reply_is_sent_in_slices() {
    for seed in 1..=3u64 {
        let opts = ConnectOpts {
            mtu: Mtu::Mtu256,
            ..ConnectOpts::default()
        };
        let net = NetConfig {
            bits_per_sec: 1_000_000_000,
            ..NetConfig::ideal()
        };
        let mut sim = Sim::new(seed, net);
        let a = sim.add_node(ip(1), ChecksumCapabilities::default());
        let b = sim.add_node(ip(2), ChecksumCapabilities::default());
        let (qa1, _) = sim.connect(a, b, &opts);
        let (qa2, _) = sim.connect(a, b, &opts);
        // B takes the READ and the WRITE in one round.
        sim.node_mut(b).set_wakeup(Duration::from_micros(5));
        const LEN: usize = 1 << 20;
        let ma = sim.node_mut(a).mem.register(1, LEN + 64, Access::ALL);
        let mb = sim.node_mut(b).mem.register(1, LEN + 64, Access::ALL);
        sim.node(b).mem.fill(mb.key, 0, LEN, &mut Rng::new(seed));
        sim.node(a)
            .qp(qa1)
            .post_send(SendWqe::read(1, sgl(ma, 0, LEN), mb.iova, mb.key))
            .unwrap();
        sim.node(a)
            .qp(qa2)
            .post_send(SendWqe::write(
                2,
                SendData::Sges(sgl(ma, LEN, 8)),
                mb.iova + LEN as u64,
                mb.key,
            ))
            .unwrap();
        assert_eq!(sim.run_until_completions(a, 2, secs(60)), Outcome::Done);
        let order: Vec<_> = sim
            .node(a)
            .completions
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect();
        assert_eq!(
            order,
            [(2, WcStatus::Success), (1, WcStatus::Success)],
            "seed {seed}"
        );
        assert!(
            sim.node(a).mem.bytes(ma.key).unwrap()[..LEN]
                == sim.node(b).mem.bytes(mb.key).unwrap()[..LEN]
        );
    }
}

#[test]
fn every_opcode_size_and_mtu_without_faults() {
    matrix(0.0);
}

#[test]
fn every_opcode_size_and_mtu_at_1_percent_faults() {
    matrix(0.01);
}

#[test]
fn every_opcode_size_and_mtu_at_10_percent_faults() {
    matrix(0.10);
}

#[test]
fn every_opcode_size_and_mtu_at_30_percent_faults() {
    matrix(0.30);
}

#[test]
fn every_opcode_size_and_mtu_at_0_1_percent_faults() {
    matrix(0.001);
}

/// Each fault on its own (loss, reordering, duplication, corruption) at 0.1%, 1%, 10% and 30%:
/// every opcode and size at MTU 256 and 4096 completes with its data intact.
#[test]
fn each_fault_alone_from_0_1_to_30_percent() {
    let alone: [fn(f64) -> NetConfig; 4] = [
        NetConfig::lossy,
        |p| NetConfig {
            reorder: p,
            ..NetConfig::ideal()
        },
        |p| NetConfig {
            duplicate: p,
            ..NetConfig::ideal()
        },
        |p| NetConfig {
            corrupt: p,
            ..NetConfig::ideal()
        },
    ];
    for p in [0.001, 0.01, 0.1, 0.3] {
        for net in alone.map(|f| f(p)) {
            for mtu in [Mtu::Mtu256, Mtu::Mtu4096] {
                for op in OPS {
                    run_case(op, mtu, net, 7, &sizes_for(mtu, false));
                }
            }
        }
    }
}

/// Pure loss at 30%: every opcode, size and MTU.
#[test]
fn every_opcode_under_30_percent_loss() {
    for mtu in MTUS {
        for op in OPS {
            for seed in 1..=2u64 {
                run_case(
                    op,
                    mtu,
                    NetConfig::lossy(0.3),
                    seed,
                    &sizes_for(mtu, seed == 1),
                );
            }
        }
    }
}

/// Loss, reordering, duplication and corruption each at 20% at once (a datagram survives loss
/// and corruption only 64% of the time).
#[test]
fn every_opcode_with_every_fault_at_20_percent() {
    for mtu in MTUS {
        for op in OPS {
            for seed in 1..=2u64 {
                run_case(
                    op,
                    mtu,
                    NetConfig::each_fault(0.2),
                    seed,
                    &sizes_for(mtu, seed == 1 && mtu == Mtu::Mtu256),
                );
            }
        }
    }
}

/// Compare-and-swap and fetch-and-add chains: every result is the value before, applied once
/// however often the network repeats the request.
fn run_atomics(mtu: Mtu, net: NetConfig, seed: u64) {
    let ctx = format!(
        "atomics mtu {} loss {:.3} seed {seed}",
        mtu.bytes(),
        net.loss
    );
    let mut rng = Rng::new(seed);
    let (psn_a, psn_b) = psns(&mut rng, seed);
    let opts = ConnectOpts {
        mtu,
        psn_a,
        psn_b,
        max_rd_atomic: 4,
        max_dest_rd_atomic: 4,
        ..ConnectOpts::default()
    };
    let mut p = Pair::new(seed, net, &opts);
    let (a, b) = (p.a, p.b);
    let n = 40usize;
    let ma = p.sim.node_mut(a).mem.register(1, 8 * n, Access::ALL);
    let mb = p.sim.node_mut(b).mem.register(1, 64, Access::ALL);
    let start = rng.next_u64();
    p.sim.node(b).mem.write(mb.key, 8, &start.to_ne_bytes());
    let mut value = start;
    let mut want = Vec::new();
    for i in 0..n {
        let result = Sge::new(ma.iova + 8 * i as u64, 8, ma.key);
        let target = mb.iova + 8;
        let wqe = if i % 2 == 0 {
            let add = rng.next_u64() >> 8;
            want.push(value);
            value = value.wrapping_add(add);
            SendWqe::fetch_add(i as u64, result, target, mb.key, add)
        } else if i % 4 == 1 {
            let swap = rng.next_u64();
            want.push(value);
            value = swap;
            SendWqe::compare_swap(i as u64, result, target, mb.key, want[i], swap)
        } else {
            // A compare that fails leaves the value.
            want.push(value);
            SendWqe::compare_swap(i as u64, result, target, mb.key, value ^ 1, 0)
        };
        p.qp(a).post_send(wqe).unwrap();
    }
    assert_eq!(
        p.sim.run_until_completions(a, n, secs(600)),
        Outcome::Done,
        "{ctx}"
    );
    let cs = p.completions(a);
    for (i, c) in cs.iter().enumerate() {
        let opcode = if i % 2 == 0 {
            WcOpcode::FetchAdd
        } else {
            WcOpcode::CompSwap
        };
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (i as u64, WcStatus::Success, opcode, 8),
            "{ctx}"
        );
    }
    let got = p.sim.node(a).mem.bytes(ma.key).unwrap();
    for (i, w) in want.iter().enumerate() {
        assert_eq!(
            u64::from_ne_bytes(got[8 * i..8 * i + 8].try_into().unwrap()),
            *w,
            "{ctx}: result {i}"
        );
    }
    let word = p.sim.node(b).mem.bytes(mb.key).unwrap();
    assert_eq!(
        u64::from_ne_bytes(word[8..16].try_into().unwrap()),
        value,
        "{ctx}: final value"
    );
    assert!(
        word[..8].iter().chain(&word[16..]).all(|&x| x == 0),
        "{ctx}: neighbours untouched"
    );
}

#[test]
fn atomics_under_every_fault_level() {
    for mtu in MTUS {
        for p in [0.0, 0.01, 0.1, 0.3] {
            for seed in 1..=3u64 {
                run_atomics(mtu, NetConfig::faulty(p), seed);
            }
        }
        run_atomics(mtu, NetConfig::lossy(0.3), 4);
        run_atomics(mtu, NetConfig::each_fault(0.2), 5);
    }
}

/// A peer that stops answering: the oldest request fails with RETRY_EXC_ERR after exactly
/// `retry_cnt` retries, i.e. within `timeout · (retry_cnt + 1)`, and everything else queued on
/// the queue pair is flushed.
fn retry_exhaustion(retry_cnt: u8, timeout: u8, vanish: bool) {
    let ctx = format!("retry_cnt {retry_cnt} timeout {timeout} vanish {vanish}");
    let opts = ConnectOpts {
        retry_cnt,
        timeout,
        ..ConnectOpts::default()
    };
    let mut p = Pair::new(7, NetConfig::ideal(), &opts);
    let (a, b) = (p.a, p.b);
    let ma = p.sim.node_mut(a).mem.register(1, 4096, Access::ALL);
    let mb = p.sim.node_mut(b).mem.register(1, 4096, Access::ALL);
    // One request completes first, so the failure happens mid-stream.
    p.qp(a)
        .post_send(SendWqe::write(
            100,
            SendData::Sges(sgl(ma, 0, 100)),
            mb.iova,
            mb.key,
        ))
        .unwrap();
    assert_eq!(p.sim.run_until_completions(a, 1, secs(1)), Outcome::Done);
    assert!(p.completions(a)[0].is_ok());
    if vanish {
        p.sim.node_mut(b).down = true;
    } else {
        p.sim.set_net(NetConfig::lossy(1.0));
    }
    p.qp(a)
        .post_recv(RecvWqe::new(50, sgl(ma, 2048, 100)))
        .unwrap();
    p.qp(a)
        .post_recv(RecvWqe::new(51, sgl(ma, 2148, 100)))
        .unwrap();
    let t0 = p.sim.now();
    let wqes = [
        SendWqe::send(0, SendData::Sges(sgl(ma, 0, 3000))),
        SendWqe::write(1, SendData::Sges(sgl(ma, 0, 10)), mb.iova, mb.key),
        SendWqe::read(2, sgl(ma, 100, 10), mb.iova, mb.key),
        SendWqe::fetch_add(3, Sge::new(ma.iova + 1024, 8, ma.key), mb.iova, mb.key, 1),
        SendWqe::send(4, SendData::Sges(sgl(ma, 0, 1))).with_flags(SendFlags::empty()),
    ];
    for w in wqes {
        p.qp(a).post_send(w).unwrap();
    }
    assert_eq!(
        p.sim.run_until_completions(a, 7, secs(3600)),
        Outcome::Done,
        "{ctx}"
    );
    let failed_at = p.sim.now() - t0;
    let t = ack_timeout(timeout).unwrap();
    let bound = t * (u32::from(retry_cnt) + 1);
    assert!(
        failed_at >= bound && failed_at <= bound + Duration::from_micros(10),
        "{ctx}: failed after {failed_at:?}, bound {bound:?}"
    );
    let cs = p.completions(a);
    let sends: Vec<_> = cs
        .iter()
        .filter(|c| c.queue() == WorkQueue::Send)
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        sends,
        [
            (0, WcStatus::RetryExcErr),
            (1, WcStatus::WrFlushErr),
            (2, WcStatus::WrFlushErr),
            (3, WcStatus::WrFlushErr),
            (4, WcStatus::WrFlushErr) // unsignaled, but flushed requests always complete
        ],
        "{ctx}"
    );
    let recvs: Vec<_> = cs
        .iter()
        .filter(|c| c.queue() == WorkQueue::Recv)
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        recvs,
        [(50, WcStatus::WrFlushErr), (51, WcStatus::WrFlushErr)],
        "{ctx}"
    );
    assert_eq!(p.state(a), QpState::Err);
    let c = p.sim.node(a).qp(p.qa).counters().clone();
    assert_eq!(
        c.timeouts,
        u64::from(retry_cnt),
        "{ctx}: one retry per timeout"
    );
    // After ERR nothing is sent and new requests complete flushed at once.
    p.qp(a)
        .post_send(SendWqe::send(9, SendData::Sges(sgl(ma, 0, 1))))
        .unwrap();
    p.sim.run(p.sim.now());
    let flushed: Vec<_> = p
        .completions(a)
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(flushed, [(9, WcStatus::WrFlushErr)]);
    let sent = p.sim.stats().sent;
    assert_eq!(
        p.sim.run(p.sim.now() + Duration::from_secs(10)),
        Outcome::Quiescent
    );
    assert_eq!(
        p.sim.stats().sent,
        sent,
        "{ctx}: an ERR queue pair sends nothing"
    );
}

#[test]
fn vanished_peer_fails_in_bounded_time() {
    for (retry_cnt, timeout) in [(0, 8), (1, 10), (3, 12), (7, 14)] {
        retry_exhaustion(retry_cnt, timeout, true);
    }
}

#[test]
fn total_loss_fails_in_bounded_time() {
    for (retry_cnt, timeout) in [(0, 10), (2, 8), (7, 12)] {
        retry_exhaustion(retry_cnt, timeout, false);
    }
}

#[test]
fn timeout_zero_never_retries() {
    let opts = ConnectOpts {
        timeout: 0,
        ..ConnectOpts::default()
    };
    let mut p = Pair::new(1, NetConfig::ideal(), &opts);
    let (a, b) = (p.a, p.b);
    let ma = p.sim.node_mut(a).mem.register(1, 64, Access::ALL);
    p.sim.node_mut(b).down = true;
    p.qp(a)
        .post_send(SendWqe::send(1, SendData::Sges(sgl(ma, 0, 8))))
        .unwrap();
    // Quiescent: no timer is armed, so nothing will ever be retried.
    assert_eq!(p.sim.run(secs(100)), Outcome::Quiescent);
    assert!(p.completions(a).is_empty());
    assert_eq!(p.state(a), QpState::Rts);
}

#[test]
fn rnr_with_finite_retries_fails() {
    for (rnr_retry, op) in [(0u8, Op::Send), (3, Op::Send), (5, Op::WriteImm)] {
        let opts = ConnectOpts {
            rnr_retry,
            min_rnr_timer: 5,
            mtu: Mtu::Mtu256,
            ..ConnectOpts::default()
        };
        let mut p = Pair::new(2, NetConfig::ideal(), &opts);
        let (a, b) = (p.a, p.b);
        let ma = p.sim.node_mut(a).mem.register(1, 4096, Access::ALL);
        let mb = p.sim.node_mut(b).mem.register(1, 4096, Access::ALL);
        let data = SendData::Sges(sgl(ma, 0, 1000));
        let wqe = match op {
            Op::Send => SendWqe::send(1, data),
            _ => SendWqe::write(1, data, mb.iova, mb.key).with_imm(5),
        };
        p.qp(a).post_send(wqe).unwrap();
        p.qp(a)
            .post_send(SendWqe::send(2, SendData::Sges(sgl(ma, 0, 10))))
            .unwrap();
        let t0 = p.sim.now();
        assert_eq!(p.sim.run_until_completions(a, 2, secs(60)), Outcome::Done);
        let cs: Vec<_> = p
            .completions(a)
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect();
        assert_eq!(
            cs,
            [(1, WcStatus::RnrRetryExcErr), (2, WcStatus::WrFlushErr)],
            "rnr_retry {rnr_retry} {op:?}"
        );
        let sent = p.sim.node(b).qp(p.qb).counters().rnr_naks_sent;
        assert_eq!(sent, u64::from(rnr_retry) + 1, "one RNR NAK per try");
        // Each retry waited the RNR timer (code 5 = 60 µs).
        assert!(p.sim.now() - t0 >= Duration::from_micros(60) * u32::from(rnr_retry));
        assert_eq!((p.state(a), p.state(b)), (QpState::Err, QpState::Rts));
    }
}

#[test]
fn rnr_retry_7_waits_for_a_receive() {
    for op in [Op::Send, Op::SendImm, Op::WriteImm] {
        let opts = ConnectOpts {
            rnr_retry: 7,
            min_rnr_timer: 3,
            mtu: Mtu::Mtu256,
            ..ConnectOpts::default()
        };
        let mut p = Pair::new(3, NetConfig::faulty(0.05), &opts);
        let (a, b) = (p.a, p.b);
        let ma = p.sim.node_mut(a).mem.register(1, 4096, Access::ALL);
        let mb = p.sim.node_mut(b).mem.register(1, 4096, Access::ALL);
        p.sim.node(a).mem.fill(ma.key, 0, 4096, &mut Rng::new(1));
        let data = SendData::Sges(sgl(ma, 0, 1500));
        let wqe = match op {
            Op::Send => SendWqe::send(1, data),
            Op::SendImm => SendWqe::send(1, data).with_imm(77),
            _ => SendWqe::write(1, data, mb.iova, mb.key).with_imm(77),
        };
        p.qp(a).post_send(wqe).unwrap();
        // 20 ms of RNR NAKs (every 30 µs): no completion, no error.
        assert_eq!(
            p.sim.run(Instant::from_nanos(20_000_000)),
            Outcome::Deadline
        );
        assert!(p.completions(a).is_empty());
        assert!(
            p.sim.node(b).qp(p.qb).counters().rnr_naks_sent > 100,
            "{op:?}"
        );
        let recv = if op == Op::WriteImm {
            SgeList::new()
        } else {
            sgl(mb, 0, 4096)
        };
        p.qp(b).post_recv(RecvWqe::new(5, recv)).unwrap();
        assert_eq!(p.sim.run_until_completions(a, 1, secs(10)), Outcome::Done);
        assert!(p.completions(a)[0].is_ok(), "{op:?}");
        assert_eq!(p.sim.run_until_completions(b, 1, secs(10)), Outcome::Done);
        let cb = p.completions(b);
        assert_eq!(
            (cb[0].wr_id, cb[0].status, cb[0].byte_len),
            (5, WcStatus::Success, 1500),
            "{op:?}"
        );
        assert_eq!(
            &p.sim.node(a).mem.bytes(ma.key).unwrap()[..1500],
            &p.sim.node(b).mem.bytes(mb.key).unwrap()[..1500]
        );
    }
}

/// What a hostile or mistaken request does: the requester's status, the responder's state, and
/// the responder's memory must be exactly as before.
struct Hostile {
    name: &'static str,
    access: Access,
    mr_access: Access,
    mr_pd: u32,
    wqe: fn(MrInfo, MrInfo) -> SendWqe,
    status: WcStatus,
}

#[test]
fn hostile_requests_are_refused_and_touch_nothing() {
    let cases = [
        Hostile {
            name: "wrong rkey",
            access: Access::ALL,
            mr_access: Access::ALL,
            mr_pd: 1,
            wqe: |ma, mb| SendWqe::write(1, SendData::Sges(sgl(ma, 0, 100)), mb.iova, mb.key + 1),
            status: WcStatus::RemAccessErr,
        },
        Hostile {
            name: "write past the end",
            access: Access::ALL,
            mr_access: Access::ALL,
            mr_pd: 1,
            wqe: |ma, mb| {
                SendWqe::write(
                    1,
                    SendData::Sges(sgl(ma, 0, 100)),
                    mb.iova + mb.len - 10,
                    mb.key,
                )
            },
            status: WcStatus::RemAccessErr,
        },
        Hostile {
            name: "write before the start",
            access: Access::ALL,
            mr_access: Access::ALL,
            mr_pd: 1,
            wqe: |ma, mb| SendWqe::write(1, SendData::Sges(sgl(ma, 0, 100)), mb.iova - 1, mb.key),
            status: WcStatus::RemAccessErr,
        },
        Hostile {
            name: "multi-packet write past the end",
            access: Access::ALL,
            mr_access: Access::ALL,
            mr_pd: 1,
            wqe: |ma, mb| {
                SendWqe::write(
                    1,
                    SendData::Sges(sgl(ma, 0, 3000)),
                    mb.iova + mb.len - 2999,
                    mb.key,
                )
            },
            status: WcStatus::RemAccessErr,
        },
        Hostile {
            name: "read past the end",
            access: Access::ALL,
            mr_access: Access::ALL,
            mr_pd: 1,
            wqe: |ma, mb| SendWqe::read(1, sgl(ma, 0, 100), mb.iova + mb.len - 50, mb.key),
            status: WcStatus::RemAccessErr,
        },
        Hostile {
            name: "region without REMOTE_WRITE",
            access: Access::ALL,
            mr_access: Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            mr_pd: 1,
            wqe: |ma, mb| SendWqe::write(1, SendData::Sges(sgl(ma, 0, 8)), mb.iova, mb.key),
            status: WcStatus::RemAccessErr,
        },
        Hostile {
            name: "region without REMOTE_READ",
            access: Access::ALL,
            mr_access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            mr_pd: 1,
            wqe: |ma, mb| SendWqe::read(1, sgl(ma, 0, 8), mb.iova, mb.key),
            status: WcStatus::RemAccessErr,
        },
        Hostile {
            name: "region without REMOTE_ATOMIC",
            access: Access::ALL,
            mr_access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            mr_pd: 1,
            wqe: |ma, mb| SendWqe::fetch_add(1, Sge::new(ma.iova, 8, ma.key), mb.iova, mb.key, 1),
            status: WcStatus::RemAccessErr,
        },
        Hostile {
            name: "queue pair without REMOTE_WRITE",
            access: Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            mr_access: Access::ALL,
            mr_pd: 1,
            wqe: |ma, mb| SendWqe::write(1, SendData::Sges(sgl(ma, 0, 8)), mb.iova, mb.key),
            status: WcStatus::RemInvReqErr,
        },
        Hostile {
            name: "queue pair without REMOTE_READ",
            access: Access::REMOTE_WRITE,
            mr_access: Access::ALL,
            mr_pd: 1,
            wqe: |ma, mb| SendWqe::read(1, sgl(ma, 0, 8), mb.iova, mb.key),
            status: WcStatus::RemInvReqErr,
        },
        Hostile {
            name: "unaligned atomic",
            access: Access::ALL,
            mr_access: Access::ALL,
            mr_pd: 1,
            wqe: |ma, mb| {
                SendWqe::compare_swap(1, Sge::new(ma.iova, 8, ma.key), mb.iova + 4, mb.key, 0, 1)
            },
            status: WcStatus::RemInvReqErr,
        },
        Hostile {
            name: "region of another protection domain",
            access: Access::ALL,
            mr_access: Access::ALL,
            mr_pd: 2,
            wqe: |ma, mb| SendWqe::write(1, SendData::Sges(sgl(ma, 0, 8)), mb.iova, mb.key),
            status: WcStatus::RemAccessErr,
        },
        Hostile {
            name: "atomic on another protection domain",
            access: Access::ALL,
            mr_access: Access::ALL,
            mr_pd: 2,
            wqe: |ma, mb| SendWqe::fetch_add(1, Sge::new(ma.iova, 8, ma.key), mb.iova, mb.key, 1),
            status: WcStatus::RemAccessErr,
        },
    ];
    for (i, h) in cases.iter().enumerate() {
        let opts = ConnectOpts {
            access: h.access,
            mtu: Mtu::Mtu1024,
            ..ConnectOpts::default()
        };
        let mut p = Pair::new(10 + i as u64, NetConfig::ideal(), &opts);
        let (a, b) = (p.a, p.b);
        let ma = p.sim.node_mut(a).mem.register(1, 4096, Access::ALL);
        let before = p.sim.node_mut(b).mem.register(1, 64, Access::ALL);
        let mb = p.sim.node_mut(b).mem.register(h.mr_pd, 1000, h.mr_access);
        let after = p.sim.node_mut(b).mem.register(1, 64, Access::ALL);
        p.sim.node(a).mem.fill(ma.key, 0, 4096, &mut Rng::new(5));
        for (k, m) in [before, mb, after].iter().enumerate() {
            let fill = vec![0xA0 + k as u8; m.len as usize];
            p.sim.node(b).mem.write(m.key, 0, &fill);
        }
        p.qp(b)
            .post_recv(RecvWqe::new(77, sgl(after, 0, 64)))
            .unwrap();
        let a_before = p.sim.node(a).mem.bytes(ma.key).unwrap().to_vec();
        p.qp(a).post_send((h.wqe)(ma, mb)).unwrap();
        p.qp(a)
            .post_send(SendWqe::send(2, SendData::Sges(sgl(ma, 0, 1))))
            .unwrap();
        assert_eq!(
            p.sim.run_until_completions(a, 2, secs(10)),
            Outcome::Done,
            "{}",
            h.name
        );
        let cs: Vec<_> = p
            .completions(a)
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect();
        assert_eq!(cs, [(1, h.status), (2, WcStatus::WrFlushErr)], "{}", h.name);
        assert_eq!(
            (p.state(a), p.state(b)),
            (QpState::Err, QpState::Err),
            "{}: both sides stop",
            h.name
        );
        for (k, m) in [before, mb, after].iter().enumerate() {
            assert!(
                p.sim
                    .node(b)
                    .mem
                    .bytes(m.key)
                    .unwrap()
                    .iter()
                    .all(|&x| x == 0xA0 + k as u8),
                "{}: responder memory changed",
                h.name
            );
        }
        assert_eq!(
            p.sim.node(a).mem.bytes(ma.key).unwrap(),
            &a_before[..],
            "{}: requester buffer changed",
            h.name
        );
        // The responder's receive is flushed, not consumed.
        let cb: Vec<_> = p
            .completions(b)
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect();
        assert_eq!(cb, [(77, WcStatus::WrFlushErr)], "{}", h.name);
    }
}

#[test]
fn send_larger_than_the_receive_buffer() {
    let mut p = Pair::new(
        1,
        NetConfig::ideal(),
        &ConnectOpts {
            mtu: Mtu::Mtu256,
            ..ConnectOpts::default()
        },
    );
    let (a, b) = (p.a, p.b);
    let ma = p.sim.node_mut(a).mem.register(1, 4096, Access::ALL);
    let mb = p.sim.node_mut(b).mem.register(1, 4096, Access::ALL);
    p.qp(b).post_recv(RecvWqe::new(7, sgl(mb, 0, 600))).unwrap();
    p.qp(b)
        .post_recv(RecvWqe::new(8, sgl(mb, 1000, 600)))
        .unwrap();
    p.qp(a)
        .post_send(SendWqe::send(1, SendData::Sges(sgl(ma, 0, 601))))
        .unwrap();
    assert_eq!(p.sim.run_until_completions(a, 1, secs(10)), Outcome::Done);
    assert_eq!(p.completions(a)[0].status, WcStatus::RemInvReqErr);
    let cb: Vec<_> = p
        .completions(b)
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(cb, [(7, WcStatus::LocLenErr), (8, WcStatus::WrFlushErr)]);
    assert!(
        p.sim.node(b).mem.bytes(mb.key).unwrap()[600..]
            .iter()
            .all(|&x| x == 0),
        "nothing past the buffer"
    );
}

#[test]
fn local_protection_errors() {
    type Make = fn(MrInfo, MrInfo, MrInfo) -> SendWqe;
    let cases: [(&str, Make, WcStatus); 5] = [
        (
            "unknown lkey",
            |ma, _, _| {
                SendWqe::send(
                    1,
                    SendData::Sges(
                        SgeList::from_slice(&[Sge::new(ma.iova, 8, 0x00de_ad00)]).unwrap(),
                    ),
                )
            },
            WcStatus::LocProtErr,
        ),
        (
            "source past its region",
            |ma, _, _| SendWqe::send(1, SendData::Sges(sgl(ma, 4000, 200))),
            WcStatus::LocProtErr,
        ),
        (
            "source in another protection domain",
            |_, other, _| SendWqe::send(1, SendData::Sges(sgl(other, 0, 8))),
            WcStatus::LocProtErr,
        ),
        (
            "read into a region without LOCAL_WRITE",
            |_, _, mb| SendWqe::read(1, sgl(mb, 0, 8), 0, 0),
            WcStatus::LocProtErr,
        ),
        (
            "atomic result past its region",
            |ma, _, _| SendWqe::fetch_add(1, Sge::new(ma.iova + 4092, 8, ma.key), 0, 0, 1),
            WcStatus::LocProtErr,
        ),
    ];
    for (name, make, status) in cases {
        let mut p = Pair::new(1, NetConfig::ideal(), &ConnectOpts::default());
        let a = p.a;
        let ma = p.sim.node_mut(a).mem.register(1, 4096, Access::ALL);
        let other = p.sim.node_mut(a).mem.register(2, 64, Access::ALL);
        let ro = p.sim.node_mut(a).mem.register(1, 64, Access::REMOTE_READ);
        p.qp(a).post_recv(RecvWqe::new(50, sgl(ma, 0, 8))).unwrap();
        p.qp(a).post_send(make(ma, other, ro)).unwrap();
        p.qp(a)
            .post_send(SendWqe::send(2, SendData::Sges(sgl(ma, 0, 8))))
            .unwrap();
        assert_eq!(
            p.sim.run_until_completions(a, 3, secs(10)),
            Outcome::Done,
            "{name}"
        );
        // In order within each queue; the queues' completions interleave as the device
        // produced them (the flush of the receive queue came with the failure).
        let cs = p.completions(a);
        let of = |q| -> Vec<_> {
            cs.iter()
                .filter(|c| c.queue() == q)
                .map(|c| (c.wr_id, c.status))
                .collect()
        };
        assert_eq!(
            of(WorkQueue::Send),
            [(1, status), (2, WcStatus::WrFlushErr)],
            "{name}"
        );
        assert_eq!(of(WorkQueue::Recv), [(50, WcStatus::WrFlushErr)], "{name}");
        assert_eq!(p.state(a), QpState::Err, "{name}");
        assert_eq!(p.sim.stats().sent, 0, "{name}: nothing reached the wire");
    }
}

#[test]
fn fence_waits_for_earlier_reads() {
    for fenced in [true, false] {
        let mut p = Pair::new(
            4,
            NetConfig::ideal(),
            &ConnectOpts {
                mtu: Mtu::Mtu256,
                ..ConnectOpts::default()
            },
        );
        let (a, b) = (p.a, p.b);
        let ma = p.sim.node_mut(a).mem.register(1, 8192, Access::ALL);
        let mb = p.sim.node_mut(b).mem.register(1, 8192, Access::ALL);
        p.sim.node(a).mem.write(ma.key, 4096, &[0xEE; 4096]);
        p.sim.node(b).mem.write(mb.key, 0, &[0x11; 8192]);
        // READ 4 KiB, then WRITE over the same remote bytes.
        p.qp(a)
            .post_send(SendWqe::read(1, sgl(ma, 0, 4096), mb.iova, mb.key))
            .unwrap();
        let w = SendWqe::write(2, SendData::Sges(sgl(ma, 4096, 4096)), mb.iova, mb.key);
        let flags = if fenced {
            SendFlags::SIGNALED | SendFlags::FENCE
        } else {
            SendFlags::SIGNALED
        };
        p.qp(a).post_send(w.with_flags(flags)).unwrap();
        assert_eq!(p.sim.run_until_completions(a, 2, secs(10)), Outcome::Done);
        assert!(p.completions(a).iter().all(Completion::is_ok));
        let read = &p.sim.node(a).mem.bytes(ma.key).unwrap()[..4096];
        if fenced {
            assert!(
                read.iter().all(|&x| x == 0x11),
                "the fenced WRITE waited for the READ"
            );
        }
        // Unfenced, IBTA lets the WRITE overtake the READ's data but does not require it.
        let wrote = &p.sim.node(b).mem.bytes(mb.key).unwrap()[..4096];
        assert!(wrote.iter().all(|&x| x == 0xEE));
    }
}

#[test]
fn initiator_depth_is_respected() {
    let opts = ConnectOpts {
        max_rd_atomic: 2,
        max_dest_rd_atomic: 2,
        mtu: Mtu::Mtu256,
        ..ConnectOpts::default()
    };
    let mut p = Pair::new(5, NetConfig::ideal(), &opts);
    let (a, b) = (p.a, p.b);
    let ma = p.sim.node_mut(a).mem.register(1, 64 * 1024, Access::ALL);
    let mb = p.sim.node_mut(b).mem.register(1, 64 * 1024, Access::ALL);
    p.sim
        .node(b)
        .mem
        .fill(mb.key, 0, 64 * 1024, &mut Rng::new(8));
    for i in 0..16u64 {
        let off = i as usize * 4096;
        p.qp(a)
            .post_send(SendWqe::read(
                i,
                sgl(ma, off, 4096),
                mb.iova + off as u64,
                mb.key,
            ))
            .unwrap();
    }
    assert_eq!(p.sim.run_until_completions(a, 16, secs(10)), Outcome::Done);
    assert!(p.completions(a).iter().all(Completion::is_ok));
    assert!(p.sim.node(a).mem.bytes(ma.key) == p.sim.node(b).mem.bytes(mb.key));
    let cb = p.sim.node(b).qp(p.qb).counters().clone();
    assert_eq!(
        cb.drops.get(DropReason::ResponderBusy),
        0,
        "never more than 2 outstanding"
    );
    assert_eq!(p.sim.node(a).qp(p.qa).counters().retries, 0);
}

#[test]
fn a_peer_exceeding_our_responder_depth_still_completes() {
    let opts = ConnectOpts {
        max_rd_atomic: 16,
        max_dest_rd_atomic: 1,
        mtu: Mtu::Mtu256,
        ..ConnectOpts::default()
    };
    let mut p = Pair::new(6, NetConfig::ideal(), &opts);
    let (a, b) = (p.a, p.b);
    // B's engine notices arrivals a little late, so READs come in batches and find the one
    // responder resource busy.
    p.sim.node_mut(b).set_wakeup(Duration::from_micros(2));
    let ma = p.sim.node_mut(a).mem.register(1, 16 * 1024, Access::ALL);
    let mb = p.sim.node_mut(b).mem.register(1, 16 * 1024, Access::ALL);
    p.sim
        .node(b)
        .mem
        .fill(mb.key, 0, 16 * 1024, &mut Rng::new(9));
    for i in 0..16u64 {
        let off = i as usize * 1024;
        p.qp(a)
            .post_send(SendWqe::read(
                i,
                sgl(ma, off, 1024),
                mb.iova + off as u64,
                mb.key,
            ))
            .unwrap();
    }
    assert_eq!(p.sim.run_until_completions(a, 16, secs(60)), Outcome::Done);
    assert!(p.completions(a).iter().all(Completion::is_ok));
    assert!(p.sim.node(a).mem.bytes(ma.key) == p.sim.node(b).mem.bytes(mb.key));
    assert!(
        p.sim
            .node(b)
            .qp(p.qb)
            .counters()
            .drops
            .get(DropReason::ResponderBusy)
            > 0
    );
}

/// The engine's regions are registered ones (`reg_mr`), which a peer cannot invalidate: IBTA
/// reserves remote invalidation for memory windows and fast-registered regions, and rxe refuses
/// it the same way. The SEND is acknowledged, its receive completes with `REM_INV_REQ_ERR`, the
/// key stays valid and the responder moves to ERR. (The protocol's invalidation itself is tested
/// over memory that allows it, in `proto::tests`.)
#[test]
fn send_with_invalidate_of_a_registered_region_is_refused_as_rxe_refuses_it() {
    let mut p = Pair::new(7, NetConfig::ideal(), &ConnectOpts::default());
    let (a, b) = (p.a, p.b);
    let ma = p.sim.node_mut(a).mem.register(1, 64, Access::ALL);
    let mb = p.sim.node_mut(b).mem.register(1, 64, Access::ALL);
    let victim = p.sim.node_mut(b).mem.register(1, 64, Access::ALL);
    p.qp(b).post_recv(RecvWqe::new(1, sgl(mb, 0, 64))).unwrap();
    p.qp(a)
        .post_send(SendWqe::send(2, SendData::Sges(sgl(ma, 0, 8))).with_invalidate(victim.key))
        .unwrap();
    assert_eq!(p.sim.run_until_completions(b, 1, secs(10)), Outcome::Done);
    let cb = p.completions(b);
    assert_eq!(
        (cb[0].status, cb[0].invalidated_rkey),
        (WcStatus::RemInvReqErr, None)
    );
    assert!(p.sim.node(b).mem.is_valid(victim.key));
    assert_eq!(p.state(b), QpState::Err);
    assert_eq!(p.sim.run_until_completions(a, 1, secs(10)), Outcome::Done);
    assert_eq!(p.completions(a)[0].status, WcStatus::Success);
}

#[test]
fn invalidating_a_key_of_another_domain_fails_the_receive() {
    let mut p = Pair::new(7, NetConfig::ideal(), &ConnectOpts::default());
    let (a, b) = (p.a, p.b);
    let ma = p.sim.node_mut(a).mem.register(1, 64, Access::ALL);
    let mb = p.sim.node_mut(b).mem.register(1, 64, Access::ALL);
    let foreign = p.sim.node_mut(b).mem.register(2, 64, Access::ALL);
    p.qp(b).post_recv(RecvWqe::new(1, sgl(mb, 0, 64))).unwrap();
    p.qp(a)
        .post_send(SendWqe::send(2, SendData::Sges(sgl(ma, 0, 8))).with_invalidate(foreign.key))
        .unwrap();
    assert_eq!(p.sim.run_until_completions(b, 1, secs(10)), Outcome::Done);
    let cb = p.completions(b);
    assert_eq!(
        (cb[0].status, cb[0].invalidated_rkey),
        (WcStatus::RemInvReqErr, None)
    );
    assert!(p.sim.node(b).mem.is_valid(foreign.key));
    assert_eq!(p.state(b), QpState::Err);
    // The message itself was acknowledged before the responder stopped.
    assert_eq!(p.sim.run_until_completions(a, 1, secs(10)), Outcome::Done);
    assert_eq!(p.completions(a)[0].status, WcStatus::Success);
}

#[test]
fn signaling_and_solicited_events() {
    let mut p = Pair::new(8, NetConfig::ideal(), &ConnectOpts::default());
    let (a, b) = (p.a, p.b);
    let ma = p.sim.node_mut(a).mem.register(1, 64, Access::ALL);
    let mb = p.sim.node_mut(b).mem.register(1, 256, Access::ALL);
    for i in 0..3 {
        p.qp(b)
            .post_recv(RecvWqe::new(i, sgl(mb, 64 * i as usize, 64)))
            .unwrap();
    }
    let d = || SendData::Sges(sgl(ma, 0, 8));
    p.qp(a)
        .post_send(SendWqe::send(0, d()).with_flags(SendFlags::empty()))
        .unwrap();
    p.qp(a)
        .post_send(SendWqe::send(1, d()).with_flags(SendFlags::SIGNALED | SendFlags::SOLICITED))
        .unwrap();
    p.qp(a)
        .post_send(
            SendWqe::write(2, d(), mb.iova + 200, mb.key)
                .with_imm(9)
                .with_flags(SendFlags::SOLICITED),
        )
        .unwrap();
    assert_eq!(p.sim.run(secs(10)), Outcome::Quiescent);
    let ca: Vec<_> = p.completions(a).iter().map(|c| c.wr_id).collect();
    assert_eq!(ca, [1], "only the signaled request completes");
    let cb: Vec<_> = p
        .completions(b)
        .iter()
        .map(|c| (c.wr_id, c.solicited, c.imm))
        .collect();
    assert_eq!(cb, [(0, false, None), (1, true, None), (2, true, Some(9))]);
}

/// Both directions at once, two queue-pair pairs per device, random opcodes (atomics too) and
/// sizes, half the receives posted late (RNR), faults.
#[test]
fn bidirectional_soak_with_two_queue_pairs() {
    soak_with(1..=6, NetConfig::faulty(0.1));
    soak_with(7..=8, NetConfig::lossy(0.3));
}

fn soak_with(seeds: std::ops::RangeInclusive<u64>, net: NetConfig) {
    const SLOT: usize = 20_000;
    const N: usize = 24;
    for seed in seeds {
        let mut sim = Sim::new(seed, net);
        let a = sim.add_node(ip(1), ChecksumCapabilities::default());
        let b = sim.add_node(ip(2), ChecksumCapabilities::default());
        let mut rng = Rng::new(seed);
        let mtus = [MTUS[rng.below(3) as usize], Mtu::Mtu512, Mtu::Mtu2048];
        let links: Vec<(u32, u32)> = mtus[..2]
            .iter()
            .map(|&mtu| {
                let (psn_a, psn_b) = psns(&mut rng, seed);
                let depth = 1 + rng.below(4) as u8;
                let opts = ConnectOpts {
                    mtu,
                    psn_a,
                    psn_b,
                    max_rd_atomic: depth,
                    max_dest_rd_atomic: depth,
                    min_rnr_timer: 2,
                    ..ConnectOpts::default()
                };
                sim.connect(a, b, &opts)
            })
            .collect();
        let mems: Vec<(MrInfo, MrInfo)> = (0..2)
            .map(|_| {
                (
                    sim.node_mut(a).mem.register(1, SLOT * N, Access::ALL),
                    sim.node_mut(b).mem.register(1, SLOT * N, Access::ALL),
                )
            })
            .collect();
        for (k, &(ma, mb)) in mems.iter().enumerate() {
            sim.node(a)
                .mem
                .fill(ma.key, 0, SLOT * N, &mut Rng::new(seed * 10 + k as u64));
            sim.node(b)
                .mem
                .fill(mb.key, 0, SLOT * N, &mut Rng::new(seed * 20 + k as u64));
        }
        // Slot i of link k carries one operation, in a random direction.
        let mut expect = Vec::new();
        let mut atomics = Vec::new();
        let mut late = Vec::new();
        let mut total = [0usize; 2];
        for (k, &(qa, qb)) in links.iter().enumerate() {
            let (ma, mb) = mems[k];
            for i in 0..N {
                let from_a = rng.below(2) == 0;
                let (src_node, dst_node, q_src, q_dst, m_src, m_dst) = if from_a {
                    (a, b, qa, qb, ma, mb)
                } else {
                    (b, a, qb, qa, mb, ma)
                };
                let off = i * SLOT;
                let raddr = m_dst.iova + off as u64;
                total[src_node] += 1;
                if rng.below(7) == 0 {
                    // Fetch-and-add on the slot's first word; the old value lands in the source
                    // slot's first word.
                    let add = rng.next_u64();
                    let old = u64::from_ne_bytes(
                        sim.node(dst_node).mem.bytes(m_dst.key).unwrap()[off..off + 8]
                            .try_into()
                            .unwrap(),
                    );
                    let w = SendWqe::fetch_add(
                        i as u64,
                        Sge::new(m_src.iova + off as u64, 8, m_src.key),
                        raddr,
                        m_dst.key,
                        add,
                    );
                    sim.node_mut(src_node).qp(q_src).post_send(w).unwrap();
                    atomics.push((
                        (src_node, m_src.key),
                        (dst_node, m_dst.key),
                        off,
                        old,
                        old.wrapping_add(add),
                    ));
                    continue;
                }
                let op = OPS[rng.below(OPS.len() as u64) as usize];
                let len = [0usize, 7, 511, 513, 4100, SLOT][rng.below(6) as usize];
                if op.consumes_recv() {
                    let sg = if op == Op::WriteImm {
                        SgeList::new()
                    } else {
                        sgl(m_dst, off, len)
                    };
                    let r = RecvWqe::new(i as u64, sg);
                    // Receives are consumed in order: once one is late, the rest are too.
                    let gone_late = late.iter().any(|&(n, q, _)| (n, q) == (dst_node, q_dst));
                    if !gone_late && rng.below(4) != 0 {
                        sim.node_mut(dst_node).qp(q_dst).post_recv(r).unwrap();
                    } else {
                        late.push((dst_node, q_dst, r));
                    }
                    total[dst_node] += 1;
                }
                let data = SendData::Sges(sgl(m_src, off, len));
                let wqe = match op {
                    Op::Send => SendWqe::send(i as u64, data),
                    Op::SendImm => SendWqe::send(i as u64, data).with_imm(i as u32),
                    Op::Write => SendWqe::write(i as u64, data, raddr, m_dst.key),
                    Op::WriteImm => {
                        SendWqe::write(i as u64, data, raddr, m_dst.key).with_imm(i as u32)
                    }
                    Op::Read => SendWqe::read(i as u64, sgl(m_src, off, len), raddr, m_dst.key),
                };
                sim.node_mut(src_node).qp(q_src).post_send(wqe).unwrap();
                let (from, to) = if op == Op::Read {
                    ((dst_node, m_dst.key), (src_node, m_src.key))
                } else {
                    ((src_node, m_src.key), (dst_node, m_dst.key))
                };
                expect.push((from, to, off, len));
            }
        }
        // The late receives arrive after a while (the senders meanwhile get RNR NAKs).
        sim.run(Instant::from_nanos(200_000));
        for (node, q, r) in late {
            sim.node_mut(node).qp(q).post_recv(r).unwrap();
        }
        let out = sim.run_until(secs(600), |s| {
            s.node(a).completions.len() >= total[0] && s.node(b).completions.len() >= total[1]
        });
        assert_eq!(out, Outcome::Done, "seed {seed}");
        for n in [a, b] {
            assert!(
                sim.node(n).completions.iter().all(Completion::is_ok),
                "seed {seed}: {:?}",
                sim.node(n).completions
            );
        }
        // Both buffers started random and distinct, so equality proves each transfer.
        for ((fnode, fkey), (tnode, tkey), off, len) in expect {
            let f = &sim.node(fnode).mem.bytes(fkey).unwrap()[off..off + len];
            let t = &sim.node(tnode).mem.bytes(tkey).unwrap()[off..off + len];
            assert!(f == t, "seed {seed}: slot at {off}, {len} bytes");
        }
        for ((snode, skey), (dnode, dkey), off, old, new) in atomics {
            let got = u64::from_ne_bytes(
                sim.node(snode).mem.bytes(skey).unwrap()[off..off + 8]
                    .try_into()
                    .unwrap(),
            );
            let now = u64::from_ne_bytes(
                sim.node(dnode).mem.bytes(dkey).unwrap()[off..off + 8]
                    .try_into()
                    .unwrap(),
            );
            assert_eq!((got, now), (old, new), "seed {seed}: atomic at {off}");
        }
    }
}

/// Random bytes and mutated valid packets straight into a device with ICRC checking off: no
/// panic, and nothing outside the one region granted to the peer ever changes. The datagrams
/// go through the engine's receive path: routing, the queue pairs, the memory table.
#[test]
fn hostile_datagrams_never_panic_or_escape() {
    let mut rng = Rng::new(99);
    let mut sim = Sim::new(1, NetConfig::ideal());
    let a = sim.add_node(ip(1), ChecksumCapabilities::ignored());
    let b = sim.add_node(ip(2), ChecksumCapabilities::ignored());
    let (qa, qb) = sim.connect(
        a,
        b,
        &ConnectOpts {
            mtu: Mtu::Mtu256,
            ..ConnectOpts::default()
        },
    );
    let granted = sim.node_mut(b).mem.register(1, 4096, Access::ALL);
    let secret = sim.node_mut(b).mem.register(1, 4096, Access::LOCAL_WRITE);
    let other_pd = sim.node_mut(b).mem.register(2, 4096, Access::ALL);
    for m in [secret, other_pd] {
        sim.node(b).mem.write(m.key, 0, &[0x5A; 4096]);
    }
    // Capture a valid request stream to mutate.
    let ma = sim.node_mut(a).mem.register(1, 8192, Access::ALL);
    {
        let qp = sim.node(a).qp(qa);
        qp.post_send(SendWqe::write(
            1,
            SendData::Sges(sgl(ma, 0, 1000)),
            granted.iova,
            granted.key,
        ))
        .unwrap();
        qp.post_send(SendWqe::read(2, sgl(ma, 0, 600), granted.iova, granted.key))
            .unwrap();
        qp.post_send(SendWqe::send(3, SendData::Sges(sgl(ma, 0, 300))))
            .unwrap();
        qp.post_send(SendWqe::fetch_add(
            4,
            Sge::new(ma.iova, 8, ma.key),
            granted.iova,
            granted.key,
            1,
        ))
        .unwrap();
    }
    // Where lanes transmit, their round sends what the posts made sendable.
    sim.node_mut(a).round();
    let valid: Vec<Vec<u8>> = sim.take_sent(a).into_iter().map(|(_, d)| d).collect();
    assert!(valid.len() >= 7);
    // A is gone from now on: B's answers go nowhere, and only the injected datagrams arrive.
    sim.node_mut(a).down = true;
    let from = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 1), 4791);
    for round in 0..20_000u32 {
        let mut d = if rng.below(4) == 0 {
            let mut v = vec![0u8; rng.below(120) as usize];
            rng.fill(&mut v);
            v
        } else {
            valid[rng.below(valid.len() as u64) as usize].clone()
        };
        // Mutate: flip bits, change fields, truncate, extend.
        for _ in 0..rng.below(4) {
            if d.is_empty() {
                break;
            }
            let i = rng.below(d.len() as u64) as usize;
            match rng.below(5) {
                0 => d[i] ^= 1 << rng.below(8),
                1 => d[i] = rng.next_u64() as u8,
                2 => d.truncate(i),
                3 => d.extend((0..rng.below(40)).map(|_| rng.next_u64() as u8)),
                _ => {
                    // Aim the PSN near the expected window so mutations reach deeper checks.
                    if d.len() >= 12 {
                        d[11] = d[11].wrapping_add(rng.below(5) as u8);
                    }
                }
            }
        }
        // Route to the real queue pair most of the time.
        if d.len() >= 8 && rng.below(4) != 0 {
            d[5..8].copy_from_slice(&qb.to_be_bytes()[1..]);
        }
        sim.inject(b, from, d);
        sim.run(sim.now() + Duration::from_micros(1));
        // A queue pair in ERR is revived so the fuzzing keeps reaching the responder.
        let qp = sim.node(b).qp(qb);
        if qp.state() == QpState::Err && round % 50 == 0 {
            qp.modify(&QpAttr::to_state(QpState::Reset)).unwrap();
            qp.modify(&QpAttr::init(Access::ALL)).unwrap();
            qp.modify(&QpAttr::rtr(ip(1), qa, Psn::new(0x100), Mtu::Mtu256, 16, 1))
                .unwrap();
            qp.modify(&QpAttr::rts(Psn::new(0x200), 8, 7, 7, 16))
                .unwrap();
        }
    }
    for m in [secret, other_pd] {
        assert!(
            sim.node(b)
                .mem
                .bytes(m.key)
                .unwrap()
                .iter()
                .all(|&x| x == 0x5A),
            "an ungranted region changed"
        );
    }
    let (totals, received) = sim.node(b).totals();
    assert!(totals.drops.total() > 0);
    assert!(totals.drops.get(DropReason::UnknownQp) > 0);
    assert!(received >= 20_000);
}

/// With the ICRC off, corrupted packets reach the state machines: the run must not panic (data
/// may be wrong; that is what the ICRC is for).
#[test]
fn corruption_without_icrc_never_panics() {
    for seed in 1..=3u64 {
        let mut sim = Sim::new(
            seed,
            NetConfig {
                corrupt: 0.2,
                loss: 0.05,
                ..NetConfig::ideal()
            },
        );
        let a = sim.add_node(ip(1), ChecksumCapabilities::ignored());
        let b = sim.add_node(ip(2), ChecksumCapabilities::ignored());
        let (qa, qb) = sim.connect(
            a,
            b,
            &ConnectOpts {
                mtu: Mtu::Mtu256,
                ..ConnectOpts::default()
            },
        );
        let ma = sim.node_mut(a).mem.register(1, 65536, Access::ALL);
        let mb = sim.node_mut(b).mem.register(1, 65536, Access::ALL);
        for i in 0..8u64 {
            sim.node_mut(b)
                .qp(qb)
                .post_recv(RecvWqe::new(i, sgl(mb, 0, 65536)))
                .unwrap();
            let qp = sim.node_mut(a).qp(qa);
            let d = SendData::Sges(sgl(ma, 0, 5000));
            let w = match i % 4 {
                0 => SendWqe::send(i, d),
                1 => SendWqe::write(i, d, mb.iova, mb.key),
                2 => SendWqe::read(i, sgl(ma, 0, 5000), mb.iova, mb.key),
                _ => SendWqe::fetch_add(i, Sge::new(ma.iova, 8, ma.key), mb.iova, mb.key, 1),
            };
            qp.post_send(w).unwrap();
        }
        let out = sim.run(secs(120));
        assert_ne!(out, Outcome::Deadline, "seed {seed}: the run ends");
    }
}

/// A polling application's receive round that holds an acknowledgement back (for the answer it
/// is about to send) while the lane's engine thread sleeps on a plan made before the hold — the
/// round drained the socket under it, so no datagram wakes it — wakes that thread: if the
/// application then stops calling, the engine sends the acknowledgement at once instead of the
/// peer waiting out its retransmission timeout. No wake-up while the engine thread is awake, or
/// asleep for at most a grace because holds came recently (a ping-pong's every round).
#[test]
fn a_hold_wakes_an_engine_thread_asleep_past_it() {
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum EngineThread {
        Awake,
        AsleepUntilWoken,
        AsleepWatchingHolds,
    }
    for state in [
        EngineThread::Awake,
        EngineThread::AsleepUntilWoken,
        EngineThread::AsleepWatchingHolds,
    ] {
        // One lane each, whatever `ERDMA_SOFT_ENGINES` says: the hold and the wake-up are lane
        // 0's.
        let mut sim = Sim::new(1, NetConfig::ideal());
        let caps = ChecksumCapabilities::default();
        let a = sim.add_node_with(ip(1), caps, 1, Steering::Qpn);
        let b = sim.add_node_with(ip(2), caps, 1, Steering::Qpn);
        let (qa, qb) = sim.connect(a, b, &ConnectOpts::default());
        let mut p = Pair { sim, a, b, qa, qb };
        let ma = p.sim.node_mut(a).mem.register(1, 4096, Access::ALL);
        let mb = p.sim.node_mut(b).mem.register(1, 4096, Access::ALL);
        let write = SendWqe::write(1, SendData::Sges(sgl(ma, 0, 64)), mb.iova, mb.key);
        p.qp(a).post_send(write).unwrap();
        p.sim.node_mut(a).round();
        let sent = p.sim.take_sent(a);
        assert_eq!(sent.len(), 1, "one WRITE datagram");
        let from = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 1), ROCE_PORT);
        p.sim.inject(b, from, sent[0].1.clone());
        let node = p.sim.node(b);
        let lane = node.engine.lane(0);
        let now = crate::soft::engine::Io::now(&*node.io).as_nanos();
        let cap = match state {
            EngineThread::Awake => None,
            EngineThread::AsleepUntilWoken => Some(node.engine.hold_watch(0, now)),
            EngineThread::AsleepWatchingHolds => {
                // An earlier round held acknowledgements back, and they have left since.
                lane.held_at.store(now.max(1), Ordering::Relaxed);
                Some(node.engine.hold_watch(0, now))
            }
        };
        if let Some(cap) = cap {
            assert_eq!(
                cap.is_some(),
                state == EngineThread::AsleepWatchingHolds,
                "{state:?}"
            );
            assert!(
                matches!(
                    lane.timers.prepare_sleep(now, cap),
                    engine::timers::Sleep::Until(_)
                ),
                "B's engine thread sleeps"
            );
        }
        let before = node.io.wakes.load(Ordering::Relaxed);
        assert!(
            node.engine.app_round(u64::MAX, true),
            "the WRITE is received"
        );
        let held = lane.tx_held.load(Ordering::Relaxed);
        let sent: Vec<_> = p.sim.take_sent(b).into_iter().map(|(_, d)| d).collect();
        assert!(
            held && sent.is_empty(),
            "{state:?}: the acknowledgement waits for the application's answer (held {held}, \
             sent {sent:02x?}, stats {:?}, B's counters {:?})",
            p.sim.stats(),
            p.sim.node(b).engine.counters()
        );
        let node = p.sim.node(b);
        assert_eq!(
            node.io.wakes.load(Ordering::Relaxed) - before,
            u64::from(state == EngineThread::AsleepUntilWoken),
            "{state:?}"
        );
    }
}

/// A request whose ACK has arrived, but not yet been taken in, when its queue pair is moved to
/// ERR or destroyed completes successfully, as on a NIC (which takes packets in as they come):
/// it is not flushed. A program that disconnects as soon as it sees the peer's last message
/// (the peer then tears its side down) relies on it.
#[test]
fn an_ack_that_arrived_before_the_move_to_err_completes_the_request() {
    for destroy in [false, true] {
        let mut p = Pair::new(21, NetConfig::ideal(), &ConnectOpts::default());
        let (a, b) = (p.a, p.b);
        // A takes its datagrams 10 ms after they arrive: the ACK waits in its socket.
        p.sim.node_mut(a).set_wakeup(Duration::from_millis(10));
        let ma = p.sim.node_mut(a).mem.register(1, 64, Access::ALL);
        let mb = p.sim.node_mut(b).mem.register(1, 64, Access::ALL);
        assert!(p.sim.node(a).mem.write(ma.key, 0, b"last one"));
        p.qp(a)
            .post_send(SendWqe::write(
                7,
                SendData::Sges(sgl(ma, 0, 8)),
                mb.iova,
                mb.key,
            ))
            .unwrap();
        let soon = p.sim.now() + Duration::from_millis(1);
        assert_eq!(p.sim.run(soon), Outcome::Deadline);
        assert_eq!(p.sim.node(b).mem.bytes(mb.key).unwrap()[..8], *b"last one");
        assert!(p.completions(a).is_empty(), "the ACK is not taken in yet");
        if destroy {
            let qa = p.qa;
            p.sim.node_mut(a).destroy_qp(qa);
        } else {
            p.qp(a).modify(&QpAttr::to_state(QpState::Err)).unwrap();
        }
        let _ = p.sim.run(p.sim.now() + Duration::from_millis(50));
        let cs: Vec<_> = p
            .completions(a)
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect();
        assert_eq!(cs, [(7, WcStatus::Success)], "destroy {destroy}");
    }
}

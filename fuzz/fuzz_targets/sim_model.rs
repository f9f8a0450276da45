//! Two simulated devices run an arbitrary sequence of verbs calls over a network with arbitrary
//! loss, reordering and duplication (0–30 % each), sometimes with the peer vanishing or the
//! queue pair forced to ERR, and the result is compared with a reference model.
//!
//! Each work request owns a 1 KiB slot on each side, so the model is independent of execution
//! order: a request that completes successfully must have had exactly its effect (the bytes
//! written, read or sent; the atomic's old value and new value). Completions arrive in posting
//! order, as a prefix of successes, then at most one error (retries exhausted, or a flush after a
//! forced error), then flushes — and the run ends within a bounded virtual time.
//!
//! Corruption is left out: ICRC verification is compiled out under `cfg(fuzzing)`, so a flipped
//! bit would reach the data (the normal-build simulation tests cover corruption with the ICRC).

#![no_main]

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use erdma::soft::proto::{Instant, RecvWqe, SendData, SendWqe, SgeList};
use erdma::{Access, Mtu, QpAttr, QpState, Sge, WcStatus};
use erdma::soft::sim::{ConnectOpts, MrInfo, NetConfig, Outcome, Rng, Sim};
use erdma::soft::wire::{ChecksumCapabilities, Psn};
use libfuzzer_sys::arbitrary::{self, Arbitrary, Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const SLOT: usize = 1024;
const MAX_OPS: usize = 16;

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Op {
    Write { len: u16 },
    Read { len: u16 },
    Send { len: u16, imm: Option<u32> },
    FetchAdd { word: u8, add: u64 },
    CompareSwap { word: u8, equal: bool, swap: u64 },
}

#[derive(Debug)]
struct Plan {
    seed: u64,
    loss: u16,
    reorder: u16,
    duplicate: u16,
    mtu: Mtu,
    timeout: u8,
    retry_cnt: u8,
    psn_a: u32,
    ops: Vec<Op>,
    /// Make the peer vanish, or force the queue pair to ERR, after this many ops are posted.
    vanish_after: Option<usize>,
    error_after: Option<usize>,
}

impl<'a> Arbitrary<'a> for Plan {
    fn arbitrary(u: &mut Unstructured<'a>) -> Result<Plan> {
        let mtus = [
            Mtu::Mtu256,
            Mtu::Mtu512,
            Mtu::Mtu1024,
            Mtu::Mtu4096,
        ];
        let n = u.int_in_range(1..=MAX_OPS)?;
        let mut ops = Vec::with_capacity(n);
        for _ in 0..n {
            ops.push(u.arbitrary()?);
        }
        Ok(Plan {
            seed: u.arbitrary()?,
            loss: u.int_in_range(0..=300)?,
            reorder: u.int_in_range(0..=300)?,
            duplicate: u.int_in_range(0..=300)?,
            mtu: *u.choose(&mtus)?,
            timeout: u.int_in_range(6..=12)?,
            retry_cnt: u.int_in_range(0..=7)?,
            psn_a: u.arbitrary::<u32>()? & 0xFF_FFFF,
            ops,
            vanish_after: if u.ratio(1, 8)? {
                Some(u.int_in_range(0..=n)?)
            } else {
                None
            },
            error_after: if u.ratio(1, 8)? {
                Some(u.int_in_range(0..=n)?)
            } else {
                None
            },
        })
    }
}

fn ip(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, n))
}

fn one(m: MrInfo, off: usize, len: usize) -> SgeList {
    SgeList::from_slice(&[Sge::new(m.iova + off as u64, len as u32, m.key)]).unwrap()
}

fn word(bytes: &[u8], at: usize) -> u64 {
    u64::from_ne_bytes(bytes[at..at + 8].try_into().unwrap())
}

fuzz_target!(|plan: Plan| {
    let net = NetConfig {
        loss: f64::from(plan.loss) / 1000.0,
        reorder: f64::from(plan.reorder) / 1000.0,
        duplicate: f64::from(plan.duplicate) / 1000.0,
        ..NetConfig::ideal()
    };
    let mut sim = Sim::new(plan.seed, net);
    let a = sim.add_node(ip(1), ChecksumCapabilities::default());
    let b = sim.add_node(ip(2), ChecksumCapabilities::default());
    let (qa, qb) = sim.connect(
        a,
        b,
        &ConnectOpts {
            mtu: plan.mtu,
            timeout: plan.timeout,
            retry_cnt: plan.retry_cnt,
            psn_a: Psn::new(plan.psn_a),
            psn_b: Psn::new(plan.psn_a ^ 0x80_0000),
            max_wr: MAX_OPS as u32,
            ..ConnectOpts::default()
        },
    );
    let bytes = MAX_OPS * SLOT;
    let ma = sim.node_mut(a).mem.register(1, bytes, Access::ALL);
    let mb = sim.node_mut(b).mem.register(1, bytes, Access::ALL);
    let mr = sim.node_mut(b).mem.register(1, bytes, Access::LOCAL_WRITE);
    let mut rng = Rng::new(plan.seed);
    sim.node(a).mem.fill(ma.key, 0, bytes, &mut rng);
    sim.node(b).mem.fill(mb.key, 0, bytes, &mut rng);
    let a0 = sim.node(a).mem.bytes(ma.key).unwrap().to_vec();
    let b0 = sim.node(b).mem.bytes(mb.key).unwrap().to_vec();

    // Post: one receive per SEND on B first, then the requests on A.
    let mut recvs = 0usize;
    for (i, op) in plan.ops.iter().enumerate() {
        if let Op::Send { .. } = op {
            let qp = sim.node(b).qp(qb);
            qp.post_recv(RecvWqe::new(i as u64, one(mr, i * SLOT, SLOT)))
                .expect("receive queue has room");
            recvs += 1;
        }
    }
    let mut posted = 0usize;
    for (i, op) in plan.ops.iter().enumerate() {
        if plan.vanish_after == Some(i) {
            sim.node_mut(b).down = true;
        }
        if plan.error_after == Some(i) {
            let qp = sim.node(a).qp(qa);
            qp.modify(&QpAttr::to_state(QpState::Err)).unwrap();
        }
        let off = i * SLOT;
        let wr_id = i as u64;
        let (rva, rkey) = (mb.iova + off as u64, mb.key);
        let wqe = match *op {
            Op::Write { len } => {
                let len = usize::from(len) % (SLOT + 1);
                SendWqe::write(wr_id, SendData::Sges(one(ma, off, len)), rva, rkey)
            }
            Op::Read { len } => {
                let len = usize::from(len) % (SLOT + 1);
                SendWqe::read(wr_id, one(ma, off, len), rva, rkey)
            }
            Op::Send { len, imm } => {
                let len = usize::from(len) % (SLOT + 1);
                let w = SendWqe::send(wr_id, SendData::Sges(one(ma, off, len)));
                match imm {
                    Some(v) => w.with_imm(v),
                    None => w,
                }
            }
            Op::FetchAdd { word, add } => {
                let at = usize::from(word % 16) * 8;
                let res = Sge::new(ma.iova + (off + at) as u64, 8, ma.key);
                SendWqe::fetch_add(wr_id, res, rva + at as u64, rkey, add)
            }
            Op::CompareSwap { word, equal, swap } => {
                let at = usize::from(word % 16) * 8;
                let res = Sge::new(ma.iova + (off + at) as u64, 8, ma.key);
                let cur = self::word(&b0, off + at);
                let compare = if equal { cur } else { cur ^ 1 };
                SendWqe::compare_swap(wr_id, res, rva + at as u64, rkey, compare, swap)
            }
        };
        let qp = sim.node(a).qp(qa);
        match qp.post_send(wqe) {
            Ok(()) => posted += 1,
            Err(e) => {
                // Only a queue pair in ERR refuses a well-formed request.
                assert_eq!(qp.state(), QpState::Err, "post refused: {e:?}");
                break;
            }
        }
    }

    // Bounded: with every retry timed out, the run ends well inside this virtual deadline.
    let deadline = Instant::ZERO + Duration::from_secs(3600);
    let out = sim.run_until_completions(a, posted, deadline);
    assert_ne!(
        out,
        Outcome::Deadline,
        "requests still outstanding after an hour"
    );
    let comps: Vec<_> = sim.node_mut(a).completions.drain(..).collect();
    assert_eq!(comps.len(), posted, "one completion per request");

    let a1 = sim.node(a).mem.bytes(ma.key).unwrap().to_vec();
    let b1 = sim.node(b).mem.bytes(mb.key).unwrap().to_vec();
    let r1 = sim.node(b).mem.bytes(mr.key).unwrap().to_vec();
    let recv_comps: Vec<_> = sim.node_mut(b).completions.drain(..).collect();
    let mut failed = false;
    for (k, c) in comps.iter().enumerate() {
        assert_eq!(c.wr_id, k as u64, "completions in posting order");
        if failed {
            assert_eq!(
                c.status,
                WcStatus::WrFlushErr,
                "after an error, only flushes"
            );
            continue;
        }
        if c.status != WcStatus::Success {
            failed = true;
            // A forced error flushes everything outstanding, earlier requests included.
            let forced = plan.error_after.is_some();
            let allowed = if forced {
                matches!(c.status, WcStatus::WrFlushErr | WcStatus::RetryExcErr)
            } else {
                c.status == WcStatus::RetryExcErr
            };
            assert!(
                allowed,
                "request {k}: unexpected {:?} in {plan:?}",
                c.status
            );
            continue;
        }
        let off = k * SLOT;
        match plan.ops[k] {
            Op::Write { len } => {
                let len = usize::from(len) % (SLOT + 1);
                assert_eq!(b1[off..off + len], a0[off..off + len], "WRITE {k} data");
            }
            Op::Read { len } => {
                let len = usize::from(len) % (SLOT + 1);
                assert_eq!(a1[off..off + len], b0[off..off + len], "READ {k} data");
                assert_eq!(c.byte_len as usize, len);
            }
            Op::Send { len, imm } => {
                let len = usize::from(len) % (SLOT + 1);
                assert_eq!(r1[off..off + len], a0[off..off + len], "SEND {k} data");
                let rc = recv_comps
                    .iter()
                    .find(|r| r.wr_id == k as u64)
                    .expect("a delivered SEND completes its receive");
                assert_eq!(rc.status, WcStatus::Success);
                assert_eq!(rc.byte_len as usize, len);
                assert_eq!(rc.imm, imm);
            }
            Op::FetchAdd { word, add } => {
                let at = off + usize::from(word % 16) * 8;
                let old = self::word(&b0, at);
                assert_eq!(self::word(&a1, at), old, "FETCH_ADD {k} old value");
                assert_eq!(self::word(&b1, at), old.wrapping_add(add), "FETCH_ADD {k}");
            }
            Op::CompareSwap { word, equal, swap } => {
                let at = off + usize::from(word % 16) * 8;
                let old = self::word(&b0, at);
                assert_eq!(self::word(&a1, at), old, "CMP_SWAP {k} old value");
                let new = if equal { swap } else { old };
                assert_eq!(self::word(&b1, at), new, "CMP_SWAP {k}");
            }
        }
    }
    // A receive completes once at most, and only with data from a SEND.
    assert!(recv_comps.len() <= recvs);
});

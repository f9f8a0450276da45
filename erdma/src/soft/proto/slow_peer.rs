//! The soft requester against a slow responder modelled on Linux rxe: one response packet per
//! pacing interval, requests served strictly one after another (a READ's whole reply, or a
//! replay for a duplicate READ, finishes before the next request is looked at), and every
//! duplicate READ answered by a fresh replay from its PSN to the end of the message.
//!
//! A 1 MiB READ's reply takes several ACK timeouts to stream, so a requester that re-requests
//! from a gap again before the first replay could start (or lets its timer expire while the peer
//! is visibly still sending) queues replay after replay at the peer, and the request behind the
//! READ starves. These tests assert the data arrives intact, nothing ends in `RETRY_EXC_ERR`,
//! and the peer sees at most one duplicate READ per lost packet, plus two per local ACK timeout
//! (after half a period of silence a timed-out READ request goes out twice).
//!
//! Seeds are fixed, so every run is reproducible. Run in release mode.

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use crate::soft::proto::{Instant, MAX_DATAGRAM, Qp, QpParams, RxMeta, SendWqe, SgeList, validate};
use crate::soft::sim::{Rng, VecMemory};
use crate::soft::wire::{
    ChecksumCapabilities, Headers, IcrcHeaders, IpPair, Ipv4IdSolver, NakCode, Opcode, PacketView,
    Psn, ROCE_PORT, Syndrome, aeth, packet,
};
use crate::vocab::{Access, Completion, Mtu, QpAttr, Sge, WcOpcode, WcStatus};

const LOCAL_QPN: u32 = 0x11;
const PEER_QPN: u32 = 0x22;
const PEER_BASE: u64 = 0x7000_0000;
const PEER_RKEY: u32 = 0x1234;
const READ_LEN: usize = 1 << 20;

fn local_ip() -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 77, 0, 1))
}

fn peer_ip() -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 77, 0, 2))
}

/// A READ the peer executed: its PSN range and the memory it covers.
#[derive(Debug, Clone, Copy)]
struct ReadRes {
    first: Psn,
    last: Psn,
    va: u64,
    len: u32,
}

/// The response stream the peer is busy with.
#[derive(Debug, Clone, Copy)]
enum Job {
    Read { res: usize, cur: Psn },
    Atomic { psn: Psn, orig: u64 },
    Nak { psn: Psn },
}

/// The rxe-like responder.
struct SlowPeer {
    mtu: u32,
    /// The next request PSN expected.
    epsn: Psn,
    /// The memory READs and atomics target, at `PEER_BASE`.
    mem: Vec<u8>,
    /// Requests received and not yet looked at.
    inbox: VecDeque<Vec<u8>>,
    job: Option<Job>,
    reads: Vec<ReadRes>,
    atomics: Vec<(Psn, u64)>,
    /// A sequence NAK was sent and no in-order request came since.
    nak_sent: bool,
    /// READ requests at an already executed PSN (each one replays).
    dup_reads: u64,
    icrc: IcrcHeaders,
}

impl SlowPeer {
    fn new(mtu: u32, epsn: Psn) -> SlowPeer {
        SlowPeer {
            mtu,
            epsn,
            mem: vec![0; READ_LEN + 64],
            inbox: VecDeque::new(),
            job: None,
            reads: Vec::new(),
            atomics: Vec::new(),
            nak_sent: false,
            dup_reads: 0,
            icrc: IcrcHeaders {
                ip: IpPair::new(peer_ip(), local_ip()).expect("both IPv4"),
                ipv4_id: 0,
                src_port: ROCE_PORT,
                dst_port: ROCE_PORT,
            },
        }
    }

    fn has_work(&self) -> bool {
        self.job.is_some() || !self.inbox.is_empty()
    }

    fn packets(&self, len: u32) -> u32 {
        len.div_ceil(self.mtu).max(1)
    }

    /// Looks at one request: the job that answers it, if any.
    fn take_request(&mut self, d: &[u8]) -> Option<Job> {
        let v = PacketView::new_checked(d).expect("the requester sends well-formed packets");
        let psn = v.psn();
        let op = v.opcode();
        if psn.after(self.epsn) {
            if self.nak_sent {
                return None;
            }
            self.nak_sent = true;
            return Some(Job::Nak { psn: self.epsn });
        }
        let dup = psn.before(self.epsn);
        match op {
            Opcode::ReadRequest if dup => {
                let res = self
                    .reads
                    .iter()
                    .position(|r| psn.within(r.first, r.last))?;
                self.dup_reads += 1;
                Some(Job::Read { res, cur: psn })
            }
            Opcode::ReadRequest => {
                let r = v.reth().expect("a READ request has a RETH");
                let n = self.packets(r.dma_len);
                self.reads.push(ReadRes {
                    first: psn,
                    last: psn + (n - 1),
                    va: r.va,
                    len: r.dma_len,
                });
                self.epsn = psn + n;
                self.nak_sent = false;
                Some(Job::Read {
                    res: self.reads.len() - 1,
                    cur: psn,
                })
            }
            Opcode::FetchAdd if dup => {
                let &(_, orig) = self.atomics.iter().find(|a| a.0 == psn)?;
                Some(Job::Atomic { psn, orig })
            }
            Opcode::FetchAdd => {
                let a = v.atomic_eth().expect("an atomic has an AtomicETH");
                let at = (a.va - PEER_BASE) as usize;
                let word = &mut self.mem[at..at + 8];
                let orig = u64::from_ne_bytes(word.try_into().expect("8 bytes"));
                word.copy_from_slice(&orig.wrapping_add(a.swap_add).to_ne_bytes());
                self.atomics.push((psn, orig));
                self.epsn = psn + 1;
                self.nak_sent = false;
                Some(Job::Atomic { psn, orig })
            }
            other => panic!("the workload sends no {other:?}"),
        }
    }

    /// The next response packet, if the peer has anything to send.
    fn emit(&mut self, buf: &mut [u8]) -> Option<usize> {
        while self.job.is_none() {
            let d = self.inbox.pop_front()?;
            self.job = self.take_request(&d);
        }
        let ack = Some(aeth::Repr {
            syndrome: Syndrome::ACK,
            msn: 0,
        });
        let caps = ChecksumCapabilities::default();
        match self.job? {
            Job::Read { res, cur } => {
                let r = self.reads[res];
                let k = cur.distance_from(r.first);
                let off = k * self.mtu;
                let rem = r.len - off;
                let size = rem.min(self.mtu);
                let opcode = match (k == 0, rem <= self.mtu) {
                    (true, true) => Opcode::ReadResponseOnly,
                    (true, false) => Opcode::ReadResponseFirst,
                    (false, false) => Opcode::ReadResponseMiddle,
                    (false, true) => Opcode::ReadResponseLast,
                };
                let mut h = Headers::new(opcode, LOCAL_QPN, cur);
                if opcode != Opcode::ReadResponseMiddle {
                    h.aeth = ack;
                }
                let at = (r.va - PEER_BASE) as usize + off as usize;
                let payload = &self.mem[at..at + size as usize];
                let n = packet::emit(buf, &h, payload, &self.icrc, &caps).expect("fits");
                self.job = (cur != r.last).then_some(Job::Read { res, cur: cur + 1 });
                Some(n)
            }
            Job::Atomic { psn, orig } => {
                let mut h = Headers::new(Opcode::AtomicAcknowledge, LOCAL_QPN, psn);
                h.aeth = ack;
                h.atomic_ack_eth = Some(orig);
                self.job = None;
                Some(packet::emit(buf, &h, &[], &self.icrc, &caps).expect("fits"))
            }
            Job::Nak { psn } => {
                let mut h = Headers::new(Opcode::Acknowledge, LOCAL_QPN, psn);
                h.aeth = Some(aeth::Repr {
                    syndrome: Syndrome::Nak(NakCode::PsnSequenceError),
                    msn: 0,
                });
                self.job = None;
                Some(packet::emit(buf, &h, &[], &self.icrc, &caps).expect("fits"))
            }
        }
    }
}

/// The run's parameters.
#[derive(Debug, Clone, Copy)]
struct Params {
    seed: u64,
    /// Loss of the peer's responses.
    resp_loss: f64,
    /// Loss of the requester's requests.
    req_loss: f64,
    /// Share of the peer's responses that overtake the others: sent at once while the rest wait
    /// `HOLD` more (netem's `delay … reorder …`).
    reorder: f64,
    /// The peer sends one packet per `pace`.
    pace: Duration,
    /// Rounds of READ 1 MiB + FETCH_ADD.
    rounds: u64,
}

/// What a run counted.
#[derive(Debug, Default)]
struct Tally {
    lost_requests: u64,
    lost_responses: u64,
    reordered: u64,
    dup_reads: u64,
    timeouts: u64,
    retries: u64,
    responses: u64,
}

/// Runs `p.rounds` rounds of a 1 MiB READ followed by a FETCH_ADD against the slow peer and
/// checks every completion, every byte and every fetched value.
fn run(p: Params) -> Tally {
    const DELAY: Duration = Duration::from_micros(50);
    const HOLD: Duration = Duration::from_millis(1);
    let mut rng = Rng::new(p.seed);
    let mtu = Mtu::Mtu1024;
    let sq_psn = Psn::new(0xFF_FF00);
    let mut qp = Qp::new(LOCAL_QPN, QpParams::new(1, local_ip()));
    qp.modify(&QpAttr::init(Access::ALL)).expect("init");
    qp.modify(&QpAttr::rtr(peer_ip(), PEER_QPN, Psn::ZERO, mtu, 1, 12))
        .expect("rtr");
    // rxe's tools: timeout 14 (67 ms), seven retries, one READ/atomic in flight.
    qp.modify(&QpAttr::rts(sq_psn, 14, 7, 7, 1)).expect("rts");
    let mut mem = VecMemory::new();
    let dst = mem.register(1, READ_LEN + 64, Access::ALL);
    let mut peer = SlowPeer::new(mtu.bytes(), sq_psn);
    let mut solver = Ipv4IdSolver::new();
    let meta = RxMeta {
        src: peer_ip(),
        src_port: ROCE_PORT,
        dst: local_ip(),
        dst_port: ROCE_PORT,
        ipv4_id: Some(0),
    };
    let mut to_peer: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut to_local: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut buf = vec![0; MAX_DATAGRAM];
    let mut now = Instant::ZERO;
    let mut peer_free = Instant::ZERO;
    let mut tally = Tally::default();
    let mut counter = 0u64;
    let counter_at = READ_LEN as u64;
    for round in 0..p.rounds {
        rng.fill(&mut peer.mem[..READ_LEN]);
        peer.mem[READ_LEN..READ_LEN + 8].copy_from_slice(&counter.to_ne_bytes());
        let whole = SgeList::from_slice(&[Sge::new(dst.iova, READ_LEN as u32, dst.key)]).unwrap();
        let word = Sge::new(dst.iova + READ_LEN as u64, 8, dst.key);
        let add = round + 1;
        qp.post_send(SendWqe::read(round * 2, whole, PEER_BASE, PEER_RKEY))
            .expect("post READ");
        qp.post_send(SendWqe::fetch_add(
            round * 2 + 1,
            word,
            PEER_BASE + counter_at,
            PEER_RKEY,
            add,
        ))
        .expect("post FETCH_ADD");
        let deadline = now + Duration::from_secs(120);
        let mut done: Vec<Completion> = Vec::new();
        while done.len() < 2 {
            while let Some(t) = qp.poll_transmit(now, &mut buf, &mut mem) {
                if rng.chance(p.req_loss) {
                    tally.lost_requests += 1;
                } else {
                    to_peer.push_back((now + DELAY, buf[..t.len].to_vec()));
                }
            }
            done.extend(std::iter::from_fn(|| qp.poll_completion()));
            if done.len() >= 2 {
                break;
            }
            let next = [
                to_peer.front().map(|x| x.0),
                to_local.front().map(|x| x.0),
                qp.poll_timeout(),
                peer.has_work().then_some(peer_free.max(now)),
            ]
            .into_iter()
            .flatten()
            .min();
            let Some(next) = next else {
                panic!("seed {}: round {round} stalled with nothing to do", p.seed);
            };
            assert!(
                next <= deadline,
                "seed {}: round {round} not done within 120 s of virtual time ({tally:?})",
                p.seed
            );
            now = now.max(next);
            while to_peer.front().is_some_and(|x| x.0 <= now) {
                let (_, d) = to_peer.pop_front().expect("just seen");
                peer.inbox.push_back(d);
            }
            while to_local.front().is_some_and(|x| x.0 <= now) {
                let (_, d) = to_local.pop_front().expect("just seen");
                let view = validate(&d, &meta, &ChecksumCapabilities::default(), &mut solver)
                    .expect("the peer sends valid packets");
                let _ = qp.handle_packet(now, peer_ip(), &view, &mut mem);
            }
            if qp.poll_timeout().is_some_and(|t| t <= now) {
                qp.handle_timeout(now);
            }
            if peer.has_work() && peer_free <= now {
                if let Some(n) = peer.emit(&mut buf) {
                    tally.responses += 1;
                    peer_free = now + p.pace;
                    if rng.chance(p.resp_loss) {
                        tally.lost_responses += 1;
                    } else {
                        let at = if rng.chance(p.reorder) {
                            tally.reordered += 1;
                            now + DELAY
                        } else if p.reorder > 0.0 {
                            now + DELAY + HOLD
                        } else {
                            now + DELAY
                        };
                        let i = to_local.partition_point(|x| x.0 <= at);
                        to_local.insert(i, (at, buf[..n].to_vec()));
                    }
                }
            }
        }
        tally.timeouts = qp.counters().timeouts;
        tally.retries = qp.counters().retries;
        tally.dup_reads = peer.dup_reads;
        let got: Vec<(WcStatus, WcOpcode)> = done.iter().map(|c| (c.status, c.opcode)).collect();
        assert_eq!(
            got,
            [
                (WcStatus::Success, WcOpcode::RdmaRead),
                (WcStatus::Success, WcOpcode::FetchAdd)
            ],
            "seed {}: round {round} ({tally:?})",
            p.seed
        );
        let bytes = mem.bytes(dst.key).expect("registered");
        assert!(
            bytes[..READ_LEN] == peer.mem[..READ_LEN],
            "seed {}: round {round}: READ data differs",
            p.seed
        );
        let fetched = u64::from_ne_bytes(bytes[READ_LEN..READ_LEN + 8].try_into().unwrap());
        assert_eq!(fetched, counter, "seed {}: round {round}", p.seed);
        counter += add;
    }
    tally
}

/// Every seed and loss rate: intact data, no error, and duplicate READs bounded by the losses
/// and timeouts that could have justified them.
fn check(resp_loss: f64, req_loss: f64, seeds: std::ops::Range<u64>) {
    for seed in seeds {
        let p = Params {
            seed,
            resp_loss,
            req_loss,
            reorder: 0.0,
            // 1024 response packets at 200 µs each: a reply streams for three ACK timeouts.
            pace: Duration::from_micros(200),
            rounds: 3,
        };
        let t = run(p);
        let bound = t.lost_responses + t.lost_requests + 2 * t.timeouts;
        assert!(
            t.dup_reads <= bound,
            "seed {seed}, loss {resp_loss}/{req_loss}: {} duplicate READs for {} lost packets \
             and {} timeouts ({t:?})",
            t.dup_reads,
            t.lost_responses + t.lost_requests,
            t.timeouts
        );
    }
}

#[test]
fn slow_responder_with_0_1_percent_response_loss() {
    check(0.001, 0.0, 0..6);
}

#[test]
fn slow_responder_with_1_percent_response_loss() {
    check(0.01, 0.0, 0..6);
}

#[test]
fn slow_responder_with_5_percent_response_loss() {
    check(0.05, 0.0, 0..4);
}

#[test]
fn slow_responder_with_loss_both_ways() {
    check(0.01, 0.01, 10..14);
    check(0.03, 0.03, 20..22);
}

#[test]
fn slow_responder_without_loss_needs_no_retry() {
    let t = run(Params {
        seed: 1,
        resp_loss: 0.0,
        req_loss: 0.0,
        reorder: 0.0,
        pace: Duration::from_micros(200),
        rounds: 2,
    });
    assert_eq!((t.retries, t.timeouts, t.dup_reads), (0, 0, 0), "{t:?}");
}

/// netem's `delay 1ms reorder 10%` on the responses as well: every overtaking response is dropped
/// as out of order and so lost as far as go-back-N is concerned (rxe drops them too), and the
/// responder replays a lot, but nothing starves and the data arrives intact.
#[test]
fn slow_responder_with_reordering_and_loss() {
    for seed in 0..2 {
        let t = run(Params {
            seed,
            resp_loss: 0.01,
            req_loss: 0.0,
            reorder: 0.1,
            pace: Duration::from_micros(200),
            rounds: 1,
        });
        assert!(t.reordered > 0 && t.dup_reads > 0, "{t:?}");
    }
}

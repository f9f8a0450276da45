//! Focused tests of single queue pairs against hand-built packets, and against packets a real
//! rxe sent (`captures/rxe61-send4096-mtu1024.pcap`).

use std::net::{IpAddr, Ipv4Addr};

use super::*;
use crate::soft::sim::{MrInfo, VecMemory};
use crate::soft::wire::{
    ChecksumCapabilities, Headers, IcrcHeaders, IpPair, Ipv4IdSolver, NakCode, Opcode, PacketView,
    Psn, Syndrome, aeth, atomic_eth, icrc, packet, reth,
};
use crate::vocab::*;

const MS: u64 = 1_000_000;

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

/// One queue pair in RTS with its memory, talking to a peer the test plays by hand.
struct Harness {
    qp: Qp,
    mem: VecMemory,
    local: IpAddr,
    peer: IpAddr,
    peer_port: u16,
    solver: Ipv4IdSolver,
    buf: Vec<u8>,
}

struct Setup {
    local: IpAddr,
    peer: IpAddr,
    qpn: u32,
    dest: u32,
    mtu: Mtu,
    rq_psn: Psn,
    sq_psn: Psn,
    access: Access,
    src_port: u16,
    retry_cnt: u8,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            local: v4(127, 0, 0, 1),
            peer: v4(127, 0, 0, 2),
            qpn: 0x11,
            dest: 0x22,
            mtu: Mtu::Mtu256,
            rq_psn: Psn::new(0x1000),
            sq_psn: Psn::new(0x2000),
            access: Access::ALL,
            src_port: ROCE,
            retry_cnt: 7,
        }
    }
}

const ROCE: u16 = crate::soft::wire::ROCE_PORT;

impl Harness {
    fn new(s: Setup) -> Harness {
        let mut cfg = QpParams::new(1, s.local);
        cfg.src_port = s.src_port;
        let mut qp = Qp::new(s.qpn, cfg);
        qp.modify(&QpAttr::init(s.access)).unwrap();
        qp.modify(&QpAttr::rtr(s.peer, s.dest, s.rq_psn, s.mtu, 4, 12))
            .unwrap();
        qp.modify(&QpAttr::rts(s.sq_psn, 14, s.retry_cnt, 7, 4))
            .unwrap();
        Harness {
            qp,
            mem: VecMemory::new(),
            local: s.local,
            peer: s.peer,
            peer_port: ROCE,
            solver: Ipv4IdSolver::new(),
            buf: vec![0; MAX_DATAGRAM],
        }
    }

    /// ICRC fields of a packet from the peer to us.
    fn inbound(&self, ipv4_id: u16) -> IcrcHeaders {
        IcrcHeaders {
            ip: IpPair::new(self.peer, self.local).unwrap(),
            ipv4_id,
            src_port: self.peer_port,
            dst_port: ROCE,
        }
    }

    /// The device-level checks, then the queue pair.
    fn feed_at(&mut self, now: Instant, d: &[u8], ipv4_id: Option<u16>) -> Result<(), DropReason> {
        let meta = RxMeta {
            src: self.peer,
            src_port: self.peer_port,
            dst: self.local,
            dst_port: ROCE,
            ipv4_id,
        };
        let view = validate(d, &meta, &ChecksumCapabilities::default(), &mut self.solver)?;
        assert_eq!(view.dest_qpn(), self.qp.qpn());
        self.qp.handle_packet(now, self.peer, &view, &mut self.mem)
    }

    fn feed(&mut self, d: &[u8]) -> Result<(), DropReason> {
        self.feed_at(Instant::ZERO, d, Some(0))
    }

    /// A packet from the peer.
    fn craft(&self, h: &Headers, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![0; MAX_DATAGRAM];
        let n = packet::emit(
            &mut out,
            h,
            payload,
            &self.inbound(0),
            &ChecksumCapabilities::default(),
        )
        .unwrap();
        out.truncate(n);
        out
    }

    /// Everything the queue pair sends now.
    fn drain(&mut self, now: Instant) -> Vec<Vec<u8>> {
        let mut v = Vec::new();
        while let Some(t) = self.qp.poll_transmit(now, &mut self.buf, &mut self.mem) {
            assert_eq!(t.dst, std::net::SocketAddr::new(self.peer, ROCE));
            let p = self.buf[..t.len].to_vec();
            // Every packet we send carries a correct ICRC for identification 0.
            let h = IcrcHeaders {
                ip: IpPair::new(self.local, self.peer).unwrap(),
                ipv4_id: 0,
                src_port: t.src_port,
                dst_port: ROCE,
            };
            assert!(icrc::verify(&h, &p), "bad ICRC on a packet we sent");
            v.push(p);
        }
        v
    }

    fn completions(&mut self) -> Vec<Completion> {
        std::iter::from_fn(|| self.qp.poll_completion()).collect()
    }
}

fn view(p: &[u8]) -> PacketView<'_> {
    PacketView::new_checked(p).unwrap()
}

fn ack(dest: u32, psn: Psn, syndrome: Syndrome) -> Headers {
    let mut h = Headers::new(Opcode::Acknowledge, dest, psn);
    h.aeth = Some(aeth::Repr { syndrome, msn: 0 });
    h
}

// ---- Interop with the rxe capture --------------------------------------------------------------

/// The capture's packets: 10.77.0.2:0xd353 (QPN 0x11) → 10.77.0.1 (QPN 0x123), PSN 0x8671cd,
/// SEND of 4096 bytes of 0x7b at MTU 1024, then the same four again (a timeout retransmission).
fn capture(i: usize) -> (u16, Vec<u8>) {
    const P: [(u16, &str, [u8; 4]); 8] = [
        (0x9a01, "0000ffff00000123008671cd", [0x43, 0x43, 0x08, 0x2c]),
        (0x9a02, "0100ffff00000123008671ce", [0x36, 0x5a, 0x47, 0x7d]),
        (0x9a03, "0100ffff00000123008671cf", [0x5a, 0xe8, 0x16, 0xf4]),
        (0x9a04, "0200ffff00000123808671d0", [0x16, 0xc6, 0x11, 0xac]),
        (0x9a15, "0000ffff00000123008671cd", [0xd5, 0xde, 0xfa, 0xef]),
        (0x9a16, "0100ffff00000123008671ce", [0xa0, 0xc7, 0xb5, 0xbe]),
        (0x9a17, "0100ffff00000123008671cf", [0xcc, 0x75, 0xe4, 0x37]),
        (0x9a18, "0200ffff00000123808671d0", [0xe3, 0xab, 0x52, 0xa7]),
    ];
    let (id, bth, icrc) = P[i];
    let mut p = crate::soft::wire::hex(bth);
    p.extend_from_slice(&[0x7b; 1024]);
    p.extend_from_slice(&icrc);
    (id, p)
}

#[test]
fn responder_accepts_a_real_rxe_send_and_acks_like_rxe() {
    let mut h = Harness::new(Setup {
        local: v4(10, 77, 0, 1),
        peer: v4(10, 77, 0, 2),
        qpn: 0x123,
        dest: 0x11,
        mtu: Mtu::Mtu1024,
        rq_psn: Psn::new(0x8671cd),
        access: Access::empty(), // rc_pingpong grants no remote access
        ..Setup::default()
    });
    h.peer_port = 0xd353;
    let m = h.mem.register(1, 4096, Access::LOCAL_WRITE);
    h.qp.post_recv(RecvWqe::new(
        42,
        SgeList::from_slice(&[Sge::new(m.iova, 4096, m.key)]).unwrap(),
    ))
    .unwrap();
    for i in 0..4 {
        // The UDP socket cannot see rxe's identification: the ICRC check solves for it.
        let (_, p) = capture(i);
        h.feed_at(Instant::ZERO, &p, None).unwrap();
    }
    let c = h.completions();
    assert_eq!(c.len(), 1);
    assert_eq!(
        (
            c[0].wr_id,
            c[0].status,
            c[0].opcode,
            c[0].byte_len,
            c[0].src_qp,
            c[0].qp_num
        ),
        (42, WcStatus::Success, WcOpcode::Recv, 4096, 0x11, 0x123)
    );
    assert!(h.mem.bytes(m.key).unwrap().iter().all(|&b| b == 0x7b));
    let out = h.drain(Instant::ZERO);
    assert_eq!(out.len(), 1, "one ACK, for the AckReq on SEND_LAST");
    // What rxe itself would send: ACKNOWLEDGE, DestQP 0x11, PSN of the SEND_LAST, AETH 0x1f/MSN 1.
    assert_eq!(
        &out[0][..16],
        &crate::soft::wire::hex("1100ffff00000011008671d01f000001")[..]
    );

    // The retransmitted copies are duplicates: answered with an ACK of the last executed PSN.
    for i in 4..8 {
        let (_, p) = capture(i);
        h.feed_at(Instant::ZERO, &p, None).unwrap();
    }
    let out = h.drain(Instant::ZERO);
    assert_eq!(out.len(), 1, "duplicate ACKs coalesce");
    assert_eq!(view(&out[0]).psn(), Psn::new(0x8671d0));
    assert!(h.completions().is_empty(), "no second receive");
    assert_eq!(h.qp.counters().duplicates, 4);
}

#[test]
fn requester_sends_the_bytes_rxe_sent() {
    let mut h = Harness::new(Setup {
        local: v4(10, 77, 0, 2),
        peer: v4(10, 77, 0, 1),
        qpn: 0x11,
        dest: 0x123,
        mtu: Mtu::Mtu1024,
        sq_psn: Psn::new(0x8671cd),
        src_port: 0xd353,
        ..Setup::default()
    });
    let m = h.mem.register(1, 4096, Access::LOCAL_WRITE);
    h.mem.bytes_mut(m.key).unwrap().fill(0x7b);
    h.qp.post_send(SendWqe::send(
        1,
        SendData::Sges(SgeList::from_slice(&[Sge::new(m.iova, 4096, m.key)]).unwrap()),
    ))
    .unwrap();
    let out = h.drain(Instant::ZERO);
    assert_eq!(out.len(), 4);
    let mut solver = Ipv4IdSolver::new();
    for (i, ours) in out.iter().enumerate() {
        let (id, theirs) = capture(i);
        let n = theirs.len();
        assert_eq!(
            &ours[..n - 4],
            &theirs[..n - 4],
            "packet {i}: every byte but the ICRC"
        );
        // The ICRC differs only by the IPv4 identification rxe's kernel chose.
        let ours_icrc = icrc::read(ours).unwrap();
        assert_eq!(
            solver.adjust(ours_icrc, id, n).map(u32::to_le_bytes),
            Some(theirs[n - 4..].try_into().unwrap())
        );
    }
    // rxe's retransmission after its ACK timeout is the same four packets again.
    h.qp.handle_timeout(Instant::from_nanos(100 * MS));
    let again = h.drain(Instant::from_nanos(100 * MS));
    assert_eq!(view(&again[0]).opcode(), Opcode::SendFirst);
    assert_eq!(view(&again[0]).psn(), Psn::new(0x8671cd));
}

// ---- Requester ---------------------------------------------------------------------------------

#[test]
fn ack_requests_at_every_end_and_every_64_packets() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 256 * 200, Access::ALL);
    let w = SendWqe::write(
        1,
        SendData::Sges(SgeList::from_slice(&[Sge::new(m.iova, 256 * 200, m.key)]).unwrap()),
        0x1000,
        5,
    );
    h.qp.post_send(w).unwrap();
    let mut flags = Vec::new();
    let mut now = 0;
    // The window holds 128 PSNs: acknowledge as we go.
    while flags.len() < 200 {
        let out = h.drain(Instant::from_nanos(now));
        assert!(!out.is_empty());
        for p in &out {
            let v = view(p);
            flags.push(v.ack_req());
            if v.ack_req() {
                let a = h.craft(&ack(0x11, v.psn(), Syndrome::ACK), &[]);
                h.feed_at(Instant::from_nanos(now), &a, Some(0)).unwrap();
            }
        }
        now += 1000;
    }
    let set: Vec<usize> = flags
        .iter()
        .enumerate()
        .filter(|(_, f)| **f)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(set, [63, 127, 191, 199]);
    assert_eq!(h.completions()[0].status, WcStatus::Success);
}

#[test]
fn window_holds_at_most_128_unacknowledged_psns() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 256 * 300, Access::ALL);
    let w = SendWqe::write(
        1,
        SendData::Sges(SgeList::from_slice(&[Sge::new(m.iova, 256 * 300, m.key)]).unwrap()),
        0x1000,
        5,
    );
    h.qp.post_send(w).unwrap();
    assert_eq!(h.drain(Instant::ZERO).len(), 128);
}

#[test]
fn a_read_takes_one_psn_per_response_packet() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 4096, Access::ALL);
    let sg = |off, len| SgeList::from_slice(&[Sge::new(m.iova + off, len, m.key)]).unwrap();
    h.qp.post_send(SendWqe::read(1, sg(0, 5 * 256 + 3), 0xABC0, 7))
        .unwrap();
    h.qp.post_send(SendWqe::read(2, sg(2000, 0), 0xABC0, 7))
        .unwrap();
    h.qp.post_send(SendWqe::send(3, SendData::Sges(sg(3000, 8))))
        .unwrap();
    let out = h.drain(Instant::ZERO);
    let got: Vec<(Opcode, u32, bool, Option<reth::Repr>)> = out
        .iter()
        .map(|p| {
            (
                view(p).opcode(),
                view(p).psn().value(),
                view(p).ack_req(),
                view(p).reth(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (
                Opcode::ReadRequest,
                0x2000,
                true,
                Some(reth::Repr {
                    va: 0xABC0,
                    rkey: 7,
                    dma_len: 5 * 256 + 3
                })
            ),
            (
                Opcode::ReadRequest,
                0x2006,
                true,
                Some(reth::Repr {
                    va: 0xABC0,
                    rkey: 7,
                    dma_len: 0
                })
            ),
            (Opcode::SendOnly, 0x2007, true, None),
        ]
    );
}

#[test]
fn go_back_n_resumes_mid_message_without_a_reth() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 1024, Access::ALL);
    for (i, b) in h.mem.bytes_mut(m.key).unwrap().iter_mut().enumerate() {
        *b = (i / 256) as u8;
    }
    let w = SendWqe::write(
        1,
        SendData::Sges(SgeList::from_slice(&[Sge::new(m.iova, 1024, m.key)]).unwrap()),
        0x9000,
        5,
    );
    h.qp.post_send(w).unwrap();
    let first = h.drain(Instant::ZERO);
    let ops: Vec<Opcode> = first.iter().map(|p| view(p).opcode()).collect();
    assert_eq!(
        ops,
        [
            Opcode::WriteFirst,
            Opcode::WriteMiddle,
            Opcode::WriteMiddle,
            Opcode::WriteLast
        ]
    );
    assert_eq!(
        view(&first[0]).reth(),
        Some(reth::Repr {
            va: 0x9000,
            rkey: 5,
            dma_len: 1024
        })
    );
    // The responder expected 0x2002: everything before is acknowledged, resume there.
    let nak = h.craft(
        &ack(
            0x11,
            Psn::new(0x2002),
            Syndrome::Nak(NakCode::PsnSequenceError),
        ),
        &[],
    );
    h.feed(&nak).unwrap();
    let again = h.drain(Instant::ZERO);
    let got: Vec<(Opcode, u32, bool, bool, u8)> = again
        .iter()
        .map(|p| {
            (
                view(p).opcode(),
                view(p).psn().value(),
                view(p).ack_req(),
                view(p).reth().is_some(),
                view(p).payload()[0],
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            // The first packet of a retry asks for an ACK and goes out twice.
            (Opcode::WriteMiddle, 0x2002, true, false, 2),
            (Opcode::WriteMiddle, 0x2002, true, false, 2),
            (Opcode::WriteLast, 0x2003, true, false, 3),
        ]
    );
    assert_eq!(h.qp.counters().retransmits, 3);
    let ok = h.craft(&ack(0x11, Psn::new(0x2003), Syndrome::ACK), &[]);
    h.feed(&ok).unwrap();
    let c = h.completions();
    assert_eq!(
        (c[0].status, c[0].opcode, c[0].byte_len),
        (WcStatus::Success, WcOpcode::RdmaWrite, 1024)
    );
}

#[test]
fn a_read_resumes_with_its_address_advanced() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 1024, Access::ALL);
    h.qp.post_send(SendWqe::read(
        1,
        SgeList::from_slice(&[Sge::new(m.iova, 1024, m.key)]).unwrap(),
        0x7000,
        9,
    ))
    .unwrap();
    assert_eq!(h.drain(Instant::ZERO).len(), 1);
    let mut first = Headers::new(Opcode::ReadResponseFirst, 0x11, Psn::new(0x2000));
    first.aeth = Some(aeth::Repr {
        syndrome: Syndrome::ACK,
        msn: 1,
    });
    let p = h.craft(&first, &[0xAA; 256]);
    h.feed(&p).unwrap();
    // The rest never comes: the timer fires.
    let t = h.qp.poll_timeout().unwrap();
    h.qp.handle_timeout(t);
    let again = h.drain(t);
    assert_eq!(again.len(), 2, "sent twice after a timeout");
    for p in &again {
        let v = view(p);
        assert_eq!(
            (v.opcode(), v.psn()),
            (Opcode::ReadRequest, Psn::new(0x2001))
        );
        assert_eq!(
            v.reth(),
            Some(reth::Repr {
                va: 0x7000 + 256,
                rkey: 9,
                dma_len: 768
            })
        );
    }
    // The responder replays MIDDLE, MIDDLE, LAST (the rxe rule for a replay not at the first PSN).
    for (k, op) in [
        Opcode::ReadResponseMiddle,
        Opcode::ReadResponseMiddle,
        Opcode::ReadResponseLast,
    ]
    .iter()
    .enumerate()
    {
        let mut r = Headers::new(*op, 0x11, Psn::new(0x2001 + k as u32));
        if *op == Opcode::ReadResponseLast {
            r.aeth = Some(aeth::Repr {
                syndrome: Syndrome::ACK,
                msn: 1,
            });
        }
        let p = h.craft(&r, &[0xB0 + k as u8; 256]);
        h.feed(&p).unwrap();
    }
    let c = h.completions();
    assert_eq!(
        (c[0].status, c[0].opcode, c[0].byte_len),
        (WcStatus::Success, WcOpcode::RdmaRead, 1024)
    );
    let d = h.mem.bytes(m.key).unwrap();
    assert!(d[..256].iter().all(|&b| b == 0xAA) && d[768..].iter().all(|&b| b == 0xB2));
}

/// Feeds `p` every third of an ACK timeout for `periods` timeouts, firing timers as they fall
/// due; returns how many packets the queue pair sent meanwhile.
fn answer_with(h: &mut Harness, p: &[u8], periods: u32) -> usize {
    let third = ack_timeout(14).unwrap() / 3;
    let mut now = Instant::ZERO;
    let mut sent = 0;
    for _ in 0..3 * periods {
        now = now + third;
        if h.qp.poll_timeout().is_some_and(|d| d <= now) {
            h.qp.handle_timeout(now);
        }
        let _ = h.feed_at(now, p, Some(0));
        sent += h.drain(now).len();
    }
    sent
}

/// A peer that answers a READ, again and again, with a response past the one it never sends
/// shows it alive but makes no progress. The READ still fails once the retry budget is spent
/// (the timer is not held off for ever), and the gap retries it caused are bounded.
#[test]
fn responses_past_a_read_cannot_hold_it_open() {
    let mut h = Harness::new(Setup {
        retry_cnt: 1,
        ..Setup::default()
    });
    let m = h.mem.register(1, 1024, Access::ALL);
    let sgl = SgeList::from_slice(&[Sge::new(m.iova, 1024, m.key)]).unwrap();
    h.qp.post_send(SendWqe::read(1, sgl, 0x7000, 9)).unwrap();
    h.drain(Instant::ZERO);
    let p = h.craft(
        &Headers::new(Opcode::ReadResponseMiddle, 0x11, Psn::new(0x2002)),
        &[0xEE; 256],
    );
    answer_with(&mut h, &p, 1000);
    let c = h.completions();
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(1, WcStatus::RetryExcErr)]
    );
    assert_eq!(h.qp.state(), QpState::Err);
    let n = h.qp.counters();
    assert!(n.retries <= u64::from(completer::GAP_RETRIES) + 2, "{n:?}");
}

/// The same with an atomic and a SEND behind it: a plain ACK at the SEND's PSN, repeated,
/// never completes the atomic, and no longer keeps it outstanding for ever.
#[test]
fn acks_past_an_atomic_cannot_hold_it_open() {
    let mut h = Harness::new(Setup {
        retry_cnt: 1,
        ..Setup::default()
    });
    let m = h.mem.register(1, 64, Access::ALL);
    h.qp.post_send(SendWqe::fetch_add(
        1,
        Sge::new(m.iova, 8, m.key),
        0x7000,
        9,
        1,
    ))
    .unwrap();
    let sgl = SgeList::from_slice(&[Sge::new(m.iova, 8, m.key)]).unwrap();
    h.qp.post_send(SendWqe::send(2, SendData::Sges(sgl)))
        .unwrap();
    assert_eq!(h.drain(Instant::ZERO).len(), 2);
    let p = h.craft(&ack(0x11, Psn::new(0x2001), Syndrome::ACK), &[]);
    answer_with(&mut h, &p, 1000);
    let c = h.completions();
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::RetryExcErr));
    assert_eq!(h.qp.state(), QpState::Err);
}

/// Every copy of a bogus response past an atomic used to start a go-back-N resend of the whole
/// window: 20 bytes in, a window out. Gap retries now have a budget between two responses that
/// make progress.
#[test]
fn bogus_responses_cost_a_bounded_number_of_resends() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 256 * 100, Access::ALL);
    h.qp.post_send(SendWqe::fetch_add(
        1,
        Sge::new(m.iova, 8, m.key),
        0x7000,
        9,
        1,
    ))
    .unwrap();
    let sgl = SgeList::from_slice(&[Sge::new(m.iova, 256 * 100, m.key)]).unwrap();
    h.qp.post_send(SendWqe::send(2, SendData::Sges(sgl)))
        .unwrap();
    let window = h.drain(Instant::ZERO).len();
    assert_eq!(window, 101);
    let p = h.craft(&ack(0x11, Psn::new(0x2001), Syndrome::ACK), &[]);
    let now = Instant::from_nanos(1000);
    let mut resent = 0;
    for _ in 0..50 {
        let _ = h.feed_at(now, &p, Some(0));
        resent += h.drain(now).len();
    }
    assert!(resent > 0, "the first gap is retried at once");
    // Each resend is the window, its atomic request doubled.
    let most = usize::from(completer::GAP_RETRIES) * (window + 1);
    assert!(resent <= most, "{resent} packets resent");
}

/// A fatal error behind a READ being answered: the queue pair goes to ERR and the reply stops;
/// only the NAK goes out (the reply's packets would read memory for a peer in error).
#[test]
fn an_errored_responder_stops_its_read_replies() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 1 << 20, Access::ALL);
    let mut r = Headers::new(Opcode::ReadRequest, 0x11, Psn::new(0x1000));
    r.reth = Some(reth::Repr {
        va: m.iova,
        rkey: m.key,
        dma_len: 1 << 20,
    });
    let p = h.craft(&r, &[]);
    h.feed(&p).unwrap();
    // The READ takes 4096 PSNs at MTU 256; a SEND_MIDDLE with no SEND begun is invalid.
    let bad = h.craft(
        &Headers::new(Opcode::SendMiddle, 0x11, Psn::new(0x2000)),
        &[0; 256],
    );
    let _ = h.feed(&bad);
    assert_eq!(h.qp.state(), QpState::Err);
    let out = h.drain(Instant::ZERO);
    let ops: Vec<Opcode> = out.iter().map(|p| view(p).opcode()).collect();
    assert_eq!(ops, [Opcode::Acknowledge], "{} packets", ops.len());
    assert!(matches!(
        view(&out[0]).aeth().unwrap().syndrome,
        Syndrome::Nak(_)
    ));
}

#[test]
fn a_read_gap_retries_once_until_the_reply_starts_again() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 1024, Access::ALL);
    h.qp.post_send(SendWqe::read(
        1,
        SgeList::from_slice(&[Sge::new(m.iova, 1024, m.key)]).unwrap(),
        0x7000,
        9,
    ))
    .unwrap();
    assert_eq!(h.drain(Instant::ZERO).len(), 1);
    let at = |ms: u64| Instant::from_nanos(ms * MS);
    let timeout = ack_timeout(14).unwrap();
    let resp = |h: &Harness, op: Opcode, psn: u32, fill: u8| {
        let mut r = Headers::new(op, 0x11, Psn::new(psn));
        if op != Opcode::ReadResponseMiddle {
            r.aeth = Some(aeth::Repr {
                syndrome: Syndrome::ACK,
                msn: 1,
            });
        }
        h.craft(&r, &[fill; 256])
    };
    let requests = |pkts: &[Vec<u8>]| -> Vec<(Opcode, u32)> {
        pkts.iter()
            .map(|p| (view(p).opcode(), view(p).psn().value()))
            .collect()
    };
    let p = resp(&h, Opcode::ReadResponseFirst, 0x2000, 0xA0);
    h.feed_at(at(1), &p, Some(0)).unwrap();
    // 0x2001 is lost: the next response asks again from it, once (a READ request is not
    // doubled: each copy would cost the responder a replay).
    let p = resp(&h, Opcode::ReadResponseMiddle, 0x2002, 0xEE);
    assert_eq!(
        h.feed_at(at(2), &p, Some(0)),
        Err(DropReason::OutOfSequence)
    );
    assert_eq!(requests(&h.drain(at(2))), [(Opcode::ReadRequest, 0x2001)]);
    // The rest of that reply is still on its way: no second request, and the timer starts
    // again (the responder is working, however slowly).
    let p = resp(&h, Opcode::ReadResponseLast, 0x2003, 0xEE);
    assert_eq!(
        h.feed_at(at(50), &p, Some(0)),
        Err(DropReason::OutOfSequence)
    );
    assert!(h.drain(at(50)).is_empty());
    assert_eq!(h.qp.poll_timeout(), Some(at(50) + timeout));
    // The replay starts again below that and lacks 0x2001 too: lost again, asked again.
    let p = resp(&h, Opcode::ReadResponseMiddle, 0x2002, 0xEE);
    assert_eq!(
        h.feed_at(at(60), &p, Some(0)),
        Err(DropReason::OutOfSequence)
    );
    assert_eq!(requests(&h.drain(at(60))), [(Opcode::ReadRequest, 0x2001)]);
    for (k, op) in [
        Opcode::ReadResponseMiddle,
        Opcode::ReadResponseMiddle,
        Opcode::ReadResponseLast,
    ]
    .into_iter()
    .enumerate()
    {
        let p = resp(&h, op, 0x2001 + k as u32, 0xB0 + k as u8);
        h.feed_at(at(70), &p, Some(0)).unwrap();
    }
    let c = h.completions();
    assert_eq!(
        (c[0].status, c[0].opcode, c[0].byte_len),
        (WcStatus::Success, WcOpcode::RdmaRead, 1024)
    );
    let d = h.mem.bytes(m.key).unwrap();
    assert!(d[..256].iter().all(|&b| b == 0xA0) && d[768..].iter().all(|&b| b == 0xB2));
    let n = h.qp.counters();
    assert_eq!((n.retries, n.timeouts), (2, 0), "no retry spent the budget");
}

#[test]
fn naks_map_to_rxe_statuses() {
    for (code, status) in [
        (NakCode::InvalidRequest, WcStatus::RemInvReqErr),
        (NakCode::RemoteAccessError, WcStatus::RemAccessErr),
        (NakCode::RemoteOperationalError, WcStatus::RemOpErr),
        (NakCode::InvalidRdRequest, WcStatus::RemOpErr),
        (NakCode::Unknown(0x1e), WcStatus::RemOpErr),
    ] {
        let mut h = Harness::new(Setup::default());
        let m = h.mem.register(1, 64, Access::ALL);
        let sg = SgeList::from_slice(&[Sge::new(m.iova, 8, m.key)]).unwrap();
        h.qp.post_send(SendWqe::write(1, SendData::Sges(sg), 0x10, 1))
            .unwrap();
        h.qp.post_send(SendWqe::send(2, SendData::Sges(sg)))
            .unwrap();
        h.qp.post_recv(RecvWqe::new(3, sg)).unwrap();
        h.drain(Instant::ZERO);
        let nak = h.craft(&ack(0x11, Psn::new(0x2000), Syndrome::Nak(code)), &[]);
        h.feed(&nak).unwrap();
        let c: Vec<_> = h
            .completions()
            .iter()
            .map(|c| (c.wr_id, c.status))
            .collect();
        assert_eq!(
            c,
            [
                (1, status),
                (2, WcStatus::WrFlushErr),
                (3, WcStatus::WrFlushErr)
            ],
            "{code:?}"
        );
        assert_eq!(h.qp.state(), QpState::Err);
        assert!(h.drain(Instant::ZERO).is_empty());
    }
}

#[test]
fn responses_for_psns_never_sent_are_ignored() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 64, Access::ALL);
    let sg = SgeList::from_slice(&[Sge::new(m.iova, 8, m.key)]).unwrap();
    h.qp.post_send(SendWqe::send(1, SendData::Sges(sg)))
        .unwrap();
    h.drain(Instant::ZERO);
    let bogus = h.craft(&ack(0x11, Psn::new(0x2005), Syndrome::ACK), &[]);
    assert_eq!(h.feed(&bogus), Err(DropReason::Unsolicited));
    assert!(h.completions().is_empty());
    let stale = h.craft(&ack(0x11, Psn::new(0x1FFF), Syndrome::ACK), &[]);
    assert_eq!(h.feed(&stale), Err(DropReason::Stale));
    let from_elsewhere = h.craft(&ack(0x11, Psn::new(0x2000), Syndrome::ACK), &[]);
    let v = view(&from_elsewhere);
    assert_eq!(
        h.qp.handle_packet(Instant::ZERO, v4(1, 2, 3, 4), &v, &mut h.mem),
        Err(DropReason::WrongSource)
    );
    assert_eq!(h.feed(&from_elsewhere), Ok(()));
    assert_eq!(h.completions()[0].status, WcStatus::Success);
    assert_eq!(h.qp.counters().drops.get(DropReason::WrongSource), 1);
}

// ---- Responder ---------------------------------------------------------------------------------

#[test]
fn sequence_naks_once_until_an_in_order_packet() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 4096, Access::ALL);
    let write = |psn: u32, op: Opcode| {
        let mut w = Headers::new(op, 0x11, Psn::new(psn));
        w.ack_req = true;
        if op == Opcode::WriteOnly {
            w.reth = Some(reth::Repr {
                va: m.iova,
                rkey: m.key,
                dma_len: 4,
            });
        }
        w
    };
    let ahead = h.craft(&write(0x1002, Opcode::WriteOnly), &[1, 2, 3, 4]);
    assert_eq!(h.feed(&ahead), Err(DropReason::OutOfSequence));
    assert_eq!(h.feed(&ahead), Err(DropReason::OutOfSequence));
    let out = h.drain(Instant::ZERO);
    assert_eq!(out.len(), 1, "one NAK");
    let a = view(&out[0]).aeth().unwrap();
    assert_eq!(
        (view(&out[0]).psn(), a.syndrome),
        (Psn::new(0x1000), Syndrome::Nak(NakCode::PsnSequenceError))
    );
    let in_order = h.craft(&write(0x1000, Opcode::WriteOnly), &[5, 6, 7, 8]);
    h.feed(&in_order).unwrap();
    assert_eq!(h.feed(&ahead), Err(DropReason::OutOfSequence));
    let out = h.drain(Instant::ZERO);
    let got: Vec<(u32, Syndrome, u32)> = out
        .iter()
        .map(|p| {
            (
                view(p).psn().value(),
                view(p).aeth().unwrap().syndrome,
                view(p).aeth().unwrap().msn,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (0x1000, Syndrome::ACK, 1),
            (0x1001, Syndrome::Nak(NakCode::PsnSequenceError), 1)
        ]
    );
    assert_eq!(&h.mem.bytes(m.key).unwrap()[..4], &[5, 6, 7, 8]);
}

#[test]
fn a_middle_without_a_first_is_an_invalid_request() {
    let mut h = Harness::new(Setup::default());
    let p = h.craft(
        &Headers::new(Opcode::WriteMiddle, 0x11, Psn::new(0x1000)),
        &[0; 256],
    );
    h.feed(&p).unwrap();
    assert_eq!(h.qp.state(), QpState::Err);
    let out = h.drain(Instant::ZERO);
    assert_eq!(out.len(), 1, "the NAK still leaves, then nothing");
    assert_eq!(
        view(&out[0]).aeth().unwrap().syndrome,
        Syndrome::Nak(NakCode::InvalidRequest)
    );
    assert_eq!(view(&out[0]).psn(), Psn::new(0x1000));
    let again = h.craft(&Headers::new(Opcode::SendOnly, 0x11, Psn::new(0x1000)), &[]);
    assert_eq!(h.feed(&again), Err(DropReason::QpNotReady));
}

/// Errors that no receive request can report (IBTA C9-222.1.1) come out as the queue pair's
/// asynchronous error, once; an error a receive request carries does not.
#[test]
fn responder_errors_without_a_receive_are_asynchronous_errors() {
    let reth = |va: u64, rkey: u32, dma_len: u32| Some(reth::Repr { va, rkey, dma_len });
    // A WRITE to a key nobody registered, a READ past its region's end, a MIDDLE with no
    // FIRST: each NAKed, the queue pair in ERR, no completion, one event.
    for case in 0..3 {
        let mut h = Harness::new(Setup::default());
        let m = h.mem.register(1, 256, Access::ALL);
        let (hd, payload, code, want) = match case {
            0 => {
                let mut w = Headers::new(Opcode::WriteOnly, 0x11, Psn::new(0x1000));
                w.reth = reth(m.iova, m.key ^ 0x100, 4);
                (
                    w,
                    vec![1; 4],
                    NakCode::RemoteAccessError,
                    QpAsyncError::AccessViolation,
                )
            }
            1 => {
                let mut r = Headers::new(Opcode::ReadRequest, 0x11, Psn::new(0x1000));
                r.reth = reth(m.iova + 128, m.key, 256);
                (
                    r,
                    vec![],
                    NakCode::RemoteAccessError,
                    QpAsyncError::AccessViolation,
                )
            }
            _ => (
                Headers::new(Opcode::WriteMiddle, 0x11, Psn::new(0x1000)),
                vec![0; 256],
                NakCode::InvalidRequest,
                QpAsyncError::InvalidRequest,
            ),
        };
        let p = h.craft(&hd, &payload);
        h.feed(&p).unwrap();
        assert_eq!(h.qp.state(), QpState::Err, "case {case}");
        let out = h.drain(Instant::ZERO);
        assert_eq!(
            view(out.last().unwrap()).aeth().unwrap().syndrome,
            Syndrome::Nak(code),
            "case {case}"
        );
        assert!(h.completions().is_empty(), "case {case}");
        assert_eq!(h.qp.take_async_error(), Some(want), "case {case}");
        assert_eq!(h.qp.take_async_error(), None, "reported once (case {case})");
    }
    // A WRITE WITH IMMEDIATE to a bad key consumed a receive: the receive reports the error.
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 256, Access::ALL);
    let sg = SgeList::from_slice(&[Sge::new(m.iova, 8, m.key)]).unwrap();
    h.qp.post_recv(RecvWqe::new(7, sg)).unwrap();
    let mut w = Headers::new(Opcode::WriteOnlyImm, 0x11, Psn::new(0x1000));
    w.reth = reth(m.iova, m.key ^ 0x100, 4);
    w.immdt = Some(9);
    let p = h.craft(&w, &[1; 4]);
    h.feed(&p).unwrap();
    assert_eq!(h.qp.state(), QpState::Err);
    let c: Vec<_> = h
        .completions()
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(c, [(7, WcStatus::RemAccessErr)]);
    assert_eq!(h.qp.take_async_error(), None);
}

/// An atomic is checked as rxe checks it: key, rights and range first (a remote access error),
/// alignment after (an invalid request). Misaligned and under a bad key, or misaligned and past
/// the region's end, is a remote access error.
#[test]
fn atomics_check_the_key_and_range_before_the_alignment() {
    let cases = [
        ("misaligned, bad key", 4, true, NakCode::RemoteAccessError),
        (
            "misaligned, past the end",
            252,
            false,
            NakCode::RemoteAccessError,
        ),
        ("misaligned, inside", 4, false, NakCode::InvalidRequest),
        ("aligned, bad key", 8, true, NakCode::RemoteAccessError),
    ];
    for (name, off, bad_key, code) in cases {
        let mut h = Harness::new(Setup::default());
        let m = h.mem.register(1, 256, Access::ALL);
        let mut a = Headers::new(Opcode::FetchAdd, 0x11, Psn::new(0x1000));
        a.atomic_eth = Some(atomic_eth::Repr {
            va: m.iova + off,
            rkey: if bad_key { m.key ^ 0x100 } else { m.key },
            swap_add: 1,
            compare: 0,
        });
        let p = h.craft(&a, &[]);
        h.feed(&p).unwrap();
        let out = h.drain(Instant::ZERO);
        assert_eq!(
            view(out.last().unwrap()).aeth().unwrap().syndrome,
            Syndrome::Nak(code),
            "{name}"
        );
        assert_eq!(h.qp.state(), QpState::Err, "{name}");
        assert!(
            h.mem.bytes(m.key).unwrap().iter().all(|&b| b == 0),
            "{name}: nothing written"
        );
    }
}

#[test]
fn segment_sizes_are_enforced() {
    // A FIRST shorter than the MTU, and a LAST longer than what the RETH announced.
    for (first_len, last_len) in [(200usize, 56usize), (256, 300)] {
        let mut h = Harness::new(Setup::default());
        let m = h.mem.register(1, 4096, Access::ALL);
        let mut f = Headers::new(Opcode::WriteFirst, 0x11, Psn::new(0x1000));
        f.reth = Some(reth::Repr {
            va: m.iova,
            rkey: m.key,
            dma_len: 512,
        });
        let p = h.craft(&f, &vec![1; first_len]);
        h.feed(&p).unwrap();
        let mut l = Headers::new(Opcode::WriteLast, 0x11, Psn::new(0x1001));
        l.ack_req = true;
        let p = h.craft(&l, &vec![2; last_len]);
        let _ = h.feed(&p);
        assert_eq!(h.qp.state(), QpState::Err, "{first_len}/{last_len}");
        let out = h.drain(Instant::ZERO);
        assert_eq!(
            view(out.last().unwrap()).aeth().unwrap().syndrome,
            Syndrome::Nak(NakCode::InvalidRequest)
        );
    }
}

#[test]
fn duplicate_read_replays_from_its_psn_with_middle_and_last() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 1024, Access::ALL);
    for (i, b) in h.mem.bytes_mut(m.key).unwrap().iter_mut().enumerate() {
        *b = (i / 256) as u8;
    }
    let mut r = Headers::new(Opcode::ReadRequest, 0x11, Psn::new(0x1000));
    r.ack_req = true;
    r.reth = Some(reth::Repr {
        va: m.iova,
        rkey: m.key,
        dma_len: 1024,
    });
    let p = h.craft(&r, &[]);
    h.feed(&p).unwrap();
    let ops: Vec<(Opcode, u32, bool, u8)> = h
        .drain(Instant::ZERO)
        .iter()
        .map(|p| {
            (
                view(p).opcode(),
                view(p).psn().value(),
                view(p).aeth().is_some(),
                view(p).payload()[0],
            )
        })
        .collect();
    assert_eq!(
        ops,
        [
            (Opcode::ReadResponseFirst, 0x1000, true, 0),
            (Opcode::ReadResponseMiddle, 0x1001, false, 1),
            (Opcode::ReadResponseMiddle, 0x1002, false, 2),
            (Opcode::ReadResponseLast, 0x1003, true, 3),
        ]
    );
    // The requester lost the last two and asks again from 0x1002.
    r.psn = Psn::new(0x1002);
    r.reth = Some(reth::Repr {
        va: m.iova + 512,
        rkey: m.key,
        dma_len: 512,
    });
    let p = h.craft(&r, &[]);
    h.feed(&p).unwrap();
    let ops: Vec<(Opcode, u32, u8)> = h
        .drain(Instant::ZERO)
        .iter()
        .map(|p| {
            (
                view(p).opcode(),
                view(p).psn().value(),
                view(p).payload()[0],
            )
        })
        .collect();
    assert_eq!(
        ops,
        [
            (Opcode::ReadResponseMiddle, 0x1002, 2),
            (Opcode::ReadResponseLast, 0x1003, 3)
        ]
    );
    // A duplicate that asks for more than the original is dropped.
    r.reth = Some(reth::Repr {
        va: m.iova + 512,
        rkey: m.key,
        dma_len: 1024,
    });
    let p = h.craft(&r, &[]);
    assert_eq!(h.feed(&p), Err(DropReason::Stale));
    assert!(h.drain(Instant::ZERO).is_empty());
}

#[test]
fn duplicate_atomic_returns_the_saved_result_and_runs_once() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 64, Access::ALL);
    h.mem.bytes_mut(m.key).unwrap()[..8].copy_from_slice(&100u64.to_ne_bytes());
    let mut a = Headers::new(Opcode::FetchAdd, 0x11, Psn::new(0x1000));
    a.ack_req = true;
    a.atomic_eth = Some(atomic_eth::Repr {
        va: m.iova,
        rkey: m.key,
        swap_add: 5,
        compare: 0,
    });
    let p = h.craft(&a, &[]);
    for _ in 0..3 {
        h.feed(&p).unwrap();
        let out = h.drain(Instant::ZERO);
        assert_eq!(out.len(), 1);
        let v = view(&out[0]);
        assert_eq!(
            (v.opcode(), v.psn(), v.atomic_ack_eth()),
            (Opcode::AtomicAcknowledge, Psn::new(0x1000), Some(100))
        );
    }
    assert_eq!(
        u64::from_ne_bytes(h.mem.bytes(m.key).unwrap()[..8].try_into().unwrap()),
        105
    );
    assert_eq!(h.qp.counters().duplicates, 2);
}

#[test]
fn acks_coalesce_to_the_newest_psn() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 64, Access::ALL);
    for i in 0..3 {
        h.qp.post_recv(RecvWqe::new(
            i,
            SgeList::from_slice(&[Sge::new(m.iova, 64, m.key)]).unwrap(),
        ))
        .unwrap();
    }
    for psn in 0x1000..0x1003 {
        let mut s = Headers::new(Opcode::SendOnly, 0x11, Psn::new(psn));
        s.ack_req = true;
        let p = h.craft(&s, b"x");
        h.feed(&p).unwrap();
    }
    let out = h.drain(Instant::ZERO);
    assert_eq!(out.len(), 1);
    assert_eq!(
        (view(&out[0]).psn(), view(&out[0]).aeth().unwrap().msn),
        (Psn::new(0x1002), 3)
    );
    assert_eq!(h.completions().len(), 3);
}

#[test]
fn rnr_nak_carries_the_min_rnr_timer_and_does_not_advance() {
    let mut h = Harness::new(Setup::default());
    let m = h.mem.register(1, 64, Access::ALL);
    let mut s = Headers::new(Opcode::SendOnlyImm, 0x11, Psn::new(0x1000));
    s.ack_req = true;
    s.immdt = Some(0xCAFE);
    let p = h.craft(&s, b"hi");
    assert_eq!(h.feed(&p), Err(DropReason::ReceiverNotReady));
    let out = h.drain(Instant::ZERO);
    assert_eq!(
        view(&out[0]).aeth().unwrap().syndrome,
        Syndrome::RnrNak { timer: 12 }
    );
    assert_eq!(view(&out[0]).psn(), Psn::new(0x1000));
    h.qp.post_recv(RecvWqe::new(
        9,
        SgeList::from_slice(&[Sge::new(m.iova, 64, m.key)]).unwrap(),
    ))
    .unwrap();
    h.feed(&p).unwrap();
    let c = h.completions();
    assert_eq!(
        (c[0].wr_id, c[0].imm, c[0].byte_len, c[0].wc_flags()),
        (9, Some(0xCAFE), 2, WC_WITH_IMM)
    );
}

// ---- Verbs surface -----------------------------------------------------------------------------

#[test]
fn state_transitions_follow_ibta() {
    let mut qp = Qp::new(5, QpParams::new(1, v4(127, 0, 0, 1)));
    assert_eq!(qp.state().to_string(), "RESET");
    assert_eq!(
        qp.modify(&QpAttr::to_state(QpState::Rtr)),
        Err(ModifyError::IllegalTransition {
            from: QpState::Reset,
            to: QpState::Rtr
        })
    );
    assert_eq!(
        qp.modify(&QpAttr {
            access: None,
            ..QpAttr::init(Access::ALL)
        }),
        Err(ModifyError::Missing("access"))
    );
    assert_eq!(
        qp.modify(&QpAttr {
            timeout: Some(3),
            ..QpAttr::init(Access::ALL)
        }),
        Err(ModifyError::NotAllowed("timeout"))
    );
    assert_eq!(
        qp.modify(&QpAttr {
            port: Some(2),
            ..QpAttr::init(Access::ALL)
        }),
        Err(ModifyError::Invalid("port"))
    );
    assert_eq!(
        qp.modify(&QpAttr {
            cur_state: Some(QpState::Init),
            ..QpAttr::init(Access::ALL)
        }),
        Err(ModifyError::StateMismatch {
            expected: QpState::Init,
            actual: QpState::Reset
        })
    );
    assert_eq!(
        qp.post_recv(RecvWqe::new(1, SgeList::new())),
        Err(PostError::InvalidState(QpState::Reset))
    );
    qp.modify(&QpAttr::init(Access::ALL)).unwrap();
    assert_eq!(qp.state().to_string(), "INIT");
    let send = SendWqe::send(1, SendData::Inline(InlineData::new(b"x").unwrap()));
    assert_eq!(
        qp.post_send(send),
        Err(PostError::InvalidState(QpState::Init))
    );
    qp.post_recv(RecvWqe::new(1, SgeList::new())).unwrap();
    let v6 = IpAddr::V6(std::net::Ipv6Addr::LOCALHOST);
    assert_eq!(
        qp.modify(&QpAttr::rtr(v6, 9, Psn::ZERO, Mtu::Mtu1024, 1, 1)),
        Err(ModifyError::Invalid("av")),
        "the peer must be of the device's address family"
    );
    assert_eq!(
        qp.modify(&QpAttr::rtr(
            v4(127, 0, 0, 2),
            9,
            Psn::ZERO,
            Mtu::Mtu1024,
            200,
            1
        )),
        Err(ModifyError::Invalid("max_dest_rd_atomic"))
    );
    qp.modify(&QpAttr::rtr(
        v4(127, 0, 0, 2),
        9,
        Psn::ZERO,
        Mtu::Mtu1024,
        1,
        1,
    ))
    .unwrap();
    assert_eq!(
        qp.modify(&QpAttr::rts(Psn::ZERO, 14, 8, 7, 1)),
        Err(ModifyError::Invalid("retry_cnt"))
    );
    qp.modify(&QpAttr::rts(Psn::ZERO, 14, 7, 7, 1)).unwrap();
    assert_eq!(qp.state().to_string(), "RTS");
    qp.modify(&QpAttr {
        min_rnr_timer: Some(3),
        ..QpAttr::to_state(QpState::Rts)
    })
    .unwrap();
    assert_eq!(
        qp.modify(&QpAttr {
            path_mtu: Some(Mtu::Mtu256),
            ..QpAttr::default()
        }),
        Err(ModifyError::NotAllowed("path_mtu"))
    );
    qp.modify(&QpAttr::to_state(QpState::Sqd)).unwrap();
    assert_eq!(qp.state().to_string(), "SQD");
    qp.modify(&QpAttr {
        retry_cnt: Some(2),
        ..QpAttr::to_state(QpState::Sqd)
    })
    .unwrap();
    qp.modify(&QpAttr::to_state(QpState::Rts)).unwrap();
    qp.post_send(send).unwrap();
    assert_eq!(qp.send_queue_len(), 1);
    // To ERR: everything outstanding is flushed.
    qp.modify(&QpAttr::to_state(QpState::Err)).unwrap();
    assert_eq!(qp.state().to_string(), "ERR");
    let c: Vec<_> = std::iter::from_fn(|| qp.poll_completion())
        .map(|c| (c.queue(), c.status))
        .collect();
    assert_eq!(
        c,
        [
            (WorkQueue::Send, WcStatus::WrFlushErr),
            (WorkQueue::Recv, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(
        qp.modify(&QpAttr::to_state(QpState::Rts)),
        Err(ModifyError::IllegalTransition {
            from: QpState::Err,
            to: QpState::Rts
        })
    );
    // To RESET: discarded without completions.
    qp.modify(&QpAttr::to_state(QpState::Reset)).unwrap();
    assert_eq!(qp.attr().dest_qp_num, Some(0));
    assert!(qp.poll_completion().is_none());
    assert_eq!(QpState::Sqe.to_string(), "SQE");
    assert_eq!(QpState::Rtr as u32, 2);
}

#[test]
fn posting_limits() {
    let mut cfg = QpParams::new(1, v4(127, 0, 0, 1));
    cfg.caps.max_send_wr = 2;
    cfg.caps.max_recv_wr = 1;
    cfg.caps.max_send_sge = 1;
    cfg.caps.max_inline_data = 16;
    let mut qp = Qp::new(5, cfg);
    qp.modify(&QpAttr::init(Access::ALL)).unwrap();
    qp.modify(&QpAttr::rtr(
        v4(127, 0, 0, 2),
        9,
        Psn::ZERO,
        Mtu::Mtu1024,
        1,
        1,
    ))
    .unwrap();
    qp.modify(&QpAttr::rts(Psn::ZERO, 14, 7, 7, 1)).unwrap();
    let two = SgeList::from_slice(&[Sge::new(0, 1, 1), Sge::new(0, 1, 1)]).unwrap();
    assert_eq!(
        qp.post_send(SendWqe::send(1, SendData::Sges(two))),
        Err(PostError::TooManySges {
            requested: 2,
            max: 1
        })
    );
    let long = SendData::Inline(InlineData::new(&[0; 17]).unwrap());
    assert_eq!(
        qp.post_send(SendWqe::send(1, long)),
        Err(PostError::InlineTooLong {
            requested: 17,
            max: 16
        })
    );
    let ok = SendWqe::send(1, SendData::Inline(InlineData::new(b"x").unwrap()));
    qp.post_send(ok).unwrap();
    qp.post_send(ok).unwrap();
    assert_eq!(qp.post_send(ok), Err(PostError::QueueFull { depth: 2 }));
    qp.post_recv(RecvWqe::new(1, SgeList::new())).unwrap();
    assert_eq!(
        qp.post_recv(RecvWqe::new(2, SgeList::new())),
        Err(PostError::QueueFull { depth: 1 })
    );
}

#[test]
fn device_checks_and_drop_reasons() {
    let me = v4(127, 0, 0, 1);
    let peer = v4(127, 0, 0, 2);
    let qpn = 0x11;
    let mut qp = Qp::new(qpn, QpParams::new(1, me));
    qp.modify(&QpAttr::init(Access::ALL)).unwrap();
    qp.modify(&QpAttr::rtr(peer, 0x22, Psn::new(0x10), Mtu::Mtu1024, 1, 1))
        .unwrap();
    let mut mem = VecMemory::new();
    let h = IcrcHeaders {
        ip: IpPair::new(peer, me).unwrap(),
        ipv4_id: 0,
        src_port: 4791,
        dst_port: 4791,
    };
    let build = |op: Opcode, qpn: u32, pkey: u16| {
        let mut hd = Headers::new(op, qpn, Psn::new(0x10));
        hd.pkey = pkey;
        let mut b = vec![0; 128];
        let n = packet::emit(&mut b, &hd, &[], &h, &ChecksumCapabilities::default()).unwrap();
        b.truncate(n);
        b
    };
    let meta = RxMeta {
        src: peer,
        src_port: 4791,
        dst: me,
        dst_port: 4791,
        ipv4_id: Some(0),
    };
    let good = build(Opcode::SendOnly, qpn, 0xFFFF);
    let mut bad_tver = good.clone();
    bad_tver[1] |= 1;
    let mut bad_icrc = good.clone();
    let n = bad_icrc.len();
    bad_icrc[n - 1] ^= 1;
    let mut ud = good.clone();
    ud[0] = 0x64;
    let cases: [(&[u8], RxMeta, DropReason); 6] = [
        (&good[..7], meta, DropReason::Truncated),
        (&bad_tver, meta, DropReason::BadVersion),
        (
            &build(Opcode::SendOnly, qpn, 0x0001),
            meta,
            DropReason::BadPkey,
        ),
        (&ud, meta, DropReason::UnknownOpcode),
        (&bad_icrc, meta, DropReason::BadIcrc),
        (
            &good,
            RxMeta {
                ipv4_id: Some(1),
                ..meta
            },
            DropReason::BadIcrc,
        ),
    ];
    let caps = ChecksumCapabilities::default();
    for (d, m, why) in cases {
        let got = validate(d, &m, &caps, &mut Ipv4IdSolver::new()).map(|v| v.opcode());
        assert_eq!(got, Err(why));
    }
    // A valid SEND with no receive posted reaches the queue pair, which drops it (RNR).
    let view = validate(&good, &meta, &caps, &mut Ipv4IdSolver::new()).unwrap();
    assert_eq!(
        qp.handle_packet(Instant::ZERO, peer, &view, &mut mem),
        Err(DropReason::ReceiverNotReady)
    );
    assert_eq!(qp.counters().drops.get(DropReason::ReceiverNotReady), 1);
    // 0x7FFF (limited member) matches the device's 0xFFFF too, and the ICRC check accepts an
    // identification it has to solve for.
    let limited = build(Opcode::SendOnly, qpn, 0x7FFF);
    let unknown_id = RxMeta {
        ipv4_id: None,
        ..meta
    };
    let v = validate(&limited, &unknown_id, &caps, &mut Ipv4IdSolver::new());
    assert_eq!(v.map(|v| v.opcode()), Ok(Opcode::SendOnly));
}

/// Two queue pairs talking to each other directly, each with its own memory: the protocol core
/// without an engine (for what the engine's memory does not do, such as remote invalidation,
/// and for IPv6, which the engine's UDP socket does not speak).
struct ProtoPair {
    qps: [Qp; 2],
    mems: [VecMemory; 2],
    addrs: [IpAddr; 2],
    solver: Ipv4IdSolver,
    buf: Vec<u8>,
    now: Instant,
    completions: [Vec<Completion>; 2],
}

impl ProtoPair {
    fn new(a: IpAddr, b: IpAddr, mtu: Mtu) -> ProtoPair {
        let mut qps = [
            Qp::new(0x11, QpParams::new(1, a)),
            Qp::new(0x12, QpParams::new(1, b)),
        ];
        let addrs = [a, b];
        for (i, qp) in qps.iter_mut().enumerate() {
            let (peer, dest) = (addrs[1 - i], 0x11 + (1 - i) as u32);
            qp.modify(&QpAttr::init(Access::ALL)).unwrap();
            qp.modify(&QpAttr::rtr(peer, dest, Psn::new(0x100), mtu, 4, 1))
                .unwrap();
            qp.modify(&QpAttr::rts(Psn::new(0x100), 14, 7, 7, 4))
                .unwrap();
        }
        ProtoPair {
            qps,
            mems: [VecMemory::new(), VecMemory::new()],
            addrs,
            solver: Ipv4IdSolver::new(),
            buf: vec![0; MAX_DATAGRAM],
            now: Instant::ZERO,
            completions: [Vec::new(), Vec::new()],
        }
    }

    /// Moves packets both ways until neither side sends anything; collects completions.
    fn run(&mut self) {
        loop {
            let mut moved = false;
            for from in 0..2 {
                let to = 1 - from;
                while let Some(t) =
                    self.qps[from].poll_transmit(self.now, &mut self.buf, &mut self.mems[from])
                {
                    moved = true;
                    let meta = RxMeta {
                        src: self.addrs[from],
                        src_port: t.src_port,
                        dst: self.addrs[to],
                        dst_port: ROCE,
                        ipv4_id: Some(0),
                    };
                    let d = self.buf[..t.len].to_vec();
                    let caps = ChecksumCapabilities::default();
                    let view = validate(&d, &meta, &caps, &mut self.solver).unwrap();
                    let _ = self.qps[to].handle_packet(
                        self.now,
                        self.addrs[from],
                        &view,
                        &mut self.mems[to],
                    );
                }
            }
            for (qp, done) in self.qps.iter_mut().zip(self.completions.iter_mut()) {
                while let Some(c) = qp.poll_completion() {
                    done.push(c);
                }
            }
            if !moved {
                return;
            }
        }
    }
}

fn one_sge(m: MrInfo, off: u64, len: u32) -> SgeList {
    SgeList::from_slice(&[Sge::new(m.iova + off, len, m.key)]).unwrap()
}

#[test]
fn ipv6_devices() {
    let a = IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1));
    let b = IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2));
    let mut p = ProtoPair::new(a, b, Mtu::Mtu4096);
    let ma = p.mems[0].register(1, 20_000, Access::ALL);
    let mb = p.mems[1].register(1, 20_000, Access::ALL);
    crate::soft::sim::Rng::new(3).fill(p.mems[0].bytes_mut(ma.key).unwrap());
    crate::soft::sim::Rng::new(4).fill(&mut p.mems[1].bytes_mut(mb.key).unwrap()[10_000..]);
    p.qps[1]
        .post_recv(RecvWqe::new(1, one_sge(mb, 0, 5000)))
        .unwrap();
    let qp = &mut p.qps[0];
    qp.post_send(SendWqe::send(1, SendData::Sges(one_sge(ma, 0, 5000))))
        .unwrap();
    qp.post_send(SendWqe::write(
        2,
        SendData::Sges(one_sge(ma, 5000, 5000)),
        mb.iova + 5000,
        mb.key,
    ))
    .unwrap();
    qp.post_send(SendWqe::read(
        3,
        one_sge(ma, 10_000, 10_000),
        mb.iova + 10_000,
        mb.key,
    ))
    .unwrap();
    p.run();
    assert_eq!(p.completions[0].len(), 3);
    assert!(p.completions[0].iter().all(Completion::is_ok));
    assert_eq!(p.completions[1].len(), 1);
    assert!(p.mems[0].bytes(ma.key) == p.mems[1].bytes(mb.key));
}

/// Remote invalidation as the protocol implements it, over memory that allows it (the engine's
/// `reg_mr` regions refuse it, as rxe's do: the simulation checks that).
#[test]
fn send_with_invalidate_revokes_the_key() {
    let mut p = ProtoPair::new(v4(127, 0, 0, 1), v4(127, 0, 0, 2), Mtu::Mtu1024);
    let ma = p.mems[0].register(1, 64, Access::ALL);
    let mb = p.mems[1].register(1, 64, Access::ALL);
    let victim = p.mems[1].register(1, 64, Access::ALL);
    p.qps[1]
        .post_recv(RecvWqe::new(1, one_sge(mb, 0, 64)))
        .unwrap();
    let qp = &mut p.qps[0];
    let write = |id| {
        SendWqe::write(
            id,
            SendData::Sges(one_sge(ma, 0, 8)),
            victim.iova,
            victim.key,
        )
    };
    qp.post_send(write(1)).unwrap();
    qp.post_send(SendWqe::send(2, SendData::Sges(one_sge(ma, 0, 8))).with_invalidate(victim.key))
        .unwrap();
    qp.post_send(write(3)).unwrap();
    p.run();
    let cs: Vec<_> = p.completions[0]
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        cs,
        [
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::RemAccessErr)
        ]
    );
    assert_eq!(p.completions[1][0].invalidated_rkey, Some(victim.key));
    assert_eq!(p.completions[1][0].wc_flags(), WC_WITH_INV);
    assert!(!p.mems[1].is_valid(victim.key));
}

#[test]
fn ack_timeout_encoding() {
    assert_eq!(ack_timeout(0), None);
    assert_eq!(ack_timeout(1), Some(core::time::Duration::from_nanos(8192)));
    assert_eq!(
        ack_timeout(14),
        Some(core::time::Duration::from_nanos(67_108_864))
    );
    assert_eq!(
        Instant::from_nanos(5) + core::time::Duration::from_nanos(7),
        Instant::from_nanos(12)
    );
    assert_eq!(
        Instant::from_nanos(5) - Instant::from_nanos(7),
        core::time::Duration::ZERO
    );
}

/// The [`Memory`] methods a test memory passes on to the `VecMemory` in its field `mem`.
macro_rules! delegate_to_vec_memory {
    () => {
        fn region(&self, key: u32) -> Option<Region> {
            self.mem.region(key)
        }
        fn read(
            &mut self,
            region: &Region,
            offset: u64,
            dst: &mut [u8],
        ) -> Result<(), MemoryError> {
            self.mem.read(region, offset, dst)
        }
        fn write(&mut self, region: &Region, offset: u64, src: &[u8]) -> Result<(), MemoryError> {
            self.mem.write(region, offset, src)
        }
        fn atomic(
            &mut self,
            region: &Region,
            offset: u64,
            op: AtomicOp,
        ) -> Result<u64, MemoryError> {
            self.mem.atomic(region, offset, op)
        }
        fn invalidate(&mut self, region: &Region) -> Result<(), MemoryError> {
            self.mem.invalidate(region)
        }
    };
}

/// A memory that accepts every lend and remembers what it lent.
struct Lending {
    mem: VecMemory,
    lent: Option<Vec<u8>>,
    offers: usize,
}

impl Memory for Lending {
    delegate_to_vec_memory!();
    fn lend(&mut self, region: &Region, offset: u64, len: usize) -> bool {
        self.offers += 1;
        let mut b = vec![0; len];
        let ok = self.mem.read(region, offset, &mut b).is_ok();
        self.lent = ok.then_some(b);
        ok
    }
    fn hash_lent(&mut self, hasher: &mut crc32fast::Hasher) {
        hasher.update(self.lent.as_deref().unwrap_or(&[]));
    }
}

/// A request's payload that lies in one entry is lent, not copied; the packet, once the lent
/// bytes are put where it says, is the one the copying path writes (ICRC included). A payload
/// that spans two entries, and inline data, are copied.
#[test]
fn payloads_in_one_entry_are_lent_and_the_packets_stay_the_same() {
    let setup = || Setup {
        mtu: Mtu::Mtu1024,
        ..Setup::default()
    };
    let post = |h: &mut Harness| {
        let m = h.mem.register(1, 8192, Access::ALL);
        for (i, b) in h.mem.bytes_mut(m.key).unwrap().iter_mut().enumerate() {
            *b = (i * 13 + 5) as u8;
        }
        // 3000 bytes in one entry (3 packets), then 1000 + 500 bytes in two entries (the
        // first packet spans both, the second lies in the second), then inline data.
        let one = SgeList::from_slice(&[Sge::new(m.iova, 3000, m.key)]).unwrap();
        let two = SgeList::from_slice(&[
            Sge::new(m.iova + 4096, 1000, m.key),
            Sge::new(m.iova + 6000, 500, m.key),
        ])
        .unwrap();
        h.qp.post_send(SendWqe::write(1, SendData::Sges(one), 0x10, 7))
            .unwrap();
        h.qp.post_send(SendWqe::send(2, SendData::Sges(two)))
            .unwrap();
        h.qp.post_send(SendWqe::send(
            3,
            SendData::Inline(wr::InlineData::new(b"inline bytes").unwrap()),
        ))
        .unwrap();
    };
    let mut plain = Harness::new(setup());
    post(&mut plain);
    let want = plain.drain(Instant::ZERO);
    assert_eq!(want.len(), 6);

    let mut h = Harness::new(setup());
    post(&mut h);
    let mut mem = Lending {
        mem: std::mem::take(&mut h.mem),
        lent: None,
        offers: 0,
    };
    let mut got = Vec::new();
    let mut lent = 0;
    while let Some(t) = h.qp.poll_transmit(Instant::ZERO, &mut h.buf, &mut mem) {
        let mut p = h.buf[..t.len].to_vec();
        if let Some(l) = t.lent {
            let bytes = mem.lent.take().expect("the memory lent the payload");
            assert_eq!(bytes.len(), l.len);
            p[l.at..l.at + l.len].copy_from_slice(&bytes);
            lent += 1;
        }
        got.push(p);
    }
    assert_eq!(got, want);
    assert_eq!(lent, 4, "the WRITE's three packets and the SEND's second");
    assert_eq!(
        mem.offers, 4,
        "two-entry and inline payloads are not offered"
    );
}

/// A memory that names its regions' bytes to a same-host peer as `key << 32 | offset`, and, as a
/// receiver, copies a peer's bytes out of a copy of the peer's regions: the reference path
/// without processes.
struct RefMemory {
    mem: VecMemory,
    peer: std::collections::HashMap<u32, Vec<u8>>,
    peer_reads: usize,
}

impl Memory for RefMemory {
    delegate_to_vec_memory!();
    fn peer_addr(&mut self, region: &Region, offset: u64, _len: usize) -> Option<u64> {
        Some(u64::from(region.key) << 32 | offset)
    }
    fn write_from_peer(
        &mut self,
        region: &Region,
        offset: u64,
        src: &crate::soft::wire::peer_ref::PeerRefs,
    ) -> Result<(), MemoryError> {
        self.peer_reads += 1;
        let mut at = offset;
        for p in src.pieces() {
            let (key, off) = ((p.addr >> 32) as u32, (p.addr & 0xFFFF_FFFF) as usize);
            let bytes = self.peer.get(&key).ok_or(MemoryError)?;
            let piece = bytes.get(off..off + p.len as usize).ok_or(MemoryError)?;
            self.mem.write(region, at, piece)?;
            at += u64::from(p.len);
        }
        Ok(())
    }
}

/// Messages sent by reference: a WRITE and a SEND longer than the MTU travel as 64 KiB segments
/// of a few dozen bytes each, a lost segment is resent from its own offset (go-back-N over
/// reference segments), a SEND's segment scatters over two receive entries, a message of one
/// MTU keeps its bytes on the wire, and every byte lands.
#[test]
fn messages_by_reference_survive_a_loss_and_land_intact() {
    let (ia, ib) = (v4(127, 0, 0, 1), v4(127, 0, 0, 2));
    let mut qps = [
        Qp::new(0x11, QpParams::new(1, ia)),
        Qp::new(0x12, QpParams::new(1, ib)),
    ];
    let addrs = [ia, ib];
    for (i, qp) in qps.iter_mut().enumerate() {
        qp.modify(&QpAttr::init(Access::ALL)).unwrap();
        qp.modify(&QpAttr::rtr(
            addrs[1 - i],
            0x11 + (1 - i) as u32,
            Psn::new(0x100),
            Mtu::Mtu1024,
            4,
            1,
        ))
        .unwrap();
        qp.modify(&QpAttr::rts(Psn::new(0x100), 14, 7, 7, 4))
            .unwrap();
    }
    qps[0].set_peer_refs(Some(7));
    let mut mems = [VecMemory::new(), VecMemory::new()].map(|mem| RefMemory {
        mem,
        peer: Default::default(),
        peer_reads: 0,
    });
    const LEN: usize = 300_000;
    let ma = mems[0].mem.register(1, LEN, Access::ALL);
    let mb = mems[1].mem.register(1, LEN, Access::ALL);
    crate::soft::sim::Rng::new(9).fill(mems[0].mem.bytes_mut(ma.key).unwrap());
    let src = mems[0].mem.bytes(ma.key).unwrap().to_vec();
    mems[1].peer.insert(ma.key, src.clone());

    let two = SgeList::from_slice(&[
        Sge::new(mb.iova + 250_000, 30_000, mb.key),
        Sge::new(mb.iova + 280_000, 20_000, mb.key),
    ])
    .unwrap();
    qps[1].post_recv(RecvWqe::new(9, two)).unwrap();
    qps[0]
        .post_send(SendWqe::write(
            1,
            SendData::Sges(one_sge(ma, 0, 200_000)),
            mb.iova,
            mb.key,
        ))
        .unwrap();
    qps[0]
        .post_send(SendWqe::send(
            2,
            SendData::Sges(one_sge(ma, 200_000, 50_000)),
        ))
        .unwrap();
    qps[0]
        .post_send(SendWqe::write(
            3,
            SendData::Sges(one_sge(ma, 260_000, 1024)),
            mb.iova + 220_000,
            mb.key,
        ))
        .unwrap();

    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut solver = Ipv4IdSolver::new();
    let mut now = Instant::ZERO;
    let mut dropped = false;
    let mut largest = 0;
    let mut done: [Vec<Completion>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..1000 {
        let mut moved = false;
        for from in 0..2 {
            let to = 1 - from;
            while let Some(t) = qps[from].poll_transmit(now, &mut buf, &mut mems[from]) {
                moved = true;
                let d = buf[..t.len].to_vec();
                let v = view(&d);
                if from == 0 {
                    largest = largest.max(t.len);
                    // The second segment of the first WRITE is lost once.
                    if !dropped && v.psn() == Psn::new(0x101) {
                        assert!(v.peer_ref(), "a long WRITE goes by reference");
                        dropped = true;
                        continue;
                    }
                }
                let meta = RxMeta {
                    src: addrs[from],
                    src_port: t.src_port,
                    dst: addrs[to],
                    dst_port: ROCE,
                    ipv4_id: Some(0),
                };
                let caps = ChecksumCapabilities::default();
                let v = validate(&d, &meta, &caps, &mut solver).unwrap();
                let _ = qps[to].handle_packet(now, addrs[from], &v, &mut mems[to]);
            }
        }
        for (qp, out) in qps.iter_mut().zip(done.iter_mut()) {
            while let Some(c) = qp.poll_completion() {
                out.push(c);
            }
        }
        if done[0].len() == 3 {
            break;
        }
        if !moved {
            now = now + core::time::Duration::from_millis(100);
            for qp in qps.iter_mut() {
                if qp.poll_timeout().is_some_and(|t| t <= now) {
                    qp.handle_timeout(now);
                }
            }
        }
    }
    assert!(dropped);
    assert_eq!(done[0].len(), 3, "{:?}", done[0]);
    assert!(done[0].iter().all(Completion::is_ok), "{:?}", done[0]);
    assert_eq!(done[1].len(), 1);
    assert!(done[1][0].is_ok());
    assert_eq!(done[1][0].byte_len, 50_000);
    let got = mems[1].mem.bytes(mb.key).unwrap();
    assert!(got[..200_000] == src[..200_000], "the WRITE");
    assert!(
        got[250_000..300_000] == src[200_000..250_000],
        "the SEND, over two entries"
    );
    assert!(
        got[220_000..221_024] == src[260_000..261_024],
        "the one-MTU WRITE"
    );
    let c = qps[0].counters();
    assert!(c.retransmits > 0, "the lost segment was resent");
    // 200 000 bytes in 4 segments and 50 000 in 1, plus resends; the one-MTU WRITE by bytes.
    assert!(c.peer_ref_sent >= 5, "{c:?}");
    assert_eq!(
        qps[1].counters().peer_ref_received as usize,
        mems[1].peer_reads - 1
    );
    assert_eq!(
        largest,
        40 + 1024 + 4 - 12,
        "only the one-MTU WRITE carried bytes"
    );
}

/// A message keeps the form it started in: a WRITE whose first packets left as bytes is resent
/// (after a timeout) as bytes, even though the peer began taking references meanwhile; the next
/// message goes by reference. Both land intact.
#[test]
fn a_message_keeps_its_form_when_the_peer_starts_taking_references() {
    let (ia, ib) = (v4(127, 0, 0, 1), v4(127, 0, 0, 2));
    let mut a = Qp::new(0x11, QpParams::new(1, ia));
    let mut b = Qp::new(0x12, QpParams::new(1, ib));
    for (qp, peer, dest) in [(&mut a, ib, 0x12), (&mut b, ia, 0x11)] {
        qp.modify(&QpAttr::init(Access::ALL)).unwrap();
        qp.modify(&QpAttr::rtr(
            peer,
            dest,
            Psn::new(0x100),
            Mtu::Mtu1024,
            4,
            1,
        ))
        .unwrap();
        qp.modify(&QpAttr::rts(Psn::new(0x100), 14, 7, 7, 4))
            .unwrap();
    }
    let mut ma_mem = RefMemory {
        mem: VecMemory::new(),
        peer: Default::default(),
        peer_reads: 0,
    };
    let mut mb_mem = RefMemory {
        mem: VecMemory::new(),
        peer: Default::default(),
        peer_reads: 0,
    };
    let ma = ma_mem.mem.register(1, 20_000, Access::ALL);
    let mb = mb_mem.mem.register(1, 20_000, Access::ALL);
    crate::soft::sim::Rng::new(5).fill(ma_mem.mem.bytes_mut(ma.key).unwrap());
    let src = ma_mem.mem.bytes(ma.key).unwrap().to_vec();
    mb_mem.peer.insert(ma.key, src.clone());
    a.post_send(SendWqe::write(
        1,
        SendData::Sges(one_sge(ma, 0, 3000)),
        mb.iova,
        mb.key,
    ))
    .unwrap();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    // The first packet leaves as bytes, and is lost.
    let t = a
        .poll_transmit(Instant::ZERO, &mut buf, &mut ma_mem)
        .unwrap();
    assert!(!view(&buf[..t.len]).peer_ref());
    a.set_peer_refs(Some(7));
    a.post_send(SendWqe::write(
        2,
        SendData::Sges(one_sge(ma, 10_000, 9000)),
        mb.iova + 10_000,
        mb.key,
    ))
    .unwrap();
    let mut now = Instant::ZERO;
    let mut forms = Vec::new();
    let mut solver = Ipv4IdSolver::new();
    let caps = ChecksumCapabilities::default();
    let mut done = Vec::new();
    for _ in 0..50 {
        now = now + core::time::Duration::from_millis(200);
        a.handle_timeout(now);
        while let Some(t) = a.poll_transmit(now, &mut buf, &mut ma_mem) {
            let d = buf[..t.len].to_vec();
            let meta = RxMeta {
                src: ia,
                src_port: t.src_port,
                dst: ib,
                dst_port: ROCE,
                ipv4_id: Some(0),
            };
            let v = validate(&d, &meta, &caps, &mut solver).unwrap();
            forms.push((v.psn().value(), v.peer_ref()));
            let _ = b.handle_packet(now, ia, &v, &mut mb_mem);
        }
        while let Some(t) = b.poll_transmit(now, &mut buf, &mut mb_mem) {
            let d = buf[..t.len].to_vec();
            let meta = RxMeta {
                src: ib,
                src_port: t.src_port,
                dst: ia,
                dst_port: ROCE,
                ipv4_id: Some(0),
            };
            let v = validate(&d, &meta, &caps, &mut solver).unwrap();
            let _ = a.handle_packet(now, ib, &v, &mut ma_mem);
        }
        while let Some(c) = a.poll_completion() {
            done.push(c);
        }
        if done.len() == 2 {
            break;
        }
    }
    assert_eq!(done.len(), 2, "{done:?}");
    assert!(done.iter().all(Completion::is_ok), "{done:?}");
    // The first WRITE's three packets (0x100–0x102) as bytes, then the second in one reference.
    assert!(
        forms.iter().filter(|f| f.0 <= 0x102).all(|f| !f.1),
        "{forms:x?}"
    );
    assert_eq!(
        forms.iter().filter(|f| f.0 == 0x103).count(),
        1,
        "{forms:x?}"
    );
    assert!(forms.iter().any(|f| f.0 == 0x103 && f.1), "{forms:x?}");
    let got = mb_mem.mem.bytes(mb.key).unwrap();
    assert!(got[..3000] == src[..3000]);
    assert!(got[10_000..19_000] == src[10_000..19_000]);
}

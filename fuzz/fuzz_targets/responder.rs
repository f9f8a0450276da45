//! A soft device holding registered memory, fed arbitrary datagrams as if from its connected
//! peer (and from strangers): raw bytes, and well-formed packets with fuzzed opcodes, PSNs near
//! the expected ones, keys picked from the device's own (and foreign) keys, addresses around the
//! regions' edges. The device also has requests of its own outstanding, so responses reach the
//! completer.
//!
//! Invariants (a panic is a finding): no panic anywhere; every memory access the protocol makes
//! lies inside a live region and is one the region's rights allow (see `Guarded`); regions the
//! peer was never granted keep their bytes; every datagram the device emits is a well-formed
//! RoCEv2 packet addressed to the peer's queue pair.
//!
//! ICRC verification is compiled out under `cfg(fuzzing)`, so mutations reach the state machines.

#![no_main]

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use erdma::soft::proto::{
    Instant, MAX_DATAGRAM, Qp, QpParams, RecvWqe, RxMeta, SendData, SendWqe, SgeList, validate,
};
use erdma::soft::sim::{MrInfo, VecMemory};
use erdma::{Access, Mtu, QpAttr, QpState, Sge};
use erdma::soft::wire::{
    ChecksumCapabilities, Headers, IcrcHeaders, IpPair, OpFlags, Opcode, PacketView, Psn, aeth,
    atomic_eth, packet, reth,
};
use erdma_fuzz::{Allowed, Guarded};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const PEER: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1));
const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
const RQ_PSN: u32 = 0x100; // what the device expects from the peer
const SQ_PSN: u32 = 0x200; // what the device sends
const REGION: usize = 4096;

struct World {
    /// The device's queue pair, talking to the peer's `qa`.
    qp: Qp,
    mem: VecMemory,
    qa: u32,
    qb: u32,
    policy: HashMap<u32, Allowed>,
    /// Keys a hostile peer may name: every region of the device, plus a dead one.
    keys: Vec<u32>,
    regions: Vec<MrInfo>,
    recv: MrInfo,
    dst: MrInfo,
    src: MrInfo,
    /// Regions whose bytes must never change.
    frozen: Vec<MrInfo>,
    now: Instant,
    out: Vec<u8>,
}

fn sgl(m: MrInfo, off: u64, len: u32) -> SgeList {
    SgeList::from_slice(&[Sge::new(m.iova + off, len, m.key)]).unwrap()
}

/// RESET → RTS towards the peer's queue pair `qa`.
fn connect(qp: &mut Qp, qa: u32) {
    qp.modify(&QpAttr::init(Access::ALL)).unwrap();
    qp.modify(&QpAttr::rtr(PEER, qa, Psn::new(RQ_PSN), Mtu::Mtu256, 4, 1))
        .unwrap();
    qp.modify(&QpAttr::rts(Psn::new(SQ_PSN), 8, 7, 7, 16))
        .unwrap();
}

impl World {
    fn new() -> World {
        let (qa, qb) = (0x11, 0x12);
        let mut params = QpParams::new(1, LOCAL);
        params.caps.max_send_wr = 16;
        params.caps.max_recv_wr = 16;
        params.checksum = ChecksumCapabilities::ignored();
        let mut qp = Qp::new(qb, params);
        connect(&mut qp, qa);
        let mut mem = VecMemory::new();
        let granted = mem.register(1, REGION, Access::ALL);
        let readonly = mem.register(1, REGION, Access::REMOTE_READ);
        let writeonly = mem.register(1, REGION, Access::REMOTE_WRITE | Access::LOCAL_WRITE);
        let secret = mem.register(1, REGION, Access::LOCAL_WRITE);
        let other_pd = mem.register(2, REGION, Access::ALL);
        let recv = mem.register(1, REGION, Access::LOCAL_WRITE);
        let dst = mem.register(1, REGION, Access::LOCAL_WRITE);
        let src = mem.register(1, REGION, Access::empty());
        let dead = mem.register(1, REGION, Access::ALL);
        mem.deregister(dead.key);
        for m in [readonly, secret, other_pd, src, dead] {
            mem.bytes_mut(m.key).unwrap().fill(0x5A);
        }
        let mut policy = HashMap::new();
        policy.insert(granted.key, Allowed::ALL);
        policy.insert(readonly.key, Allowed::READ);
        policy.insert(writeonly.key, Allowed::ALL);
        policy.insert(recv.key, Allowed::ALL);
        policy.insert(dst.key, Allowed::ALL);
        policy.insert(src.key, Allowed::READ);
        let regions = vec![
            granted, readonly, writeonly, secret, other_pd, recv, dst, src, dead,
        ];
        let keys = regions.iter().map(|m| m.key).collect();
        let mut w = World {
            qp,
            mem,
            qa,
            qb,
            policy,
            keys,
            regions,
            recv,
            dst,
            src,
            frozen: vec![readonly, secret, other_pd, src, dead],
            now: Instant::ZERO,
            out: vec![0; MAX_DATAGRAM],
        };
        w.post_own_requests();
        w
    }

    /// Requests of the device's own, so fuzzed responses have something to answer.
    fn post_own_requests(&mut self) {
        let (src, dst) = (self.src, self.dst);
        let qp = &mut self.qp;
        let _ = qp.post_send(SendWqe::send(1, SendData::Sges(sgl(src, 0, 300))));
        let _ = qp.post_send(SendWqe::read(2, sgl(dst, 0, 600), 0x10_0000, 0x100));
        let _ = qp.post_send(SendWqe::fetch_add(
            3,
            Sge::new(dst.iova + 1024, 8, dst.key),
            0x10_0000,
            0x100,
            1,
        ));
        let _ = qp.post_send(SendWqe::write(
            4,
            SendData::Sges(sgl(src, 8, 40)),
            0x10_0000,
            0x100,
        ));
        for i in 0..4 {
            let _ = qp.post_recv(RecvWqe::new(10 + i, sgl(self.recv, i * 1024, 1024)));
        }
    }

    fn revive(&mut self) {
        self.qp
            .modify(&QpAttr::to_state(QpState::Reset))
            .unwrap();
        connect(&mut self.qp, self.qa);
        self.post_own_requests();
    }

    fn deliver(&mut self, src: IpAddr, datagram: &[u8]) {
        let meta = RxMeta {
            src,
            src_port: 4791,
            dst: LOCAL,
            dst_port: 4791,
            ipv4_id: Some(0),
        };
        let mut mem = Guarded {
            inner: &mut self.mem,
            policy: &self.policy,
        };
        // The device's own checks (ICRC off under fuzzing), then its routing by QPN.
        let caps = ChecksumCapabilities::ignored();
        let mut solver = erdma::soft::wire::Ipv4IdSolver::new();
        if let Ok(view) = validate(datagram, &meta, &caps, &mut solver)
            && view.dest_qpn() == self.qb
        {
            let _ = self.qp.handle_packet(self.now, src, &view, &mut mem);
        }
        self.pump();
    }

    fn pump(&mut self) {
        let mut mem = Guarded {
            inner: &mut self.mem,
            policy: &self.policy,
        };
        let mut sent = 0;
        while let Some(t) = self.qp.poll_transmit(self.now, &mut self.out, &mut mem) {
            let view = PacketView::new_checked(&self.out[..t.len])
                .expect("the device emits well-formed packets");
            assert_eq!(view.dest_qpn(), self.qa, "emitted to the peer's queue pair");
            assert_eq!(t.dst.ip(), PEER, "emitted to the peer");
            sent += 1;
            assert!(sent < 10_000, "a transmit loop that never ends");
        }
        while self.qp.poll_completion().is_some() {}
    }

    fn advance(&mut self, by: Duration) {
        self.now = self.now + by;
        if self.qp.poll_timeout().is_some_and(|t| t <= self.now) {
            self.qp.handle_timeout(self.now);
        }
        self.pump();
    }

    fn check_frozen(&self) {
        for m in &self.frozen {
            assert!(
                self.mem.bytes(m.key).unwrap().iter().all(|&x| x == 0x5A),
                "protected region {:#x} changed",
                m.key
            );
        }
    }

    fn key(&self, u: &mut Unstructured<'_>) -> Result<u32> {
        Ok(if u.ratio(1, 8)? {
            u.arbitrary()?
        } else {
            *u.choose(&self.keys)?
        })
    }

    /// An address near the edges of a region (or anywhere).
    fn va(&self, u: &mut Unstructured<'_>) -> Result<u64> {
        if u.ratio(1, 8)? {
            return u.arbitrary();
        }
        let m = u.choose(&self.regions)?;
        let off: i64 = match u.int_in_range(0..=3)? {
            0 => u.int_in_range(-64..=64)?,
            1 => REGION as i64 + u.int_in_range(-64..=64)?,
            _ => u.int_in_range(0..=REGION as i64)?,
        };
        Ok(m.iova.wrapping_add_signed(off))
    }

    fn structured(&mut self, u: &mut Unstructured<'_>) -> Result<()> {
        let raw: u8 = if u.ratio(1, 16)? {
            u.arbitrary()?
        } else {
            u.int_in_range(0..=0x17)?
        };
        let opcode = Opcode::from(raw);
        let Some(flags) = opcode.flags() else {
            return Ok(());
        };
        let base = if flags.contains(OpFlags::RESPONSE) {
            SQ_PSN
        } else {
            RQ_PSN
        };
        let psn = if u.ratio(1, 16)? {
            Psn::new(u.arbitrary()?)
        } else {
            Psn::new(base).wrapping_add(u.int_in_range(0..=24)?)
        };
        let dest_qpn = if u.ratio(1, 32)? {
            u.arbitrary::<u32>()? & 0xFF_FFFF
        } else {
            self.qb
        };
        let mut h = Headers::new(opcode, dest_qpn, psn);
        h.ack_req = u.arbitrary()?;
        h.solicited = u.arbitrary()?;
        if flags.contains(OpFlags::RETH) {
            h.reth = Some(reth::Repr {
                va: self.va(u)?,
                rkey: self.key(u)?,
                dma_len: if u.ratio(1, 8)? {
                    u.arbitrary()?
                } else {
                    u.int_in_range(0..=2 * REGION as u32)?
                },
            });
        }
        if flags.contains(OpFlags::ATOMIC_ETH) {
            h.atomic_eth = Some(atomic_eth::Repr {
                va: self.va(u)?,
                rkey: self.key(u)?,
                swap_add: u.arbitrary()?,
                compare: u.arbitrary()?,
            });
        }
        if flags.contains(OpFlags::AETH) {
            h.aeth = Some(aeth::Repr {
                syndrome: aeth::Syndrome::from(u.arbitrary::<u8>()?),
                msn: u.arbitrary::<u32>()? & 0xFF_FFFF,
            });
        }
        if flags.contains(OpFlags::ATOMIC_ACK_ETH) {
            h.atomic_ack_eth = Some(u.arbitrary()?);
        }
        if flags.contains(OpFlags::IMMDT) {
            h.immdt = Some(u.arbitrary()?);
        }
        if flags.contains(OpFlags::IETH) {
            h.ieth = Some(self.key(u)?);
        }
        let payload_len = if flags.contains(OpFlags::PAYLOAD) {
            u.int_in_range(0..=300usize)?
        } else {
            0
        };
        let payload: Vec<u8> = (0..payload_len).map(|i| i as u8).collect();
        let mut buf = vec![0u8; h.buffer_len(payload_len).unwrap()];
        let ih = IcrcHeaders {
            ip: IpPair::new(PEER, LOCAL).unwrap(),
            ipv4_id: 0,
            src_port: 4791,
            dst_port: 4791,
        };
        let n = packet::emit(
            &mut buf,
            &h,
            &payload,
            &ih,
            &ChecksumCapabilities::default(),
        )
        .expect("headers built from the opcode's flags");
        let src = if u.ratio(1, 32)? {
            IpAddr::V4(Ipv4Addr::new(127, 0, 0, 9))
        } else {
            PEER
        };
        self.deliver(src, &buf[..n]);
        Ok(())
    }

    fn step(&mut self, u: &mut Unstructured<'_>) -> Result<()> {
        match u.int_in_range(0..=9)? {
            0 => {
                let len = u.int_in_range(0..=200usize)?;
                let mut d = u.bytes(len)?.to_vec();
                if d.len() >= 8 && u.arbitrary()? {
                    d[5..8].copy_from_slice(&self.qb.to_be_bytes()[1..]);
                }
                self.deliver(PEER, &d);
            }
            1 => self.advance(Duration::from_micros(u.int_in_range(1..=2_000_000)?)),
            2 => {
                let i: u64 = u.int_in_range(0..=3)?;
                let _ = self
                    .qp
                    .post_recv(RecvWqe::new(20 + i, sgl(self.recv, i * 1024, 1024)));
            }
            3 => {
                if self.qp.state() == QpState::Err {
                    self.revive();
                }
            }
            _ => self.structured(u)?,
        }
        self.check_frozen();
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let mut w = World::new();
    let mut u = Unstructured::new(data);
    let mut steps = 0;
    while !u.is_empty() && steps < 256 {
        if w.step(&mut u).is_err() {
            break;
        }
        steps += 1;
    }
    // Let every timer run out: retries end in bounded (virtual) time.
    for _ in 0..64 {
        w.advance(Duration::from_secs(2));
    }
    w.check_frozen();
});

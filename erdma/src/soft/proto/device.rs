//! The device level: receive checks every datagram passes before a queue pair sees it, drop
//! reasons and counters, and a QPN-routed table of queue pairs.
//!
//! Owns what rxe checks before its per-QP state machines: structure and lengths, TVer, P_Key,
//! the ICRC (per [`ChecksumCapabilities`]), and the destination QPN. Bad input is a counted drop
//! with a reason, never a panic.

use std::collections::HashMap;
use std::net::IpAddr;

use super::Instant;
use super::memory::Memory;
use super::qp::{Qp, QpParams, Transmit};
use crate::soft::wire::{
    self, ChecksumCapabilities, IcrcHeaders, IpPair, Ipv4IdSolver, PacketView, icrc,
};
use crate::vocab::Completion;

/// Why a packet was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DropReason {
    /// Shorter than its headers and ICRC.
    Truncated = 0,
    /// Inconsistent lengths (pad, payload on an opcode without one).
    Malformed = 1,
    /// Not an RC opcode (other transports, unknown values).
    UnknownOpcode = 2,
    /// BTH.TVer is not 0.
    BadVersion = 3,
    /// The P_Key does not match 0xFFFF.
    BadPkey = 4,
    /// The ICRC is wrong.
    BadIcrc = 5,
    /// Source and destination of different address families.
    AddressFamily = 6,
    /// Not addressed to this device's address.
    WrongDestination = 7,
    /// No queue pair has the destination QPN.
    UnknownQp = 8,
    /// Not from the queue pair's peer address.
    WrongSource = 9,
    /// The queue pair's state does not accept this packet.
    QpNotReady = 10,
    /// A request ahead of the expected PSN (answered by a sequence NAK once), or a read response
    /// after a gap.
    OutOfSequence = 11,
    /// A response for a request already completed, or a duplicate that cannot be replayed.
    Stale = 12,
    /// A response for a PSN never sent.
    Unsolicited = 13,
    /// No receive posted (answered by an RNR NAK).
    ReceiverNotReady = 14,
    /// More outstanding READs/atomics than the responder serves, or its reply queue is full.
    ResponderBusy = 15,
}

impl DropReason {
    /// Number of reasons.
    pub const COUNT: usize = 16;

    /// Every reason, in numeric order.
    pub const ALL: [DropReason; Self::COUNT] = [
        DropReason::Truncated,
        DropReason::Malformed,
        DropReason::UnknownOpcode,
        DropReason::BadVersion,
        DropReason::BadPkey,
        DropReason::BadIcrc,
        DropReason::AddressFamily,
        DropReason::WrongDestination,
        DropReason::UnknownQp,
        DropReason::WrongSource,
        DropReason::QpNotReady,
        DropReason::OutOfSequence,
        DropReason::Stale,
        DropReason::Unsolicited,
        DropReason::ReceiverNotReady,
        DropReason::ResponderBusy,
    ];

    /// The reason in snake case, as the port counters name it (`drop_<name>`).
    pub fn name(self) -> &'static str {
        match self {
            DropReason::Truncated => "truncated",
            DropReason::Malformed => "malformed",
            DropReason::UnknownOpcode => "unknown_opcode",
            DropReason::BadVersion => "bad_version",
            DropReason::BadPkey => "bad_pkey",
            DropReason::BadIcrc => "bad_icrc",
            DropReason::AddressFamily => "address_family",
            DropReason::WrongDestination => "wrong_destination",
            DropReason::UnknownQp => "unknown_qp",
            DropReason::WrongSource => "wrong_source",
            DropReason::QpNotReady => "qp_not_ready",
            DropReason::OutOfSequence => "out_of_sequence",
            DropReason::Stale => "stale",
            DropReason::Unsolicited => "unsolicited",
            DropReason::ReceiverNotReady => "receiver_not_ready",
            DropReason::ResponderBusy => "responder_busy",
        }
    }
}

impl From<wire::Error> for DropReason {
    fn from(e: wire::Error) -> DropReason {
        match e {
            wire::Error::Truncated => DropReason::Truncated,
            wire::Error::Malformed => DropReason::Malformed,
            wire::Error::UnknownOpcode(_) => DropReason::UnknownOpcode,
            wire::Error::BadVersion(_) => DropReason::BadVersion,
        }
    }
}

/// Drop counts by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DropCounters {
    counts: [u64; DropReason::COUNT],
}

impl DropCounters {
    /// Counts one drop.
    pub fn count(&mut self, why: DropReason) {
        self.counts[why as usize] += 1;
    }

    /// Drops for `why`.
    pub fn get(&self, why: DropReason) -> u64 {
        self.counts[why as usize]
    }

    /// All drops.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Adds every count of `other`.
    pub fn add(&mut self, other: &DropCounters) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
    }

    /// `(reason, count)` for every reason with a non-zero count.
    pub fn nonzero(&self) -> impl Iterator<Item = (DropReason, u64)> + '_ {
        DropReason::ALL
            .iter()
            .map(|&r| (r, self.get(r)))
            .filter(|&(_, n)| n > 0)
    }
}

/// The IP and UDP facts of a received datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxMeta {
    /// Source address.
    pub src: IpAddr,
    /// Source UDP port.
    pub src_port: u16,
    /// Destination address.
    pub dst: IpAddr,
    /// Destination UDP port.
    pub dst_port: u16,
    /// The IPv4 identification, when the receiver could see it; `None` makes the ICRC check
    /// solve for it (see [`wire::icrc`]).
    pub ipv4_id: Option<u16>,
}

/// The device-level receive checks: structure, TVer = 0, P_Key 0xFFFF/0x7FFF, and the ICRC
/// (when `caps` verifies it). Returns the checked view; its `dest_qpn()` routes it.
///
/// # Errors
/// The reason to drop the datagram.
pub fn validate<'a>(
    datagram: &'a [u8],
    meta: &RxMeta,
    caps: &ChecksumCapabilities,
    solver: &mut Ipv4IdSolver,
) -> Result<PacketView<'a>, DropReason> {
    let view = PacketView::new_checked(datagram)?;
    if view.tver() != 0 {
        return Err(DropReason::BadVersion);
    }
    // Low 15 bits equal and at least one full member: the device's P_Key is 0xFFFF.
    if view.pkey() & 0x7FFF != 0x7FFF {
        return Err(DropReason::BadPkey);
    }
    let ip = IpPair::new(meta.src, meta.dst).ok_or(DropReason::AddressFamily)?;
    if caps.icrc.rx() {
        let ok = match (ip, meta.ipv4_id) {
            (IpPair::V4 { src, dst }, None) => solver
                .solve(src, dst, meta.src_port, meta.dst_port, datagram)
                .is_some(),
            (ip, id) => {
                let h = IcrcHeaders {
                    ip,
                    ipv4_id: id.unwrap_or(0),
                    src_port: meta.src_port,
                    dst_port: meta.dst_port,
                };
                icrc::verify(&h, datagram)
            }
        };
        if !ok {
            return Err(DropReason::BadIcrc);
        }
    }
    Ok(view)
}

/// Device-wide counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Datagrams handed to the device.
    pub datagrams_received: u64,
    /// Datagrams emitted.
    pub datagrams_sent: u64,
    /// Drops before a queue pair saw the packet.
    pub drops: DropCounters,
}

/// A soft device's queue pairs, routed by QPN.
#[derive(Debug)]
pub struct Device {
    local: IpAddr,
    caps: ChecksumCapabilities,
    solver: Ipv4IdSolver,
    qps: Vec<Qp>,
    index: HashMap<u32, usize>,
    next_qpn: u32,
    tx_next: usize,
    cq_next: usize,
    counters: DeviceCounters,
}

/// First QPN handed out (rxe's user QPs start here too).
const FIRST_QPN: u32 = 0x11;

impl Device {
    /// A device at `local` (its GID is this address, v4-mapped for IPv4).
    pub fn new(local: IpAddr, caps: ChecksumCapabilities) -> Device {
        Device {
            local,
            caps,
            solver: Ipv4IdSolver::new(),
            qps: Vec::new(),
            index: HashMap::new(),
            next_qpn: FIRST_QPN,
            tx_next: 0,
            cq_next: 0,
            counters: DeviceCounters::default(),
        }
    }

    /// The device's address.
    pub fn local_addr(&self) -> IpAddr {
        self.local
    }

    /// Counters.
    pub fn counters(&self) -> &DeviceCounters {
        &self.counters
    }

    /// Creates a queue pair (in RESET) and returns its QPN. The configuration's address and ICRC
    /// switches are replaced by the device's.
    pub fn create_qp(&mut self, cfg: QpParams) -> u32 {
        while self.index.contains_key(&self.next_qpn) || self.next_qpn < FIRST_QPN {
            self.next_qpn = (self.next_qpn + 1) & 0x00FF_FFFF;
        }
        let qpn = self.next_qpn;
        self.next_qpn = (self.next_qpn + 1) & 0x00FF_FFFF;
        let cfg = QpParams {
            local_addr: self.local,
            checksum: self.caps,
            ..cfg
        };
        self.index.insert(qpn, self.qps.len());
        self.qps.push(Qp::new(qpn, cfg));
        qpn
    }

    /// Removes a queue pair.
    pub fn destroy_qp(&mut self, qpn: u32) -> Option<Qp> {
        let i = self.index.remove(&qpn)?;
        let qp = self.qps.swap_remove(i);
        if let Some(moved) = self.qps.get(i) {
            self.index.insert(moved.qpn(), i);
        }
        Some(qp)
    }

    /// The queue pair `qpn`.
    pub fn qp(&self, qpn: u32) -> Option<&Qp> {
        self.qps.get(*self.index.get(&qpn)?)
    }

    /// The queue pair `qpn`, mutably (post, modify).
    pub fn qp_mut(&mut self, qpn: u32) -> Option<&mut Qp> {
        let i = *self.index.get(&qpn)?;
        self.qps.get_mut(i)
    }

    /// Every QPN.
    pub fn qpns(&self) -> impl Iterator<Item = u32> + '_ {
        self.qps.iter().map(Qp::qpn)
    }

    /// Checks a received UDP payload and hands it to its queue pair. Returns the QPN.
    ///
    /// # Errors
    /// The reason the datagram was dropped (counted here, or in the queue pair's counters once
    /// it reached one).
    pub fn handle_datagram<M: Memory + ?Sized>(
        &mut self,
        now: Instant,
        meta: &RxMeta,
        datagram: &[u8],
        mem: &mut M,
    ) -> Result<u32, DropReason> {
        self.counters.datagrams_received += 1;
        let r = if meta.dst != self.local {
            Err(DropReason::WrongDestination)
        } else {
            validate(datagram, meta, &self.caps, &mut self.solver)
        };
        let view = r.inspect_err(|&why| self.counters.drops.count(why))?;
        let qpn = view.dest_qpn();
        let Some(&i) = self.index.get(&qpn) else {
            self.counters.drops.count(DropReason::UnknownQp);
            return Err(DropReason::UnknownQp);
        };
        self.qps[i].handle_packet(now, meta.src, &view, mem)?;
        Ok(qpn)
    }

    /// The next datagram from any queue pair (round robin).
    pub fn poll_transmit<M: Memory + ?Sized>(
        &mut self,
        now: Instant,
        buf: &mut [u8],
        mem: &mut M,
    ) -> Option<Transmit> {
        let n = self.qps.len();
        for k in 0..n {
            let i = (self.tx_next + k) % n;
            if let Some(t) = self.qps[i].poll_transmit(now, buf, mem) {
                self.tx_next = (i + 1) % n;
                self.counters.datagrams_sent += 1;
                return Some(t);
            }
        }
        None
    }

    /// The earliest timer deadline over all queue pairs.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.qps.iter().filter_map(Qp::poll_timeout).min()
    }

    /// Runs the timers due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        for qp in &mut self.qps {
            if qp.poll_timeout().is_some_and(|t| t <= now) {
                qp.handle_timeout(now);
            }
        }
    }

    /// The next completion from any queue pair (round robin over queue pairs; in order within
    /// one).
    pub fn poll_completion(&mut self) -> Option<Completion> {
        let n = self.qps.len();
        for k in 0..n {
            let i = (self.cq_next + k) % n;
            if let Some(c) = self.qps[i].poll_completion() {
                self.cq_next = (i + 1) % n;
                return Some(c);
            }
        }
        None
    }
}

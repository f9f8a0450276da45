//! The device level: receive checks every datagram passes before a queue pair sees it, drop
//! reasons and counters.
//!
//! Owns what rxe checks before its per-QP state machines: structure and lengths, TVer, P_Key,
//! the ICRC (per [`ChecksumCapabilities`]), and the destination QPN. Bad input is a counted drop
//! with a reason, never a panic.

use std::net::IpAddr;

use crate::soft::wire::peer_ref::PeerRefs;
use crate::soft::wire::{
    self, ChecksumCapabilities, IcrcHeaders, IpPair, Ipv4IdSolver, OpFlags, PacketView, icrc,
};

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
    /// A same-host reference packet ([`wire::peer_ref`]) from a sender that has not proved it
    /// shares this host, or to a device that does not take them.
    PeerRefRefused = 16,
}

impl DropReason {
    /// Number of reasons.
    pub const COUNT: usize = 17;

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
        DropReason::PeerRefRefused,
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
            DropReason::PeerRefRefused => "peer_ref_refused",
        }
    }
}

impl From<wire::PacketError> for DropReason {
    fn from(e: wire::PacketError) -> DropReason {
        match e {
            wire::PacketError::Truncated => DropReason::Truncated,
            wire::PacketError::Malformed => DropReason::Malformed,
            wire::PacketError::UnknownOpcode(_) => DropReason::UnknownOpcode,
            wire::PacketError::BadVersion(_) => DropReason::BadVersion,
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
    // The peer-reference bit: SEND and WRITE packets with a payload only, which must be a
    // well-formed list. Whether the sender may use it at all is the driver's check.
    if view.peer_ref() {
        let f = view.flags();
        if !f.contains(OpFlags::PAYLOAD)
            || !f.intersects(OpFlags::SEND | OpFlags::WRITE)
            || view.pad_count() != 0
            || PeerRefs::parse(view.payload()).is_err()
        {
            return Err(DropReason::Malformed);
        }
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

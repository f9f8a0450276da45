//! What the three state machines of a queue pair share: its attributes as they stand, the
//! queues, timers, counters and pending completions ([`Shared`]), and the memory walks every
//! machine makes over scatter/gather lists ([`gather`], [`scatter`], [`check_local`]).

use core::time::Duration;
use std::collections::VecDeque;
use std::net::IpAddr;

use super::ack_timeout;
use super::device::DropReason;
use super::memory::Memory;
use super::qp::{Lent, QpAsyncError, QpCounters, QpParams};
use super::queue::{RecvQueue, SendQueue, SqEntry};
use super::timer::TimerTable;
use super::wr::{SendData, SgeList};
use crate::soft::wire::peer_ref::{MAX_PIECES, PeerRefs};
use crate::soft::wire::{Headers, IcrcHeaders, PacketWriter, Psn};
use crate::vocab::{
    Access, AddressVector, Completion, Mtu, QpState, SendFlags, WcOpcode, WcStatus, WrOpcode,
};

/// Current values of the modifiable attributes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Attrs {
    pub pkey_index: u16,
    pub port: u8,
    pub access: Access,
    pub mtu: Mtu,
    pub dest_qpn: u32,
    pub rq_psn: Psn,
    pub sq_psn: Psn,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub peer: Option<IpAddr>,
    /// The route as given (the peer's GID and the rest, for queries).
    pub av: Option<AddressVector>,
}

impl Default for Attrs {
    fn default() -> Attrs {
        Attrs {
            pkey_index: 0,
            port: 1,
            access: Access::empty(),
            mtu: Mtu::Mtu256,
            dest_qpn: 0,
            rq_psn: Psn::ZERO,
            sq_psn: Psn::ZERO,
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            peer: None,
            av: None,
        }
    }
}

/// What the three state machines share.
#[derive(Debug)]
pub(super) struct Shared {
    pub qpn: u32,
    pub cfg: QpParams,
    pub attrs: Attrs,
    pub state: QpState,
    pub sq: SendQueue,
    pub rq: RecvQueue,
    pub timers: TimerTable,
    pub cq: VecDeque<Completion>,
    pub counters: QpCounters,
    /// IP/UDP fields of every packet sent (valid once the peer is known).
    pub icrc: IcrcHeaders,
    /// A machine hit an error that moves the queue pair to ERR.
    pub fatal: bool,
    /// An error no work request can report, for the owner's asynchronous events (taken by
    /// [`Qp::take_async_error`]).
    pub async_error: Option<QpAsyncError>,
    /// The payload of the datagram just written, when the memory lent it.
    pub lent: Option<Lent>,
    /// The peer accepts same-host reference packets carrying this token
    /// ([`super::Qp::set_peer_refs`]).
    pub peer_refs: Option<u64>,
}

impl Shared {
    pub fn mtu(&self) -> u32 {
        self.attrs.mtu.bytes()
    }

    pub fn ack_timeout(&self) -> Option<Duration> {
        ack_timeout(self.attrs.timeout)
    }

    /// Starts a datagram in `buf` (headers written); `None` when `buf` is too small.
    pub fn writer<'b>(
        &self,
        buf: &'b mut [u8],
        h: &Headers,
        payload_len: usize,
    ) -> Option<PacketWriter<'b>> {
        PacketWriter::new(buf, h, payload_len).ok()
    }

    /// Finishes a datagram (ICRC) and returns its length.
    pub fn finish(&self, w: PacketWriter<'_>) -> usize {
        w.finish(&self.icrc, &self.cfg.checksum)
    }

    /// Finishes a datagram whose payload `mem` lent (its ICRC covers the lent bytes) and
    /// records where they go.
    pub fn finish_lent<M: Memory + ?Sized>(&mut self, w: PacketWriter<'_>, mem: &mut M) -> usize {
        let (at, len) = w.payload_range();
        self.lent = Some(Lent { at, len });
        w.finish_lent(&self.icrc, &self.cfg.checksum, |h| mem.hash_lent(h))
    }

    /// Queues the send completion of `e`: always for errors, otherwise if signaled.
    pub fn complete_send(&mut self, e: &SqEntry, status: WcStatus) {
        let signaled = self.cfg.sq_sig_all || e.wqe.flags.contains(SendFlags::SIGNALED);
        if status != WcStatus::Success || signaled {
            let mut c =
                Completion::new(e.wqe.wr_id, status, send_wc_opcode(e.wqe.opcode), self.qpn);
            c.byte_len = e.len;
            self.cq.push_back(c);
        }
    }

    /// Queues a receive completion.
    pub fn complete_recv(
        &mut self,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u32,
    ) -> &mut Completion {
        let mut c = Completion::new(wr_id, status, opcode, self.qpn);
        c.byte_len = byte_len;
        c.src_qp = self.attrs.dest_qpn;
        self.cq.push_back(c);
        let last = self.cq.len() - 1;
        &mut self.cq[last]
    }

    /// Counts a dropped packet.
    pub fn drop_packet(&mut self, why: DropReason) -> DropReason {
        self.counters.drops.count(why);
        why
    }
}

/// The completion opcode of a send work request.
pub(super) fn send_wc_opcode(op: WrOpcode) -> WcOpcode {
    match op {
        WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::SendWithInv => WcOpcode::Send,
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
        WrOpcode::RdmaRead => WcOpcode::RdmaRead,
        WrOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
        WrOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
    }
}

/// Why a scatter/gather copy failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SgError {
    /// A key, protection domain, range or right refused (or the copy failed).
    Protection,
    /// More bytes than the entries hold.
    Length,
}

/// Copies `dst.len()` bytes starting `offset` bytes into the local data of a work request.
/// Checks every entry's key, protection domain and range. Bytes that lie in one entry are
/// offered to `mem` to lend instead ([`Memory::lend`]); returns whether it took them (then
/// `dst` is left as it was).
pub(super) fn gather<M: Memory + ?Sized>(
    mem: &mut M,
    pd: u32,
    data: &SendData,
    offset: u32,
    dst: &mut [u8],
) -> Result<bool, SgError> {
    if dst.is_empty() {
        return Ok(false);
    }
    let sges = match data {
        SendData::Inline(d) => {
            let start = offset as usize;
            let src = d
                .as_bytes()
                .get(start..start + dst.len())
                .ok_or(SgError::Length)?;
            dst.copy_from_slice(src);
            return Ok(false);
        }
        SendData::Sges(l) => l,
    };
    let len = dst.len();
    let mut lent = false;
    walk(
        mem,
        pd,
        sges,
        offset,
        len,
        Access::empty(),
        |mem, region, off, at, n| {
            if n == len && mem.lend(region, off, n) {
                lent = true;
                return Ok(());
            }
            mem.read(region, off, &mut dst[at..at + n])
                .map_err(|_| SgError::Protection)
        },
    )?;
    Ok(lent)
}

/// Names the pieces of `[offset, offset+len)` of a request's local data in this process
/// ([`Memory::peer_addr`]) into `refs`, for a reference packet. Checks every entry as
/// [`gather`] does; a piece the memory cannot place is a protection error.
pub(super) fn gather_refs<M: Memory + ?Sized>(
    mem: &mut M,
    pd: u32,
    data: &SendData,
    offset: u32,
    len: u32,
    refs: &mut PeerRefs,
) -> Result<(), SgError> {
    let SendData::Sges(sges) = data else {
        return Err(SgError::Protection);
    };
    walk(
        mem,
        pd,
        sges,
        offset,
        len as usize,
        Access::empty(),
        |mem, region, off, _, n| {
            let placed = mem
                .peer_addr(region, off, n)
                .is_some_and(|addr| refs.push(addr, n as u32));
            if placed {
                Ok(())
            } else {
                Err(SgError::Protection)
            }
        },
    )
}

/// Whether every byte of a request's local data can be sent by reference: all in
/// scatter/gather entries the memory can place ([`Memory::peer_addr`]), few enough pieces per
/// segment. Checks nothing else (the request's own checks come first).
pub(super) fn placeable<M: Memory + ?Sized>(mem: &mut M, pd: u32, data: &SendData) -> bool {
    let SendData::Sges(sges) = data else {
        return false;
    };
    sges.as_slice().len() <= MAX_PIECES
        && sges.as_slice().iter().all(|sge| {
            sge.length == 0
                || mem.region(sge.lkey).is_some_and(|r| {
                    r.pd == pd
                        && r.offset_of(sge.addr, u64::from(sge.length))
                            .and_then(|off| mem.peer_addr(&r, off, sge.length as usize))
                            .is_some()
                })
        })
}

/// Where a received packet's payload comes from: its own bytes, or a same-host peer's memory.
#[derive(Debug, Clone, Copy)]
pub(super) enum Payload<'a> {
    /// The bytes the datagram carries.
    Bytes(&'a [u8]),
    /// The pieces of the sender's memory a reference packet names.
    Peer(PeerRefs),
}

impl Payload<'_> {
    pub fn len(&self) -> u32 {
        match self {
            Payload::Bytes(b) => b.len() as u32,
            Payload::Peer(r) => r.total(),
        }
    }

    /// Copies bytes `[at, at+n)` of the payload into `region` at `off`.
    pub fn copy_into<M: Memory + ?Sized>(
        &self,
        mem: &mut M,
        region: &super::memory::Region,
        off: u64,
        at: usize,
        n: usize,
    ) -> Result<(), super::memory::MemoryError> {
        match self {
            Payload::Bytes(b) => mem.write(region, off, &b[at..at + n]),
            Payload::Peer(r) => {
                let piece = r
                    .slice(at as u32, n as u32)
                    .ok_or(super::memory::MemoryError)?;
                mem.write_from_peer(region, off, &piece)
            }
        }
    }
}

/// Copies `src` into the entries of `sges` starting `offset` bytes in. Every entry touched
/// must grant local write.
pub(super) fn scatter<M: Memory + ?Sized>(
    mem: &mut M,
    pd: u32,
    sges: &SgeList,
    offset: u32,
    src: &Payload<'_>,
) -> Result<(), SgError> {
    if src.len() == 0 {
        return Ok(());
    }
    walk(
        mem,
        pd,
        sges,
        offset,
        src.len() as usize,
        Access::LOCAL_WRITE,
        |mem, region, off, at, n| {
            src.copy_into(mem, region, off, at, n)
                .map_err(|_| SgError::Protection)
        },
    )
}

/// Visits the pieces of `[offset, offset+len)` across the entries, validating each region.
fn walk<M: Memory + ?Sized>(
    mem: &mut M,
    pd: u32,
    sges: &SgeList,
    offset: u32,
    len: usize,
    need: Access,
    mut copy: impl FnMut(&mut M, &super::memory::Region, u64, usize, usize) -> Result<(), SgError>,
) -> Result<(), SgError> {
    let mut skip = u64::from(offset);
    let mut done = 0usize;
    for sge in sges.as_slice() {
        if done == len {
            break;
        }
        let sl = u64::from(sge.length);
        if skip >= sl {
            skip -= sl;
            continue;
        }
        let n = (sl - skip).min((len - done) as u64) as usize;
        let region = mem.region(sge.lkey).ok_or(SgError::Protection)?;
        if region.pd != pd || !region.access.contains(need) {
            return Err(SgError::Protection);
        }
        let va = sge.addr.checked_add(skip).ok_or(SgError::Protection)?;
        let off = region.offset_of(va, n as u64).ok_or(SgError::Protection)?;
        copy(mem, &region, off, done, n)?;
        done += n;
        skip = 0;
    }
    if done == len {
        Ok(())
    } else {
        Err(SgError::Length)
    }
}

/// Checks every entry of a work request's local data before it runs: key, protection domain,
/// range, and local write where the device writes.
pub(super) fn check_local<M: Memory + ?Sized>(
    mem: &M,
    pd: u32,
    data: &SendData,
    writes: bool,
) -> Result<(), WcStatus> {
    let SendData::Sges(l) = data else {
        return Ok(());
    };
    for sge in l.as_slice() {
        if sge.length == 0 {
            continue;
        }
        let r = mem.region(sge.lkey).ok_or(WcStatus::LocProtErr)?;
        if r.pd != pd || r.offset_of(sge.addr, u64::from(sge.length)).is_none() {
            return Err(WcStatus::LocProtErr);
        }
        if writes && !r.access.contains(Access::LOCAL_WRITE) {
            return Err(WcStatus::LocProtErr);
        }
    }
    Ok(())
}

//! The receiving side of a connection: clear-to-sends out, notices in
//! ([`crate::proto`] has the protocol), and `iflush`.
//!
//! `irecv` takes the next of the [`SLOTS`] transfer slots (none free: no request, NCCL tries
//! again), describes its buffers in a clear-to-send and SENDs it on queue pair 0. Notices
//! arrive in the receives every queue pair keeps posted; a transfer is complete when as many
//! notices as it names have arrived, and its sizes come from the notice or its record.
#![allow(unsafe_code)]

use std::sync::Arc;

use erdma::connect::cm::Connection;
use erdma::{Completion, Cq, Mr, Qp, RawSendWr, RemoteMr, Sge, WcOpcode, WrOpcode};

use crate::comm::{FLUSH_TAG, QUIET_TAG, RX_TAG, create_qps, post_receives, recv_ctrl};
use crate::core::{Completions, Core, progress};
use crate::device::Dev;
use crate::error::{NetError, NetResult};
use crate::link::Link;
use crate::mem::MemReg;
use crate::proto::{
    CTS_BYTES, Cts, CtsEntry, MAX_RECVS, NOTICE_BYTES, Notice, NoticeMode, RECORD_BYTES, RX_PER_QP,
    Record, SLOTS,
};

/// One receive NCCL posts (`irecv`'s arrays, element by element).
#[derive(Debug, Clone)]
pub struct RecvBuf {
    /// Where the data goes.
    pub addr: u64,
    /// How much it may take.
    pub size: u64,
    /// NCCL's tag.
    pub tag: i32,
    /// The registration holding it (none for a zero-byte receive).
    pub mr: Option<Arc<MemReg>>,
}

#[derive(Debug, Clone, Default)]
struct Slot {
    posted: bool,
    seq: u64,
    n: usize,
    sizes: [u64; MAX_RECVS],
    mrs: [Option<Arc<MemReg>>; MAX_RECVS],
    got: usize,
    nq: usize,
    record: bool,
    error: bool,
    size: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum FlushState {
    #[default]
    Free,
    Posted,
    Done,
}

/// A receiving connection.
pub struct RecvComm {
    // Drop order: the queue pairs (the transport's and the flush's) go first.
    core: Core,
    flush_qp: Option<Qp>,
    ctrl: Mr<'static>,
    record: Mr<'static>,
    dev: Arc<Dev>,
    notice: NoticeMode,
    head: u64,
    slots: Vec<Slot>,
    flushes: [FlushState; SLOTS],
    flush_next: usize,
}

impl std::fmt::Debug for RecvComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvComm")
            .field("dev", &self.dev.name())
            .field("peer", &self.core.peer())
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}

/// Sub-ids of flush requests have this bit.
const FLUSH_SUB: u16 = 1 << 15;

impl RecvComm {
    /// A connected receiver (notice receives already posted).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: Arc<Dev>,
        qps: Vec<Qp>,
        conns: Vec<Connection<()>>,
        cq: Cq,
        ctrl: Mr<'static>,
        record: Mr<'static>,
        link: Link,
        notice: NoticeMode,
        _min_chunk: u64,
    ) -> RecvComm {
        RecvComm {
            core: Core::new(qps, conns, cq, link),
            flush_qp: None,
            ctrl,
            record,
            dev,
            notice,
            head: 0,
            slots: vec![Slot::default(); SLOTS],
            flushes: [FlushState::Free; SLOTS],
            flush_next: 0,
        }
    }

    /// The device.
    pub fn dev(&self) -> &Arc<Dev> {
        &self.dev
    }

    fn on_completion(&mut self, c: &Completion) -> NetResult<()> {
        if !c.status.is_success() {
            let what = if c.wr_id & RX_TAG != 0 {
                "a notice receive"
            } else if c.wr_id & FLUSH_TAG != 0 {
                "a flush READ"
            } else {
                "a clear-to-send"
            };
            return self.core.failed(c, what);
        }
        if c.wr_id & RX_TAG != 0 {
            let q = ((c.wr_id >> 16) & 0xff) as usize;
            let b = (c.wr_id & 0xffff) as usize;
            if q >= self.core.qps.len() || b >= RX_PER_QP {
                return Err(self
                    .core
                    .protocol(format!("a receive with unknown id {:#x}", c.wr_id)));
            }
            let at = recv_ctrl::RX_AT + (q * RX_PER_QP + b) * NOTICE_BYTES;
            let word = match (c.opcode, c.imm) {
                (WcOpcode::RecvRdmaWithImm, Some(imm)) => imm,
                (WcOpcode::Recv, _) if c.byte_len == 4 => {
                    let mut w = [0u8; 4];
                    self.ctrl
                        .read_at(at, &mut w)
                        .map_err(|e| NetError::internal(e.to_string()))?;
                    u32::from_le_bytes(w)
                }
                (op, _) => {
                    return Err(self.core.protocol(format!(
                        "a receive completed as {op:?} with {} bytes, not a notice",
                        c.byte_len
                    )));
                }
            };
            self.on_notice(Notice::decode(word))?;
            post_receives(
                &self.core.qps[q],
                &self.ctrl,
                q,
                at - b * NOTICE_BYTES,
                NOTICE_BYTES,
                b..b + 1,
            )
            .map_err(|e| self.core.fail(e))
        } else if c.wr_id & FLUSH_TAG != 0 {
            let f = (c.wr_id & 0xffff) as usize;
            if let Some(s @ FlushState::Posted) = self.flushes.get_mut(f) {
                *s = FlushState::Done;
            }
            Ok(())
        } else {
            Ok(())
        }
    }

    fn on_notice(&mut self, n: Notice) -> NetResult<()> {
        let s = &mut self.slots[n.slot];
        if !s.posted {
            return Err(self.core.protocol(format!(
                "a notice for transfer slot {}, which has no receive",
                n.slot
            )));
        }
        if s.nq != 0 && s.nq != n.nq {
            let msg = format!(
                "transfer slot {}: notices name {} and {} queue pairs",
                n.slot, s.nq, n.nq
            );
            return Err(self.core.protocol(msg));
        }
        s.nq = n.nq;
        s.got += 1;
        s.record |= n.record;
        s.error |= n.error;
        if !n.record {
            s.size = n.size;
        }
        if s.got > s.nq {
            let msg = format!("transfer slot {}: more notices than queue pairs", n.slot);
            return Err(self.core.protocol(msg));
        }
        Ok(())
    }

    /// `irecv`: `Some(sub-id)` once the receives are granted, `None`: try again.
    pub fn irecv(&mut self, bufs: &[RecvBuf]) -> NetResult<Option<u16>> {
        self.core.alive()?;
        let n = bufs.len();
        if !(1..=MAX_RECVS).contains(&n) {
            return Err(NetError::invalid(format!(
                "irecv of {n} grouped receives (1..={MAX_RECVS})"
            )));
        }
        progress(self)?;
        let seq = self.head;
        let slot = (seq % SLOTS as u64) as usize;
        if self.slots[slot].posted {
            return Ok(None);
        }
        let mut cts = Cts {
            seq: seq as u32,
            n,
            entries: [CtsEntry::default(); MAX_RECVS],
        };
        for (i, b) in bufs.iter().enumerate() {
            let rkey = match &b.mr {
                Some(r) => {
                    r.check(b.addr, b.size).map_err(NetError::invalid)?;
                    if !Arc::ptr_eq(&r.dev, &self.dev) {
                        return Err(NetError::invalid(
                            "a receive into memory registered with another device",
                        ));
                    }
                    r.rkey()
                }
                None if b.size == 0 => 0,
                None => return Err(NetError::invalid("a receive of data with no memory handle")),
            };
            cts.entries[i] = CtsEntry {
                addr: b.addr,
                size: b.size,
                rkey,
                tag: b.tag,
            };
        }
        let mut msg = [0u8; CTS_BYTES];
        let len = cts.encode(&mut msg);
        self.ctrl
            .write_at(slot * CTS_BYTES, &msg[..len])
            .map_err(|e| NetError::internal(e.to_string()))?;
        let sge = [Sge {
            addr: self.ctrl.addr() + (slot * CTS_BYTES) as u64,
            length: len as u32,
            lkey: self.ctrl.lkey(),
        }];
        let wr = RawSendWr::new(QUIET_TAG | slot as u64, WrOpcode::Send, &sge);
        // SAFETY: the message lies in the connection's control region, which outlives its queue
        // pairs; its slot is written again only when the transfer is over, which needs the
        // sender to have received this message.
        if let Err(e) = unsafe { self.core.qps[0].post_send_raw(&[wr]) } {
            return Err(self
                .core
                .fail(NetError::system(format!("posting a clear-to-send: {e}"))));
        }
        let s = &mut self.slots[slot];
        *s = Slot {
            posted: true,
            seq,
            n,
            ..Slot::default()
        };
        for (i, b) in bufs.iter().enumerate() {
            s.sizes[i] = b.size;
            s.mrs[i] = b.mr.clone();
        }
        self.head += 1;
        let epoch = ((seq / SLOTS as u64) & 0x3ff) as u16;
        Ok(Some((epoch << 5) | slot as u16))
    }

    /// `test` of receive or flush `sub`: `Some(sizes)` once done.
    pub fn test(&mut self, sub: u16) -> NetResult<Option<([u64; MAX_RECVS], usize)>> {
        if sub & FLUSH_SUB != 0 {
            return self.test_flush((sub & 0x1f) as usize);
        }
        let slot = (sub & 0x1f) as usize;
        let epoch = (sub >> 5) & 0x3ff;
        let progress = progress(self);
        let s = &self.slots[slot];
        if !s.posted || ((s.seq / SLOTS as u64) & 0x3ff) as u16 != epoch {
            return Err(NetError::internal(format!(
                "test of a receive request this connection does not know (slot {slot}): \
                 finished or never made"
            )));
        }
        if s.nq > 0 && s.got == s.nq {
            return self.finish(slot).map(Some);
        }
        progress?;
        self.core.alive()?;
        self.core.check_link(true)?;
        Ok(None)
    }

    fn finish(&mut self, slot: usize) -> NetResult<([u64; MAX_RECVS], usize)> {
        let s = std::mem::take(&mut self.slots[slot]);
        if s.error {
            return Err(self.core.fail(NetError::internal(format!(
                "{} refused transfer {}: a send larger than its receive ({:?} bytes posted)",
                self.core.peer(),
                s.seq,
                &s.sizes[..s.n]
            ))));
        }
        let mut sizes = [0u64; MAX_RECVS];
        if s.record {
            let mut buf = [0u8; RECORD_BYTES];
            self.record
                .read_at(slot * RECORD_BYTES, &mut buf)
                .map_err(|e| NetError::internal(e.to_string()))?;
            match Record::decode(&buf, s.seq as u32, s.n) {
                Ok(r) => sizes = r.sizes,
                Err(e) => return Err(self.core.protocol(e.0)),
            }
        } else if s.n == 1 {
            sizes[0] = s.size;
        } else {
            return Err(self.core.protocol(format!(
                "transfer {} of {} receives came without a record",
                s.seq, s.n
            )));
        }
        if let Some((got, want)) = sizes[..s.n]
            .iter()
            .zip(&s.sizes[..s.n])
            .find(|(got, want)| got > want)
        {
            return Err(self.core.protocol(format!(
                "transfer {}: {got} bytes arrived for a receive of {want}",
                s.seq
            )));
        }
        Ok((sizes, s.n))
    }

    /// `iflush`: `Some(sub-id)` when a flush is needed and posted, `None` when there is nothing
    /// to flush (no GPU memory, nothing received, or a device whose writes are visible once
    /// they complete).
    pub fn iflush(&mut self, bufs: &[(u64, u64, Option<Arc<MemReg>>)]) -> NetResult<Option<u16>> {
        self.core.alive()?;
        let Some((addr, _, Some(mr))) = bufs
            .iter()
            .rev()
            .find(|(_, size, mr)| *size > 0 && mr.as_ref().is_some_and(|m| m.is_gpu()))
            .cloned()
        else {
            return Ok(None);
        };
        if self.dev.is_soft() {
            // The soft device writes GPU memory with CUDA copies that finish before the
            // notice's completion is reported.
            return Ok(None);
        }
        mr.check(addr, 1).map_err(NetError::invalid)?;
        let f = self.flush_next;
        if self.flushes[f] != FlushState::Free {
            return Ok(None);
        }
        if self.flush_qp.is_none() {
            self.flush_qp = Some(self.loopback_qp()?);
        }
        let qp = self.flush_qp.as_ref().expect("set above");
        let sge = [Sge {
            addr: self.ctrl.addr() + recv_ctrl::FLUSH_AT as u64,
            length: 1,
            lkey: self.ctrl.lkey(),
        }];
        let mut wr = RawSendWr::new(FLUSH_TAG | f as u64, WrOpcode::RdmaRead, &sge);
        wr.flags = erdma::SendFlags::SIGNALED;
        wr.remote = RemoteMr {
            addr,
            len: 1,
            rkey: mr.rkey(),
        };
        // SAFETY: the READ's target is the flush byte of the connection's control region, which
        // outlives the flush queue pair and which the CPU never reads.
        unsafe { qp.post_send_raw(&[wr]) }
            .map_err(|e| NetError::system(format!("posting the flush READ: {e}")))?;
        self.flushes[f] = FlushState::Posted;
        self.flush_next = (f + 1) % SLOTS;
        Ok(Some(FLUSH_SUB | f as u16))
    }

    fn loopback_qp(&self) -> NetResult<Qp> {
        let qp = create_qps(&self.dev, &self.core.cq, 1, 16)?.remove(0);
        let me = qp
            .endpoint()
            .map_err(|e| NetError::system(format!("the flush queue pair's endpoint: {e}")))?;
        qp.connect(&me, &crate::comm::connect_options())
            .map_err(|e| {
                NetError::system(format!(
                    "{}: connecting the flush queue pair to itself: {}",
                    self.dev.name(),
                    e.error
                ))
            })
    }

    fn test_flush(&mut self, f: usize) -> NetResult<Option<([u64; MAX_RECVS], usize)>> {
        let progress = progress(self);
        match self.flushes.get(f) {
            Some(FlushState::Done) => {
                self.flushes[f] = FlushState::Free;
                Ok(Some(([0; MAX_RECVS], 0)))
            }
            Some(FlushState::Posted) => {
                progress?;
                self.core.alive()?;
                Ok(None)
            }
            _ => Err(NetError::internal(format!(
                "test of a flush request this connection does not know ({f})"
            ))),
        }
    }

    /// The transport.
    pub fn transport(&mut self) -> &mut Core {
        &mut self.core
    }

    /// How this connection is notified.
    pub fn notice(&self) -> NoticeMode {
        self.notice
    }
}

impl Completions for RecvComm {
    fn core(&mut self) -> &mut Core {
        &mut self.core
    }

    fn on_completion(&mut self, c: &Completion) -> NetResult<()> {
        RecvComm::on_completion(self, c)
    }
}

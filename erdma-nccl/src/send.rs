//! The sending side of a connection: clear-to-sends in, data and notices out
//! ([`crate::proto`] has the protocol).
//!
//! `isend` matches NCCL's send to an entry of the oldest clear-to-send by tag and returns no
//! request ("try again") while that clear-to-send has not arrived; once every entry of the group
//! has its send, the transfer goes out: the record (if any), the data cut into pieces striped
//! over the queue pairs, and the last request on each queue pair used carries the notice and is
//! the only one signalled. A send is done when every queue pair of its transfer has reported.
//!
//! Everything a transfer needs is preallocated: no allocation per request.
#![allow(unsafe_code)]

use std::sync::Arc;

use erdma::connect::cm::Connection;
use erdma::{Completion, Cq, Mr, Qp, RawSendWr, RemoteMr, SendFlags, Sge, WcOpcode, WrOpcode};

use crate::comm::{QUIET_TAG, RX_TAG, XFER_TAG, XFERS, post_receives, send_ctrl};
use crate::core::{Completions, Core, progress};
use crate::device::Dev;
use crate::error::{NetError, NetResult};
use crate::link::Link;
use crate::mem::MemReg;
use crate::proto::{
    CTS_BYTES, Cts, MAX_RECVS, NOTICE_SIZE_MAX, Notice, NoticeMode, RECORD_BYTES, Record, SLOTS,
    plan_pieces,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum XState {
    #[default]
    Free,
    /// The clear-to-send arrived; sends are being matched to its entries.
    Matching,
    /// Posted; `pending` queue pairs have not reported yet.
    Posted,
}

#[derive(Debug, Clone, Default)]
struct Member {
    matched: bool,
    done: bool,
    addr: u64,
    size: u64,
    mr: Option<Arc<MemReg>>,
}

#[derive(Debug, Clone, Default)]
struct Xfer {
    state: XState,
    seq: u64,
    cts: Cts,
    members: [Member; MAX_RECVS],
    matched: usize,
    tested: usize,
    pending: usize,
}

/// A sending connection.
pub struct SendComm {
    // Drop order: the transport goes first, so the device has let go of every region below
    // before it is freed.
    core: Core,
    ctrl: Mr<'static>,
    dev: Arc<Dev>,
    notice: NoticeMode,
    peer_record: RemoteMr,
    min_chunk: u64,
    fifo: [Option<Cts>; SLOTS],
    head: u64,
    xfers: Vec<Xfer>,
    rr: usize,
    pieces: Vec<(usize, u64, u64, usize)>,
}

impl std::fmt::Debug for SendComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendComm")
            .field("dev", &self.dev.name())
            .field("peer", &self.core.peer())
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}

/// Posts one unsignalled RDMA WRITE of `len` bytes at `at` in `ctrl` to `target`.
pub fn write_quiet(
    qp: &Qp,
    ctrl: &Mr<'static>,
    at: usize,
    len: usize,
    target: RemoteMr,
) -> NetResult<()> {
    let sge = [Sge {
        addr: ctrl.addr() + at as u64,
        length: len as u32,
        lkey: ctrl.lkey(),
    }];
    let mut wr = RawSendWr::new(QUIET_TAG, WrOpcode::RdmaWrite, &sge);
    wr.remote = target;
    // SAFETY: the bytes lie in `ctrl`, a region of the connection, which drops its queue pairs
    // before its regions; the CPU does not write them again (the hello word is written once).
    unsafe { qp.post_send_raw(&[wr]) }
        .map_err(|e| NetError::system(format!("posting a WRITE: {e}")))
}

/// Requests laid out for one post: at most [`BATCH`] per call.
const BATCH: usize = 16;

#[derive(Clone, Copy)]
struct Spec {
    wr_id: u64,
    opcode: WrOpcode,
    flags: SendFlags,
    sge: Sge,
    remote: RemoteMr,
    imm: u32,
}

struct Batch {
    n: usize,
    specs: [Spec; BATCH],
}

impl Batch {
    fn new() -> Batch {
        Batch {
            n: 0,
            specs: [Spec {
                wr_id: 0,
                opcode: WrOpcode::RdmaWrite,
                flags: SendFlags::empty(),
                sge: Sge::default(),
                remote: RemoteMr::default(),
                imm: 0,
            }; BATCH],
        }
    }

    /// Adds a request; posts the batch first when it is full.
    fn push(&mut self, qp: &Qp, spec: Spec) -> NetResult<()> {
        if self.n == BATCH {
            self.post(qp)?;
        }
        self.specs[self.n] = spec;
        self.n += 1;
        Ok(())
    }

    fn last(&mut self) -> Option<&mut Spec> {
        self.n.checked_sub(1).map(|i| &mut self.specs[i])
    }

    /// Posts what is laid out, as one chain.
    fn post(&mut self, qp: &Qp) -> NetResult<()> {
        let specs = &self.specs;
        let wrs: [RawSendWr<'_>; BATCH] = std::array::from_fn(|i| {
            let s = &specs[i];
            let sges: &[Sge] = if s.sge.length == 0 {
                &[]
            } else {
                std::slice::from_ref(&s.sge)
            };
            let mut wr = RawSendWr::new(s.wr_id, s.opcode, sges);
            wr.flags = s.flags;
            wr.remote = s.remote;
            wr.imm = s.imm;
            wr
        });
        let n = std::mem::take(&mut self.n);
        // SAFETY: every SGE lies in a live registration: NCCL's buffer, whose registration the
        // transfer holds until every queue pair it used has reported (RC completes a queue
        // pair's requests in order, so the signalled last one covers the rest), or the
        // connection's control region, which outlives the queue pairs. NCCL does not write a
        // send buffer before its request completes; the record and notice word of a transfer
        // are written only while its state is free.
        unsafe { qp.post_send_raw(&wrs[..n]) }
            .map_err(|e| NetError::system(format!("posting {n} requests: {e}")))
    }
}

impl SendComm {
    /// A connected sender.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: Arc<Dev>,
        qps: Vec<Qp>,
        conns: Vec<Connection<()>>,
        cq: Cq,
        ctrl: Mr<'static>,
        link: Link,
        notice: NoticeMode,
        peer_record: RemoteMr,
        min_chunk: u64,
    ) -> SendComm {
        SendComm {
            core: Core::new(qps, conns, cq, link),
            ctrl,
            dev,
            notice,
            peer_record,
            min_chunk,
            fifo: [None; SLOTS],
            head: 0,
            xfers: vec![Xfer::default(); XFERS],
            rr: 0,
            pieces: Vec::with_capacity(MAX_RECVS + 16),
        }
    }

    /// The device.
    pub fn dev(&self) -> &Arc<Dev> {
        &self.dev
    }

    fn on_completion(&mut self, c: &Completion) -> NetResult<()> {
        if !c.status.is_success() {
            let what = if c.wr_id & RX_TAG != 0 {
                "a clear-to-send receive"
            } else if c.wr_id & XFER_TAG != 0 {
                "a transfer"
            } else {
                "a WRITE"
            };
            return self.core.failed(c, what);
        }
        if c.wr_id & RX_TAG != 0 {
            if c.opcode != WcOpcode::Recv {
                return Err(self
                    .core
                    .protocol(format!("a receive completed as {:?}, not a SEND", c.opcode)));
            }
            let b = (c.wr_id & 0xffff) as usize;
            self.on_cts(b, c.byte_len as usize)
        } else if c.wr_id & XFER_TAG != 0 {
            let xi = (c.wr_id & 0xffff) as usize;
            match self.xfers.get_mut(xi) {
                Some(x) if x.state == XState::Posted && x.pending > 0 => {
                    x.pending -= 1;
                    Ok(())
                }
                _ => Err(self
                    .core
                    .protocol(format!("a completion for transfer slot {xi}, idle"))),
            }
        } else {
            Ok(())
        }
    }

    fn on_cts(&mut self, b: usize, len: usize) -> NetResult<()> {
        if len > CTS_BYTES || b >= crate::proto::CTS_RX {
            return Err(self
                .core
                .protocol(format!("a {len}-byte clear-to-send in buffer {b}")));
        }
        let mut buf = [0u8; CTS_BYTES];
        self.ctrl
            .read_at(b * CTS_BYTES, &mut buf[..len])
            .map_err(|e| NetError::internal(e.to_string()))?;
        let cts = match Cts::decode(&buf[..len]) {
            Ok(c) => c,
            Err(e) => return Err(self.core.protocol(e.0)),
        };
        let ahead = cts.seq.wrapping_sub(self.head as u32) as usize;
        let slot = cts.seq as usize % SLOTS;
        if ahead >= SLOTS || self.fifo[slot].is_some() {
            return Err(self.core.protocol(format!(
                "a clear-to-send for transfer {} while transfers {}.. are expected",
                cts.seq, self.head as u32
            )));
        }
        self.fifo[slot] = Some(cts);
        post_receives(&self.core.qps[0], &self.ctrl, 0, 0, CTS_BYTES, b..b + 1)
            .map_err(|e| self.core.fail(e))
    }

    /// `isend`: `Some(sub-id)` once the send is matched to a receive, `None`: try again.
    pub fn isend(
        &mut self,
        addr: u64,
        size: u64,
        tag: i32,
        mr: Option<Arc<MemReg>>,
    ) -> NetResult<Option<u16>> {
        self.core.alive()?;
        progress(self)?;
        let seq = self.head;
        let xi = (seq % XFERS as u64) as usize;
        let slot = (seq % SLOTS as u64) as usize;
        if self.xfers[xi].state == XState::Free {
            match self.fifo[slot] {
                Some(cts) if cts.seq == seq as u32 => {
                    self.fifo[slot] = None;
                    let x = &mut self.xfers[xi];
                    *x = Xfer {
                        state: XState::Matching,
                        seq,
                        cts,
                        ..Xfer::default()
                    };
                }
                _ => {
                    self.core.check_link(false)?;
                    return Ok(None);
                }
            }
        } else if self.xfers[xi].state != XState::Matching || self.xfers[xi].seq != seq {
            // Transfer `seq - XFERS` still waits for NCCL to test its sends.
            return Ok(None);
        }
        let x = &self.xfers[xi];
        let Some(m) = (0..x.cts.n).find(|&m| !x.members[m].matched && x.cts.entries[m].tag == tag)
        else {
            return Ok(None);
        };
        let entry = x.cts.entries[m];
        if size > entry.size {
            let msg = format!(
                "a send of {size} bytes (tag {tag}) into a receive of {} bytes: NCCL's sizes \
                 disagree",
                entry.size
            );
            self.refuse(xi);
            return Err(self.core.fail(NetError::internal(msg)));
        }
        if size > 0 {
            match &mr {
                Some(r) => r.check(addr, size).map_err(NetError::invalid)?,
                None => return Err(NetError::invalid("a send of data with no memory handle")),
            }
            if mr.as_ref().is_some_and(|r| !Arc::ptr_eq(&r.dev, &self.dev)) {
                return Err(NetError::invalid(
                    "a send from memory registered with another device",
                ));
            }
        }
        let x = &mut self.xfers[xi];
        x.members[m] = Member {
            matched: true,
            done: false,
            addr,
            size,
            mr,
        };
        x.matched += 1;
        if x.matched == x.cts.n {
            self.post(xi)?;
            self.head += 1;
        }
        let epoch = ((seq / XFERS as u64) & 0x7f) as u16;
        Ok(Some((epoch << 9) | ((xi as u16) << 3) | m as u16))
    }

    /// Tells the receiver that the transfer is refused (its receive then fails too).
    fn refuse(&mut self, xi: usize) {
        let x = &self.xfers[xi];
        let notice = Notice {
            slot: (x.seq % SLOTS as u64) as usize,
            nq: 1,
            record: false,
            error: true,
            size: 0,
        }
        .encode();
        let _ = self.post_notices(xi, &[], notice, QUIET_TAG, false);
    }

    /// Posts transfer `xi`.
    fn post(&mut self, xi: usize) -> NetResult<()> {
        let x = &self.xfers[xi];
        let n = x.cts.n;
        let mut sizes = [0u64; MAX_RECVS];
        for (s, m) in sizes.iter_mut().zip(&x.members[..n]) {
            *s = m.size;
        }
        let k = self.core.qps.len();
        let mut pieces = std::mem::take(&mut self.pieces);
        let nq = plan_pieces(&sizes[..n], k, self.rr, self.min_chunk, &mut pieces);
        let with_record = n > 1 || sizes[0] > NOTICE_SIZE_MAX;
        let slot = (x.seq % SLOTS as u64) as usize;
        if with_record {
            let mut buf = [0u8; RECORD_BYTES];
            let len = Record {
                seq: x.seq as u32,
                n,
                sizes,
            }
            .encode(&mut buf);
            self.ctrl
                .write_at(send_ctrl::RECORD_AT + xi * RECORD_BYTES, &buf[..len])
                .map_err(|e| NetError::internal(e.to_string()))?;
        }
        let notice = Notice {
            slot,
            nq,
            record: with_record,
            error: false,
            size: if with_record { 0 } else { sizes[0] },
        }
        .encode();
        self.xfers[xi].pending = nq;
        self.xfers[xi].state = XState::Posted;
        let r = self.post_notices(xi, &pieces, notice, XFER_TAG | xi as u64, with_record);
        self.pieces = pieces;
        self.rr = (self.rr + nq) % k;
        r.map_err(|e| self.core.fail(e))
    }

    /// Posts a transfer's requests: on each queue pair used, the record first (on the first),
    /// its pieces, and the notice on the last request, which alone is signalled (`wr_id`).
    fn post_notices(
        &mut self,
        xi: usize,
        pieces: &[(usize, u64, u64, usize)],
        notice: u32,
        wr_id: u64,
        with_record: bool,
    ) -> NetResult<()> {
        let k = self.core.qps.len();
        let nq = Notice::decode(notice).nq;
        let x = &self.xfers[xi];
        let slot = (x.seq % SLOTS as u64) as usize;
        let record_target = RemoteMr {
            addr: self.peer_record.addr + (slot * RECORD_BYTES) as u64,
            len: RECORD_BYTES as u64,
            rkey: self.peer_record.rkey,
        };
        if self.notice == NoticeMode::Send {
            self.ctrl
                .write_at(send_ctrl::WORD_AT + xi * 8, &notice.to_le_bytes())
                .map_err(|e| NetError::internal(e.to_string()))?;
        }
        let ctrl_lkey = self.ctrl.lkey();
        let ctrl_addr = self.ctrl.addr();
        let max_wr = self.dev.max_wr_bytes;
        let mode = self.notice;
        let qps = &self.core.qps;
        let quiet = |opcode, sge, remote| Spec {
            wr_id: QUIET_TAG,
            opcode,
            flags: SendFlags::empty(),
            sge,
            remote,
            imm: 0,
        };
        erdma::soft::coalesce_sends(|| -> NetResult<()> {
            for i in 0..nq {
                let q = (self.rr + i) % k;
                let qp = &qps[q];
                let mut batch = Batch::new();
                if i == 0 && with_record {
                    let sge = Sge {
                        addr: ctrl_addr + (send_ctrl::RECORD_AT + xi * RECORD_BYTES) as u64,
                        length: (8 + 8 * x.cts.n) as u32,
                        lkey: ctrl_lkey,
                    };
                    batch.push(qp, quiet(WrOpcode::RdmaWrite, sge, record_target))?;
                }
                for &(m, off, len, pq) in pieces.iter().filter(|p| p.3 == q) {
                    debug_assert_eq!(pq, q);
                    let member = &x.members[m];
                    let entry = &x.cts.entries[m];
                    let lkey = member.mr.as_ref().map_or(0, |r| r.lkey());
                    let mut done = 0;
                    while done < len {
                        let part = (len - done).min(max_wr);
                        let sge = Sge {
                            addr: member.addr + off + done,
                            length: part as u32,
                            lkey,
                        };
                        let remote = RemoteMr {
                            addr: entry.addr + off + done,
                            len: part,
                            rkey: entry.rkey,
                        };
                        batch.push(qp, quiet(WrOpcode::RdmaWrite, sge, remote))?;
                        done += part;
                    }
                }
                if batch.n == 0 && mode == NoticeMode::Imm {
                    // Nothing to carry the immediate: a zero-length WRITE into the record slot.
                    batch.push(
                        qp,
                        quiet(WrOpcode::RdmaWrite, Sge::default(), record_target),
                    )?;
                }
                match mode {
                    NoticeMode::Imm => {
                        let last = batch.last().expect("one request at least");
                        last.opcode = WrOpcode::RdmaWriteWithImm;
                        last.imm = notice;
                        last.wr_id = wr_id;
                        last.flags = SendFlags::SIGNALED;
                    }
                    NoticeMode::Send => {
                        let sge = Sge {
                            addr: ctrl_addr + (send_ctrl::WORD_AT + xi * 8) as u64,
                            length: 4,
                            lkey: ctrl_lkey,
                        };
                        batch.push(
                            qp,
                            Spec {
                                wr_id,
                                opcode: WrOpcode::Send,
                                flags: SendFlags::SIGNALED,
                                sge,
                                remote: RemoteMr::default(),
                                imm: 0,
                            },
                        )?;
                    }
                }
                if wr_id & XFER_TAG == 0 {
                    if let Some(last) = batch.last() {
                        last.flags = SendFlags::empty();
                    }
                }
                batch.post(qp)?;
            }
            Ok(())
        })
    }

    /// `test` of send `sub`: `Some(size)` once done.
    pub fn test(&mut self, sub: u16) -> NetResult<Option<u64>> {
        let xi = ((sub >> 3) & 0x3f) as usize;
        let m = (sub & 7) as usize;
        let epoch = sub >> 9;
        let progress = progress(self);
        let x = &mut self.xfers[xi];
        let known = x.state != XState::Free
            && ((x.seq / XFERS as u64) & 0x7f) as u16 == epoch
            && m < x.cts.n
            && x.members[m].matched
            && !x.members[m].done;
        if !known {
            return Err(NetError::internal(format!(
                "test of a send request this connection does not know (slot {xi}, entry {m}): \
                 finished or never made"
            )));
        }
        if x.state == XState::Posted && x.pending == 0 {
            let member = &mut x.members[m];
            member.done = true;
            member.mr = None;
            let size = member.size;
            x.tested += 1;
            if x.tested == x.cts.n {
                x.state = XState::Free;
            }
            return Ok(Some(size));
        }
        progress?;
        self.core.alive()?;
        self.core.check_link(false)?;
        Ok(None)
    }

    /// The transport.
    pub fn transport(&mut self) -> &mut Core {
        &mut self.core
    }
}

impl Completions for SendComm {
    fn core(&mut self) -> &mut Core {
        &mut self.core
    }

    fn on_completion(&mut self, c: &Completion) -> NetResult<()> {
        SendComm::on_completion(self, c)
    }
}

//! Work requests: what a queue pair is asked to do.
//!
//! Safe work requests ([`SendWr`], [`RecvWr`]) are built from registered-memory segments
//! ([`MrSlice`], [`MrSliceMut`]) and carry the borrows of that memory; raw work requests
//! ([`RawSendWr`], [`RawRecvWr`]) carry plain addresses for the `unsafe` zero-overhead path.
//! Both are turned into the provider line's raw requests at post time.
//!
//! Lifetimes: `'m` is how long the local memory must stay untouched (the scope that posts the
//! request), `'i` how long the request's own lists must live (only the call that posts it).

use crate::error::{Error, Result};
use crate::mr::{MrSlice, MrSliceMut, RemoteMr};
use crate::vocab::{SendFlags, Sge, WrOpcode};

/// An SGE for `len` bytes at `addr`; an SGE holds at most `u32::MAX` bytes.
fn checked_sge(addr: u64, len: u64, lkey: u32) -> Result<Sge> {
    let length = u32::try_from(len).map_err(|_| {
        Error::invalid(format!(
            "a {len}-byte segment: one SGE holds at most {} bytes",
            u32::MAX
        ))
    })?;
    Ok(Sge { addr, length, lkey })
}

impl TryFrom<MrSlice<'_>> for Sge {
    type Error = Error;

    fn try_from(l: MrSlice<'_>) -> Result<Sge> {
        checked_sge(l.addr, l.len, l.lkey)
    }
}

/// Where a send work request's local bytes come from.
pub(crate) enum SendMemory<'m, 'i> {
    /// Registered segments the device reads.
    Gather(&'i [MrSlice<'m>]),
    /// Bytes copied at post time.
    Inline(&'i [u8]),
    /// One registered segment the device writes (READ, atomics).
    Target(MrSliceMut<'m>),
}

/// A send work request over registered memory. Build it with the constructors, adjust it with
/// the chained setters, post it with [`crate::Scope::post_send`] (any memory) or
/// [`crate::Qp::post_send`] (`'static` memory and inline data only).
///
/// Requests are signaled by default: each one produces a completion. Call
/// [`SendWr::unsignaled`] to skip it (the SDK still signals often enough that the send queue
/// never stalls, and hides those completions).
#[must_use = "a work request does nothing until it is posted"]
pub struct SendWr<'m, 'i> {
    pub(crate) wr_id: u64,
    pub(crate) opcode: WrOpcode,
    pub(crate) flags: SendFlags,
    pub(crate) data: SendMemory<'m, 'i>,
    pub(crate) remote: RemoteMr,
    pub(crate) imm: u32,
    pub(crate) invalidate_rkey: u32,
    pub(crate) compare_add: u64,
    pub(crate) swap: u64,
}

impl<'m, 'i> SendWr<'m, 'i> {
    fn new(wr_id: u64, opcode: WrOpcode, data: SendMemory<'m, 'i>) -> Self {
        SendWr {
            wr_id,
            opcode,
            flags: SendFlags::SIGNALED,
            data,
            remote: RemoteMr::default(),
            imm: 0,
            invalidate_rkey: 0,
            compare_add: 0,
            swap: 0,
        }
    }

    /// SEND the bytes of `sges`, in order, into the peer's next receive buffer.
    pub fn send(wr_id: u64, sges: &'i [MrSlice<'m>]) -> Self {
        Self::new(wr_id, WrOpcode::Send, SendMemory::Gather(sges))
    }

    /// SEND `data`, copied into the request at post time (at most `max_inline_data` bytes).
    pub fn send_inline(wr_id: u64, data: &'i [u8]) -> Self {
        let mut wr = Self::new(wr_id, WrOpcode::Send, SendMemory::Inline(data));
        wr.flags |= SendFlags::INLINE;
        wr
    }

    /// SEND that also invalidates `rkey` at the peer.
    pub fn send_with_invalidate(wr_id: u64, sges: &'i [MrSlice<'m>], rkey: u32) -> Self {
        let mut wr = Self::new(wr_id, WrOpcode::SendWithInv, SendMemory::Gather(sges));
        wr.invalidate_rkey = rkey;
        wr
    }

    /// RDMA WRITE the bytes of `sges` to `remote` (which must be at least as long).
    pub fn write(wr_id: u64, sges: &'i [MrSlice<'m>], remote: RemoteMr) -> Self {
        let mut wr = Self::new(wr_id, WrOpcode::RdmaWrite, SendMemory::Gather(sges));
        wr.remote = remote;
        wr
    }

    /// RDMA WRITE `data` (copied at post time) to `remote`.
    pub fn write_inline(wr_id: u64, data: &'i [u8], remote: RemoteMr) -> Self {
        let mut wr = Self::new(wr_id, WrOpcode::RdmaWrite, SendMemory::Inline(data));
        wr.flags |= SendFlags::INLINE;
        wr.remote = remote;
        wr
    }

    /// RDMA READ `dest.len()` bytes from `remote` into `dest`.
    pub fn read(wr_id: u64, dest: MrSliceMut<'m>, remote: RemoteMr) -> Self {
        let mut wr = Self::new(wr_id, WrOpcode::RdmaRead, SendMemory::Target(dest));
        wr.remote = remote;
        wr
    }

    /// Atomic compare-and-swap of the 8 bytes at `remote.addr`: if they equal `compare` they
    /// become `swap`. The original value lands in `dest` (8 bytes, in the peer's byte order).
    pub fn compare_swap(
        wr_id: u64,
        dest: MrSliceMut<'m>,
        remote: RemoteMr,
        compare: u64,
        swap: u64,
    ) -> Self {
        let mut wr = Self::new(wr_id, WrOpcode::AtomicCmpAndSwp, SendMemory::Target(dest));
        wr.remote = remote;
        wr.compare_add = compare;
        wr.swap = swap;
        wr
    }

    /// Atomic fetch-and-add of `add` to the 8 bytes at `remote.addr`; the original value lands
    /// in `dest`.
    pub fn fetch_add(wr_id: u64, dest: MrSliceMut<'m>, remote: RemoteMr, add: u64) -> Self {
        let mut wr = Self::new(wr_id, WrOpcode::AtomicFetchAndAdd, SendMemory::Target(dest));
        wr.remote = remote;
        wr.compare_add = add;
        wr
    }

    /// Adds immediate data: SEND becomes SEND_WITH_IMM and WRITE becomes WRITE_WITH_IMM (which
    /// consumes a receive at the peer and completes there with `imm`). Other operations ignore
    /// it.
    pub fn with_imm(mut self, imm: u32) -> Self {
        self.opcode = match self.opcode {
            WrOpcode::Send => WrOpcode::SendWithImm,
            WrOpcode::RdmaWrite => WrOpcode::RdmaWriteWithImm,
            other => other,
        };
        self.imm = imm;
        self
    }

    /// No completion unless the request fails.
    pub fn unsignaled(mut self) -> Self {
        self.flags.remove(SendFlags::SIGNALED);
        self
    }

    /// A completion when the request finishes (the default).
    pub fn signaled(mut self) -> Self {
        self.flags.insert(SendFlags::SIGNALED);
        self
    }

    /// Wait for every earlier READ/atomic of this queue pair before starting.
    pub fn fence(mut self) -> Self {
        self.flags.insert(SendFlags::FENCE);
        self
    }

    /// Set the solicited-event bit.
    pub fn solicited(mut self) -> Self {
        self.flags.insert(SendFlags::SOLICITED);
        self
    }

    /// Copy the gathered bytes into the request at post time (total at most
    /// `max_inline_data`).
    pub fn inline(mut self) -> Self {
        self.flags.insert(SendFlags::INLINE);
        self
    }

    /// The request's id, as its completion will report it.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// The operation.
    pub fn opcode(&self) -> WrOpcode {
        self.opcode
    }

    /// Appends the local part as SGEs to `out`.
    pub(crate) fn sges(&self, out: &mut impl Extend<Sge>) -> Result<()> {
        match &self.data {
            SendMemory::Gather(list) => {
                for l in list.iter() {
                    if l.device && self.flags.contains(SendFlags::INLINE) {
                        return Err(Error::invalid(
                            "inline data is copied by the CPU at post time: GPU memory cannot \
                             be sent inline",
                        ));
                    }
                    out.extend([Sge::try_from(*l)?]);
                }
            }
            SendMemory::Inline(data) => {
                if !data.is_empty() {
                    out.extend([checked_sge(data.as_ptr() as u64, data.len() as u64, 0)?]);
                }
            }
            SendMemory::Target(dest) => out.extend([checked_sge(dest.addr, dest.len, dest.lkey)?]),
        }
        Ok(())
    }

    /// Total local bytes.
    pub(crate) fn local_len(&self) -> u64 {
        match &self.data {
            SendMemory::Gather(list) => list.iter().map(|l| l.len).sum(),
            SendMemory::Inline(data) => data.len() as u64,
            SendMemory::Target(dest) => dest.len,
        }
    }
}

impl std::fmt::Debug for SendWr<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendWr")
            .field("wr_id", &self.wr_id)
            .field("opcode", &self.opcode)
            .field("flags", &self.flags)
            .field("local_len", &self.local_len())
            .field("remote", &self.remote)
            .finish()
    }
}

/// A receive work request: where the next incoming SEND (or WRITE_WITH_IMM notification) lands.
#[must_use = "a work request does nothing until it is posted"]
pub struct RecvWr<'m> {
    pub(crate) wr_id: u64,
    pub(crate) sges: RecvSges<'m>,
}

pub(crate) enum RecvSges<'m> {
    None,
    One(MrSliceMut<'m>),
    Many(Vec<MrSliceMut<'m>>),
}

impl<'m> RecvWr<'m> {
    /// Receive into `buf`.
    pub fn new(wr_id: u64, buf: MrSliceMut<'m>) -> Self {
        RecvWr {
            wr_id,
            sges: RecvSges::One(buf),
        }
    }

    /// A receive with no buffer: enough for WRITE_WITH_IMM notifications and zero-byte SENDs.
    pub fn empty(wr_id: u64) -> Self {
        RecvWr {
            wr_id,
            sges: RecvSges::None,
        }
    }

    /// Receive scattered over several buffers, in order (eRDMA allows one).
    pub fn scatter(wr_id: u64, bufs: Vec<MrSliceMut<'m>>) -> Self {
        RecvWr {
            wr_id,
            sges: RecvSges::Many(bufs),
        }
    }

    /// The request's id.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    pub(crate) fn sges(&self, out: &mut impl Extend<Sge>) -> Result<()> {
        let conv = |b: &MrSliceMut<'m>| checked_sge(b.addr, b.len, b.lkey);
        match &self.sges {
            RecvSges::None => {}
            RecvSges::One(b) => out.extend([conv(b)?]),
            RecvSges::Many(v) => {
                for b in v {
                    out.extend([conv(b)?]);
                }
            }
        }
        Ok(())
    }

    pub(crate) fn sge_count(&self) -> usize {
        match &self.sges {
            RecvSges::None => 0,
            RecvSges::One(_) => 1,
            RecvSges::Many(v) => v.len(),
        }
    }
}

impl std::fmt::Debug for RecvWr<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvWr")
            .field("wr_id", &self.wr_id)
            .field("sges", &self.sge_count())
            .finish()
    }
}

/// A send work request over raw addresses, for [`crate::Qp::post_send_raw`].
///
/// Nothing here is checked against borrows: see that function's safety contract.
#[derive(Debug, Clone, Copy)]
pub struct RawSendWr<'i> {
    /// Id reported by the completion.
    pub wr_id: u64,
    /// Operation.
    pub opcode: WrOpcode,
    /// Flags (`SIGNALED` is not implied here).
    pub flags: SendFlags,
    /// Local SGEs (for inline requests: plain addresses, lkey ignored).
    pub sges: &'i [Sge],
    /// Remote target (WRITE, READ, atomics).
    pub remote: RemoteMr,
    /// Immediate data (`*_WITH_IMM`), host order.
    pub imm: u32,
    /// Key to invalidate (`SendWithInv`).
    pub invalidate_rkey: u32,
    /// Compare value (CAS) or addend (FAA).
    pub compare_add: u64,
    /// Swap value (CAS).
    pub swap: u64,
}

impl<'i> RawSendWr<'i> {
    /// A raw request with everything but the opcode and SGEs zero.
    pub fn new(wr_id: u64, opcode: WrOpcode, sges: &'i [Sge]) -> Self {
        RawSendWr {
            wr_id,
            opcode,
            flags: SendFlags::empty(),
            sges,
            remote: RemoteMr::default(),
            imm: 0,
            invalidate_rkey: 0,
            compare_add: 0,
            swap: 0,
        }
    }
}

/// A receive work request over raw addresses, for [`crate::Qp::post_recv_raw`].
#[derive(Debug, Clone, Copy)]
pub struct RawRecvWr<'i> {
    /// Id reported by the completion.
    pub wr_id: u64,
    /// Where the data lands.
    pub sges: &'i [Sge],
}

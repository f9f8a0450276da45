//! Protection domains and memory regions of a kernel device.

use erdma_sys as sys;

use super::VerbsCtx;
use crate::error::{Error, Result};
use crate::vocab::{Access, QpCaps};

use super::{VerbsCq, VerbsQp};

/// `IBV_QPT_RC`.
const IBV_QPT_RC: u32 = 2;

/// A protection domain.
pub(crate) struct VerbsPd {
    pub(super) pd: *mut sys::ibv_pd,
}

// SAFETY: verbs objects are thread-safe; the pointer is owned by one handle.
unsafe impl Send for VerbsPd {}
// SAFETY: as above.
unsafe impl Sync for VerbsPd {}

impl VerbsPd {
    /// # Safety
    /// Called at most once per object, by its owner's `Drop`; the object is not used after.
    /// Every region and queue pair of the domain is gone first (they hold the domain alive).
    pub(crate) unsafe fn dealloc(&self, ctx: &VerbsCtx) {
        // SAFETY: the caller's contract: the pointer is live and released only here, once.
        unsafe { (ctx.lib.ibv_dealloc_pd)(self.pd) };
    }

    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    /// `[addr, addr+len)` stays allocated until the region is deregistered; the device may read
    /// and write it meanwhile.
    pub(crate) unsafe fn reg_mr(
        &self,
        ctx: &VerbsCtx,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<(VerbsMr, u32, u32)> {
        // SAFETY: the caller guarantees `[addr, addr+len)` stays valid while the region lives.
        let mr = unsafe { (ctx.lib.ibv_reg_mr)(self.pd, addr.cast(), len, access.bits() as i32) };
        if mr.is_null() {
            return Err(Error::last_os("ibv_reg_mr"));
        }
        // SAFETY: `mr` was just returned and is valid.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok((VerbsMr { mr }, lkey, rkey))
    }

    /// Registers a dma-buf (`fd`, bytes `[offset, offset+len)` of it) reached at `iova`.
    #[cfg(feature = "gpu")]
    pub(crate) fn reg_dmabuf_mr(
        &self,
        ctx: &VerbsCtx,
        offset: u64,
        len: usize,
        iova: u64,
        fd: i32,
        access: Access,
    ) -> Result<(VerbsMr, u32, u32)> {
        let reg = ctx
            .lib
            .ibv_reg_dmabuf_mr
            .ok_or_else(|| Error::Unsupported {
                feature: "ibv_reg_dmabuf_mr (libibverbs older than rdma-core v34)",
                device: ctx.ibdev_path.clone(),
            })?;
        // The kernel takes its own reference to `fd`; the caller deregisters before freeing the
        // memory behind it.
        // SAFETY: `fd` is an open dma-buf exported for `[offset, offset+len)` that outlives the MR.
        let mr = unsafe { reg(self.pd, offset, len, iova, fd, access.bits() as i32) };
        if mr.is_null() {
            return Err(Error::last_os("ibv_reg_dmabuf_mr"));
        }
        // SAFETY: `mr` was just returned and is valid.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok((VerbsMr { mr }, lkey, rkey))
    }

    /// Registers GPU memory: dma-buf first, then the peer-memory path (`ibv_reg_mr` on the
    /// device pointer, where nvidia_peermem is loaded). Returns the region, its keys, the path
    /// and why dma-buf was not used when the peer-memory path was.
    ///
    /// # Safety
    /// `span` is allocated device memory that stays allocated until the region is
    /// deregistered.
    #[cfg(feature = "gpu")]
    pub(crate) unsafe fn reg_gpu(
        &self,
        ctx: &VerbsCtx,
        span: crate::vocab::GpuSpan,
        access: Access,
    ) -> Result<(
        VerbsMr,
        u32,
        u32,
        crate::vocab::RegistrationPath,
        Option<String>,
    )> {
        use crate::vocab::RegistrationPath;
        use std::os::fd::AsRawFd;
        let (addr, len) = (span.addr, span.len);
        let dmabuf = crate::gpu::cuda::export_dmabuf(span).and_then(|(fd, offset)| {
            // The registration holds its own reference to the dma-buf; `fd` closes here.
            self.reg_dmabuf_mr(ctx, offset, len, addr, fd.as_raw_fd(), access)
        });
        let why_not_dmabuf = match dmabuf {
            Ok((m, l, r)) => return Ok((m, l, r, RegistrationPath::DmaBuf, None)),
            Err(e) => e,
        };
        // SAFETY: `[addr, addr+len)` is device memory that outlives the region (this
        // function's contract).
        match unsafe { self.reg_mr(ctx, addr as *mut u8, len, access) } {
            Ok((m, l, r)) => Ok((
                m,
                l,
                r,
                RegistrationPath::PeerMemory,
                Some(why_not_dmabuf.to_string()),
            )),
            Err(why_not_peer) => Err(Error::Gpu {
                what: format!(
                    "device {} cannot register GPU memory: dma-buf: {why_not_dmabuf}; peer memory \
                     (ibv_reg_mr on the device pointer, needs the nvidia_peermem module): \
                     {why_not_peer}",
                    ctx.name()
                ),
            }),
        }
    }

    pub(crate) fn create_qp(
        &self,
        ctx: &VerbsCtx,
        send_cq: &VerbsCq,
        recv_cq: &VerbsCq,
        caps: &QpCaps,
        sig_all: bool,
    ) -> Result<(VerbsQp, u32, QpCaps)> {
        // SAFETY: a zeroed ibv_qp_init_attr is a valid starting value (null pointers, 0 fields).
        let mut attr: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = send_cq.cq;
        attr.recv_cq = recv_cq.cq;
        attr.cap.max_send_wr = caps.max_send_wr;
        attr.cap.max_recv_wr = caps.max_recv_wr;
        attr.cap.max_send_sge = caps.max_send_sge;
        attr.cap.max_recv_sge = caps.max_recv_sge;
        attr.cap.max_inline_data = caps.max_inline_data;
        attr.qp_type = IBV_QPT_RC as _;
        attr.sq_sig_all = i32::from(sig_all);
        // The call writes the granted capacities back into `attr`.
        // SAFETY: the PD and CQs are live and of this context; `attr` is a valid, live value.
        let qp = unsafe { (ctx.lib.ibv_create_qp)(self.pd, &mut attr) };
        if qp.is_null() {
            return Err(Error::last_os("ibv_create_qp"));
        }
        // SAFETY: `qp` was just created.
        let qp_num = unsafe { (*qp).qp_num };
        // The kernel may grant more than asked; the SDK's rings never exceed what was asked,
        // except where the provider reports less.
        let granted = QpCaps {
            max_send_wr: attr.cap.max_send_wr.min(caps.max_send_wr).max(1),
            max_recv_wr: attr.cap.max_recv_wr.min(caps.max_recv_wr).max(1),
            max_send_sge: attr.cap.max_send_sge.min(caps.max_send_sge),
            max_recv_sge: attr.cap.max_recv_sge.min(caps.max_recv_sge),
            max_inline_data: attr.cap.max_inline_data.min(caps.max_inline_data),
        };
        Ok((VerbsQp { lib: ctx.lib, qp }, qp_num, granted))
    }
}

/// A memory region.
pub(crate) struct VerbsMr {
    pub(super) mr: *mut sys::ibv_mr,
}

// SAFETY: verbs objects are thread-safe; the pointer is owned by one handle.
unsafe impl Send for VerbsMr {}
// SAFETY: as above.
unsafe impl Sync for VerbsMr {}

impl VerbsMr {
    /// # Safety
    /// Called at most once per object, by its owner's `Drop`; the object is not used after.
    pub(crate) unsafe fn deregister(&self, ctx: &VerbsCtx) {
        // SAFETY: the caller's contract: the pointer is live and released only here, once.
        unsafe { (ctx.lib.ibv_dereg_mr)(self.mr) };
    }
}

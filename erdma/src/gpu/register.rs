//! Registering GPU memory with a device: the path policy.
//!
//! Kernel devices: dma-buf first (`cuMemGetHandleForAddressRange` → `ibv_reg_dmabuf_mr`), then
//! the peer-memory path (`ibv_reg_mr` on the device pointer). Soft device: a region whose bytes
//! the engine moves through a [`Stager`] over a [`CudaEngine`].

use std::os::fd::AsRawFd;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::mr::{Mr, MrInner};
use crate::pd::Pd;
use crate::provider::{CtxImpl, MrImpl, PdImpl};
use crate::vocab::Access;

use super::cuda::CudaEngine;
use super::stage::{READ_SLOTS, Stager, WRITE_SLOTS, slot_len_for};
use super::{GpuBuffer, RegistrationPath};

/// Registers `buf` with `pd`'s device. Returns the region, the path used, and why dma-buf was
/// not used when another path was.
pub(crate) fn register<'a>(
    pd: &Pd,
    buf: &GpuBuffer,
    access: Access,
) -> Result<(Mr<'a>, RegistrationPath, Option<String>)> {
    let len = buf.len();
    pd.context().limits().check_mr_len(len as u64)?;
    crate::mr::check_access(access)?;
    let addr = buf.device_ptr();
    let (imp, lkey, rkey, path, fallback) = match (&pd.inner.imp, &pd.context().inner.imp) {
        (PdImpl::Soft(p), CtxImpl::Soft(c)) => {
            let engine = CudaEngine::new(
                buf.device(),
                addr,
                READ_SLOTS + WRITE_SLOTS,
                slot_len_for(len as u64),
            )?;
            let stager = Arc::new(Stager::new(Box::new(engine), len as u64));
            let (m, l, r) = p.reg_device_mr(c, addr, len, access, stager)?;
            (MrImpl::Soft(m), l, r, RegistrationPath::SoftStaging, None)
        }
        (PdImpl::Verbs(p), CtxImpl::Verbs(c)) => {
            let dmabuf = buf.export_dmabuf().and_then(|(fd, offset)| {
                // The registration holds its own reference to the dma-buf; `fd` closes here.
                p.reg_dmabuf_mr(c, offset, len, addr, fd.as_raw_fd(), access)
            });
            match dmabuf {
                Ok((m, l, r)) => (MrImpl::Verbs(m), l, r, RegistrationPath::DmaBuf, None),
                Err(why_not_dmabuf) => {
                    // SAFETY: `[addr, addr+len)` is the buffer's device memory, which outlives
                    // the region (the GpuMr owns or borrows the buffer and deregisters first).
                    match p.reg_mr(c, addr as *mut u8, len, access) {
                        Ok((m, l, r)) => (
                            MrImpl::Verbs(m),
                            l,
                            r,
                            RegistrationPath::PeerMemory,
                            Some(why_not_dmabuf.to_string()),
                        ),
                        Err(why_not_peer) => {
                            return Err(Error::Gpu {
                                what: format!(
                                    "device {} cannot register GPU memory: dma-buf: \
                                     {why_not_dmabuf}; peer memory (ibv_reg_mr on the device \
                                     pointer, needs the nvidia_peermem module): {why_not_peer}",
                                    pd.context().name()
                                ),
                            });
                        }
                    }
                }
            }
        }
        _ => {
            return Err(Error::invalid(
                "objects of two different providers cannot be combined",
            ));
        }
    };
    Ok((
        Mr::from_inner(MrInner {
            pd: pd.clone(),
            imp,
            addr: addr as *mut u8,
            len,
            lkey,
            rkey,
            access,
            owned: None,
            device: true,
        }),
        path,
        fallback,
    ))
}

/// Registers a soft-device region over any copy backend (the host-memory mock in tests): the
/// same staging code the CUDA backend runs, reachable at `iova`.
#[cfg(test)]
pub(crate) fn register_soft_with_engine(
    pd: &Pd,
    iova: u64,
    len: usize,
    access: Access,
    engine: Box<dyn super::stage::CopyEngine>,
) -> Result<Mr<'static>> {
    let (PdImpl::Soft(p), CtxImpl::Soft(c)) = (&pd.inner.imp, &pd.context().inner.imp) else {
        return Err(Error::invalid("a soft device is needed"));
    };
    let stager = Arc::new(Stager::new(engine, len as u64));
    let (m, lkey, rkey) = p.reg_device_mr(c, iova, len, access, stager)?;
    Ok(Mr::from_inner(MrInner {
        pd: pd.clone(),
        imp: MrImpl::Soft(m),
        addr: iova as *mut u8,
        len,
        lkey,
        rkey,
        access,
        owned: None,
        device: true,
    }))
}

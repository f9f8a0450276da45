//! Registering GPU memory with a device: the path policy.
//!
//! Kernel devices: dma-buf first (`cuMemGetHandleForAddressRange` → `ibv_reg_dmabuf_mr`), then
//! the peer-memory path (`ibv_reg_mr` on the device pointer). Soft device: a region whose bytes
//! the engine moves through staging copies over CUDA. The providers hold each path
//! (`PdImpl::reg_gpu`); this builds the region.

use crate::error::Result;
use crate::mr::{Mr, MrInner};
use crate::pd::Pd;
use crate::vocab::Access;

use super::GpuBuffer;
use crate::vocab::RegistrationPath;

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
    let ctx = &pd.context().inner.imp;
    // SAFETY: the span is `buf`'s device memory, which outlives the region: the region owns or
    // borrows the buffer and deregisters before letting it go.
    let (imp, lkey, rkey, path, fallback) =
        unsafe { pd.inner.imp.reg_gpu(ctx, buf.span(), access)? };
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
    engine: Box<dyn crate::soft::engine::stage::CopyEngine>,
) -> Result<Mr<'static>> {
    let (imp, lkey, rkey) =
        pd.inner
            .imp
            .reg_soft_staged(&pd.context().inner.imp, iova, len, access, engine)?;
    Ok(Mr::from_inner(MrInner {
        pd: pd.clone(),
        imp,
        addr: iova as *mut u8,
        len,
        lkey,
        rkey,
        access,
        owned: None,
        device: true,
    }))
}

//! Protection domains: the scope of memory regions and queue pairs that may use each other.
//!
//! Owns [`Pd`]: registering memory (owned, borrowed, raw) and creating queue pairs, with every
//! limit checked before the device is called.

#![allow(unsafe_code)] // registers memory by address

use std::fmt;
use std::sync::Arc;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::mr::{HostBuffer, Mr, MrInner};
use crate::provider::PdImpl;
use crate::qp::{Qp, QpConfig, QpShared, Reset};
use crate::vocab::Access;

/// A protection domain. Cheap to clone; it lives while any handle, region or queue pair uses it.
#[derive(Clone)]
pub struct Pd {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    pub(crate) ctx: Context,
    pub(crate) imp: PdImpl,
}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: Drop runs once and the domain is not used after; its regions and queue pairs
        // hold it alive, so they are gone.
        unsafe { self.imp.dealloc(&self.ctx.inner.imp) };
    }
}

impl Pd {
    pub(crate) fn new(ctx: Context, imp: PdImpl) -> Pd {
        Pd {
            inner: Arc::new(PdInner { ctx, imp }),
        }
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Registers memory the region will own, with any access rights.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`]/[`Error::LimitBelowMinimum`] for the size, [`Error::Verb`].
    pub fn register(&self, buf: impl Into<HostBuffer>, access: Access) -> Result<Mr<'static>> {
        let buf = buf.into();
        let (addr, len) = (buf.as_ptr(), buf.len());
        // The region owns the buffer, which never moves and is freed only after the region is
        // deregistered (`MrInner`'s drop order).
        // SAFETY: `register_inner`'s contract holds (above).
        unsafe { self.register_inner(addr, len, access, Some(buf)) }
    }

    /// Allocates `len` zeroed, page-aligned bytes, resident from the start
    /// ([`HostBuffer::zeroed`]), and registers them.
    ///
    /// # Errors
    /// As [`Pd::register`], or [`Error::Io`] when the memory cannot be mapped.
    pub fn alloc(&self, len: usize, access: Access) -> Result<Mr<'static>> {
        self.context().limits().check_mr_len(len as u64)?;
        self.register(HostBuffer::zeroed(len)?, access)
    }

    /// Registers borrowed memory for **local** access (sources and targets of this process's own
    /// work requests). The memory stays borrowed, and untouchable except through the region, for
    /// as long as the region lives.
    ///
    /// Granting a peer access needs memory the region owns ([`Pd::register`]) or the `unsafe`
    /// [`Pd::register_raw`]: a peer's access cannot be tied to a borrow.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `access` has a remote right; otherwise as
    /// [`Pd::register`].
    pub fn register_slice<'a>(&self, mem: &'a mut [u8], access: Access) -> Result<Mr<'a>> {
        if access.is_remote() {
            return Err(Error::invalid(
                "borrowed memory can be registered for local access only; use Pd::register with \
                 an owned Buffer to grant a peer access",
            ));
        }
        // The region holds the exclusive borrow for `'a`, its whole life: the memory stays
        // allocated and unmoved until it is deregistered, and only the region reaches it.
        // SAFETY: `register_inner`'s contract holds (above).
        unsafe { self.register_inner(mem.as_mut_ptr(), mem.len(), access, None) }
    }

    /// Registers memory by address, with any rights.
    ///
    /// # Safety
    /// `[addr, addr+len)` must be allocated, and stay allocated and unmoved until the returned
    /// region is dropped (the device, and any peer granted access, may read or write it until
    /// then). The CPU must not access it in ways that race with the device's access: reads and
    /// writes through the region's own methods follow the same rules as for owned memory.
    ///
    /// # Errors
    /// As [`Pd::register`].
    pub unsafe fn register_raw(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Mr<'static>> {
        // SAFETY: the caller's contract is `register_inner`'s.
        unsafe { self.register_inner(addr, len, access, None) }
    }

    /// Registers `[addr, addr+len)`, owning `owned` (the memory itself, when the region owns
    /// it).
    ///
    /// # Safety
    /// The memory stays allocated and unmoved until the returned region is deregistered (the
    /// device may read and write it until then).
    unsafe fn register_inner<'a>(
        &self,
        addr: *mut u8,
        len: usize,
        access: Access,
        owned: Option<HostBuffer>,
    ) -> Result<Mr<'a>> {
        self.context().limits().check_mr_len(len as u64)?;
        crate::mr::check_access(access)?;
        // SAFETY: the caller's contract is the provider's.
        let (imp, lkey, rkey) = unsafe {
            self.inner
                .imp
                .reg_mr(&self.context().inner.imp, addr, len, access)
        }?;
        Ok(Mr::from_inner(MrInner {
            pd: self.clone(),
            imp,
            addr,
            len,
            lkey,
            rkey,
            access,
            owned,
            device: false,
        }))
    }

    /// Registers GPU memory the region will own, with any access rights. On a kernel device it
    /// tries dma-buf, then peer memory ([`crate::gpu::GpuMr::path`] says which worked); on the
    /// soft device the engine stages the bytes through pinned host memory.
    ///
    /// # Errors
    /// As [`Pd::register`]; [`Error::Gpu`] when neither registration path works (with both
    /// reasons) or the CUDA driver fails.
    #[cfg(feature = "gpu")]
    pub fn register_gpu(
        &self,
        buf: crate::gpu::GpuBuffer,
        access: Access,
    ) -> Result<crate::gpu::GpuMr<'static>> {
        crate::gpu::GpuMr::owned(self, buf, access)
    }

    /// Registers a borrowed GPU buffer for **local** access, holding the borrow for as long as
    /// the region lives (like [`Pd::register_slice`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `access` has a remote right; otherwise as
    /// [`Pd::register_gpu`].
    #[cfg(feature = "gpu")]
    pub fn register_gpu_local<'a>(
        &self,
        buf: &'a mut crate::gpu::GpuBuffer,
        access: Access,
    ) -> Result<crate::gpu::GpuMr<'a>> {
        crate::gpu::GpuMr::borrowed(self, buf, access)
    }

    /// Creates a reliable-connected queue pair in RESET.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`]/[`Error::LimitBelowMinimum`] naming the capacity out of range,
    /// [`Error::InvalidArgument`] when a completion queue belongs to another device,
    /// [`Error::Verb`].
    pub fn create_qp(&self, config: &QpConfig) -> Result<Qp<Reset>> {
        let limits = self.context().limits();
        limits.check_qp_caps(&config.caps)?;
        for cq in [&config.send_cq, &config.recv_cq] {
            if !Arc::ptr_eq(&cq.context().inner, &self.context().inner) {
                return Err(Error::invalid(
                    "a queue pair's completion queues must belong to its device",
                ));
            }
        }
        let ctx = &self.context().inner;
        let (imp, qp_num, caps) = self.inner.imp.create_qp(
            &ctx.imp,
            &config.send_cq.inner.imp,
            &config.recv_cq.inner.imp,
            &config.caps,
            config.sig_all,
            &ctx.events,
        )?;
        let shared = QpShared::new(self.clone(), config, imp, qp_num, caps);
        Ok(Qp::from_shared(shared))
    }
}

impl fmt::Debug for Pd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pd")
            .field("device", &self.context().name())
            .finish()
    }
}

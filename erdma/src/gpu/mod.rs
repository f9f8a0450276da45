//! GPU memory for RDMA: CUDA buffers as sources and targets of work requests.
//!
//! CUDA is reached through the driver API, loaded at run time from `libcuda.so.1`: nothing of
//! CUDA is needed to build, and on a machine without an NVIDIA GPU or driver every function here
//! returns [`Error::Gpu`] naming `libcuda.so.1` and the reason, while the rest of the SDK works
//! as before.
//!
//! - [`GpuBuffer`]: device memory, allocated on a chosen device ([`GpuBuffer::new`]) or borrowed
//!   from another framework ([`GpuBuffer::from_raw`], for PyTorch or CuPy pointers), with copies
//!   to and from host slices.
//! - [`GpuMr`]: a registration of a `GpuBuffer` ([`crate::Pd::register_gpu`]). On a kernel
//!   device it tries dma-buf first (`cuMemGetHandleForAddressRange` → `ibv_reg_dmabuf_mr`),
//!   then the peer-memory path (`ibv_reg_mr` on the device pointer, which works where
//!   `nvidia_peermem` is loaded), and says which one it used and why the other failed
//!   ([`GpuMr::path`], [`GpuMr::fallback_reason`]). The eRDMA provider has no dma-buf operation,
//!   so on eRDMA the peer-memory path is the one that works. On the soft device the engine moves
//!   the bytes with CUDA copies, pipelined through pinned staging slots (a dma-buf of NVIDIA
//!   memory cannot be mapped by the CPU).
//!
//! Segments of a `GpuMr` ([`GpuMr::slice`], [`GpuMr::slice_mut`]) go into work requests like
//! those of host regions; their bytes are not host memory, so reading them through `Deref`
//! panics: copy them with [`GpuBuffer::copy_to_host`] instead, once the request completed.
//!
//! Ordering: as with any RDMA device, the application finishes its own GPU work on a buffer
//! (synchronises its stream) before posting a request that reads it, and reads bytes a request
//! wrote only after that request (or the peer's signal) completed.

#![allow(unsafe_code)] // device pointers and dma-buf descriptors from CUDA

pub(crate) mod cuda;
pub(crate) use cuda::{HostPin, StreamCopies};
mod register;

use std::fmt;
use std::ops::RangeBounds;
use std::os::fd::OwnedFd;

use crate::error::{Error, Result};
use crate::mr::{Mr, MrSlice, MrSliceMut, RemoteMr};
use crate::pd::Pd;
pub use crate::vocab::RegistrationPath;
use crate::vocab::{Access, GpuSpan};

pub(crate) use register::register;

/// Number of CUDA devices on this machine.
///
/// # Errors
/// [`Error::Gpu`] when `libcuda.so.1` cannot be loaded or initialised (no driver, no device).
pub fn device_count() -> Result<usize> {
    cuda::driver()?.device_count()
}

/// The name of CUDA device `ordinal` (for example `NVIDIA H100 80GB HBM3`).
///
/// # Errors
/// [`Error::Gpu`] without a driver or for an ordinal past the last device.
pub fn device_name(ordinal: usize) -> Result<String> {
    cuda::driver()?.device_name(ordinal)
}

/// The CUDA version the driver supports, as `(major, minor)`.
///
/// # Errors
/// [`Error::Gpu`] without a driver.
pub fn driver_version() -> Result<(u32, u32)> {
    let v = cuda::driver()?.version()?.max(0) as u32;
    Ok((v / 1000, v % 1000 / 10))
}

/// Whether device `ordinal` can export its memory as dma-buf (what `ibv_reg_dmabuf_mr` needs).
///
/// # Errors
/// [`Error::Gpu`] without a driver or for an ordinal past the last device.
pub fn dmabuf_supported(ordinal: usize) -> Result<bool> {
    Ok(cuda::driver()?.attribute(ordinal, cuda::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? != 0)
}

/// Device memory on one CUDA device.
///
/// Made by [`GpuBuffer::new`] (allocated here, freed on drop) or [`GpuBuffer::from_raw`]
/// (another framework's memory, never freed here). Copies to and from host memory are
/// synchronous.
pub struct GpuBuffer {
    ptr: u64,
    len: usize,
    device: usize,
    owned: bool,
}

impl GpuBuffer {
    /// Allocates `len` zeroed bytes on device `device`.
    ///
    /// # Errors
    /// [`Error::Gpu`] without a driver, for a device that does not exist, or when the device is
    /// out of memory; [`Error::InvalidArgument`] for `len == 0`.
    pub fn new(device: usize, len: usize) -> Result<GpuBuffer> {
        if len == 0 {
            return Err(Error::invalid("a GPU buffer needs at least one byte"));
        }
        let cuda = cuda::driver()?;
        cuda.bind(device)?;
        let mut ptr = 0u64;
        // SAFETY: `ptr` is a valid out-parameter; the device's context is current.
        cuda.check(&format!("cuMemAlloc({len} bytes)"), unsafe {
            (cuda.cu_mem_alloc)(&mut ptr, len)
        })?;
        let mut buf = GpuBuffer {
            ptr,
            len,
            device,
            owned: true,
        };
        buf.fill(0)?;
        Ok(buf)
    }

    /// Wraps device memory another framework allocated (`tensor.data_ptr()` in PyTorch,
    /// `array.data.ptr` in CuPy). The device is found from the pointer. Dropping the buffer
    /// leaves the memory to its owner.
    ///
    /// # Safety
    /// `[ptr, ptr+len)` must be device memory of one CUDA allocation, and it must stay allocated
    /// until the returned buffer and every region registered over it are dropped (the device,
    /// and peers granted access, may read and write it until then). The owner must not free or
    /// reuse it meanwhile (keep the tensor alive).
    ///
    /// # Errors
    /// [`Error::Gpu`] when the driver does not know the pointer as device memory, or the range
    /// leaves its allocation; [`Error::InvalidArgument`] for `len == 0`.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Result<GpuBuffer> {
        if len == 0 {
            return Err(Error::invalid("a GPU buffer needs at least one byte"));
        }
        let cuda = cuda::driver()?;
        let not_device = |detail: String| Error::Gpu {
            what: format!("{ptr:#x} is not CUDA device memory: {detail}"),
        };
        let kind: u32 = {
            // SAFETY: MEMORY_TYPE is written as an unsigned int (CUmemorytype).
            unsafe { cuda.pointer_attribute(ptr, cuda::CU_POINTER_ATTRIBUTE_MEMORY_TYPE) }
        }
        .map_err(|rc| not_device(cuda.error_name(rc)))?;
        if kind != cuda::CU_MEMORYTYPE_DEVICE {
            return Err(not_device(format!("memory type {kind}")));
        }
        let device: i32 = {
            // SAFETY: DEVICE_ORDINAL is written as an int.
            unsafe { cuda.pointer_attribute(ptr, cuda::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) }
        }
        .map_err(|rc| not_device(cuda.error_name(rc)))?;
        let start: u64 = {
            // SAFETY: RANGE_START_ADDR is written as a CUdeviceptr.
            unsafe { cuda.pointer_attribute(ptr, cuda::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) }
        }
        .map_err(|rc| not_device(cuda.error_name(rc)))?;
        let size: usize = {
            // SAFETY: RANGE_SIZE is written as a size_t.
            unsafe { cuda.pointer_attribute(ptr, cuda::CU_POINTER_ATTRIBUTE_RANGE_SIZE) }
        }
        .map_err(|rc| not_device(cuda.error_name(rc)))?;
        let end = ptr.checked_add(len as u64);
        if end.is_none_or(|e| e > start + size as u64) {
            return Err(Error::OutOfBounds {
                what: "GPU allocation",
                offset: ptr - start,
                len: len as u64,
                available: size as u64,
            });
        }
        Ok(GpuBuffer {
            ptr,
            len,
            device: device.max(0) as usize,
            owned: false,
        })
    }

    /// The device address of the first byte.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: zero-length buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The CUDA device ordinal the memory lives on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Whether this buffer frees its memory on drop (it was allocated by [`GpuBuffer::new`]).
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(Error::OutOfBounds {
                what: "GPU buffer",
                offset: offset as u64,
                len: len as u64,
                available: self.len as u64,
            });
        }
        Ok(())
    }

    /// Copies `src` into the buffer at `offset`; the bytes are in device memory when this
    /// returns.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range leaves the buffer; [`Error::Gpu`] when the copy
    /// fails.
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let cuda = cuda::driver()?;
        cuda.bind(self.device)?;
        // SAFETY: the device range is inside the buffer (checked); `src` is readable host memory.
        cuda.check("cuMemcpyHtoD", unsafe {
            (cuda.cu_memcpy_htod)(self.ptr + offset as u64, src.as_ptr().cast(), src.len())
        })?;
        // A copy from pageable memory may return before its DMA finished: wait for it, so
        // copies on other streams (the soft device's staging) see the bytes.
        // SAFETY: the null stream is the context's default stream.
        cuda.check("cuStreamSynchronize", unsafe {
            (cuda.cu_stream_synchronize)(std::ptr::null_mut())
        })
    }

    /// Copies bytes at `offset` out of the buffer into `dst`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range leaves the buffer; [`Error::Gpu`] when the copy
    /// fails.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let cuda = cuda::driver()?;
        cuda.bind(self.device)?;
        // SAFETY: the device range is inside the buffer (checked); `dst` is writable host memory.
        cuda.check("cuMemcpyDtoH", unsafe {
            (cuda.cu_memcpy_dtoh)(dst.as_mut_ptr().cast(), self.ptr + offset as u64, dst.len())
        })
    }

    /// The whole buffer, copied to a new host vector.
    ///
    /// # Errors
    /// As [`GpuBuffer::copy_to_host`].
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len];
        self.copy_to_host(0, &mut v)?;
        Ok(v)
    }

    /// Sets every byte to `byte`.
    ///
    /// # Errors
    /// [`Error::Gpu`] when the driver fails.
    pub fn fill(&mut self, byte: u8) -> Result<()> {
        let cuda = cuda::driver()?;
        cuda.bind(self.device)?;
        // SAFETY: the range is the buffer itself.
        cuda.check("cuMemsetD8", unsafe {
            (cuda.cu_memset_d8)(self.ptr, byte, self.len)
        })?;
        // SAFETY: the null stream is the context's default stream.
        cuda.check("cuStreamSynchronize", unsafe {
            (cuda.cu_stream_synchronize)(std::ptr::null_mut())
        })
    }

    /// Exports the pages holding the buffer as a dma-buf. Returns the file descriptor and the
    /// buffer's offset inside it (the export starts at the page holding the first byte).
    ///
    /// # Errors
    /// [`Error::Gpu`] when the driver refuses (no dma-buf support in this driver or kernel).
    pub fn export_dmabuf(&self) -> Result<(OwnedFd, u64)> {
        cuda::export_dmabuf(self.span())
    }

    /// The buffer as the provider line sees it.
    pub(crate) fn span(&self) -> GpuSpan {
        GpuSpan {
            addr: self.ptr,
            len: self.len,
            device: self.device,
        }
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if let Ok(cuda) = cuda::driver()
            && cuda.bind(self.device).is_ok()
        {
            // Allocated by cuMemAlloc in `new` and freed once; every region over it was dropped
            // first (a region owns or borrows the buffer).
            // SAFETY: a live allocation, unused and freed once (above).
            unsafe { (cuda.cu_mem_free)(self.ptr) };
        }
    }
}

impl fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device", &self.device)
            .field("owned", &self.owned)
            .finish()
    }
}

enum Backing<'a> {
    Owned(GpuBuffer),
    Borrowed(&'a mut GpuBuffer),
}

/// A registered GPU memory region. Like [`Mr`], typed by the lifetime of its memory:
/// `GpuMr<'static>` owns its [`GpuBuffer`]; a region over a borrowed buffer holds the borrow.
///
/// Dropping it deregisters the memory first, then frees a buffer it owns.
pub struct GpuMr<'a> {
    // Field order matters: the registration goes before the memory.
    mr: Mr<'a>,
    backing: Backing<'a>,
    path: RegistrationPath,
    fallback: Option<String>,
}

impl<'a> GpuMr<'a> {
    pub(crate) fn owned(pd: &Pd, buf: GpuBuffer, access: Access) -> Result<GpuMr<'static>> {
        let (mr, path, fallback) = register(pd, &buf, access)?;
        Ok(GpuMr {
            mr,
            backing: Backing::Owned(buf),
            path,
            fallback,
        })
    }

    pub(crate) fn borrowed(pd: &Pd, buf: &'a mut GpuBuffer, access: Access) -> Result<GpuMr<'a>> {
        if access.is_remote() {
            return Err(Error::invalid(
                "a borrowed GPU buffer can be registered for local access only; register an \
                 owned GpuBuffer to grant a peer access",
            ));
        }
        let (mr, path, fallback) = register(pd, buf, access)?;
        Ok(GpuMr {
            mr,
            backing: Backing::Borrowed(buf),
            path,
            fallback,
        })
    }

    /// How the memory was registered.
    pub fn path(&self) -> RegistrationPath {
        self.path
    }

    /// Why the preferred path (dma-buf) was not used, when the region fell back to another.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// The memory.
    pub fn buffer(&self) -> &GpuBuffer {
        match &self.backing {
            Backing::Owned(b) => b,
            Backing::Borrowed(b) => b,
        }
    }

    /// The memory, for copies from the host. Needs `&mut self`, so no request of this process
    /// uses the region meanwhile (a peer granted write access still may).
    pub fn buffer_mut(&mut self) -> &mut GpuBuffer {
        match &mut self.backing {
            Backing::Owned(b) => b,
            Backing::Borrowed(b) => b,
        }
    }

    /// The region's start address (the device address, which is also its RDMA address).
    pub fn addr(&self) -> u64 {
        self.mr.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mr.len()
    }

    /// Whether the region is empty (never).
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The access rights.
    pub fn access(&self) -> Access {
        self.mr.access()
    }

    /// The protection domain.
    pub fn pd(&self) -> &Pd {
        self.mr.pd()
    }

    /// What a peer needs to reach the whole region.
    pub fn remote(&self) -> RemoteMr {
        self.mr.remote()
    }

    /// A segment the device reads (SEND and WRITE sources). Its bytes are device memory:
    /// dereferencing it panics.
    ///
    /// # Panics
    /// When the range lies outside the region. [`GpuMr::get`] is the checked form.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> MrSlice<'_> {
        self.mr.slice(range)
    }

    /// Checked form of [`GpuMr::slice`].
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn get(&self, range: impl RangeBounds<usize>) -> Result<MrSlice<'_>> {
        self.mr.get(range)
    }

    /// A segment the device writes (receive buffers, READ targets).
    ///
    /// # Panics
    /// When the range lies outside the region. [`GpuMr::get_mut`] is the checked form.
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> MrSliceMut<'_> {
        self.mr.slice_mut(range)
    }

    /// Checked form of [`GpuMr::slice_mut`].
    ///
    /// # Errors
    /// [`Error::OutOfBounds`].
    pub fn get_mut(&mut self, range: impl RangeBounds<usize>) -> Result<MrSliceMut<'_>> {
        self.mr.get_mut(range)
    }
}

impl fmt::Debug for GpuMr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuMr")
            .field("mr", &self.mr)
            .field("buffer", self.buffer())
            .field("path", &self.path)
            .field("fallback", &self.fallback)
            .finish()
    }
}

/// The soft device's GPU path end to end, with the host-memory mock backend in place of CUDA:
/// the same staging, flush and announcement code, on two real soft devices over loopback.
#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::register::register_soft_with_engine;
    use crate::soft::engine::stage::tests::MockEngine;
    use crate::{
        Access, Context, Cq, InitOptions, Mr, Qp, QpConfig, RecvWr, SendWr, WcStatus, scope,
    };

    const WAIT: Duration = Duration::from_secs(20);

    fn end(name: &str) -> (Context, Cq, crate::Qp<crate::Init>) {
        let ctx = Context::open(name).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let qp = pd
            .create_qp(&QpConfig::new(&cq))
            .unwrap()
            .init(&InitOptions {
                access: Access::ALL,
                ..InitOptions::default()
            })
            .unwrap();
        (ctx, cq, qp)
    }

    fn pair(n: u8) -> ((Cq, Qp), (Cq, Qp)) {
        let (_ca, cqa, qa) = end(&format!("soft:127.1.{n}.1"));
        let (_cb, cqb, qb) = end(&format!("soft:127.1.{n}.2"));
        let (ea, eb) = (qa.endpoint().unwrap(), qb.endpoint().unwrap());
        let qa = qa.connect(&eb, &Default::default()).unwrap();
        let qb = qb.connect(&ea, &Default::default()).unwrap();
        ((cqa, qa), (cqb, qb))
    }

    /// A mock "GPU" region of `len` bytes at a fake device address, and its memory.
    fn device_mr(qp: &Qp, iova: u64, len: usize, fill: u8) -> (Mr<'static>, Arc<Mutex<Vec<u8>>>) {
        let dev = Arc::new(Mutex::new(vec![fill; len]));
        let engine = MockEngine::new(
            dev.clone(),
            crate::soft::engine::stage::slot_len_for(len as u64),
        );
        let mr =
            register_soft_with_engine(qp.pd(), iova, len, Access::ALL, Box::new(engine)).unwrap();
        (mr, dev)
    }

    fn ok(cq: &Cq) -> crate::Completion {
        let c = cq.wait_one(WAIT).unwrap();
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        c
    }

    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 13) as u8 ^ seed)
            .collect()
    }

    #[test]
    fn soft_device_moves_device_memory_through_the_stager() {
        let ((cqa, qa), (cqb, qb)) = pair(77);
        let len = (5 << 20) + 123;
        let (ma, deva) = device_mr(&qa, 0x7f00_0000_0000, len, 0);
        let (mut mb, devb) = device_mr(&qb, 0x7e00_0000_0000, len, 0xEE);
        let data = pattern(3, len);
        deva.lock().unwrap().copy_from_slice(&data);
        // WRITE: every byte is in B's device memory once A's completion arrives (B flushed its
        // staged writes before acknowledging).
        scope(|s| {
            let src = [ma.slice(..)];
            s.post_send(&qa, SendWr::write(1, &src, mb.remote()))
                .unwrap();
            ok(&cqa);
        });
        assert!(*devb.lock().unwrap() == data, "WRITE placed every byte");
        // READ back into B after changing A's memory: bytes staged before the READ request are
        // not used for it.
        deva.lock()
            .unwrap()
            .iter_mut()
            .for_each(|b| *b = b.wrapping_add(1));
        let changed = deva.lock().unwrap().clone();
        scope(|s| {
            s.post_send(&qb, SendWr::read(2, mb.slice_mut(..), ma.remote()))
                .unwrap();
            ok(&cqb);
        });
        assert!(
            *devb.lock().unwrap() == changed,
            "READ saw the changed bytes"
        );
        // SEND into a device receive buffer, from device memory changed again before posting.
        deva.lock().unwrap()[..4096].fill(0x33);
        scope(|s| {
            s.post_recv(&qb, RecvWr::new(3, mb.slice_mut(100..100 + 8192)))
                .unwrap();
            let src = [ma.slice(..8192)];
            s.post_send(&qa, SendWr::send(4, &src)).unwrap();
            ok(&cqa);
            assert_eq!(ok(&cqb).byte_len, 8192);
        });
        let got = devb.lock().unwrap()[100..100 + 8192].to_vec();
        assert!(
            got[..4096].iter().all(|&b| b == 0x33),
            "SEND sent fresh bytes"
        );
        assert_eq!(got[4096..], changed[4096..8192]);
    }

    #[test]
    #[should_panic(expected = "GPU memory")]
    fn the_cpu_cannot_dereference_device_segments() {
        let ((_cqa, qa), _) = pair(79);
        let (ma, _) = device_mr(&qa, 0x7b00_0000_0000, 4096, 0);
        let seg = ma.slice(..8);
        assert!(seg.is_device());
        let _ = seg.to_vec();
    }

    #[test]
    fn device_memory_refuses_atomics_and_inline() {
        let ((cqa, qa), (_cqb, qb)) = pair(78);
        let (ma, _) = device_mr(&qa, 0x7d00_0000_0000, 4096, 0);
        let (mb, _) = device_mr(&qb, 0x7c00_0000_0000, 4096, 0);
        let mut host = qa.pd().alloc(8, Access::ALL).unwrap();
        let c = scope(|s| {
            s.post_send(
                &qa,
                SendWr::fetch_add(1, host.slice_mut(..), mb.remote().slice(0, 8).unwrap(), 1),
            )
            .unwrap();
            cqa.wait_one(WAIT).unwrap()
        });
        assert_eq!(c.status, WcStatus::RemOpErr, "{c:?}");
        let err = scope(|s| {
            let src = [ma.slice(..16)];
            s.post_send(&qa, SendWr::send(2, &src).inline())
        });
        assert!(
            matches!(err, Err(crate::Error::InvalidArgument(_))),
            "{err:?}"
        );
    }
}

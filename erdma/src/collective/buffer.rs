//! Where the data of a collective lives: the seam between the ring and the memory it reduces.
//!
//! The ring always works in its own registered host buffer. A [`ReduceBuffer`] moves the
//! user's data into it and the result back; host memory does it with `memcpy`, and memory the
//! ring cannot use directly supplies its own copies.
//!
//! A [`GpuBuffer`](crate::gpu::GpuBuffer) is one such memory: its contents are copied to the
//! ring's host buffer, the ring reduces there (on the host, over the staged copies), and the
//! result is copied back to the GPU, piece by piece beside the ring (see
//! [`ReduceBuffer::as_gpu_mut`]). The GPU holds the result when
//! [`Communicator::all_reduce`](crate::collective::Communicator::all_reduce) returns. The
//! first such call page-locks the ring's host buffer for the GPU's copies.

#![allow(unsafe_code)] // raw views of registered buffers the ring writes by RDMA

use crate::error::{Error, Result};

/// Memory whose contents a collective reduces, staged through the ring's host buffer.
pub trait ReduceBuffer {
    /// Size in bytes.
    fn len_bytes(&self) -> usize;

    /// Copies the contents into `host` (exactly [`ReduceBuffer::len_bytes`] bytes).
    ///
    /// # Errors
    /// Whatever the memory's copy reports.
    fn copy_to_host(&self, host: &mut [u8]) -> Result<()>;

    /// Replaces the contents with `host` (exactly [`ReduceBuffer::len_bytes`] bytes).
    ///
    /// # Errors
    /// Whatever the memory's copy reports.
    fn copy_from_host(&mut self, host: &[u8]) -> Result<()>;

    /// This memory as a GPU buffer, if it is one (default: not). The communicator then moves
    /// it with asynchronous copies beside the ring, piece by piece, instead of copying the
    /// whole buffer before and after: each piece is loaded before the ring first reads it and
    /// stored as soon as its result is final. A wrapper around a [`GpuBuffer`] (a tensor's
    /// memory, say) returns it here to get the same.
    ///
    /// [`GpuBuffer`]: crate::gpu::GpuBuffer
    #[cfg(feature = "gpu")]
    fn as_gpu_mut(&mut self) -> Option<&mut crate::gpu::GpuBuffer> {
        None
    }
}

/// Ordinary host memory.
impl ReduceBuffer for [u8] {
    fn len_bytes(&self) -> usize {
        self.len()
    }

    fn copy_to_host(&self, host: &mut [u8]) -> Result<()> {
        same_len(self.len(), host.len())?;
        host.copy_from_slice(self);
        Ok(())
    }

    fn copy_from_host(&mut self, host: &[u8]) -> Result<()> {
        same_len(self.len(), host.len())?;
        self.copy_from_slice(host);
        Ok(())
    }
}

impl ReduceBuffer for Vec<u8> {
    fn len_bytes(&self) -> usize {
        self.len()
    }

    fn copy_to_host(&self, host: &mut [u8]) -> Result<()> {
        self.as_slice().copy_to_host(host)
    }

    fn copy_from_host(&mut self, host: &[u8]) -> Result<()> {
        self.as_mut_slice().copy_from_host(host)
    }
}

#[cfg(feature = "gpu")]
impl ReduceBuffer for crate::gpu::GpuBuffer {
    fn len_bytes(&self) -> usize {
        self.len()
    }

    fn copy_to_host(&self, host: &mut [u8]) -> Result<()> {
        same_len(self.len(), host.len())?;
        crate::gpu::GpuBuffer::copy_to_host(self, 0, host)
    }

    fn copy_from_host(&mut self, host: &[u8]) -> Result<()> {
        same_len(self.len(), host.len())?;
        crate::gpu::GpuBuffer::copy_from_host(self, 0, host)
    }

    fn as_gpu_mut(&mut self) -> Option<&mut crate::gpu::GpuBuffer> {
        Some(self)
    }
}

/// Copies between memory the ring cannot reach and the ring's host buffer that run beside the
/// ring. Offsets are in bytes, the same in both. The ring loads every byte it reads (waiting
/// for the load before its first read or write of it) and stores every byte once its result
/// is final.
pub(crate) trait Overlap {
    /// Starts copying `[off, off+len)` of the memory into the host buffer, as unit `unit`.
    ///
    /// # Safety
    /// The caller reads and writes no byte of that range of the host buffer before
    /// [`Overlap::loaded`]`(unit)` returns `Ok`, nor after an error until
    /// [`Overlap::finish`] returns.
    ///
    /// # Errors
    /// A range outside either buffer; the copy's own errors.
    unsafe fn load(&mut self, unit: usize, off: usize, len: usize) -> Result<()>;

    /// Waits until unit `unit` has been loaded (the ring asks once per unit).
    ///
    /// # Errors
    /// The copy's errors.
    fn loaded(&mut self, unit: usize) -> Result<()>;

    /// Starts copying `[off, off+len)` of the host buffer back into the memory.
    ///
    /// # Safety
    /// The caller writes no byte of that range of the host buffer before [`Overlap::finish`]
    /// returns.
    ///
    /// # Errors
    /// A range outside either buffer; the copy's own errors.
    unsafe fn store(&mut self, off: usize, len: usize) -> Result<()>;

    /// Waits for every copy started.
    ///
    /// # Errors
    /// The copies' errors.
    fn finish(&mut self) -> Result<()>;
}

/// [`Overlap`] for a [`GpuBuffer`](crate::gpu::GpuBuffer): copies on one stream, an event per
/// load unit.
#[cfg(feature = "gpu")]
pub(crate) struct GpuOverlap<'a> {
    pub(crate) copies: &'a mut crate::gpu::StreamCopies,
    /// Device address and length of the GPU buffer.
    pub(crate) dev: u64,
    pub(crate) dev_len: usize,
    /// The ring's host buffer (page-locked where the driver allowed), and its length. Whoever
    /// builds this value keeps those `host_len` bytes allocated, and leaves the bytes it loads
    /// and stores to it, for as long as this value lives (the communicator, which owns the
    /// buffer, builds one per call).
    pub(crate) host: *mut u8,
    pub(crate) host_len: usize,
}

#[cfg(feature = "gpu")]
impl GpuOverlap<'_> {
    fn check(&self, off: usize, len: usize) -> Result<()> {
        match off.checked_add(len) {
            Some(end) if end <= self.dev_len && end <= self.host_len => Ok(()),
            _ => Err(Error::OutOfBounds {
                what: "staged GPU copy",
                offset: off as u64,
                len: len as u64,
                available: self.dev_len.min(self.host_len) as u64,
            }),
        }
    }
}

#[cfg(feature = "gpu")]
impl Overlap for GpuOverlap<'_> {
    unsafe fn load(&mut self, unit: usize, off: usize, len: usize) -> Result<()> {
        self.check(off, len)?;
        // In bounds of both buffers (checked); the caller leaves the host range alone until
        // the unit is loaded or `finish` returns, and the GPU buffer is borrowed mutably by
        // the call for as long.
        // SAFETY: both ranges are live and untouched while the copy runs (above).
        unsafe {
            self.copies
                .queue_to_host(unit, self.host.add(off), self.dev + off as u64, len)
        }
    }

    fn loaded(&mut self, unit: usize) -> Result<()> {
        self.copies.wait(unit)
    }

    unsafe fn store(&mut self, off: usize, len: usize) -> Result<()> {
        self.check(off, len)?;
        // In bounds (checked); the caller writes the host range no more before `finish`, and
        // the GPU buffer is borrowed mutably by the call.
        // SAFETY: both ranges are live and unwritten by others while the copy runs (above).
        unsafe {
            self.copies
                .queue_to_device(self.dev + off as u64, self.host.add(off), len)
        }
    }

    fn finish(&mut self) -> Result<()> {
        self.copies.finish()
    }
}

fn same_len(mine: usize, host: usize) -> Result<()> {
    if mine == host {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "staging {host} bytes for a buffer of {mine} bytes"
        )))
    }
}

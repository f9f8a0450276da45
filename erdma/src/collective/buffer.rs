//! Where the data of a collective lives: the seam between the ring and the memory it reduces.
//!
//! The ring always works in its own registered host buffer. A [`ReduceBuffer`] moves the
//! user's data into it and the result back; host memory does it with `memcpy`, and memory the
//! ring cannot use directly supplies its own copies.
//!
//! A [`GpuBuffer`](crate::gpu::GpuBuffer) is one such memory: its whole contents are copied to
//! the ring's host buffer, the ring reduces there (on the host, over the staged copies), and the
//! result is copied back to the GPU. The copies are synchronous, so the GPU holds the result
//! when [`Communicator::all_reduce`](crate::collective::Communicator::all_reduce) returns. The
//! first such call page-locks the ring's host buffer for the GPU's copies (see
//! [`ReduceBuffer::gpu_device`]).

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

    /// The CUDA device whose memory this is, for GPU memory (default: none). The communicator
    /// then page-locks its host buffer for that device's copies, once: copies from and to
    /// page-locked memory go by DMA instead of through the driver's bounce buffers. Where the
    /// driver refuses, the copies still work, through those buffers.
    fn gpu_device(&self) -> Option<usize> {
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

    fn gpu_device(&self) -> Option<usize> {
        Some(self.device())
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

//! Memory NCCL registers (`regMr`): its buffers, host or GPU, registered with the device's
//! protection domain, so that any connection of the device can use them.
#![allow(unsafe_code)]

use std::sync::Arc;

use erdma::gpu::{GpuBuffer, GpuMr};
use erdma::{Access, Mr};

use crate::device::Dev;

/// NCCL's `NCCL_PTR_HOST`.
pub const PTR_HOST: i32 = 1;
/// NCCL's `NCCL_PTR_CUDA`.
pub const PTR_CUDA: i32 = 2;

enum Backing {
    Host(Mr<'static>),
    Gpu(GpuMr<'static>),
    /// A zero-byte registration: nothing to register, nothing to reach.
    Empty,
}

/// One registration.
pub struct MemReg {
    /// The device it belongs to.
    pub dev: Arc<Dev>,
    backing: Backing,
    addr: u64,
    len: u64,
}

impl std::fmt::Debug for MemReg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemReg")
            .field("dev", &self.dev.name())
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("gpu", &self.is_gpu())
            .finish()
    }
}

/// Rights every registration gets: the device writes received data, peers WRITE into receive
/// buffers, and the flush READs them.
const ACCESS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ);

impl MemReg {
    /// Registers `[addr, addr+len)` of memory type `ptr_type` with `dev`.
    ///
    /// # Safety
    /// The memory must stay allocated until the registration is dropped (NCCL deregisters
    /// before freeing, and every request holds its registration until it completes).
    ///
    /// # Errors
    /// A message naming the reason: an unknown type, GPU memory on a device that does not take
    /// it, the device's refusal.
    pub unsafe fn register(
        dev: &Arc<Dev>,
        addr: u64,
        len: u64,
        ptr_type: i32,
    ) -> Result<MemReg, String> {
        let backing = if len == 0 {
            Backing::Empty
        } else if addr == 0 {
            return Err(format!("registering {len} bytes at address 0"));
        } else {
            let size = usize::try_from(len).map_err(|_| format!("{len} bytes"))?;
            match ptr_type {
                PTR_HOST => {
                    // SAFETY: the caller keeps the memory allocated while the region lives.
                    let mr = unsafe { dev.pd.register_raw(addr as *mut u8, size, ACCESS) }
                        .map_err(|e| format!("registering {len} bytes of host memory: {e}"))?;
                    Backing::Host(mr)
                }
                PTR_CUDA => {
                    // SAFETY: the caller keeps the GPU memory allocated while the region lives;
                    // the wrapper never frees it.
                    let buf = unsafe { GpuBuffer::from_raw(addr, size) }
                        .map_err(|e| format!("GPU memory at {addr:#x}: {e}"))?;
                    let mr = dev
                        .pd
                        .register_gpu(buf, ACCESS)
                        .map_err(|e| format!("registering {len} bytes of GPU memory: {e}"))?;
                    crate::log::info!(
                        crate::log::NET,
                        "NET/erdma: {}: {len} bytes of GPU memory registered through {}",
                        dev.name(),
                        mr.path()
                    );
                    Backing::Gpu(mr)
                }
                t => {
                    return Err(format!(
                        "memory type {t} (NCCL_PTR_HOST=1, NCCL_PTR_CUDA=2)"
                    ));
                }
            }
        };
        Ok(MemReg {
            dev: dev.clone(),
            backing,
            addr,
            len,
        })
    }

    /// The local key.
    pub fn lkey(&self) -> u32 {
        match &self.backing {
            Backing::Host(m) => m.lkey(),
            Backing::Gpu(m) => m.lkey(),
            Backing::Empty => 0,
        }
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        match &self.backing {
            Backing::Host(m) => m.rkey(),
            Backing::Gpu(m) => m.rkey(),
            Backing::Empty => 0,
        }
    }

    /// Whether the memory is GPU memory.
    pub fn is_gpu(&self) -> bool {
        matches!(self.backing, Backing::Gpu(_))
    }

    /// Checks that `[addr, addr+len)` lies inside the registration.
    ///
    /// # Errors
    /// A message naming the range and the registration.
    pub fn check(&self, addr: u64, len: u64) -> Result<(), String> {
        if len == 0 {
            return Ok(());
        }
        let inside = addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len);
        if inside {
            Ok(())
        } else {
            Err(format!(
                "{len} bytes at {addr:#x} lie outside the registration of {} bytes at {:#x}",
                self.len, self.addr
            ))
        }
    }
}

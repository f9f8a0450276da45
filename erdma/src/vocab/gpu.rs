//! GPU memory as the provider line sees it: where it is, and how it was registered.

use core::fmt;

/// A span of GPU device memory: a CUDA device pointer, its length, and the device's ordinal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuSpan {
    /// The device pointer (`CUdeviceptr`) of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// The CUDA device ordinal.
    pub device: usize,
}

/// How a GPU memory region (`erdma::gpu::GpuMr`) was registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegistrationPath {
    /// `ibv_reg_dmabuf_mr` over a dma-buf exported by the CUDA driver.
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer (the kernel's peer-memory client, `nvidia_peermem`).
    PeerMemory,
    /// The soft device: CUDA copies through pinned staging slots.
    SoftStaging,
}

impl fmt::Display for RegistrationPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RegistrationPath::DmaBuf => "dma-buf",
            RegistrationPath::PeerMemory => "peer memory",
            RegistrationPath::SoftStaging => "soft device staging",
        })
    }
}

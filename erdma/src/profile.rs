//! The eRDMA limit profile's fixed numbers, and how an eRDMA adapter identifies itself.
//!
//! A device is held to this profile when it is an eRDMA device and when it is the soft device,
//! which models eRDMA ([`crate::Limits`] says which rules a context follows). Sources: the
//! kernel driver's `erdma_verbs.h` / `erdma_qp_validate_cap` and the rdma-core provider.

/// PCI vendor id of Alibaba's eRDMA adapter.
pub const ERDMA_VENDOR_ID: u32 = 0x1ded;
/// PCI part id of Alibaba's eRDMA adapter.
pub const ERDMA_PART_ID: u32 = 0x107f;
/// Vendor id the kernel's soft-iWARP driver (siw) reports (`"bmt"`).
pub const SIW_VENDOR_ID: u32 = 0x626d74;
/// Inline bytes per send work request on siw (5 SGE slots of 16 bytes; the kernel refuses a
/// queue pair that asks for more).
pub const SIW_MAX_INLINE_DATA: u32 = 80;

/// Send SGEs per work request.
pub const MAX_SEND_SGE: u32 = 6;
/// Receive SGEs per work request.
pub const MAX_RECV_SGE: u32 = 1;
/// Inline bytes per send work request (6 SGE slots of 16 bytes).
pub const MAX_INLINE_DATA: u32 = 96;
/// Send work requests per queue pair.
pub const MAX_SEND_WR: u32 = 8192;
/// Outstanding RDMA READ / atomic operations, as initiator (ORD) and as target (IRD).
pub const MAX_RD_ATOMIC: u32 = 128;
/// SGEs of an RDMA READ: exactly one.
pub const MAX_SGE_RD: u32 = 1;
/// Smallest completion queue the userspace provider creates.
pub const MIN_CQ_DEPTH: u32 = 64;
/// Largest memory region seen on eRDMA (`max_mr_size`, 64 GiB).
pub const MAX_MR_SIZE: u64 = 64 << 30;
/// Protection domains per device.
pub const MAX_PD: u32 = 128 * 1024;

//! `devinfo --nccl`: for each device, the mode, the GID index, and the NCCL / PyTorch settings
//! that fit.

/// The report (placeholder until written).
pub fn report() -> String {
    String::new()
}

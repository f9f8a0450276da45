//! Work-request values: the [`WrOpcode`] of a send request, its [`SendFlags`], and the
//! scatter/gather element [`Sge`] (the layout of `ibv_sge`).

use bitflags::bitflags;

/// The operation of a send work request (the `IBV_WR_*` numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WrOpcode {
    /// RDMA WRITE.
    RdmaWrite = 0,
    /// RDMA WRITE with immediate data (consumes a receive at the peer).
    RdmaWriteWithImm = 1,
    /// SEND.
    Send = 2,
    /// SEND with immediate data.
    SendWithImm = 3,
    /// RDMA READ.
    RdmaRead = 4,
    /// Atomic compare and swap.
    AtomicCmpAndSwp = 5,
    /// Atomic fetch and add.
    AtomicFetchAndAdd = 6,
    /// SEND that invalidates a remote key at the peer.
    SendWithInv = 9,
}

impl WrOpcode {
    /// From the verbs value; `None` for operations this crate does not implement
    /// (local invalidate, memory-window binds, TSO, the mlx5 extensions).
    pub const fn from_raw(v: u32) -> Option<WrOpcode> {
        Some(match v {
            0 => WrOpcode::RdmaWrite,
            1 => WrOpcode::RdmaWriteWithImm,
            2 => WrOpcode::Send,
            3 => WrOpcode::SendWithImm,
            4 => WrOpcode::RdmaRead,
            5 => WrOpcode::AtomicCmpAndSwp,
            6 => WrOpcode::AtomicFetchAndAdd,
            9 => WrOpcode::SendWithInv,
            _ => return None,
        })
    }

    /// The verbs value.
    pub const fn as_raw(self) -> u32 {
        self as u32
    }

    /// SEND, SEND_WITH_IMM or SEND_WITH_INV: consumes a receive at the peer.
    pub const fn is_send(self) -> bool {
        matches!(
            self,
            WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::SendWithInv
        )
    }

    /// RDMA_WRITE or RDMA_WRITE_WITH_IMM.
    pub const fn is_write(self) -> bool {
        matches!(self, WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm)
    }

    /// Whether the request targets remote memory (needs an address and rkey).
    pub const fn is_remote(self) -> bool {
        !self.is_send()
    }

    /// A compare-and-swap or fetch-and-add.
    pub const fn is_atomic(self) -> bool {
        matches!(
            self,
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd
        )
    }

    /// Whether the device writes local memory for this request (READ and atomic results).
    pub const fn writes_local(self) -> bool {
        matches!(self, WrOpcode::RdmaRead) || self.is_atomic()
    }

    /// READ or atomic: counts against the initiator depth and the fence.
    pub const fn is_rd_atomic(self) -> bool {
        self.writes_local()
    }

    /// Whether the request carries immediate data.
    pub const fn has_imm(self) -> bool {
        matches!(self, WrOpcode::RdmaWriteWithImm | WrOpcode::SendWithImm)
    }
}

bitflags! {
    /// Send flags (the `IBV_SEND_*` values).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct SendFlags: u32 {
        /// Wait for earlier READs and atomics of the queue pair to complete before starting.
        const FENCE = 1;
        /// Generate a completion on success.
        const SIGNALED = 1 << 1;
        /// Set the solicited-event bit (wakes a peer armed for solicited completions only).
        const SOLICITED = 1 << 2;
        /// Copy the data into the request at post time (no lkey needed; the memory is free as
        /// soon as the post returns).
        const INLINE = 1 << 3;
    }
}

/// A scatter/gather element: `len` bytes at `addr` in the region of `lkey`. Its layout is
/// `struct ibv_sge`'s.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Sge {
    /// Start address (in the region's address space).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the region holding it.
    pub lkey: u32,
}

impl Sge {
    /// An element.
    pub const fn new(addr: u64, length: u32, lkey: u32) -> Sge {
        Sge { addr, length, lkey }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcodes_round_trip_and_classify() {
        for v in 0..16 {
            if let Some(op) = WrOpcode::from_raw(v) {
                assert_eq!(op.as_raw(), v);
            }
        }
        assert_eq!(WrOpcode::from_raw(7), None);
        assert!(WrOpcode::SendWithInv.is_send() && !WrOpcode::SendWithInv.is_remote());
        assert!(WrOpcode::RdmaRead.writes_local() && WrOpcode::RdmaRead.is_rd_atomic());
        assert!(WrOpcode::AtomicFetchAndAdd.is_atomic());
        assert!(WrOpcode::RdmaWriteWithImm.has_imm() && WrOpcode::RdmaWriteWithImm.is_write());
    }

    #[test]
    fn sge_has_the_layout_of_ibv_sge() {
        assert_eq!(core::mem::size_of::<Sge>(), 16);
        assert_eq!(core::mem::align_of::<Sge>(), 8);
        assert_eq!(core::mem::offset_of!(Sge, length), 8);
        assert_eq!(core::mem::offset_of!(Sge, lkey), 12);
    }
}

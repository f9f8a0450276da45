//! Access rights of memory regions and queue pairs.

use bitflags::bitflags;

bitflags! {
    /// Access rights of a memory region or a queue pair (the `IBV_ACCESS_*` values).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct Access: u32 {
        /// The device may write local memory (receives, READ responses, atomic results).
        const LOCAL_WRITE = 1;
        /// A peer may RDMA WRITE into the region.
        const REMOTE_WRITE = 1 << 1;
        /// A peer may RDMA READ from the region.
        const REMOTE_READ = 1 << 2;
        /// A peer may run atomics on the region.
        const REMOTE_ATOMIC = 1 << 3;
        /// Relaxed PCIe ordering where the device supports it.
        const RELAXED_ORDERING = 1 << 20;
    }
}

impl Access {
    /// Every remote right.
    pub const REMOTE: Access = Access::REMOTE_WRITE
        .union(Access::REMOTE_READ)
        .union(Access::REMOTE_ATOMIC);

    /// Local write plus every remote right: what a buffer shared with a peer usually needs.
    pub const ALL: Access = Access::LOCAL_WRITE.union(Access::REMOTE);

    /// Whether any remote right is set.
    pub const fn is_remote(self) -> bool {
        self.intersects(Access::REMOTE)
    }

    /// Whether the verbs rule holds that remote write and remote atomic need local write.
    pub const fn is_consistent(self) -> bool {
        !self.intersects(Access::REMOTE_WRITE.union(Access::REMOTE_ATOMIC))
            || self.contains(Access::LOCAL_WRITE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_values_and_the_local_write_rule() {
        assert_eq!(Access::ALL.bits(), 15);
        assert!(Access::REMOTE_READ.is_consistent());
        assert!(!Access::REMOTE_WRITE.is_consistent());
        assert!((Access::REMOTE_ATOMIC | Access::LOCAL_WRITE).is_consistent());
        assert!(Access::REMOTE_READ.is_remote() && !Access::LOCAL_WRITE.is_remote());
    }
}

//! The names of the limits a device enforces ([`Limit`]), for errors that say which one was hit.

use core::fmt;

/// A named limit. Its `Display` is the verbs attribute name, so errors read like the verbs docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Limit {
    /// Send queue depth (`max_send_wr`).
    MaxSendWr,
    /// Receive queue depth (`max_recv_wr`).
    MaxRecvWr,
    /// SGEs per send work request (`max_send_sge`).
    MaxSendSge,
    /// SGEs per receive work request (`max_recv_sge`).
    MaxRecvSge,
    /// Inline bytes per send work request (`max_inline_data`).
    MaxInlineData,
    /// SGEs of an RDMA READ (`max_sge_rd`).
    MaxSgeRd,
    /// SGEs of an atomic operation (always exactly one).
    AtomicSge,
    /// Completion queue depth (`max_cqe`).
    MaxCqe,
    /// Outstanding READ/atomic operations as initiator (`max_rd_atomic`, ORD).
    MaxRdAtomic,
    /// Outstanding READ/atomic operations as target (`max_dest_rd_atomic`, IRD).
    MaxDestRdAtomic,
    /// Bytes in one memory region (`max_mr_size`).
    MaxMrSize,
    /// Bytes in one message (`max_msg_sz`).
    MaxMsgSize,
    /// Queue pairs per device (`max_qp`).
    MaxQp,
    /// Completion queues per device (`max_cq`).
    MaxCq,
    /// Memory regions per device (`max_mr`).
    MaxMr,
    /// Protection domains per device (`max_pd`).
    MaxPd,
    /// Work requests in one posted chain.
    ChainLength,
    /// Path MTU in bytes.
    PathMtu,
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Limit::MaxSendWr => "max_send_wr",
            Limit::MaxRecvWr => "max_recv_wr",
            Limit::MaxSendSge => "max_send_sge",
            Limit::MaxRecvSge => "max_recv_sge",
            Limit::MaxInlineData => "max_inline_data",
            Limit::MaxSgeRd => "max_sge_rd",
            Limit::AtomicSge => "atomic SGE count",
            Limit::MaxCqe => "max_cqe",
            Limit::MaxRdAtomic => "max_rd_atomic",
            Limit::MaxDestRdAtomic => "max_dest_rd_atomic",
            Limit::MaxMrSize => "max_mr_size",
            Limit::MaxMsgSize => "max_msg_sz",
            Limit::MaxQp => "max_qp",
            Limit::MaxCq => "max_cq",
            Limit::MaxMr => "max_mr",
            Limit::MaxPd => "max_pd",
            Limit::ChainLength => "work requests per post",
            Limit::PathMtu => "path MTU",
        })
    }
}

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
    /// Bytes of memory the process may lock (`RLIMIT_MEMLOCK`), which siw counts every
    /// registration against, even for root.
    LockedMemory,
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
            Limit::LockedMemory => "RLIMIT_MEMLOCK (locked memory; raise it with ulimit -l)",
        })
    }
}

/// Something a device may lack that verbs reports nowhere, or that the SDK checks before the
/// device is called. Named by `Error::MissingCapability`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Capability {
    /// Immediate data: SEND WITH IMM and RDMA WRITE WITH IMM. iWARP itself has none (RFC 5040);
    /// eRDMA adds both in its iWARP mode, siw neither, other iWARP devices at most WRITE WITH
    /// IMM.
    ImmediateData,
    /// 8-byte atomics: compare-and-swap and fetch-and-add (`atomic_cap`).
    Atomics,
    /// Connecting a queue pair by hand: moving it to RTR and RTS with `modify_qp` after an
    /// out-of-band exchange of endpoints. An iWARP queue pair reaches RTS only through the
    /// connection manager, which hands it the TCP connection it runs on.
    ManualConnect,
    /// Reading a queue pair's state back (`ibv_query_qp`): siw fills in everything but the
    /// state, which then always reads RESET.
    QpStateQuery,
}

impl Capability {
    /// What a program does instead.
    pub fn advice(self) -> &'static str {
        match self {
            Capability::ImmediateData => {
                "send the value in the payload of a SEND instead (after a WRITE, on the same \
                 queue pair, it arrives after the WRITE's data)"
            }
            Capability::Atomics => "coordinate through SEND/RECV or READ/WRITE instead",
            Capability::ManualConnect => {
                "connect through rdma_cm on an iWARP device (erdma::connect::cm::connect and \
                 Listener::accept)"
            }
            Capability::QpStateQuery => {
                "learn the state from completions (an error or flush status means ERR) and \
                 from the connection's events"
            }
        }
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Capability::ImmediateData => "immediate data (SEND/RDMA WRITE WITH IMM)",
            Capability::Atomics => "atomic operations (compare-and-swap, fetch-and-add)",
            Capability::ManualConnect => {
                "connecting a queue pair with modify_qp (out-of-band endpoints to RTR/RTS)"
            }
            Capability::QpStateQuery => "reading a queue pair's state (ibv_query_qp)",
        })
    }
}

//! Work completions: [`Completion`], its [`WcStatus`] and [`WcOpcode`], numbered as
//! `ibv_wc_status` and `ibv_wc_opcode` number them.

use core::fmt;

/// Status of a finished work request (the `IBV_WC_*` numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum WcStatus {
    /// It worked.
    #[default]
    Success,
    /// Local length error (a receive buffer too small, a message too long).
    LocLenErr,
    /// Local queue-pair operation error.
    LocQpOpErr,
    /// Local EE context operation error.
    LocEecOpErr,
    /// Local protection error (an lkey, protection domain, range or right the device refused).
    LocProtErr,
    /// Flushed: the queue pair went to the error state before this request ran.
    WrFlushErr,
    /// Memory window bind error.
    MwBindErr,
    /// Bad response from the peer (out of protocol).
    BadRespErr,
    /// Local access error.
    LocAccessErr,
    /// The peer found the request invalid (NAK "invalid request").
    RemInvReqErr,
    /// The peer refused access (NAK "remote access error": rkey, bounds, rights).
    RemAccessErr,
    /// The peer failed to execute it (NAK "remote operational error").
    RemOpErr,
    /// Transport retries exhausted: the peer stopped answering.
    RetryExcErr,
    /// Receiver-not-ready retries exhausted: the peer had no receive posted.
    RnrRetryExcErr,
    /// Local RDD violation.
    LocRddViolErr,
    /// Remote invalid RD request.
    RemInvRdReqErr,
    /// Remote aborted.
    RemAbortErr,
    /// Invalid EE context number.
    InvEecnErr,
    /// Invalid EE context state.
    InvEecStateErr,
    /// Fatal error.
    FatalErr,
    /// Response timeout.
    RespTimeoutErr,
    /// General error.
    GeneralErr,
    /// A status this crate does not know (the raw value).
    Other(u32),
}

impl WcStatus {
    /// Every known status, in numeric order (the value is the index).
    pub const ALL: [WcStatus; 22] = {
        use WcStatus::*;
        [
            Success,
            LocLenErr,
            LocQpOpErr,
            LocEecOpErr,
            LocProtErr,
            WrFlushErr,
            MwBindErr,
            BadRespErr,
            LocAccessErr,
            RemInvReqErr,
            RemAccessErr,
            RemOpErr,
            RetryExcErr,
            RnrRetryExcErr,
            LocRddViolErr,
            RemInvRdReqErr,
            RemAbortErr,
            InvEecnErr,
            InvEecStateErr,
            FatalErr,
            RespTimeoutErr,
            GeneralErr,
        ]
    };

    /// From the verbs value.
    pub const fn from_raw(v: u32) -> WcStatus {
        if (v as usize) < Self::ALL.len() {
            Self::ALL[v as usize]
        } else {
            WcStatus::Other(v)
        }
    }

    /// The verbs value.
    pub const fn as_raw(self) -> u32 {
        use WcStatus::*;
        match self {
            Success => 0,
            LocLenErr => 1,
            LocQpOpErr => 2,
            LocEecOpErr => 3,
            LocProtErr => 4,
            WrFlushErr => 5,
            MwBindErr => 6,
            BadRespErr => 7,
            LocAccessErr => 8,
            RemInvReqErr => 9,
            RemAccessErr => 10,
            RemOpErr => 11,
            RetryExcErr => 12,
            RnrRetryExcErr => 13,
            LocRddViolErr => 14,
            RemInvRdReqErr => 15,
            RemAbortErr => 16,
            InvEecnErr => 17,
            InvEecStateErr => 18,
            FatalErr => 19,
            RespTimeoutErr => 20,
            GeneralErr => 21,
            Other(n) => n,
        }
    }

    /// Whether the request succeeded.
    pub const fn is_success(self) -> bool {
        matches!(self, WcStatus::Success)
    }

    /// The text `ibv_wc_status_str` gives (`None` for a status this crate does not know).
    pub const fn as_str(self) -> Option<&'static str> {
        use WcStatus::*;
        Some(match self {
            Success => "success",
            LocLenErr => "local length error",
            LocQpOpErr => "local QP operation error",
            LocEecOpErr => "local EE context operation error",
            LocProtErr => "local protection error",
            WrFlushErr => "Work Request Flushed Error",
            MwBindErr => "memory management operation error",
            BadRespErr => "bad response error",
            LocAccessErr => "local access error",
            RemInvReqErr => "remote invalid request error",
            RemAccessErr => "remote access error",
            RemOpErr => "remote operation error",
            RetryExcErr => "transport retry counter exceeded",
            RnrRetryExcErr => "RNR retry counter exceeded",
            LocRddViolErr => "local RDD violation error",
            RemInvRdReqErr => "remote invalid RD request",
            RemAbortErr => "aborted error",
            InvEecnErr => "invalid EE context number",
            InvEecStateErr => "invalid EE context state",
            FatalErr => "fatal error",
            RespTimeoutErr => "response timeout error",
            GeneralErr => "general error",
            Other(_) => return None,
        })
    }
}

impl WcStatus {
    /// What the status usually means for the application, where the name does not say it.
    pub(crate) const fn hint(self) -> Option<&'static str> {
        match self {
            WcStatus::RetryExcErr => {
                Some("the peer stopped acknowledging (it is gone, or unreachable)")
            }
            WcStatus::RnrRetryExcErr => Some("the peer had no receive posted for the message"),
            WcStatus::RemAccessErr => {
                Some("the peer refused the access (rkey, bounds or the region's rights)")
            }
            WcStatus::LocProtErr => {
                Some("a local buffer is outside its region or the region lacks the right")
            }
            WcStatus::LocLenErr => Some("the message does not fit the receive buffer"),
            _ => None,
        }
    }
}

impl fmt::Display for WcStatus {
    /// The text `ibv_wc_status_str` gives.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.as_str() {
            Some(s) => f.write_str(s),
            None => write!(f, "unknown status {}", self.as_raw()),
        }
    }
}

/// What kind of work request a completion reports (the `IBV_WC_*` opcode numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A SEND (with or without immediate or invalidate) finished.
    #[default]
    Send,
    /// An RDMA WRITE finished.
    RdmaWrite,
    /// An RDMA READ finished.
    RdmaRead,
    /// A compare-and-swap finished.
    CompSwap,
    /// A fetch-and-add finished.
    FetchAdd,
    /// A memory-window bind finished.
    BindMw,
    /// A local invalidate finished.
    LocalInv,
    /// A SEND arrived in a receive buffer.
    Recv,
    /// A WRITE_WITH_IMM arrived (the receive carries only the immediate).
    RecvRdmaWithImm,
    /// An opcode this crate does not know (the raw value).
    Other(u32),
}

impl WcOpcode {
    /// From the verbs value.
    pub const fn from_raw(v: u32) -> WcOpcode {
        match v {
            0 => WcOpcode::Send,
            1 => WcOpcode::RdmaWrite,
            2 => WcOpcode::RdmaRead,
            3 => WcOpcode::CompSwap,
            4 => WcOpcode::FetchAdd,
            5 => WcOpcode::BindMw,
            6 => WcOpcode::LocalInv,
            128 => WcOpcode::Recv,
            129 => WcOpcode::RecvRdmaWithImm,
            n => WcOpcode::Other(n),
        }
    }

    /// The verbs value.
    pub const fn as_raw(self) -> u32 {
        match self {
            WcOpcode::Send => 0,
            WcOpcode::RdmaWrite => 1,
            WcOpcode::RdmaRead => 2,
            WcOpcode::CompSwap => 3,
            WcOpcode::FetchAdd => 4,
            WcOpcode::BindMw => 5,
            WcOpcode::LocalInv => 6,
            WcOpcode::Recv => 128,
            WcOpcode::RecvRdmaWithImm => 129,
            WcOpcode::Other(n) => n,
        }
    }

    /// Whether this completion came from the receive queue (`IBV_WC_RECV` sets bit 7).
    pub const fn is_recv(self) -> bool {
        self.as_raw() & 128 != 0
    }
}

/// Which work queue of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkQueue {
    /// The send queue.
    Send,
    /// The receive queue.
    Recv,
}

impl fmt::Display for WorkQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WorkQueue::Send => "send queue",
            WorkQueue::Recv => "receive queue",
        })
    }
}

/// `IBV_WC_WITH_IMM`: the completion carries immediate data.
pub const WC_WITH_IMM: u32 = 1 << 1;
/// `IBV_WC_WITH_INV`: the completion carries an invalidated rkey.
pub const WC_WITH_INV: u32 = 1 << 3;

/// A finished work request.
///
/// `Debug` prints request ids and queue-pair numbers in hex (`0x…`), as every message of the
/// SDK does.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Completion {
    /// The request's id.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What it was. Flushed receives report [`WcOpcode::Recv`]; other unsuccessful requests
    /// report their own operation where the device says so.
    pub opcode: WcOpcode,
    /// Provider-specific error detail.
    pub vendor_err: u32,
    /// Bytes: received (a SEND), announced (the RETH length of a WRITE_WITH_IMM received), or
    /// moved (sends, READs, WRITEs; 8 for atomics), as the device reports them.
    pub byte_len: u32,
    /// Immediate data, host order, when the message carried it.
    pub imm: Option<u32>,
    /// The key a SEND_WITH_INV invalidated, when the device reports it.
    pub invalidated_rkey: Option<u32>,
    /// The local queue pair.
    pub qp_num: u32,
    /// The remote queue pair (UD; 0 on RC where the device does not say).
    pub src_qp: u32,
    /// The message asked for a solicited event (receive completions): it wakes a queue armed for
    /// solicited completions only.
    pub solicited: bool,
    /// Why the queue pair failed, on an error completion. See [`Completion::cause`].
    pub(crate) cause: Option<QpFailure>,
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Completion");
        d.field("wr_id", &format_args!("{:#x}", self.wr_id))
            .field("status", &self.status)
            .field("opcode", &self.opcode)
            .field("vendor_err", &format_args!("{:#x}", self.vendor_err))
            .field("byte_len", &self.byte_len)
            .field("imm", &self.imm)
            .field("invalidated_rkey", &self.invalidated_rkey)
            .field("qp_num", &format_args!("{:#x}", self.qp_num))
            .field("src_qp", &format_args!("{:#x}", self.src_qp))
            .field("solicited", &self.solicited);
        if let Some(c) = &self.cause {
            d.field("cause", c);
        }
        d.finish()
    }
}

/// Why a queue pair went to the error state, as far as the SDK saw it: carried by the flush
/// completions that follow ([`Completion::cause`]) and by [`crate::Error::QpInError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QpFailure {
    /// A work request failed (its completion was the first error on the queue pair); every
    /// request behind it was flushed.
    Request {
        /// The application's id of the request that failed.
        wr_id: u64,
        /// How it failed.
        status: WcStatus,
        /// What it was.
        opcode: WcOpcode,
        /// Provider-specific detail.
        vendor_err: u32,
    },
    /// The peer went away, as the connection's liveness channel saw it (see
    /// [`crate::connect::cm`]); the SDK moved the queue pair to the error state.
    PeerLost(PeerLoss),
    /// The application moved the queue pair to the error state ([`crate::Qp::to_error`], or a
    /// connection it closed).
    Local,
}

/// How a peer was lost ([`QpFailure::PeerLost`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PeerLoss {
    /// The peer closed or reset the connection: its process ended (or was killed), or it closed
    /// the connection.
    Closed,
    /// Nothing came from the peer for this long (its heartbeats stopped: the network or its host
    /// is gone).
    Silent(std::time::Duration),
    /// rdma_cm reported DISCONNECTED (or the device went away).
    Disconnected,
}

impl fmt::Display for PeerLoss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerLoss::Closed => write!(f, "the peer closed the connection (its process ended)"),
            PeerLoss::Silent(d) => write!(
                f,
                "the peer sent nothing for {} ms (its host or the network is gone)",
                d.as_millis()
            ),
            PeerLoss::Disconnected => write!(f, "rdma_cm reported the peer disconnected"),
        }
    }
}

impl fmt::Display for QpFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QpFailure::Request {
                wr_id,
                status,
                opcode,
                vendor_err,
            } => {
                write!(f, "work request {wr_id:#x} ({opcode:?}) failed: {status}")?;
                if *vendor_err != 0 {
                    write!(f, " (vendor error {vendor_err:#x})")?;
                }
                if let Some(hint) = status.hint() {
                    write!(f, " — {hint}")?;
                }
                Ok(())
            }
            QpFailure::PeerLost(how) => write!(f, "peer lost: {how}"),
            QpFailure::Local => write!(f, "the application moved it to the error state"),
        }
    }
}

impl Completion {
    /// A completion with every other field zero or empty.
    pub const fn new(wr_id: u64, status: WcStatus, opcode: WcOpcode, qp_num: u32) -> Completion {
        Completion {
            wr_id,
            status,
            opcode,
            vendor_err: 0,
            byte_len: 0,
            imm: None,
            invalidated_rkey: None,
            qp_num,
            src_qp: 0,
            solicited: false,
            cause: None,
        }
    }

    /// Why the queue pair failed, on an error completion: the first request that failed (the
    /// first error completion names itself), the lost peer, or the application's move to
    /// ERROR; a flush (`WR_FLUSH_ERR`) names the earlier failure. `None` on successes and on a
    /// flush whose cause the SDK did not see (the queue pair's other completion queue, not yet
    /// polled, holds it).
    pub const fn cause(&self) -> Option<QpFailure> {
        self.cause
    }

    /// The queue the request was posted to.
    pub const fn queue(&self) -> WorkQueue {
        if self.opcode.is_recv() {
            WorkQueue::Recv
        } else {
            WorkQueue::Send
        }
    }

    /// Whether the status is success.
    pub const fn is_ok(&self) -> bool {
        self.status.is_success()
    }

    /// `ibv_wc_flags` bits (`IBV_WC_WITH_IMM`, `IBV_WC_WITH_INV`).
    pub const fn wc_flags(&self) -> u32 {
        let mut f = 0;
        if self.imm.is_some() {
            f |= WC_WITH_IMM;
        }
        if self.invalidated_rkey.is_some() {
            f |= WC_WITH_INV;
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbering_matches_verbs() {
        for (i, s) in WcStatus::ALL.iter().enumerate() {
            assert_eq!(s.as_raw(), i as u32);
            assert_eq!(WcStatus::from_raw(i as u32), *s);
        }
        assert_eq!(WcStatus::LocProtErr.as_raw(), 4);
        assert_eq!(WcStatus::WrFlushErr.as_raw(), 5);
        assert_eq!(WcStatus::RemAccessErr.as_raw(), 10);
        assert_eq!(WcStatus::RetryExcErr.as_raw(), 12);
        assert_eq!(WcStatus::from_raw(22), WcStatus::Other(22));
        assert_eq!(WcStatus::Other(22).to_string(), "unknown status 22");
        assert_eq!(
            WcStatus::RetryExcErr.to_string(),
            "transport retry counter exceeded"
        );
        for v in [0, 1, 2, 3, 4, 5, 6, 128, 129, 7, 130] {
            assert_eq!(WcOpcode::from_raw(v).as_raw(), v);
        }
        assert!(WcOpcode::RecvRdmaWithImm.is_recv() && !WcOpcode::FetchAdd.is_recv());
    }

    #[test]
    fn flags_and_queue() {
        let mut c = Completion::new(7, WcStatus::WrFlushErr, WcOpcode::Recv, 0x11);
        assert_eq!(c.queue(), WorkQueue::Recv);
        assert_eq!(c.wc_flags(), 0);
        c.imm = Some(1);
        c.invalidated_rkey = Some(2);
        assert_eq!(c.wc_flags(), WC_WITH_IMM | WC_WITH_INV);
        assert_eq!(
            Completion::new(1, WcStatus::Success, WcOpcode::RdmaRead, 1).queue(),
            WorkQueue::Send
        );
    }
}

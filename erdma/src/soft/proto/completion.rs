//! Work completions, with statuses and opcodes numbered exactly as `ibv_wc_status` and
//! `ibv_wc_opcode` (`as u32` gives the verbs value).

use core::fmt;

/// Completion status (`enum ibv_wc_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcStatus {
    /// IBV_WC_SUCCESS.
    Success = 0,
    /// IBV_WC_LOC_LEN_ERR: a receive buffer too small, a message too long.
    LocLenErr = 1,
    /// IBV_WC_LOC_QP_OP_ERR: a local queue-pair inconsistency.
    LocQpOpErr = 2,
    /// IBV_WC_LOC_EEC_OP_ERR.
    LocEecOpErr = 3,
    /// IBV_WC_LOC_PROT_ERR: a local key, protection domain, range or right refused.
    LocProtErr = 4,
    /// IBV_WC_WR_FLUSH_ERR: the queue pair entered the error state first.
    WrFlushErr = 5,
    /// IBV_WC_MW_BIND_ERR.
    MwBindErr = 6,
    /// IBV_WC_BAD_RESP_ERR: the responder answered with something out of protocol.
    BadRespErr = 7,
    /// IBV_WC_LOC_ACCESS_ERR.
    LocAccessErr = 8,
    /// IBV_WC_REM_INV_REQ_ERR: NAK "invalid request".
    RemInvReqErr = 9,
    /// IBV_WC_REM_ACCESS_ERR: NAK "remote access error".
    RemAccessErr = 10,
    /// IBV_WC_REM_OP_ERR: NAK "remote operational error".
    RemOpErr = 11,
    /// IBV_WC_RETRY_EXC_ERR: transport retries exhausted.
    RetryExcErr = 12,
    /// IBV_WC_RNR_RETRY_EXC_ERR: receiver-not-ready retries exhausted.
    RnrRetryExcErr = 13,
    /// IBV_WC_LOC_RDD_VIOL_ERR.
    LocRddViolErr = 14,
    /// IBV_WC_REM_INV_RD_REQ_ERR.
    RemInvRdReqErr = 15,
    /// IBV_WC_REM_ABORT_ERR.
    RemAbortErr = 16,
    /// IBV_WC_INV_EECN_ERR.
    InvEecnErr = 17,
    /// IBV_WC_INV_EEC_STATE_ERR.
    InvEecStateErr = 18,
    /// IBV_WC_FATAL_ERR.
    FatalErr = 19,
    /// IBV_WC_RESP_TIMEOUT_ERR.
    RespTimeoutErr = 20,
    /// IBV_WC_GENERAL_ERR.
    GeneralErr = 21,
}

impl WcStatus {
    /// Every status, in numeric order (the value is the index).
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

    /// The status numbered `v`, if there is one.
    pub const fn from_raw(v: u32) -> Option<WcStatus> {
        if (v as usize) < Self::ALL.len() {
            Some(Self::ALL[v as usize])
        } else {
            None
        }
    }

    /// The name `ibv_wc_status_str` prints.
    pub const fn as_str(self) -> &'static str {
        use WcStatus::*;
        match self {
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
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Completion opcode (`enum ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcOpcode {
    /// IBV_WC_SEND.
    Send = 0,
    /// IBV_WC_RDMA_WRITE.
    RdmaWrite = 1,
    /// IBV_WC_RDMA_READ.
    RdmaRead = 2,
    /// IBV_WC_COMP_SWAP.
    CompSwap = 3,
    /// IBV_WC_FETCH_ADD.
    FetchAdd = 4,
    /// IBV_WC_BIND_MW.
    BindMw = 5,
    /// IBV_WC_LOCAL_INV.
    LocalInv = 6,
    /// IBV_WC_RECV: a SEND arrived.
    Recv = 128,
    /// IBV_WC_RECV_RDMA_WITH_IMM: a WRITE_WITH_IMM arrived.
    RecvRdmaWithImm = 129,
}

/// Which work queue a completion belongs to (the driver routes it to that queue's CQ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkQueue {
    /// The send queue.
    Send,
    /// The receive queue.
    Recv,
}

/// `IBV_WC_WITH_IMM`.
pub const WC_WITH_IMM: u32 = 1 << 1;
/// `IBV_WC_WITH_INV`.
pub const WC_WITH_INV: u32 = 1 << 3;

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// Opcode.
    pub opcode: WcOpcode,
    /// Bytes: the message length for sends, READs and WRITEs (8 for atomics); the bytes placed
    /// for a SEND received; the RETH length for a WRITE_WITH_IMM received; 0 for flushed receives.
    pub byte_len: u32,
    /// The local queue pair.
    pub qp_num: u32,
    /// The remote queue pair (receive completions).
    pub src_qp: u32,
    /// Immediate data (big-endian value of the wire bytes), when the message carried it.
    pub imm: Option<u32>,
    /// The R_Key a SEND_WITH_INVALIDATE invalidated.
    pub invalidated_rkey: Option<u32>,
    /// The message asked for a solicited event.
    pub solicited: bool,
    /// The queue the work request was posted to.
    pub queue: WorkQueue,
}

impl Completion {
    /// `ibv_wc_flags` bits (`IBV_WC_WITH_IMM`, `IBV_WC_WITH_INV`).
    pub fn wc_flags(&self) -> u32 {
        let mut f = 0;
        if self.imm.is_some() {
            f |= WC_WITH_IMM;
        }
        if self.invalidated_rkey.is_some() {
            f |= WC_WITH_INV;
        }
        f
    }

    /// Whether the status is success.
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbering_matches_verbs() {
        assert_eq!(WcStatus::Success as u32, 0);
        assert_eq!(WcStatus::LocProtErr as u32, 4);
        assert_eq!(WcStatus::WrFlushErr as u32, 5);
        assert_eq!(WcStatus::RemInvReqErr as u32, 9);
        assert_eq!(WcStatus::RemAccessErr as u32, 10);
        assert_eq!(WcStatus::RetryExcErr as u32, 12);
        assert_eq!(WcStatus::RnrRetryExcErr as u32, 13);
        assert_eq!(WcStatus::GeneralErr as u32, 21);
        assert_eq!(WcOpcode::FetchAdd as u32, 4);
        assert_eq!(WcOpcode::Recv as u32, 128);
        assert_eq!(WcOpcode::RecvRdmaWithImm as u32, 129);
        assert_eq!(
            WcStatus::RetryExcErr.to_string(),
            "transport retry counter exceeded"
        );
    }
}

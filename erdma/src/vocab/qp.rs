//! Queue-pair values: its [`QpState`], the capacities of its queues ([`QpCaps`]), the route to its
//! peer ([`AddressVector`]) and the attributes of a modify ([`QpAttr`], `ibv_qp_attr` with its
//! mask folded into `Option`s).

use core::fmt;

use super::Access;
use super::device::{Gid, Mtu};

/// A queue pair's state (the `IBV_QPS_*` numbering); `Display` prints the specification's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum QpState {
    /// Just created or reset.
    Reset = 0,
    /// Initialised: receives may be posted.
    Init = 1,
    /// Ready to receive.
    Rtr = 2,
    /// Ready to send.
    Rts = 3,
    /// Send queue drain.
    Sqd = 4,
    /// Send queue error.
    Sqe = 5,
    /// Error: every outstanding request is flushed.
    Err = 6,
}

impl QpState {
    /// From the verbs value; `None` for `IBV_QPS_UNKNOWN` and anything else.
    pub const fn from_raw(v: u32) -> Option<QpState> {
        Some(match v {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            4 => QpState::Sqd,
            5 => QpState::Sqe,
            6 => QpState::Err,
            _ => return None,
        })
    }

    /// The verbs value.
    pub const fn as_raw(self) -> u32 {
        self as u32
    }

    /// The responder accepts requests.
    pub const fn responder_ready(self) -> bool {
        matches!(
            self,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    }

    /// The requester sends and accepts responses.
    pub const fn requester_ready(self) -> bool {
        matches!(self, QpState::Rts | QpState::Sqd)
    }
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::Rtr => "RTR",
            QpState::Rts => "RTS",
            QpState::Sqd => "SQD",
            QpState::Sqe => "SQE",
            QpState::Err => "ERR",
        })
    }
}

/// How to reach the peer (the RoCE global route header; `ibv_ah_attr` with its GRH).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressVector {
    /// The peer's GID.
    pub dgid: Gid,
    /// Which entry of the local GID table to send from.
    pub sgid_index: u8,
    /// IP TTL / hop limit.
    pub hop_limit: u8,
    /// IP traffic class (DSCP + ECN).
    pub traffic_class: u8,
    /// IPv6 flow label (also picks the UDP source port on RoCE).
    pub flow_label: u32,
    /// Service level.
    pub sl: u8,
    /// Destination LID (InfiniBand only; 0 on RoCE).
    pub dlid: u16,
    /// Local port.
    pub port: u8,
}

impl AddressVector {
    /// A route to `dgid` from local GID `sgid_index`: hop limit 64, port 1, the rest zero.
    pub const fn new(dgid: Gid, sgid_index: u8) -> AddressVector {
        AddressVector {
            dgid,
            sgid_index,
            hop_limit: 64,
            traffic_class: 0,
            flow_label: 0,
            sl: 0,
            dlid: 0,
            port: 1,
        }
    }
}

/// The attributes of one modify (`ibv_qp_attr`): `None` leaves an attribute alone (its bit is
/// not in the mask). Which attributes a transition requires and accepts follows the verbs rules
/// for RC queue pairs; the device checks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAttr {
    /// The state to move to.
    pub state: Option<QpState>,
    /// The state the caller believes the queue pair is in (checked when given).
    pub cur_state: Option<QpState>,
    /// P_Key index (0 on RoCE, eRDMA and the soft device).
    pub pkey_index: Option<u16>,
    /// Port number (1).
    pub port: Option<u8>,
    /// Remote access rights the responder grants.
    pub access: Option<Access>,
    /// Path MTU.
    pub path_mtu: Option<Mtu>,
    /// The peer's queue pair number (24 bits).
    pub dest_qp_num: Option<u32>,
    /// The responder's first expected PSN (24 bits).
    pub rq_psn: Option<u32>,
    /// The requester's first PSN (24 bits).
    pub sq_psn: Option<u32>,
    /// Outstanding READs/atomics this side may initiate (ORD).
    pub max_rd_atomic: Option<u8>,
    /// Outstanding READs/atomics this side serves (IRD).
    pub max_dest_rd_atomic: Option<u8>,
    /// RNR NAK timer code (0–31; IB encoding: 12 = 0.64 ms).
    pub min_rnr_timer: Option<u8>,
    /// Local ACK timeout: 4.096 µs · 2^timeout; 0 disables it (0–31).
    pub timeout: Option<u8>,
    /// Transport retries before `RETRY_EXC_ERR` (0–7).
    pub retry_cnt: Option<u8>,
    /// RNR retries (0–6; 7 retries forever).
    pub rnr_retry: Option<u8>,
    /// The route to the peer.
    pub av: Option<AddressVector>,
}

impl QpAttr {
    /// RESET → INIT with the given remote access rights (P_Key index 0, port 1).
    pub const fn init(access: Access) -> QpAttr {
        QpAttr {
            state: Some(QpState::Init),
            pkey_index: Some(0),
            port: Some(1),
            access: Some(access),
            ..QpAttr::EMPTY
        }
    }

    /// INIT → RTR towards `peer`'s queue pair `dest_qp_num` (the peer: a GID, or an IP
    /// address for its GID).
    pub fn rtr(
        peer: impl Into<Gid>,
        dest_qp_num: u32,
        rq_psn: impl Into<u32>,
        path_mtu: Mtu,
        max_dest_rd_atomic: u8,
        min_rnr_timer: u8,
    ) -> QpAttr {
        QpAttr {
            state: Some(QpState::Rtr),
            av: Some(AddressVector::new(peer.into(), 0)),
            dest_qp_num: Some(dest_qp_num),
            rq_psn: Some(rq_psn.into()),
            path_mtu: Some(path_mtu),
            max_dest_rd_atomic: Some(max_dest_rd_atomic),
            min_rnr_timer: Some(min_rnr_timer),
            ..QpAttr::EMPTY
        }
    }

    /// RTR → RTS.
    pub fn rts(
        sq_psn: impl Into<u32>,
        timeout: u8,
        retry_cnt: u8,
        rnr_retry: u8,
        max_rd_atomic: u8,
    ) -> QpAttr {
        QpAttr {
            state: Some(QpState::Rts),
            sq_psn: Some(sq_psn.into()),
            timeout: Some(timeout),
            retry_cnt: Some(retry_cnt),
            rnr_retry: Some(rnr_retry),
            max_rd_atomic: Some(max_rd_atomic),
            ..QpAttr::EMPTY
        }
    }

    /// A bare state change (to ERR or RESET, say).
    pub const fn to_state(state: QpState) -> QpAttr {
        QpAttr {
            state: Some(state),
            ..QpAttr::EMPTY
        }
    }

    /// No attribute (an empty mask).
    pub const EMPTY: QpAttr = QpAttr {
        state: None,
        cur_state: None,
        pkey_index: None,
        port: None,
        access: None,
        path_mtu: None,
        dest_qp_num: None,
        rq_psn: None,
        sq_psn: None,
        max_rd_atomic: None,
        max_dest_rd_atomic: None,
        min_rnr_timer: None,
        timeout: None,
        retry_cnt: None,
        rnr_retry: None,
        av: None,
    };
}

/// The capacities of a queue pair's queues (`ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth (default 128).
    pub max_send_wr: u32,
    /// Receive queue depth (default 128).
    pub max_recv_wr: u32,
    /// SGEs per send request (default 1; eRDMA allows 6).
    pub max_send_sge: u32,
    /// SGEs per receive request (default 1).
    pub max_recv_sge: u32,
    /// Inline bytes per send request (default 64; eRDMA allows 96).
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    /// 128-deep queues, one SGE each way, 64 inline bytes.
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_numbers_and_names() {
        for v in 0..7 {
            assert_eq!(QpState::from_raw(v).map(QpState::as_raw), Some(v));
        }
        assert_eq!(QpState::from_raw(7), None);
        assert_eq!(QpState::Rts.to_string(), "RTS");
        assert_eq!(QpState::Err.to_string(), "ERR");
    }
}

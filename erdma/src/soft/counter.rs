//! Names of the soft device's port counters, as [`crate::Context::port_counters`] reports them.
//!
//! The first seven are named after the Linux rxe `hw_counters` that count the same events; the
//! rest are the soft device's own.

/// Packets sent, every queue pair (requests, retransmissions, responses, ACKs).
pub const SENT_PKTS: &str = "sent_pkts";
/// Packets that passed the device's checks (version, P_Key, ICRC, destination queue pair)
/// and reached a queue pair; what the queue pair then drops is in `drop_*` too.
pub const RCVD_PKTS: &str = "rcvd_pkts";
/// Requests received again (answered from saved state, or ignored).
pub const DUPLICATE_REQUEST: &str = "duplicate_request";
/// Gaps in the request stream: requests ahead of the expected PSN that drew a sequence NAK
/// (each request of a gap, the first included, is also in `drop_out_of_sequence`).
pub const OUT_OF_SEQ_REQUEST: &str = "out_of_seq_request";
/// RNR NAKs received: the peer had no receive posted.
pub const RCVD_RNR_ERR: &str = "rcvd_rnr_err";
/// RNR NAKs sent: a SEND arrived with no receive posted.
pub const SEND_RNR_ERR: &str = "send_rnr_err";
/// Go-back-N retries the requester started (ACK timeouts, sequence NAKs, lost READ
/// responses).
pub const COMPLETER_RETRY_ERR: &str = "completer_retry_err";
/// The same retries (the soft device's own name for [`COMPLETER_RETRY_ERR`]).
pub const RETRIES: &str = "retries";
/// Request packets sent again by those retries.
pub const RETRANSMITTED_PKTS: &str = "retransmitted_pkts";
/// Retries started because no ACK came in time.
pub const ACK_TIMEOUTS: &str = "ack_timeouts";
/// ACKs sent (a coalesced ACK counts once).
pub const ACKS_SENT: &str = "acks_sent";
/// NAKs sent, sequence and fatal (RNR NAKs: [`SEND_RNR_ERR`]).
pub const NAKS_SENT: &str = "naks_sent";
/// NAKs received, sequence and fatal (RNR NAKs: [`RCVD_RNR_ERR`]).
pub const NAKS_RCVD: &str = "naks_rcvd";
/// Datagrams the device received, valid or not.
pub const RCVD_DATAGRAMS: &str = "rcvd_datagrams";
/// Request packets sent whose payload was a same-host reference list (the peer copied the
/// bytes out of this process: `ERDMA_SOFT_SAME_HOST=cma`).
pub const PEER_REF_SENT_PKTS: &str = "peer_ref_sent_pkts";
/// Request packets received whose payload this device copied out of a same-host peer.
pub const PEER_REF_RCVD_PKTS: &str = "peer_ref_rcvd_pkts";
/// Packets this device wrote into shared-memory rings instead of its socket (soft devices of
/// one host: `ERDMA_SOFT_SAME_HOST=shm`, the default).
pub const RING_SENT_PKTS: &str = "ring_sent_pkts";
/// Packets this device took from shared-memory rings.
pub const RING_RCVD_PKTS: &str = "ring_rcvd_pkts";
/// Messages for a peer with a ring that went by the socket because the ring was full (the
/// peer fell behind; nothing is dropped for it).
pub const RING_SPILLED_MSGS: &str = "ring_spilled_msgs";
/// Datagrams for the device dropped before it could receive them (its UDP sockets' receive
/// buffers, from `/proc/net/udp`, or an engine's hand-off queue were full: the device fell
/// behind). The
/// peer's go-back-N retry recovers them, at the cost of `retransmitted_pkts` there.
pub const SOCKET_DROPS: &str = "socket_drops";
/// Messages the kernel refused to send (a datagram, or a GSO train of them: an unreachable
/// or broadcast destination, a path MTU below the queue pair's, a route that cannot
/// segment). Each was dropped alone, as a network would drop it; the protocol retransmits.
pub const SEND_REFUSED: &str = "send_refused";
/// Packets dropped, every reason; each reason also has its own `drop_<reason>` counter
/// (`drop_bad_icrc`, `drop_truncated`, `drop_unknown_qp`, …).
pub const DROPS: &str = "drops";
/// Prefix of the per-reason drop counters.
pub const DROP_PREFIX: &str = "drop_";
/// The part of [`DROPS`] that is harmless: responses (mostly duplicate or late ACKs) for
/// requests already acknowledged, which the requester ignores.
pub const DROP_STALE: &str = "drop_stale";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_stale_is_the_soft_devices_stale_reason_counter() {
        let soft_name = format!(
            "{}{}",
            DROP_PREFIX,
            crate::soft::proto::DropReason::Stale.name()
        );
        assert_eq!(soft_name, DROP_STALE);
    }
}

//! The private data rdma_cm carries with a connection request, an accept and a reject: this
//! SDK's [`PeerInfo`] in the room each transport gives, and the reasons a peer's reject names.

use std::os::raw::c_int;

use super::{IB_ACCEPT_PRIVATE_DATA, IB_CONNECT_PRIVATE_DATA, IWARP_PRIVATE_DATA, REJECT_TAG};
use crate::connect::{HEADER_LEN, MAGIC, PeerInfo};
use crate::error::{Error, Result};
use crate::vocab::Transport;

pub(super) fn private_limit(t: Transport, accept: bool) -> usize {
    match (t, accept) {
        (Transport::Iwarp, _) => IWARP_PRIVATE_DATA,
        (_, false) => IB_CONNECT_PRIVATE_DATA,
        (_, true) => IB_ACCEPT_PRIVATE_DATA,
    }
}

pub(super) fn encode_private(info: &PeerInfo, limit: usize, step: &str) -> Result<Vec<u8>> {
    let bytes = info.encode()?;
    if bytes.len() > limit {
        return Err(Error::invalid(format!(
            "the connection info ({} bytes: {} region(s), {} user byte(s)) exceeds the {limit} \
             bytes rdma_cm carries with {step} on this transport; grant fewer regions here and \
             send the rest over the connection",
            bytes.len(),
            info.regions.len(),
            info.user.len()
        )));
    }
    Ok(bytes)
}

/// Parses a peer's private data: this SDK's [`PeerInfo`] (followed by the transport's zero
/// padding), nothing (all zero), or foreign bytes (kept as user data).
///
/// # Errors
/// [`Error::Protocol`] for data that starts like a [`PeerInfo`] but is malformed, truncated, or
/// names queue pairs.
pub fn decode_private(data: &[u8]) -> Result<PeerInfo> {
    if data.iter().all(|&b| b == 0) {
        return Ok(PeerInfo::default());
    }
    if data.len() < 4 || data[..4] != MAGIC {
        return Ok(PeerInfo {
            user: data.to_vec(),
            ..PeerInfo::default()
        });
    }
    let header: &[u8; HEADER_LEN] = data
        .get(..HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| Error::protocol("the peer's connection info is shorter than its header"))?;
    let len = PeerInfo::body_len(header)?;
    let body = data.get(HEADER_LEN..HEADER_LEN + len).ok_or_else(|| {
        Error::protocol(format!(
            "the peer's connection info announces {} bytes and {} came",
            HEADER_LEN + len,
            data.len()
        ))
    })?;
    let info = PeerInfo::decode_body(body)?;
    if !info.endpoints.is_empty() {
        return Err(Error::protocol(
            "the peer's connection info names queue pairs (rdma_cm connects them itself)",
        ));
    }
    Ok(info)
}

/// Why a peer rejected: the reject code and the peer's own words.
pub(super) fn reject_reason(t: Transport, status: c_int, private: &[u8]) -> String {
    let code = if t == Transport::Iwarp {
        super::iwarp::reject_code(status)
    } else {
        match status {
            8 => "nobody is listening at that port (IB CM reject reason 8, invalid service ID)"
                .to_string(),
            28 => {
                "rejected by the application (IB CM reject reason 28, consumer-defined)".to_string()
            }
            1 => "no queue pair (IB CM reject reason 1)".to_string(),
            3 => "no resources (IB CM reject reason 3)".to_string(),
            4 => "timeout (IB CM reject reason 4)".to_string(),
            n => format!("IB CM reject reason {n}"),
        }
    };
    match private.strip_prefix(REJECT_TAG) {
        Some(msg) => {
            let end = msg.iter().position(|&b| b == 0).unwrap_or(msg.len());
            format!("{code}: {}", String::from_utf8_lossy(&msg[..end]))
        }
        None => code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mr::RemoteMr;

    #[test]
    fn private_data_round_trips_with_padding() {
        let info = PeerInfo {
            endpoints: Vec::new(),
            regions: vec![RemoteMr {
                addr: 0x1000,
                len: 4096,
                rkey: 0x77,
            }],
            user: b"0123456789abcdef".to_vec(),
        };
        let mut bytes = encode_private(&info, IB_CONNECT_PRIVATE_DATA, "a request").unwrap();
        assert_eq!(
            bytes.len(),
            IB_CONNECT_PRIVATE_DATA,
            "one region + 16 bytes fit exactly"
        );
        assert_eq!(decode_private(&bytes).unwrap(), info);
        // InfiniBand pads the private data with zeros.
        bytes.resize(IB_ACCEPT_PRIVATE_DATA, 0);
        assert_eq!(decode_private(&bytes).unwrap(), info);
        // One byte more does not fit a RoCE connection request.
        let big = PeerInfo {
            user: vec![1; 17],
            ..info.clone()
        };
        let e = encode_private(&big, IB_CONNECT_PRIVATE_DATA, "a request").unwrap_err();
        assert!(e.to_string().contains("56 bytes"), "{e}");
    }

    #[test]
    fn foreign_and_malformed_private_data() {
        assert_eq!(decode_private(&[0; 56]).unwrap(), PeerInfo::default());
        assert_eq!(decode_private(b"hello").unwrap().user, b"hello");
        let good = PeerInfo {
            user: b"x".to_vec(),
            ..PeerInfo::default()
        }
        .encode()
        .unwrap();
        // Cut short: the header announces more than came.
        let e = decode_private(&good[..good.len() - 1]).unwrap_err();
        assert!(matches!(e, Error::Protocol { .. }), "{e}");
        // Wrong version.
        let mut bad = good.clone();
        bad[5] = 7;
        assert!(
            decode_private(&bad)
                .unwrap_err()
                .to_string()
                .contains("version 7")
        );
        // Endpoints have no place in rdma_cm private data.
        let with_ep = PeerInfo {
            endpoints: vec![crate::qp::QpEndpoint {
                qp_num: 1,
                psn: 2,
                gid: crate::vocab::Gid::ZERO,
                lid: 0,
                mtu: crate::vocab::Mtu::Mtu1024,
            }],
            ..PeerInfo::default()
        };
        let e = decode_private(&with_ep.encode().unwrap()).unwrap_err();
        assert!(e.to_string().contains("queue pairs"), "{e}");
    }

    #[test]
    fn reject_reasons_name_the_cause() {
        let r = reject_reason(Transport::Ib, 8, &[0; 148]);
        assert!(r.contains("nobody is listening"), "{r}");
        let mut data = REJECT_TAG.to_vec();
        data.extend_from_slice(b"out of memory");
        data.resize(148, 0);
        let r = reject_reason(Transport::Ib, 28, &data);
        assert!(r.ends_with(": out of memory"), "{r}");
        let r = reject_reason(Transport::Iwarp, -libc::ECONNREFUSED, &[]);
        assert!(r.contains("ECONNREFUSED"), "{r}");
    }
}

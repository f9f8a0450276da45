//! The listen handle: the at most 128 bytes NCCL carries from a receiver (`listen`) to its
//! sender (`connect`).
//!
//! Layout (big-endian numbers):
//!
//! ```text
//!  0  magic "ENCL"            4  version u8 (=1)        5  flags u8 (bit 0: rdma_cm)
//!  6  queue pairs u8          7  notice mode u8         8  nonce u64
//! 16  address family u8 (4 or 6), 3 reserved            20 address [16] (IPv4 in the first 4)
//! 36  TCP port u16            38 rdma_cm port u16       40 reserved (zero) up to 64
//! 64  connect stage u64: written by `connect` into its own copy of the handle (the id of the
//!     connection it is building), zero from `listen`
//! 72  unused up to 128
//! ```
//!
//! The TCP port is the connection's out-of-band channel (the exchange, then its liveness); the
//! rdma_cm port is set when the receiver's device connects queue pairs through rdma_cm.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::proto::{MAX_QPS, NoticeMode};

/// NCCL's `NCCL_NET_HANDLE_MAXSIZE`.
pub const HANDLE_BYTES: usize = 128;
const MAGIC: [u8; 4] = *b"ENCL";
const VERSION: u8 = 1;
const FLAG_CM: u8 = 1;
/// Where `connect` keeps the id of the connection it is building.
const STAGE_AT: usize = 64;

/// What a listen handle says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handle {
    /// The receiver's out-of-band (TCP) address.
    pub addr: SocketAddr,
    /// The receiver's rdma_cm port, when its queue pairs connect through rdma_cm.
    pub cm_port: Option<u16>,
    /// Queue pairs per connection.
    pub qps: usize,
    /// How the receiver's device can be notified.
    pub notice: NoticeMode,
    /// A random number naming this listen (checked in the exchange).
    pub nonce: u64,
}

impl Handle {
    /// Writes the handle into NCCL's buffer (the whole [`HANDLE_BYTES`], stage zeroed).
    pub fn encode(&self, out: &mut [u8; HANDLE_BYTES]) {
        out.fill(0);
        out[0..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = if self.cm_port.is_some() { FLAG_CM } else { 0 };
        out[6] = self.qps as u8;
        out[7] = self.notice.code();
        out[8..16].copy_from_slice(&self.nonce.to_be_bytes());
        match self.addr.ip() {
            IpAddr::V4(a) => {
                out[16] = 4;
                out[20..24].copy_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                out[16] = 6;
                out[20..36].copy_from_slice(&a.octets());
            }
        }
        out[36..38].copy_from_slice(&self.addr.port().to_be_bytes());
        out[38..40].copy_from_slice(&self.cm_port.unwrap_or(0).to_be_bytes());
    }

    /// Parses a handle.
    ///
    /// # Errors
    /// A message naming what is wrong: not this plugin's handle, another version, a queue-pair
    /// count or address that makes no sense.
    pub fn decode(h: &[u8; HANDLE_BYTES]) -> Result<Handle, String> {
        if h[0..4] != MAGIC {
            return Err(format!(
                "the connection handle is not this plugin's (it starts {:02x?}; was it made by \
                 another network plugin?)",
                &h[0..4]
            ));
        }
        if h[4] != VERSION {
            return Err(format!(
                "the connection handle is version {} and this plugin speaks {VERSION}: both ends \
                 must load the same plugin",
                h[4]
            ));
        }
        let qps = h[6] as usize;
        if !(1..=MAX_QPS).contains(&qps) {
            return Err(format!(
                "the connection handle asks for {qps} queue pairs (1..={MAX_QPS})"
            ));
        }
        let notice = NoticeMode::from_code(h[7])
            .ok_or_else(|| format!("the connection handle names notice mode {}", h[7]))?;
        let ip = match h[16] {
            4 => IpAddr::V4(Ipv4Addr::new(h[20], h[21], h[22], h[23])),
            6 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(&h[20..36]);
                IpAddr::V6(Ipv6Addr::from(o))
            }
            f => return Err(format!("the connection handle has address family {f}")),
        };
        let port = u16::from_be_bytes([h[36], h[37]]);
        if port == 0 {
            return Err("the connection handle has TCP port 0".into());
        }
        let cm = u16::from_be_bytes([h[38], h[39]]);
        let cm_port = if h[5] & FLAG_CM != 0 {
            if cm == 0 {
                return Err("the connection handle asks for rdma_cm on port 0".into());
            }
            Some(cm)
        } else {
            None
        };
        let mut nonce = [0u8; 8];
        nonce.copy_from_slice(&h[8..16]);
        Ok(Handle {
            addr: SocketAddr::new(ip, port),
            cm_port,
            qps,
            notice,
            nonce: u64::from_be_bytes(nonce),
        })
    }

    /// The connection id `connect` stored in its copy of the handle (0: none yet).
    pub fn stage(h: &[u8; HANDLE_BYTES]) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[STAGE_AT..STAGE_AT + 8]);
        u64::from_ne_bytes(b)
    }

    /// Stores the id of the connection `connect` is building.
    pub fn set_stage(h: &mut [u8; HANDLE_BYTES], id: u64) {
        h[STAGE_AT..STAGE_AT + 8].copy_from_slice(&id.to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Handle {
        Handle {
            addr: "127.0.0.2:40001".parse().unwrap(),
            cm_port: Some(40002),
            qps: 8,
            notice: NoticeMode::Imm,
            nonce: 0x0102_0304_0506_0708,
        }
    }

    #[test]
    fn round_trip_with_golden_bytes() {
        let mut b = [0xffu8; HANDLE_BYTES];
        sample().encode(&mut b);
        assert_eq!(&b[0..8], b"ENCL\x01\x01\x08\x00");
        assert_eq!(&b[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[16..24], &[4, 0, 0, 0, 127, 0, 0, 2]);
        assert_eq!(&b[36..40], &[0x9c, 0x41, 0x9c, 0x42]);
        assert!(b[40..].iter().all(|&x| x == 0));
        assert_eq!(Handle::decode(&b).unwrap(), sample());
        assert_eq!(Handle::stage(&b), 0);
        Handle::set_stage(&mut b, 42);
        assert_eq!(Handle::stage(&b), 42);
        assert_eq!(Handle::decode(&b).unwrap(), sample());
        let v6 = Handle {
            addr: "[fe80::1]:9".parse().unwrap(),
            cm_port: None,
            ..sample()
        };
        v6.encode(&mut b);
        assert_eq!(Handle::decode(&b).unwrap(), v6);
    }

    #[test]
    fn foreign_or_damaged_handles_are_refused() {
        let mut b = [0u8; HANDLE_BYTES];
        assert!(
            Handle::decode(&b)
                .unwrap_err()
                .contains("not this plugin's")
        );
        sample().encode(&mut b);
        b[4] = 2;
        assert!(Handle::decode(&b).unwrap_err().contains("version 2"));
        sample().encode(&mut b);
        b[6] = 0;
        assert!(Handle::decode(&b).unwrap_err().contains("0 queue pairs"));
        sample().encode(&mut b);
        b[16] = 5;
        assert!(Handle::decode(&b).unwrap_err().contains("family 5"));
        sample().encode(&mut b);
        b[36..38].fill(0);
        assert!(Handle::decode(&b).unwrap_err().contains("port 0"));
    }
}

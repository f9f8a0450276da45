//! The out-of-band formats of the C tools, so the project's tools can face them: rdma-core's
//! `ibv_rc_pingpong` ([`rc_pingpong`]) and perftest 4.5's default, non-rdma_cm exchange
//! ([`perftest`], used by `ib_write_bw`, `ib_send_lat` and the rest of the suite).
//!
//! Both are plain TCP exchanges of fixed-size text or binary messages. Decoders are strict:
//! every message must have exactly its size and every field its shape, or the exchange fails
//! with an [`Error::Protocol`] naming the field and what was wrong. Every read and write has a
//! deadline, so a silent or vanished peer gives [`Error::Timeout`] or [`Error::Protocol`] in
//! bounded time.
//!
//! This module only moves bytes; arming queue pairs stays with the caller (the server side of
//! `rc_pingpong` takes a closure for the one step that must happen mid-exchange).

use std::net::TcpStream;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::vocab::Gid;

use super::{read_exact_by, write_all_by};

/// The TCP port both C tools use by default.
pub const DEFAULT_PORT: u16 = 18515;

/// `"done\0"`: the closing word both tools write.
pub const DONE: &[u8; 5] = b"done\0";

/// Parses `text` as lowercase or uppercase hexadecimal of exactly `text.len()` digits.
fn hex_field(msg: &str, field: &str, text: &[u8]) -> Result<u64> {
    if text.is_empty() || !text.iter().all(u8::is_ascii_hexdigit) {
        return Err(Error::protocol(format!(
            "{msg}: field `{field}` is {:?}, not {} hexadecimal digits",
            String::from_utf8_lossy(text),
            text.len()
        )));
    }
    let s = std::str::from_utf8(text).map_err(|_| Error::protocol("unreachable: ASCII"))?;
    u64::from_str_radix(s, 16)
        .map_err(|_| Error::protocol(format!("{msg}: field `{field}` does not fit 64 bits")))
}

/// Checks that `msg[at]` is `want`.
fn expect_byte(msg_name: &str, msg: &[u8], at: usize, want: u8, after: &str) -> Result<()> {
    if msg[at] != want {
        return Err(Error::protocol(format!(
            "{msg_name}: expected {:?} after `{after}` at byte {at}, found {:?}",
            want as char, msg[at] as char
        )));
    }
    Ok(())
}

fn check_len(msg_name: &str, msg: &[u8], want: usize) -> Result<()> {
    if msg.len() != want {
        return Err(Error::protocol(format!(
            "{msg_name} is {} bytes, expected exactly {want}",
            msg.len()
        )));
    }
    Ok(())
}

fn check_24(msg_name: &str, field: &str, v: u32) -> Result<()> {
    if v > 0xff_ffff {
        return Err(Error::invalid(format!(
            "{msg_name}: {field} {v:#x} does not fit 24 bits"
        )));
    }
    Ok(())
}

/// rdma-core's `ibv_rc_pingpong` exchange (libibverbs/examples, v44).
///
/// ```text
/// message  "%04x:%06x:%06x:%s\0" = lid : qpn : psn : 32 hex digits of the raw GID  (52 bytes)
/// client   connect, write 52 B, read 52 B, write "done\0"
/// server   accept, read 52 B, arm its queue pair, write 52 B, read "done\0"
/// ```
///
/// The tool exchanges no MTU (both ends must be started with the same `-m`) and grants no remote
/// access: traffic is SENDs only.
pub mod rc_pingpong {
    use super::*;

    /// Size of the message, trailing NUL included.
    pub const MSG_LEN: usize = 52;
    const NAME: &str = "rc_pingpong message";

    /// What one side of `ibv_rc_pingpong` tells the other.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Dest {
        /// LID (0 on RoCE).
        pub lid: u16,
        /// Queue pair number (24 bits).
        pub qpn: u32,
        /// First send PSN (24 bits).
        pub psn: u32,
        /// GID, raw bytes in order.
        pub gid: Gid,
    }

    impl Dest {
        /// Serialises to the 52-byte message.
        ///
        /// # Errors
        /// [`Error::InvalidArgument`] when the QPN or PSN exceeds 24 bits.
        pub fn encode(&self) -> Result<[u8; MSG_LEN]> {
            check_24(NAME, "QPN", self.qpn)?;
            check_24(NAME, "PSN", self.psn)?;
            let mut gid = String::with_capacity(32);
            for b in self.gid.0 {
                gid.push_str(&format!("{b:02x}"));
            }
            let text = format!("{:04x}:{:06x}:{:06x}:{gid}", self.lid, self.qpn, self.psn);
            let mut out = [0u8; MSG_LEN];
            out[..MSG_LEN - 1].copy_from_slice(text.as_bytes());
            Ok(out)
        }

        /// Parses a 52-byte message.
        ///
        /// # Errors
        /// [`Error::Protocol`] naming the field that is malformed, or the wrong length.
        pub fn decode(msg: &[u8]) -> Result<Dest> {
            check_len(NAME, msg, MSG_LEN)?;
            expect_byte(NAME, msg, 4, b':', "lid")?;
            expect_byte(NAME, msg, 11, b':', "qpn")?;
            expect_byte(NAME, msg, 18, b':', "psn")?;
            if msg[MSG_LEN - 1] != 0 {
                return Err(Error::protocol(format!(
                    "{NAME}: not NUL-terminated (last byte {:#04x})",
                    msg[MSG_LEN - 1]
                )));
            }
            let lid = hex_field(NAME, "lid", &msg[0..4])? as u16;
            let qpn = hex_field(NAME, "qpn", &msg[5..11])? as u32;
            let psn = hex_field(NAME, "psn", &msg[12..18])? as u32;
            let mut gid = [0u8; 16];
            for (i, b) in gid.iter_mut().enumerate() {
                let at = 19 + 2 * i;
                *b = hex_field(NAME, "gid", &msg[at..at + 2])? as u8;
            }
            Ok(Dest {
                lid,
                qpn,
                psn,
                gid: Gid(gid),
            })
        }
    }

    /// The client's side: sends `local`, receives the server's info, confirms with `done`.
    ///
    /// # Errors
    /// [`Error::Timeout`] past `timeout`, [`Error::Protocol`] for a malformed reply or a peer
    /// that closes early, [`Error::Io`].
    pub fn client_exchange(
        stream: &mut TcpStream,
        local: &Dest,
        timeout: Duration,
    ) -> Result<Dest> {
        let deadline = crate::sync::deadline(timeout);
        write_all_by(
            stream,
            &local.encode()?,
            deadline,
            "the rc_pingpong message",
        )?;
        let mut msg = [0u8; MSG_LEN];
        read_exact_by(stream, &mut msg, deadline, "the rc_pingpong message")?;
        let remote = Dest::decode(&msg)?;
        write_all_by(stream, DONE, deadline, "the rc_pingpong `done`")?;
        Ok(remote)
    }

    /// The server's side: receives the client's info, calls `arm` with it (the queue pair must
    /// be ready to receive before the reply goes out, since the client sends as soon as it has
    /// it), sends `local`, and waits for the client's `done`.
    ///
    /// # Errors
    /// As [`client_exchange`], plus whatever `arm` returns; a wrong closing word is an
    /// [`Error::Protocol`].
    pub fn server_exchange(
        stream: &mut TcpStream,
        local: &Dest,
        timeout: Duration,
        arm: impl FnOnce(&Dest) -> Result<()>,
    ) -> Result<Dest> {
        let deadline = crate::sync::deadline(timeout);
        let mut msg = [0u8; MSG_LEN];
        read_exact_by(stream, &mut msg, deadline, "the rc_pingpong message")?;
        let remote = Dest::decode(&msg)?;
        arm(&remote)?;
        write_all_by(
            stream,
            &local.encode()?,
            deadline,
            "the rc_pingpong message",
        )?;
        let mut done = [0u8; 5];
        read_exact_by(stream, &mut done, deadline, "the rc_pingpong `done`")?;
        if &done != DONE {
            return Err(Error::protocol(format!(
                "rc_pingpong: expected \"done\\0\" to close the exchange, got {:?}",
                String::from_utf8_lossy(&done)
            )));
        }
        Ok(remote)
    }
}

/// perftest 4.5's exchange: what `ib_write_bw`, `ib_send_lat` and the others speak, over TCP
/// by default ([`perftest::Session`]) and, with `-R` / `--rdma_cm`, as SEND/RECV messages on a
/// connection of its own that rdma_cm makes (the same steps; keys then travel as the binary
/// `struct pingpong_dest`, [`perftest::Keys::encode_struct`], and there is no `done`). The steps
/// are written once over a lock-step exchange ([`perftest::setup_over`],
/// [`perftest::bw_report_over`]).
///
/// Every primitive step is lock-step: the client writes then reads, the server reads then writes,
/// each message of a fixed size. The steps:
///
/// ```text
/// version   16 B: NUL-padded decimal version text; peers older than 5.70 are refused
/// sys data  4 B + 4 B: cycle buffer (page size), cache line size, big-endian; both use the max
/// MTU       2 B: the ibv_mtu enum as one ASCII digit + NUL; both use the smaller
/// keys      108 B per message (the GID form): see [`perftest::Keys`]
/// reports   5 x 8 B big-endian: size, iterations, peak and average bandwidth, message rate
/// close     one keys exchange, then "done\0" each way (unread)
/// ```
pub mod perftest {
    use super::*;
    use crate::vocab::Mtu;

    /// The version this side claims (perftest 4.5-0.17's own).
    pub const VERSION: &str = "6.06";
    /// The oldest version perftest itself accepts, and so do we.
    pub const MIN_VERSION: f64 = 5.70;
    /// Size of the version message.
    pub const VERSION_LEN: usize = 16;
    /// Size of a keys message (the GID form), trailing NUL included.
    pub const KEYS_LEN: usize = 108;
    /// Size of a keys message on perftest's rdma_cm channel (`-R`): `struct pingpong_dest`.
    pub const KEYS_STRUCT_LEN: usize = 56;
    /// perftest's cycle buffer (the page size).
    pub const CYCLE_BUFFER: u32 = 4096;
    /// perftest's cache line size.
    pub const CACHE_LINE: u32 = 64;
    const NAME: &str = "perftest keys message";

    /// Which end of the TCP connection this side is.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Role {
        /// Dialled out (writes first).
        Client,
        /// Accepted (reads first).
        Server,
    }

    /// One queue pair's connection data (`struct pingpong_dest`'s wire form).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Keys {
        /// LID (0 on RoCE).
        pub lid: u16,
        /// Outstanding READ/atomics the sender supports (the peer's `max_rd_atomic`).
        pub out_reads: u16,
        /// Queue pair number (24 bits).
        pub qpn: u32,
        /// First send PSN (24 bits).
        pub psn: u32,
        /// Remote key of the sender's buffer.
        pub rkey: u32,
        /// Address of the sender's buffer.
        pub vaddr: u64,
        /// GID, raw bytes in order.
        pub gid: Gid,
        /// SRQ number (0 without XRC/DC).
        pub srqn: u32,
    }

    // Byte offsets of the fixed-width fields in the keys message.
    const F_LID: (usize, usize) = (0, 4);
    const F_OUT_READS: (usize, usize) = (5, 9);
    const F_QPN: (usize, usize) = (10, 16);
    const F_PSN: (usize, usize) = (17, 23);
    const F_RKEY: (usize, usize) = (24, 32);
    const F_VADDR: (usize, usize) = (33, 49);
    const F_GID: usize = 50;
    const F_SRQN: (usize, usize) = (98, 106);

    impl Keys {
        /// Serialises to the 108-byte message
        /// `"%04x:%04x:%06x:%06x:%08x:%016x:" + 16 x "%02x:" + "%08x:\0"`.
        ///
        /// # Errors
        /// [`Error::InvalidArgument`] when the QPN or PSN exceeds 24 bits.
        pub fn encode(&self) -> Result<[u8; KEYS_LEN]> {
            check_24(NAME, "QPN", self.qpn)?;
            check_24(NAME, "PSN", self.psn)?;
            let mut text = format!(
                "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:",
                self.lid, self.out_reads, self.qpn, self.psn, self.rkey, self.vaddr
            );
            for b in self.gid.0 {
                text.push_str(&format!("{b:02x}:"));
            }
            text.push_str(&format!("{:08x}:", self.srqn));
            let mut out = [0u8; KEYS_LEN];
            out[..KEYS_LEN - 1].copy_from_slice(text.as_bytes());
            Ok(out)
        }

        /// Parses a 108-byte message.
        ///
        /// # Errors
        /// [`Error::Protocol`] naming the malformed field, or the wrong length.
        pub fn decode(msg: &[u8]) -> Result<Keys> {
            check_len(NAME, msg, KEYS_LEN)?;
            if msg[KEYS_LEN - 1] != 0 {
                return Err(Error::protocol(format!(
                    "{NAME}: not NUL-terminated (last byte {:#04x})",
                    msg[KEYS_LEN - 1]
                )));
            }
            let field = |name: &str, (a, b): (usize, usize)| -> Result<u64> {
                expect_byte(NAME, msg, b, b':', name)?;
                hex_field(NAME, name, &msg[a..b])
            };
            let lid = field("lid", F_LID)? as u16;
            let out_reads = field("out_reads", F_OUT_READS)? as u16;
            let qpn = field("qpn", F_QPN)? as u32;
            let psn = field("psn", F_PSN)? as u32;
            let rkey = field("rkey", F_RKEY)? as u32;
            let vaddr = field("vaddr", F_VADDR)?;
            let mut gid = [0u8; 16];
            for (i, g) in gid.iter_mut().enumerate() {
                let at = F_GID + 3 * i;
                *g = field("gid", (at, at + 2))? as u8;
            }
            let srqn = field("srqn", F_SRQN)? as u32;
            Ok(Keys {
                lid,
                out_reads,
                qpn,
                psn,
                rkey,
                vaddr,
                gid: Gid(gid),
                srqn,
            })
        }

        /// The binary form perftest sends on its rdma_cm channel (`-R`): `struct pingpong_dest`
        /// as x86-64 lays it out, integers big-endian: lid, out_reads, qpn, psn, rkey (4 bytes
        /// each), 4 bytes of padding, vaddr (8), the GID (16), srqn and gid_index (4 each).
        pub fn encode_struct(&self) -> [u8; KEYS_STRUCT_LEN] {
            let mut out = [0u8; KEYS_STRUCT_LEN];
            let words = [
                u32::from(self.lid),
                u32::from(self.out_reads),
                self.qpn,
                self.psn,
                self.rkey,
            ];
            for (i, w) in words.iter().enumerate() {
                out[4 * i..4 * i + 4].copy_from_slice(&w.to_be_bytes());
            }
            out[24..32].copy_from_slice(&self.vaddr.to_be_bytes());
            out[32..48].copy_from_slice(&self.gid.0);
            out[48..52].copy_from_slice(&self.srqn.to_be_bytes());
            out
        }

        /// Parses the binary form ([`Keys::encode_struct`]); perftest itself reads neither the
        /// srqn nor the GID index of it, and neither does this.
        ///
        /// # Errors
        /// [`Error::Protocol`] for the wrong length or a field too wide for its kind.
        pub fn decode_struct(msg: &[u8]) -> Result<Keys> {
            const STRUCT: &str = "perftest rdma_cm keys message";
            check_len(STRUCT, msg, KEYS_STRUCT_LEN)?;
            let word = |i: usize| u32::from_be_bytes([msg[i], msg[i + 1], msg[i + 2], msg[i + 3]]);
            let narrow = |field: &str, v: u32| -> Result<u16> {
                u16::try_from(v).map_err(|_| {
                    Error::protocol(format!("{STRUCT}: {field} {v:#x} does not fit 16 bits"))
                })
            };
            let keys = Keys {
                lid: narrow("lid", word(0))?,
                out_reads: narrow("out_reads", word(4))?,
                qpn: word(8),
                psn: word(12),
                rkey: word(16),
                vaddr: u64::from_be_bytes(msg[24..32].try_into().expect("8 bytes")),
                gid: Gid(msg[32..48].try_into().expect("16 bytes")),
                srqn: 0,
            };
            check_24(STRUCT, "QPN", keys.qpn)
                .and_then(|()| check_24(STRUCT, "PSN", keys.psn))
                .map_err(|e| Error::protocol(e.to_string()))?;
            Ok(keys)
        }
    }

    /// What the setup steps agreed on.
    #[derive(Debug, Clone, PartialEq)]
    pub struct Setup {
        /// The peer's version text.
        pub remote_version: String,
        /// The cycle buffer both sides use (the larger of the two).
        pub cycle_buffer: u32,
        /// The cache line size both sides use (the larger of the two).
        pub cache_line: u32,
        /// The path MTU both sides use (the smaller of the two).
        pub mtu: Mtu,
    }

    /// A bandwidth report (`struct bw_report_data`'s exchanged part).
    #[derive(Debug, Clone, Copy, PartialEq, Default)]
    pub struct BwReport {
        /// Message size, bytes.
        pub size: u64,
        /// Messages.
        pub iters: u64,
        /// Peak bandwidth, in the report's unit.
        pub bw_peak: f64,
        /// Average bandwidth, in the report's unit.
        pub bw_avg: f64,
        /// Average message rate, Mpps.
        pub msg_rate: f64,
    }

    /// Encodes a version message.
    pub fn encode_version(version: &str) -> [u8; VERSION_LEN] {
        let mut out = [0u8; VERSION_LEN];
        let n = version.len().min(VERSION_LEN - 1);
        out[..n].copy_from_slice(&version.as_bytes()[..n]);
        out
    }

    /// Parses a version message and checks it is one perftest 4.5 talks to (≥ 5.70).
    ///
    /// # Errors
    /// [`Error::Protocol`] for a version that is not a number or is too old.
    pub fn decode_version(msg: &[u8]) -> Result<String> {
        check_len("perftest version message", msg, VERSION_LEN)?;
        let end = msg.iter().position(|&b| b == 0).ok_or_else(|| {
            Error::protocol("perftest version message: no NUL terminator in 16 bytes")
        })?;
        let text = std::str::from_utf8(&msg[..end])
            .ok()
            .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'.'))
            .ok_or_else(|| {
                Error::protocol(format!(
                    "perftest version message: {:?} is not a version number",
                    String::from_utf8_lossy(&msg[..end])
                ))
            })?;
        let v: f64 = text.parse().map_err(|_| {
            Error::protocol(format!(
                "perftest version message: {text:?} is not a version number"
            ))
        })?;
        if v < MIN_VERSION {
            return Err(Error::protocol(format!(
                "peer speaks perftest version {text}, older than {MIN_VERSION:.2} (incompatible)"
            )));
        }
        Ok(text.to_string())
    }

    /// Encodes the MTU message.
    pub fn encode_mtu(mtu: Mtu) -> [u8; 2] {
        [b'0' + mtu.as_enum() as u8, 0]
    }

    /// Parses the MTU message.
    ///
    /// # Errors
    /// [`Error::Protocol`] unless it is one digit 1..=5 and a NUL.
    pub fn decode_mtu(msg: &[u8]) -> Result<Mtu> {
        check_len("perftest MTU message", msg, 2)?;
        let code = msg[0].wrapping_sub(b'0');
        match (Mtu::from_enum(code as u32), msg[1]) {
            (Some(m), 0) => Ok(m),
            _ => Err(Error::protocol(format!(
                "perftest MTU message: {:?} is not an MTU code 1..=5 followed by NUL",
                String::from_utf8_lossy(msg)
            ))),
        }
    }

    fn decode_sys(what: &str, msg: [u8; 4], max: u32) -> Result<u32> {
        let v = i32::from_be_bytes(msg);
        if v <= 0 || v as u32 > max {
            return Err(Error::protocol(format!(
                "perftest sys data: {what} {v} is outside 1..={max}"
            )));
        }
        Ok(v as u32)
    }

    fn decode_f64(what: &str, msg: [u8; 8]) -> Result<f64> {
        let v = f64::from_be_bytes(msg);
        if !v.is_finite() || v < 0.0 {
            return Err(Error::protocol(format!(
                "perftest report: {what} {v} is not a non-negative number"
            )));
        }
        Ok(v)
    }

    /// One lock-step exchange of equal-sized messages, whatever carries it: `(mine, theirs,
    /// what)`, `what` naming the step in errors.
    pub type Xchg<'a> = dyn FnMut(&[u8], &mut [u8], &str) -> Result<()> + 'a;

    /// The setup steps over `xchg`: versions, sys data and MTU. `local_mtu` is this side's path
    /// MTU.
    ///
    /// # Errors
    /// [`Error::Protocol`] for an old version or a malformed message, and what `xchg` fails with.
    pub fn setup_over(xchg: &mut Xchg<'_>, local_mtu: Mtu) -> Result<Setup> {
        let mut v = [0u8; VERSION_LEN];
        xchg(&encode_version(VERSION), &mut v, "the perftest version")?;
        let remote_version = decode_version(&v)?;
        let mut cb = [0u8; 4];
        xchg(
            &(CYCLE_BUFFER as i32).to_be_bytes(),
            &mut cb,
            "the perftest cycle buffer size",
        )?;
        let cycle_buffer = decode_sys("cycle buffer", cb, 1 << 30)?.max(CYCLE_BUFFER);
        let mut cl = [0u8; 4];
        xchg(
            &(CACHE_LINE as i32).to_be_bytes(),
            &mut cl,
            "the perftest cache line size",
        )?;
        let cache_line = decode_sys("cache line size", cl, 1 << 16)?.max(CACHE_LINE);
        let mut m = [0u8; 2];
        xchg(&encode_mtu(local_mtu), &mut m, "the perftest MTU")?;
        let mtu = decode_mtu(&m)?.min(local_mtu);
        Ok(Setup {
            remote_version,
            cycle_buffer,
            cache_line,
            mtu,
        })
    }

    /// The five-part bandwidth report exchange over `xchg`.
    ///
    /// # Errors
    /// A negative or non-finite number is an [`Error::Protocol`]; and what `xchg` fails with.
    pub fn bw_report_over(xchg: &mut Xchg<'_>, mine: &BwReport) -> Result<BwReport> {
        let mut parts = [[0u8; 8]; 5];
        let ours = [
            mine.size.to_be_bytes(),
            mine.iters.to_be_bytes(),
            mine.bw_peak.to_be_bytes(),
            mine.bw_avg.to_be_bytes(),
            mine.msg_rate.to_be_bytes(),
        ];
        for (o, t) in ours.iter().zip(parts.iter_mut()) {
            xchg(o, t, "the perftest bandwidth report")?;
        }
        Ok(BwReport {
            size: u64::from_be_bytes(parts[0]),
            iters: u64::from_be_bytes(parts[1]),
            bw_peak: decode_f64("peak bandwidth", parts[2])?,
            bw_avg: decode_f64("average bandwidth", parts[3])?,
            msg_rate: decode_f64("message rate", parts[4])?,
        })
    }

    /// One side of a perftest connection: a TCP stream, its role, and the time each step may take.
    #[derive(Debug)]
    pub struct Session {
        stream: TcpStream,
        role: Role,
        step_timeout: Duration,
    }

    impl Session {
        /// Wraps a connected stream. Each step (one lock-step exchange) must finish within
        /// `step_timeout`.
        pub fn new(stream: TcpStream, role: Role, step_timeout: Duration) -> Session {
            let _ = stream.set_nodelay(true);
            Session {
                stream,
                role,
                step_timeout,
            }
        }

        /// The underlying stream (to check whether the peer has spoken, for example).
        pub fn stream(&self) -> &TcpStream {
            &self.stream
        }

        /// This side's role.
        pub fn role(&self) -> Role {
            self.role
        }

        /// Changes the time each later step may take (a server waiting for the client's run
        /// needs as long as the run).
        pub fn set_step_timeout(&mut self, timeout: Duration) {
            self.step_timeout = timeout;
        }

        /// One lock-step exchange of equal-sized messages.
        fn xchg(&mut self, mine: &[u8], theirs: &mut [u8], what: &str) -> Result<()> {
            let deadline = crate::sync::deadline(self.step_timeout);
            match self.role {
                Role::Client => {
                    write_all_by(&mut self.stream, mine, deadline, what)?;
                    read_exact_by(&mut self.stream, theirs, deadline, what)
                }
                Role::Server => {
                    read_exact_by(&mut self.stream, theirs, deadline, what)?;
                    write_all_by(&mut self.stream, mine, deadline, what)
                }
            }
        }

        /// The setup steps ([`setup_over`]).
        ///
        /// # Errors
        /// [`Error::Protocol`] for an old version or a malformed message, [`Error::Timeout`],
        /// [`Error::Io`].
        pub fn setup(&mut self, local_mtu: Mtu) -> Result<Setup> {
            setup_over(&mut |m, t, w| self.xchg(m, t, w), local_mtu)
        }

        /// One keys exchange (`ctx_hand_shake`): also how perftest synchronises its phases.
        ///
        /// # Errors
        /// As [`Session::setup`].
        pub fn hand_shake(&mut self, mine: &Keys) -> Result<Keys> {
            let mut theirs = [0u8; KEYS_LEN];
            self.xchg(&mine.encode()?, &mut theirs, "the perftest keys message")?;
            Keys::decode(&theirs)
        }

        /// The five-part bandwidth report exchange ([`bw_report_over`]).
        ///
        /// # Errors
        /// As [`Session::setup`]; a negative or non-finite number is an [`Error::Protocol`].
        pub fn xchg_bw_report(&mut self, mine: &BwReport) -> Result<BwReport> {
            bw_report_over(&mut |m, t, w| self.xchg(m, t, w), mine)
        }

        /// Closes the connection as perftest does: one keys exchange, then `done`.
        ///
        /// # Errors
        /// As [`Session::hand_shake`].
        pub fn close(mut self, mine: &Keys) -> Result<()> {
            self.hand_shake(mine)?;
            let deadline = crate::sync::deadline(self.step_timeout);
            // The peer does not read the word and may already be gone: a failure here is not one.
            let _ = write_all_by(&mut self.stream, DONE, deadline, "the perftest `done`");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests;

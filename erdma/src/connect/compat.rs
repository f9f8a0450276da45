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

/// perftest 4.5's default exchange (no `-R` / `--rdma_cm`): what `ib_write_bw`, `ib_send_lat`
/// and the others speak.
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

        /// The setup steps: versions, sys data and MTU. `local_mtu` is this side's path MTU.
        ///
        /// # Errors
        /// [`Error::Protocol`] for an old version or a malformed message, [`Error::Timeout`],
        /// [`Error::Io`].
        pub fn setup(&mut self, local_mtu: Mtu) -> Result<Setup> {
            let mut v = [0u8; VERSION_LEN];
            self.xchg(&encode_version(VERSION), &mut v, "the perftest version")?;
            let remote_version = decode_version(&v)?;
            let mut cb = [0u8; 4];
            self.xchg(
                &(CYCLE_BUFFER as i32).to_be_bytes(),
                &mut cb,
                "the perftest cycle buffer size",
            )?;
            let cycle_buffer = decode_sys("cycle buffer", cb, 1 << 30)?.max(CYCLE_BUFFER);
            let mut cl = [0u8; 4];
            self.xchg(
                &(CACHE_LINE as i32).to_be_bytes(),
                &mut cl,
                "the perftest cache line size",
            )?;
            let cache_line = decode_sys("cache line size", cl, 1 << 16)?.max(CACHE_LINE);
            let mut m = [0u8; 2];
            self.xchg(&encode_mtu(local_mtu), &mut m, "the perftest MTU")?;
            let mtu = decode_mtu(&m)?.min(local_mtu);
            Ok(Setup {
                remote_version,
                cycle_buffer,
                cache_line,
                mtu,
            })
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

        /// The five-part bandwidth report exchange.
        ///
        /// # Errors
        /// As [`Session::setup`]; a negative or non-finite number is an [`Error::Protocol`].
        pub fn xchg_bw_report(&mut self, mine: &BwReport) -> Result<BwReport> {
            let mut parts = [[0u8; 8]; 5];
            let ours = [
                mine.size.to_be_bytes(),
                mine.iters.to_be_bytes(),
                mine.bw_peak.to_be_bytes(),
                mine.bw_avg.to_be_bytes(),
                mine.msg_rate.to_be_bytes(),
            ];
            for (o, t) in ours.iter().zip(parts.iter_mut()) {
                self.xchg(o, t, "the perftest bandwidth report")?;
            }
            Ok(BwReport {
                size: u64::from_be_bytes(parts[0]),
                iters: u64::from_be_bytes(parts[1]),
                bw_peak: decode_f64("peak bandwidth", parts[2])?,
                bw_avg: decode_f64("average bandwidth", parts[3])?,
                msg_rate: decode_f64("message rate", parts[4])?,
            })
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
mod tests {
    use super::perftest::{BwReport, Keys, Role, Session};
    use super::rc_pingpong::Dest;
    use super::*;
    use crate::connect::{Listener, dial};
    use crate::vocab::Mtu;
    use std::io::Write;

    fn gid() -> Gid {
        "::ffff:192.168.1.10".parse().unwrap()
    }

    #[test]
    fn rc_pingpong_message_golden_bytes() {
        let d = Dest {
            lid: 0,
            qpn: 0x11,
            psn: 0xa3f21c,
            gid: gid(),
        };
        let m = d.encode().unwrap();
        assert_eq!(
            &m[..],
            &b"0000:000011:a3f21c:00000000000000000000ffffc0a8010a\0"[..]
        );
        assert_eq!(Dest::decode(&m).unwrap(), d);
        // Uppercase hex (sscanf accepts it) is accepted too.
        let upper = m.to_ascii_uppercase();
        assert_eq!(Dest::decode(&upper).unwrap(), d);
    }

    #[test]
    fn rc_pingpong_malformed_messages() {
        let good = Dest {
            lid: 0,
            qpn: 0x11,
            psn: 0x1,
            gid: gid(),
        }
        .encode()
        .unwrap();
        let err = |m: &[u8]| Dest::decode(m).unwrap_err().to_string();
        for cut in [0, 1, 20, 51] {
            assert!(
                err(&good[..cut]).contains("expected exactly 52"),
                "cut {cut}"
            );
        }
        let mut long = good.to_vec();
        long.push(0);
        assert!(err(&long).contains("53 bytes"));
        let mut bad = good;
        bad[4] = b'-';
        assert!(err(&bad).contains("after `lid`"));
        let mut bad = good;
        bad[7] = b'g';
        assert!(err(&bad).contains("`qpn`"));
        let mut bad = good;
        bad[13] = b' ';
        assert!(err(&bad).contains("`psn`"));
        let mut bad = good;
        bad[40] = b'z';
        assert!(err(&bad).contains("`gid`"));
        let mut bad = good;
        bad[51] = b'0';
        assert!(err(&bad).contains("NUL"));
        assert!(
            Dest {
                lid: 0,
                qpn: 1 << 24,
                psn: 0,
                gid: gid()
            }
            .encode()
            .is_err()
        );
    }

    fn keys() -> Keys {
        Keys {
            lid: 0,
            out_reads: 1,
            qpn: 0x11,
            psn: 0x5b1d3e,
            rkey: 0x1234,
            vaddr: 0x7f12_a4c0_1000,
            gid: gid(),
            srqn: 0,
        }
    }

    #[test]
    fn perftest_keys_golden_bytes() {
        let m = keys().encode().unwrap();
        let want = b"0000:0001:000011:5b1d3e:00001234:00007f12a4c01000:00:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:01:0a:00000000:\0";
        assert_eq!(want.len(), perftest::KEYS_LEN);
        assert_eq!(&m[..], &want[..]);
        assert_eq!(Keys::decode(&m).unwrap(), keys());
    }

    #[test]
    fn perftest_malformed_messages() {
        let good = keys().encode().unwrap();
        let err = |m: &[u8]| Keys::decode(m).unwrap_err().to_string();
        for cut in [0, 59, 107] {
            assert!(err(&good[..cut]).contains("expected exactly 108"));
        }
        let mut bad = good;
        bad[9] = b'x';
        assert!(err(&bad).contains("after `out_reads`"), "{}", err(&bad));
        let mut bad = good;
        bad[30] = b'q';
        assert!(err(&bad).contains("`rkey`"));
        let mut bad = good;
        bad[40] = b'-';
        assert!(err(&bad).contains("`vaddr`"));
        let mut bad = good;
        bad[F_GID_PROBE] = b'k';
        assert!(err(&bad).contains("`gid`"));
        let mut bad = good;
        bad[100] = b'!';
        assert!(err(&bad).contains("`srqn`"));
        let mut bad = good;
        bad[107] = b'1';
        assert!(err(&bad).contains("NUL"));

        assert_eq!(
            perftest::decode_version(&perftest::encode_version("6.06")).unwrap(),
            "6.06"
        );
        let old = perftest::decode_version(&perftest::encode_version("5.60")).unwrap_err();
        assert!(old.to_string().contains("older than 5.70"), "{old}");
        let junk = perftest::decode_version(&perftest::encode_version("v6")).unwrap_err();
        assert!(junk.to_string().contains("not a version"), "{junk}");
        assert!(perftest::decode_version(&[b'6'; 16]).is_err());
        assert!(perftest::decode_version(&[0; 15]).is_err());

        assert_eq!(perftest::decode_mtu(b"3\0").unwrap(), Mtu::Mtu1024);
        assert_eq!(perftest::encode_mtu(Mtu::Mtu4096), *b"5\0");
        for bad in [&b"6\0"[..], b"0\0", b"3x", b"3", b"30\0"] {
            assert!(perftest::decode_mtu(bad).is_err(), "{bad:?}");
        }
    }
    const F_GID_PROBE: usize = 50 + 3 * 7;

    #[test]
    fn perftest_session_both_roles() {
        let l = Listener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = Duration::from_secs(5);
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept(t).unwrap();
            let mut s = Session::new(s, Role::Server, t);
            let setup = s.setup(Mtu::Mtu4096).unwrap();
            let mut mine = keys();
            mine.qpn = 0x22;
            let theirs = s.hand_shake(&mine).unwrap();
            let rep = s.xchg_bw_report(&BwReport::default()).unwrap();
            s.close(&mine).unwrap();
            (setup, theirs, rep)
        });
        let c = dial(addr, t).unwrap();
        let mut c = Session::new(c, Role::Client, t);
        let setup = c.setup(Mtu::Mtu1024).unwrap();
        assert_eq!(setup.mtu, Mtu::Mtu1024);
        assert_eq!(setup.remote_version, "6.06");
        assert_eq!(setup.cycle_buffer, 4096);
        let theirs = c.hand_shake(&keys()).unwrap();
        assert_eq!(theirs.qpn, 0x22);
        let rep = BwReport {
            size: 65536,
            iters: 5000,
            bw_peak: 1000.5,
            bw_avg: 900.25,
            msg_rate: 0.0144,
        };
        assert_eq!(c.xchg_bw_report(&rep).unwrap(), BwReport::default());
        c.close(&keys()).unwrap();
        let (s_setup, s_theirs, s_rep) = server.join().unwrap();
        assert_eq!(s_setup.mtu, Mtu::Mtu1024);
        assert_eq!(s_theirs, keys());
        assert_eq!(s_rep, rep);
    }

    /// A fake peer that sends `bytes` and then closes (or goes silent with `hold`).
    fn fake_peer(bytes: Vec<u8>, hold: Duration) -> std::net::SocketAddr {
        let l = Listener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept(Duration::from_secs(5)) {
                let _ = s.write_all(&bytes);
                std::thread::sleep(hold);
            }
        });
        addr
    }

    #[test]
    fn bad_peers_fail_in_bounded_time() {
        let t = Duration::from_millis(500);
        // perftest: a peer claiming an old version.
        let addr = fake_peer(perftest::encode_version("5.10").to_vec(), Duration::ZERO);
        let mut c = Session::new(dial(addr, t).unwrap(), Role::Client, t);
        let e = c.setup(Mtu::Mtu1024).unwrap_err();
        assert!(e.to_string().contains("older than"), "{e}");
        // perftest: a peer that stops half-way through its version.
        let addr = fake_peer(b"6.0".to_vec(), Duration::ZERO);
        let mut c = Session::new(dial(addr, t).unwrap(), Role::Client, t);
        let e = c.setup(Mtu::Mtu1024).unwrap_err();
        assert!(matches!(e, Error::Protocol { .. }), "{e}");
        // perftest: an MTU of 7.
        let mut msg = perftest::encode_version("6.06").to_vec();
        msg.extend_from_slice(&4096i32.to_be_bytes());
        msg.extend_from_slice(&64i32.to_be_bytes());
        msg.extend_from_slice(b"7\0");
        let addr = fake_peer(msg, Duration::from_millis(200));
        let mut c = Session::new(dial(addr, t).unwrap(), Role::Client, t);
        let e = c.setup(Mtu::Mtu1024).unwrap_err();
        assert!(e.to_string().contains("MTU"), "{e}");
        // perftest: a silent peer times out.
        let addr = fake_peer(Vec::new(), Duration::from_secs(2));
        let mut c = Session::new(dial(addr, t).unwrap(), Role::Client, t);
        let t0 = std::time::Instant::now();
        let e = c.setup(Mtu::Mtu1024).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(2));
        // rc_pingpong: a truncated reply, then a wrong closing word.
        let local = Dest {
            lid: 0,
            qpn: 5,
            psn: 6,
            gid: gid(),
        };
        let addr = fake_peer(local.encode().unwrap()[..30].to_vec(), Duration::ZERO);
        let mut s = dial(addr, t).unwrap();
        let e = rc_pingpong::client_exchange(&mut s, &local, t).unwrap_err();
        assert!(e.to_string().contains("30 of 52"), "{e}");
        let l = Listener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let client = std::thread::spawn(move || {
            let mut s = dial(addr, t).unwrap();
            s.write_all(&local.encode().unwrap()).unwrap();
            let mut reply = [0u8; 52];
            std::io::Read::read_exact(&mut s, &mut reply).unwrap();
            s.write_all(b"nope\0").unwrap();
        });
        let (mut s, _) = l.accept(t).unwrap();
        let mut armed = false;
        let e = rc_pingpong::server_exchange(&mut s, &local, t, |d| {
            armed = d.qpn == 5;
            Ok(())
        })
        .unwrap_err();
        assert!(armed);
        assert!(e.to_string().contains("done"), "{e}");
        client.join().unwrap();
    }
}

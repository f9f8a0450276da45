//! Connecting queue pairs out of band.
//!
//! **To connect in one call**, sync or async, with a connection that notices a dead peer and
//! flushes the queue pair's outstanding requests (receives included): [`cm::connect`] /
//! [`cm::Listener::accept`] (with the `tokio` feature, `cm::connect_async` /
//! `cm::Listener::accept_async`). What follows is the hand-made way underneath, for full
//! control: it keeps no watch on the peer.
//!
//! Owns the project's own exchange format ([`PeerInfo`], versioned and length-checked) and the
//! TCP exchange that carries it ([`exchange`], [`Listener`], [`dial`]), with bounded waits: a peer
//! that sends garbage, stops half-way or never answers gives a clear [`Error`] in bounded time.
//!
//! Format (all integers big-endian):
//!
//! ```text
//! header  "ERDM" | version u16 (=1) | flags u16 (=0) | body length u32 (≤ 1 MiB)
//! body    endpoint count u16 | region count u16 | user data length u32
//!         endpoints: qp_num u32 | psn u32 | gid [16] | lid u16 | mtu enum u8 | reserved u8
//!         regions:   addr u64 | len u64 | rkey u32
//!         user data
//! ```
//!
//! The body length must equal exactly what the counts imply; QPNs and PSNs must fit 24 bits and
//! MTUs must be valid, or the message is refused.

#![allow(unsafe_code)] // socket option syscalls

pub mod compat;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::mr::RemoteMr;
use crate::qp::QpEndpoint;
use crate::vocab::{Gid, Mtu};

pub mod cm;

/// The format's magic bytes.
pub const MAGIC: [u8; 4] = *b"ERDM";
/// The format version this SDK speaks.
pub const VERSION: u16 = 1;
/// Largest body accepted.
pub const MAX_BODY: usize = 1 << 20;
const HEADER_LEN: usize = 12;
const ENDPOINT_LEN: usize = 28;
const REGION_LEN: usize = 20;

/// What one side tells the other: its queue pairs, the memory it grants, and opaque
/// application data.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PeerInfo {
    /// Queue pairs to connect to, in order.
    pub endpoints: Vec<QpEndpoint>,
    /// Memory the peer may reach.
    pub regions: Vec<RemoteMr>,
    /// Anything else the application wants to say.
    pub user: Vec<u8>,
}

impl PeerInfo {
    /// Serialises to the wire format.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the message would exceed the format's limits.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let body_len = 8
            + self.endpoints.len() * ENDPOINT_LEN
            + self.regions.len() * REGION_LEN
            + self.user.len();
        if body_len > MAX_BODY
            || self.endpoints.len() > u16::MAX as usize
            || self.regions.len() > u16::MAX as usize
        {
            return Err(Error::invalid(format!(
                "connection info of {body_len} bytes exceeds the {MAX_BODY}-byte limit"
            )));
        }
        let mut out = Vec::with_capacity(HEADER_LEN + body_len);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_be_bytes());
        out.extend_from_slice(&0u16.to_be_bytes());
        out.extend_from_slice(&(body_len as u32).to_be_bytes());
        out.extend_from_slice(&(self.endpoints.len() as u16).to_be_bytes());
        out.extend_from_slice(&(self.regions.len() as u16).to_be_bytes());
        out.extend_from_slice(&(self.user.len() as u32).to_be_bytes());
        for e in &self.endpoints {
            if e.qp_num > 0xff_ffff || e.psn > 0xff_ffff {
                return Err(Error::invalid("QPN and PSN must fit 24 bits"));
            }
            out.extend_from_slice(&e.qp_num.to_be_bytes());
            out.extend_from_slice(&e.psn.to_be_bytes());
            out.extend_from_slice(&e.gid.0);
            out.extend_from_slice(&e.lid.to_be_bytes());
            out.push(e.mtu.as_enum() as u8);
            out.push(0);
        }
        for r in &self.regions {
            out.extend_from_slice(&r.addr.to_be_bytes());
            out.extend_from_slice(&r.len.to_be_bytes());
            out.extend_from_slice(&r.rkey.to_be_bytes());
        }
        out.extend_from_slice(&self.user);
        Ok(out)
    }

    /// Checks a header and returns the body length it announces.
    ///
    /// # Errors
    /// [`Error::Protocol`] for a wrong magic, version or length.
    pub fn body_len(header: &[u8; HEADER_LEN]) -> Result<usize> {
        if header[..4] != MAGIC {
            return Err(Error::protocol(format!(
                "peer is not speaking the erdma connection format (first bytes {:02x?})",
                &header[..4]
            )));
        }
        let version = u16::from_be_bytes([header[4], header[5]]);
        if version != VERSION {
            return Err(Error::protocol(format!(
                "peer speaks connection format version {version}, this side speaks {VERSION}"
            )));
        }
        let flags = u16::from_be_bytes([header[6], header[7]]);
        if flags != 0 {
            return Err(Error::protocol(format!(
                "peer set header flags {flags:#06x}; version {VERSION} defines none"
            )));
        }
        let len = u32::from_be_bytes([header[8], header[9], header[10], header[11]]) as usize;
        if !(8..=MAX_BODY).contains(&len) {
            return Err(Error::protocol(format!(
                "peer announced a {len}-byte message (allowed: 8..={MAX_BODY})"
            )));
        }
        Ok(len)
    }

    /// Parses a body (what follows the header).
    ///
    /// # Errors
    /// [`Error::Protocol`] naming what is malformed.
    pub fn decode_body(body: &[u8]) -> Result<PeerInfo> {
        let short = || Error::protocol("connection info is truncated");
        if body.len() < 8 {
            return Err(short());
        }
        let ne = u16::from_be_bytes([body[0], body[1]]) as usize;
        let nr = u16::from_be_bytes([body[2], body[3]]) as usize;
        let nu = u32::from_be_bytes([body[4], body[5], body[6], body[7]]) as usize;
        let expect = 8 + ne * ENDPOINT_LEN + nr * REGION_LEN + nu;
        if expect != body.len() {
            return Err(Error::protocol(format!(
                "connection info length {} does not match its contents ({ne} endpoints, {nr} \
                 regions, {nu} user bytes make {expect})",
                body.len()
            )));
        }
        let mut at = 8;
        let mut endpoints = Vec::with_capacity(ne);
        for i in 0..ne {
            let b = &body[at..at + ENDPOINT_LEN];
            let qp_num = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
            let psn = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
            if qp_num > 0xff_ffff || psn > 0xff_ffff {
                return Err(Error::protocol(format!(
                    "endpoint {i}: QPN {qp_num:#x} or PSN {psn:#x} does not fit 24 bits"
                )));
            }
            let mut gid = [0u8; 16];
            gid.copy_from_slice(&b[8..24]);
            let lid = u16::from_be_bytes([b[24], b[25]]);
            let mtu = Mtu::from_enum(b[26] as u32).ok_or_else(|| {
                Error::protocol(format!("endpoint {i}: MTU code {} is not 1..=5", b[26]))
            })?;
            endpoints.push(QpEndpoint {
                qp_num,
                psn,
                gid: Gid(gid),
                lid,
                mtu,
            });
            at += ENDPOINT_LEN;
        }
        let mut regions = Vec::with_capacity(nr);
        for _ in 0..nr {
            let b = &body[at..at + REGION_LEN];
            regions.push(RemoteMr {
                addr: u64::from_be_bytes(b[0..8].try_into().map_err(|_| short())?),
                len: u64::from_be_bytes(b[8..16].try_into().map_err(|_| short())?),
                rkey: u32::from_be_bytes(b[16..20].try_into().map_err(|_| short())?),
            });
            at += REGION_LEN;
        }
        Ok(PeerInfo {
            endpoints,
            regions,
            user: body[at..].to_vec(),
        })
    }

    /// Parses a whole message (header and body).
    ///
    /// # Errors
    /// [`Error::Protocol`] naming what is malformed.
    pub fn decode(msg: &[u8]) -> Result<PeerInfo> {
        let header: &[u8; HEADER_LEN] = msg
            .get(..HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or_else(|| Error::protocol("connection info is shorter than its header"))?;
        let len = PeerInfo::body_len(header)?;
        if msg.len() != HEADER_LEN + len {
            return Err(Error::protocol(format!(
                "connection info is {} bytes, its header says {}",
                msg.len(),
                HEADER_LEN + len
            )));
        }
        PeerInfo::decode_body(&msg[HEADER_LEN..])
    }
}

/// Reads exactly `buf.len()` bytes before `deadline`, naming `what` in errors.
///
/// # Errors
/// [`Error::Timeout`] past the deadline, [`Error::Protocol`] when the peer closes early,
/// [`Error::Io`] for other failures.
pub fn read_exact_by(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    let len = buf.len();
    transfer_by(stream, len, deadline, what, Way::Read, |s, at| {
        s.read(&mut buf[at..])
    })
}

/// Writes all of `buf` before `deadline`.
///
/// The deadline bounds the whole message, not each `write`: a socket timeout applies to one
/// call, so a peer that reads a little now and then would otherwise stretch a message's time
/// without bound. Every call gets what is left.
///
/// # Errors
/// [`Error::Timeout`] past the deadline, [`Error::Protocol`] when the peer closes the
/// connection, [`Error::Io`] for other failures.
pub fn write_all_by(
    stream: &mut TcpStream,
    buf: &[u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    transfer_by(stream, buf.len(), deadline, what, Way::Write, |s, at| {
        s.write(&buf[at..])
    })
}

/// Which way a deadline-bounded transfer goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    Read,
    Write,
}

/// Moves `len` bytes with `step` (given the stream and how many moved so far; it returns how
/// many more it moved) before `deadline`: each call gets what is left of the deadline as its
/// socket timeout, so the deadline bounds the whole transfer.
fn transfer_by(
    stream: &mut TcpStream,
    len: usize,
    deadline: Instant,
    what: &str,
    way: Way,
    mut step: impl FnMut(&mut TcpStream, usize) -> std::io::Result<usize>,
) -> Result<()> {
    let reading = way == Way::Read;
    let progress = |done: usize| {
        let verb = if reading { "came" } else { "went" };
        format!("{done} of {len} bytes {verb}")
    };
    let mut done = 0;
    while done < len {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let what = if reading {
                format!("{what} from the peer ({})", progress(done))
            } else {
                format!("sending {what} ({})", progress(done))
            };
            return Err(Error::Timeout { what });
        }
        let timeout = Some(left.max(Duration::from_millis(1)));
        if reading {
            stream.set_read_timeout(timeout)
        } else {
            stream.set_write_timeout(timeout)
        }
        .map_err(|e| Error::io("setting a socket timeout", e))?;
        match step(stream, done) {
            Ok(0) => {
                return Err(Error::protocol(if reading {
                    format!(
                        "peer closed the connection during {what} ({})",
                        progress(done)
                    )
                } else {
                    format!("peer stopped taking {what} ({})", progress(done))
                }));
            }
            Ok(n) => done += n,
            Err(e) if is_retry(&e) => {}
            Err(e) if is_disconnect(&e) => {
                return Err(Error::protocol(if reading {
                    format!(
                        "peer reset the connection during {what} ({})",
                        progress(done)
                    )
                } else {
                    format!(
                        "peer closed the connection while we sent {what} ({})",
                        progress(done)
                    )
                }));
            }
            Err(e) => {
                let op = if reading { "reading" } else { "sending" };
                return Err(Error::io(format!("{op} {what}"), e));
            }
        }
    }
    Ok(())
}

/// An error after which the same call may simply be made again (a timeout that left time, an
/// interruption).
pub(crate) fn is_retry(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock
            | std::io::ErrorKind::TimedOut
            | std::io::ErrorKind::Interrupted
    )
}

fn is_disconnect(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::UnexpectedEof
    )
}

/// Sends `local` and receives the peer's [`PeerInfo`] over a connected stream (both sides call
/// this; each writes first, so neither waits on the other).
///
/// # Errors
/// [`Error::Protocol`] for a malformed or incompatible message, [`Error::Timeout`] past
/// `timeout`, [`Error::Io`].
pub fn exchange(stream: &mut TcpStream, local: &PeerInfo, timeout: Duration) -> Result<PeerInfo> {
    let deadline = crate::sync::deadline(timeout);
    let msg = local.encode()?;
    write_all_by(stream, &msg, deadline, "connection info")?;
    let mut header = [0u8; HEADER_LEN];
    read_exact_by(stream, &mut header, deadline, "the connection info header")?;
    let len = PeerInfo::body_len(&header)?;
    let mut body = vec![0u8; len];
    read_exact_by(stream, &mut body, deadline, "the connection info")?;
    PeerInfo::decode_body(&body)
}

/// A listening socket for out-of-band exchanges.
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
}

/// A socket the caller bound and listens on.
impl From<TcpListener> for Listener {
    fn from(inner: TcpListener) -> Listener {
        Listener { inner }
    }
}

impl std::os::fd::AsRawFd for Listener {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.inner.as_raw_fd()
    }
}

impl Listener {
    /// Listens on `addr` (e.g. `0.0.0.0:18515`; port 0 picks one).
    ///
    /// # Errors
    /// [`Error::Io`] naming the address.
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Listener> {
        let inner =
            TcpListener::bind(&addr).map_err(|e| Error::io(format!("listening on {addr:?}"), e))?;
        Ok(Listener { inner })
    }

    /// The bound address.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.inner
            .local_addr()
            .map_err(|e| Error::io("reading the listening address", e))
    }

    /// A descriptor of its own for the same socket (close-on-exec).
    pub(crate) fn try_clone_fd(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::AsFd;
        self.inner.as_fd().try_clone_to_owned()
    }

    /// Stops listening, for every descriptor of the socket: connections still queued are
    /// reset, and later ones are refused, while the descriptors stay open until dropped.
    pub(crate) fn stop_listening(&self) {
        // SAFETY: shutdown(2) on our own open socket; it changes the socket's state only.
        unsafe {
            libc::shutdown(
                std::os::fd::AsRawFd::as_raw_fd(&self.inner),
                libc::SHUT_RDWR,
            )
        };
    }

    /// Waits up to `timeout` for one peer.
    ///
    /// # Errors
    /// [`Error::Timeout`] when nobody connects in time, [`Error::Io`].
    pub fn accept(&self, timeout: Duration) -> Result<(TcpStream, SocketAddr)> {
        let deadline = crate::sync::deadline(timeout);
        self.inner
            .set_nonblocking(true)
            .map_err(|e| Error::io("configuring the listener", e))?;
        loop {
            match self.inner.accept() {
                Ok((s, a)) => {
                    s.set_nonblocking(false)
                        .map_err(|e| Error::io("configuring a connection", e))?;
                    let _ = s.set_nodelay(true);
                    return Ok((s, a));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(Error::Timeout {
                            what: format!(
                                "a peer to connect to {}",
                                self.local_addr().map(|a| a.to_string()).unwrap_or_default()
                            ),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(Error::io("accepting a connection", e)),
            }
        }
    }
}

/// Connects to a listening peer, retrying until `timeout` (the peer may not be up yet).
///
/// # Errors
/// [`Error::Timeout`] naming the address when no connection could be made.
pub fn dial(addr: impl ToSocketAddrs + std::fmt::Debug, timeout: Duration) -> Result<TcpStream> {
    let deadline = crate::sync::deadline(timeout);
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| Error::io(format!("resolving {addr:?}"), e))?
        .collect();
    if addrs.is_empty() {
        return Err(Error::invalid(format!("{addr:?} resolves to no address")));
    }
    let mut last = None;
    loop {
        for a in &addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            // An attempt is never cut short on a timer of its own while the deadline allows
            // more: the kernel retransmits a lost SYN itself, and a socket given up on just as
            // its handshake completes is a connection the listener has queued — the server
            // accepts it, reads its close, and fails, while the attempt that replaced it sits
            // unaccepted. Several addresses share what is left; only a refusal (no listener
            // yet) goes round again.
            let attempt = (left / addrs.len() as u32).max(Duration::from_millis(10));
            match TcpStream::connect_timeout(a, attempt) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                what: format!(
                    "a connection to {addr:?} (last error: {})",
                    last.map(|e| e.to_string()).unwrap_or_default()
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PeerInfo {
        PeerInfo {
            endpoints: vec![
                QpEndpoint {
                    qp_num: 0x11,
                    psn: 0xabcdef,
                    gid: "::ffff:10.0.0.1".parse().unwrap(),
                    lid: 0,
                    mtu: Mtu::Mtu4096,
                },
                QpEndpoint {
                    qp_num: 0x12,
                    psn: 1,
                    gid: "::ffff:10.0.0.1".parse().unwrap(),
                    lid: 7,
                    mtu: Mtu::Mtu1024,
                },
            ],
            regions: vec![RemoteMr {
                addr: 0x7f00_0000_1000,
                len: 1 << 20,
                rkey: 0x1234,
            }],
            user: b"rank 3".to_vec(),
        }
    }

    #[test]
    fn round_trip() {
        let info = sample();
        let bytes = info.encode().unwrap();
        assert_eq!(&bytes[..4], b"ERDM");
        assert_eq!(PeerInfo::decode(&bytes).unwrap(), info);
        assert_eq!(
            PeerInfo::decode(&PeerInfo::default().encode().unwrap()).unwrap(),
            PeerInfo::default()
        );
    }

    #[test]
    fn malformed_messages_are_refused_with_reasons() {
        let good = sample().encode().unwrap();
        let msg = |e: Error| e.to_string();
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(msg(PeerInfo::decode(&bad).unwrap_err()).contains("not speaking"));
        let mut bad = good.clone();
        bad[5] = 9;
        assert!(msg(PeerInfo::decode(&bad).unwrap_err()).contains("version 9"));
        let mut bad = good.clone();
        bad[7] = 1;
        assert!(msg(PeerInfo::decode(&bad).unwrap_err()).contains("flags 0x0001"));
        for cut in [0, 5, 11, 12, 20, good.len() - 1] {
            assert!(PeerInfo::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = good.clone();
        bad.push(0);
        assert!(PeerInfo::decode(&bad).is_err(), "trailing byte");
        // Counts that disagree with the length.
        let mut bad = good.clone();
        bad[12 + 1] = 3;
        assert!(msg(PeerInfo::decode(&bad).unwrap_err()).contains("does not match"));
        // A QPN beyond 24 bits, an MTU code out of range.
        let mut bad = good.clone();
        bad[12 + 8] = 1;
        assert!(msg(PeerInfo::decode(&bad).unwrap_err()).contains("24 bits"));
        let mut bad = good.clone();
        bad[12 + 8 + 26] = 9;
        assert!(msg(PeerInfo::decode(&bad).unwrap_err()).contains("MTU code 9"));
        // An absurd announced length.
        let mut bad = good;
        bad[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(msg(PeerInfo::decode(&bad).unwrap_err()).contains("announced"));
    }

    #[test]
    fn exchange_over_tcp_and_bounded_failures() {
        let l = Listener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept(Duration::from_secs(5)).unwrap();
            exchange(&mut s, &sample(), Duration::from_secs(5)).unwrap()
        });
        let mut c = dial(addr, Duration::from_secs(5)).unwrap();
        let mine = PeerInfo {
            user: b"client".to_vec(),
            ..PeerInfo::default()
        };
        assert_eq!(
            exchange(&mut c, &mine, Duration::from_secs(5)).unwrap(),
            sample()
        );
        assert_eq!(server.join().unwrap(), mine);

        // A peer that connects and then says nothing: a timeout, in bounded time.
        let l = Listener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let silent = std::thread::spawn(move || {
            let (s, _) = l.accept(Duration::from_secs(5)).unwrap();
            std::thread::sleep(Duration::from_millis(600));
            drop(s);
        });
        let mut c = dial(addr, Duration::from_secs(5)).unwrap();
        let t0 = Instant::now();
        let e = exchange(&mut c, &mine, Duration::from_millis(300)).unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(3));
        silent.join().unwrap();

        // A peer that disconnects mid-message.
        let l = Listener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let rude = std::thread::spawn(move || {
            let (mut s, _) = l.accept(Duration::from_secs(5)).unwrap();
            let half = sample().encode().unwrap();
            s.write_all(&half[..20]).unwrap();
        });
        let mut c = dial(addr, Duration::from_secs(5)).unwrap();
        let e = exchange(&mut c, &mine, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, Error::Protocol { .. }), "{e}");
        rude.join().unwrap();

        // Nobody listening: a timeout naming the address.
        let e = dial("127.0.0.1:1", Duration::from_millis(200)).unwrap_err();
        assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
    }

    /// A peer that takes a little now and then cannot stretch a message past its deadline: the
    /// deadline bounds the whole write, not each system call (each of which a trickle of reads
    /// keeps making progress).
    #[test]
    fn a_trickling_reader_cannot_stretch_a_write_past_its_deadline() {
        let l = Listener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = done.clone();
        let trickle = std::thread::spawn(move || {
            let (mut s, _) = l.accept(Duration::from_secs(5)).unwrap();
            let mut buf = [0u8; 4096];
            let mut took = 0usize;
            // Until the writer has given up: 4 KiB every 20 ms.
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && let Ok(n @ 1..) = s.read(&mut buf)
            {
                took += n;
                std::thread::sleep(Duration::from_millis(20));
            }
            took
        });
        let mut c = dial(addr, Duration::from_secs(5)).unwrap();
        // Far more than any socket buffers hold, so the write depends on the reader.
        let big = vec![0x5au8; 64 << 20];
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let r = write_all_by(
                &mut c,
                &big,
                t0 + Duration::from_millis(500),
                "a big message",
            );
            let _ = tx.send((r, t0.elapsed()));
        });
        let (r, took) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the write outlived its 500 ms deadline by 20 s");
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("a big message"), "{e}");
        assert!(took < Duration::from_secs(5), "the write took {took:?}");
        let took_bytes = trickle.join().unwrap();
        assert!(
            took_bytes < 64 << 20,
            "the reader got everything ({took_bytes} bytes)"
        );
    }
}

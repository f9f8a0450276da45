//! A connection's out-of-band TCP link, used without ever blocking: first for the exchange
//! (one [`PeerInfo`] frame each way, the SDK's versioned format), then as the connection's
//! liveness channel. RC gives a receiver no timeout, so a receive waiting on a dead peer would
//! wait forever; the link says when the peer is gone.
//!
//! Closing a connection sends one byte, [`BYE`], then shuts the link down for writing. A peer
//! whose link ends after a `BYE` closed in order; one whose link ends without it died.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};

use erdma::connect::{MAX_BODY, PeerInfo};

/// The byte that announces an orderly close.
pub const BYE: u8 = b'B';
const HEADER: usize = 12;

/// What the link says about the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// Connected.
    Alive,
    /// Closed in order (sent `BYE`; its link may still be open).
    Closed,
    /// Gone without closing: the reason.
    Dead(String),
}

/// A non-blocking TCP link.
#[derive(Debug)]
pub struct Link {
    stream: TcpStream,
    connecting: bool,
    out: Vec<u8>,
    out_at: usize,
    inbuf: Vec<u8>,
    bye: bool,
    eof: bool,
    peer: String,
}

impl Link {
    /// A link over an accepted stream.
    ///
    /// # Errors
    /// When the stream cannot be made non-blocking.
    pub fn accepted(stream: TcpStream, peer: SocketAddr) -> std::io::Result<Link> {
        stream.set_nonblocking(true)?;
        let _ = stream.set_nodelay(true);
        crate::sys::keepalive(&stream);
        Ok(Link::new(stream, false, peer))
    }

    /// Starts connecting to `addr`.
    ///
    /// # Errors
    /// When the connection fails at once.
    pub fn connect(addr: SocketAddr) -> std::io::Result<Link> {
        let stream = crate::sys::connect_start(addr)?;
        Ok(Link::new(stream, true, addr))
    }

    fn new(stream: TcpStream, connecting: bool, peer: SocketAddr) -> Link {
        Link {
            stream,
            connecting,
            out: Vec::new(),
            out_at: 0,
            inbuf: Vec::new(),
            bye: false,
            eof: false,
            peer: peer.to_string(),
        }
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Queues a frame for sending.
    ///
    /// # Errors
    /// When the information does not fit the format.
    pub fn queue(&mut self, info: &PeerInfo) -> Result<(), String> {
        let bytes = info.encode().map_err(|e| e.to_string())?;
        self.out.extend_from_slice(&bytes);
        Ok(())
    }

    /// Moves what it can: finishes connecting, writes queued bytes, reads what arrived.
    ///
    /// # Errors
    /// A message when the connection failed or broke.
    pub fn pump(&mut self) -> Result<(), String> {
        if self.connecting {
            match crate::sys::connect_finished(&self.stream) {
                Ok(true) => {
                    self.connecting = false;
                    let _ = self.stream.set_nodelay(true);
                    crate::sys::keepalive(&self.stream);
                }
                Ok(false) => return Ok(()),
                Err(e) => return Err(format!("connecting to {}: {e}", self.peer)),
            }
        }
        while self.out_at < self.out.len() {
            match self.stream.write(&self.out[self.out_at..]) {
                Ok(0) => return Err(format!("{} stopped taking data", self.peer)),
                Ok(n) => self.out_at += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("sending to {}: {e}", self.peer)),
            }
        }
        if self.out_at == self.out.len() {
            self.out.clear();
            self.out_at = 0;
        }
        self.read_available()
    }

    fn read_available(&mut self) -> Result<(), String> {
        let mut buf = [0u8; 4096];
        while !self.eof {
            match self.stream.read(&mut buf) {
                Ok(0) => self.eof = true,
                Ok(n) => self.inbuf.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("reading from {}: {e}", self.peer)),
            }
            if self.inbuf.len() > HEADER + MAX_BODY {
                return Err(format!("{} sent more than one exchange message", self.peer));
            }
        }
        Ok(())
    }

    /// Whether everything queued has been written.
    pub fn flushed(&self) -> bool {
        !self.connecting && self.out.is_empty()
    }

    /// The peer's frame, once it has arrived whole.
    ///
    /// # Errors
    /// A message when the peer sent something else, or closed first.
    pub fn take_frame(&mut self) -> Result<Option<PeerInfo>, String> {
        if self.inbuf.len() >= HEADER {
            let mut header = [0u8; HEADER];
            header.copy_from_slice(&self.inbuf[..HEADER]);
            let len = PeerInfo::body_len(&header)
                .map_err(|e| format!("{} sent a malformed exchange message: {e}", self.peer))?;
            if self.inbuf.len() >= HEADER + len {
                let info = PeerInfo::decode_body(&self.inbuf[HEADER..HEADER + len])
                    .map_err(|e| format!("{} sent a malformed exchange message: {e}", self.peer))?;
                self.inbuf.drain(..HEADER + len);
                return Ok(Some(info));
            }
        }
        if self.eof {
            return Err(format!(
                "{} closed the connection during the exchange ({} bytes of its message came)",
                self.peer,
                self.inbuf.len()
            ));
        }
        Ok(None)
    }

    /// Reads what the peer sent since and says whether it is still there.
    pub fn check(&mut self) -> Peer {
        if let Err(e) = self.read_available() {
            return if self.bye {
                Peer::Closed
            } else {
                Peer::Dead(e)
            };
        }
        for b in self.inbuf.drain(..) {
            if b == BYE {
                self.bye = true;
            } else {
                return Peer::Dead(format!(
                    "{} sent an unexpected byte {b:#04x} on the connection's link",
                    self.peer
                ));
            }
        }
        if self.bye {
            Peer::Closed
        } else if self.eof {
            Peer::Dead(format!(
                "{} closed the connection's link without closing the connection: the peer \
                 process exited or was killed",
                self.peer
            ))
        } else {
            Peer::Alive
        }
    }

    /// Whether the peer's side of the link has ended (after its `BYE` or not).
    pub fn peer_finished(&mut self) -> bool {
        let _ = self.check();
        self.eof
    }

    /// Closes this side in order: `BYE`, then no more writes.
    pub fn close(&mut self) {
        let _ = self.stream.write(&[BYE]);
        let _ = self.stream.shutdown(Shutdown::Write);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    fn pair() -> (Link, Link) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = Link::connect(l.local_addr().unwrap()).unwrap();
        let (s, peer) = l.accept().unwrap();
        let b = Link::accepted(s, peer).unwrap();
        let t = Instant::now();
        while a.connecting {
            a.pump().unwrap();
            assert!(t.elapsed() < Duration::from_secs(5));
        }
        (a, b)
    }

    fn until<T>(mut f: impl FnMut() -> Option<T>) -> T {
        let t = Instant::now();
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(t.elapsed() < Duration::from_secs(5), "timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn frames_cross_and_close_in_order() {
        let (mut a, mut b) = pair();
        let info = PeerInfo {
            user: b"hello".to_vec(),
            ..PeerInfo::default()
        };
        a.queue(&info).unwrap();
        let got = until(|| {
            a.pump().unwrap();
            b.pump().unwrap();
            b.take_frame().unwrap()
        });
        assert_eq!(got, info);
        assert!(a.flushed());
        assert_eq!(a.check(), Peer::Alive);
        b.close();
        until(|| (a.check() == Peer::Closed).then_some(()));
        assert!(until(|| a.peer_finished().then_some(true)));
    }

    #[test]
    fn a_vanished_peer_is_dead_and_garbage_is_refused() {
        let (mut a, b) = pair();
        drop(b);
        let why = until(|| match a.check() {
            Peer::Dead(w) => Some(w),
            _ => None,
        });
        assert!(why.contains("exited or was killed"), "{why}");
        let (mut a, mut b) = pair();
        b.stream.write_all(b"NOPE-this-is-not-a-frame").unwrap();
        let e = until(|| {
            a.pump().unwrap();
            a.take_frame().err()
        });
        assert!(e.contains("malformed"), "{e}");
        b.stream.write_all(b"x").unwrap();
        let _ = b.pump();
    }
}

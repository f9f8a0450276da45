//! The soft device's path: the project's TCP exchange carries a full [`PeerInfo`] (with the
//! queue pair's endpoint), then each side says "ready" once its queue pair is in RTS; the TCP
//! connection stays open as the connection's lifeline. This is the soft rdma_cm exchange of
//! `docs/SOFT-CM.md`, which the drop-in librdmacm (`erdma-rdmacm`) speaks too: change both, and
//! the format's version, together.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::Instant;

use super::{Connection, Link, Options, Setup, remaining};
use crate::connect::{self, PeerInfo};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::qp::{ConnectOptions, InitOptions};

fn soft_device(options_device: Option<String>, ip: IpAddr) -> Result<String> {
    if let Some(d) = options_device {
        return Ok(d);
    }
    match ip {
        IpAddr::V4(v4) => Ok(format!("soft:{v4}")),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => Ok(format!("soft:{v4}")),
            None => Err(Error::invalid(format!(
                "the soft device needs an IPv4 address, and this connection's local address is \
                 {v6}"
            ))),
        },
    }
}

pub(super) fn soft_connect<T>(
    dst: SocketAddr,
    deadline: Instant,
    options: &Options,
    device: Option<String>,
    setup: impl FnOnce(&Context) -> Result<Setup<T>>,
) -> Result<Connection<T>> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Error::Timeout {
            what: format!("a TCP connection to {dst}"),
        });
    }
    let mut stream = TcpStream::connect_timeout(&dst, left).map_err(|e| tcp_error(dst, e))?;
    let _ = stream.set_nodelay(true);
    let local = stream.local_addr().ok();
    let source = options
        .source
        .or(local.map(|a| a.ip()))
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let ctx = Context::open_with(&soft_device(device, source)?, options.open_options())?;
    let mut s = setup(&ctx)?;
    let qp = s.pd.create_qp(&s.config)?.init(&InitOptions {
        access: s.access,
        ..InitOptions::default()
    })?;
    s.run_on_init(&qp)?;
    let mut info = s.info();
    info.endpoints.push(qp.endpoint()?);
    let mut peer = connect::exchange(&mut stream, &info, remaining(deadline))?;
    let Some(remote) = peer.endpoints.first().copied() else {
        return Err(Error::Refused {
            peer: dst.to_string(),
            reason: format!(
                "the peer rejected the connection: {}",
                String::from_utf8_lossy(&peer.user)
            ),
        });
    };
    let qp = qp.connect(&remote, &ConnectOptions::default())?;
    ready_handshake(&mut stream, deadline)?;
    peer.endpoints.clear();
    Connection::start(
        qp,
        peer,
        s.app,
        Link::Soft(Mutex::new(stream)),
        local,
        dst,
        options,
    )
}

pub(super) fn soft_accept<T>(
    listener: &connect::Listener,
    deadline: Instant,
    options: &Options,
    setup: impl FnOnce(&Context) -> Result<Setup<T>>,
) -> Result<Connection<T>> {
    let (mut stream, remote) = listener.accept(remaining(deadline))?;
    let local = stream.local_addr().ok();
    let attempt = (|| -> Result<_> {
        let ip = local
            .map(|a| a.ip())
            .ok_or_else(|| Error::protocol("the accepted connection has no local address"))?;
        let ctx = Context::open_with(
            &soft_device(options.device.clone(), ip)?,
            options.open_options(),
        )?;
        let mut s = setup(&ctx)?;
        let qp = s.pd.create_qp(&s.config)?.init(&InitOptions {
            access: s.access,
            ..InitOptions::default()
        })?;
        s.run_on_init(&qp)?;
        Ok((s, qp))
    })();
    let (s, qp) = match attempt {
        Ok(v) => v,
        Err(e) => {
            // A refusal: no endpoint, the reason as user data. Best effort; the error stands.
            let refusal = PeerInfo {
                user: e.to_string().into_bytes(),
                ..PeerInfo::default()
            };
            if let Ok(bytes) = refusal.encode() {
                let _ = connect::write_all_by(&mut stream, &bytes, deadline, "a refusal");
            }
            return Err(e);
        }
    };
    let mut info = s.info();
    info.endpoints.push(qp.endpoint()?);
    let mut peer = connect::exchange(&mut stream, &info, remaining(deadline))?;
    let Some(endpoint) = peer.endpoints.first().copied() else {
        return Err(Error::protocol(format!(
            "{remote} sent no queue pair to connect to"
        )));
    };
    let qp = qp.connect(&endpoint, &ConnectOptions::default())?;
    ready_handshake(&mut stream, deadline)?;
    peer.endpoints.clear();
    Connection::start(
        qp,
        peer,
        s.app,
        Link::Soft(Mutex::new(stream)),
        local,
        remote,
        options,
    )
}

/// Both sides say "ready" once their queue pair is in RTS, so neither returns (and sends) before
/// the other can receive.
fn ready_handshake(stream: &mut TcpStream, deadline: Instant) -> Result<()> {
    connect::write_all_by(stream, b"R", deadline, "the ready mark")?;
    let mut b = [0u8; 1];
    connect::read_exact_by(stream, &mut b, deadline, "the peer's ready mark")?;
    if b[0] != b'R' {
        return Err(Error::protocol(format!(
            "the peer sent {:#04x} where its ready mark belongs",
            b[0]
        )));
    }
    Ok(())
}

fn tcp_error(dst: SocketAddr, e: std::io::Error) -> Error {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::ConnectionRefused => Error::Refused {
            peer: dst.to_string(),
            reason: "nobody is listening there (TCP connection refused)".into(),
        },
        K::NetworkUnreachable | K::HostUnreachable | K::AddrNotAvailable | K::NetworkDown => {
            Error::Unreachable {
                peer: dst.to_string(),
                detail: e.to_string(),
            }
        }
        K::TimedOut | K::WouldBlock => Error::Timeout {
            what: format!("a TCP connection to {dst}"),
        },
        _ => Error::io(format!("connecting to {dst}"), e),
    }
}

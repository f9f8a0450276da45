//! The TCP side of a connection: the soft rdma_cm exchange (`docs/soft-cm.md`), the same as the
//! SDK's `erdma::connect::cm` speaks on a soft device.
//!
//! 1. The active side connects from its device's address to the listener's address and port
//!    and sends a `PeerInfo` (the SDK's versioned connection format): its queue pair's endpoint
//!    and, as the user data, the private data of `rdma_connect`.
//! 2. The passive side answers `rdma_accept` with its own `PeerInfo` (endpoint and private data),
//!    or `rdma_reject` with one that has no endpoint (the private data as the user data).
//! 3. Each side sends the ready mark `R` once its queue pair is in RTS; the other's mark is
//!    ESTABLISHED.
//! 4. The connection stays open as the connection's lifeline: a heartbeat byte `H` every
//!    500 ms each way; its end (close, reset, or 5 s of silence) is DISCONNECTED.
//!    `rdma_disconnect` shuts down this side's writing; the peer answers by closing.
//!
//! One thread per listener and per connection; none touches an identifier the program has
//! destroyed, or posts an event for it.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::raw::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use erdma::connect::PeerInfo;
use erdma::connect::cm::{DEFAULT_HEARTBEAT, DEFAULT_PEER_TIMEOUT};
use erdma_sys as sys;

use crate::channel::Event;
use crate::device;
use crate::id::{Id, Phase, move_qp, sockaddr_in};
use crate::last_errno;

/// How long a passive side waits for a request's bytes.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an active side waits for the TCP connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an active side waits for the answer (the program on the other side decides).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an active side retries a refused connection (nobody listening yet).
const REFUSED_GRACE: Duration = Duration::from_secs(1);
/// How long a disconnecting side waits for the peer to close its end.
const DISCONNECT_GRACE: Duration = Duration::from_secs(1);

/// Private data sizes of a RoCE connection (`IB_CM_*_PRIVATE_DATA_SIZE` less rdma_cm's header
/// for a request): what events carry, zero-padded, and the most a call may send.
pub(crate) const CONNECT_PRIVATE: usize = 56;
pub(crate) const ACCEPT_PRIVATE: usize = 196;
pub(crate) const REJECT_PRIVATE: usize = 148;

/// `IB_CM_REJ_CONSUMER_DEFINED` and `IB_CM_REJ_INVALID_SERVICE_ID`: a REJECTED event's status
/// for a rejection by the program, and for nobody listening at the port.
const REJ_CONSUMER: c_int = 28;
const REJ_NO_LISTENER: c_int = 8;

fn errno_of(e: &std::io::Error) -> c_int {
    e.raw_os_error().unwrap_or(libc::EIO)
}

fn v4(a: std::io::Result<SocketAddr>) -> Option<SocketAddrV4> {
    match a {
        Ok(SocketAddr::V4(a)) => Some(a),
        _ => None,
    }
}

/// A TCP socket bound to `addr` (SO_REUSEADDR, so a port in TIME_WAIT binds again; one that
/// listens does not).
pub(crate) fn bind_tcp(addr: SocketAddrV4) -> Result<(OwnedFd, SocketAddrV4), c_int> {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(last_errno());
    }
    // SAFETY: the descriptor just made, owned here alone.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    let one: c_int = 1;
    let sa = sockaddr_in(addr);
    // SAFETY: valid option and address structs of the sizes given, on an open socket.
    let rc = unsafe {
        libc::setsockopt(
            raw,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&raw const one).cast(),
            4,
        );
        libc::bind(
            raw,
            (&raw const sa).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(last_errno());
    }
    let mut got: libc::sockaddr_in = sa;
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a sockaddr_in out-parameter with its length.
    if unsafe { libc::getsockname(raw, (&raw mut got).cast(), &mut len) } < 0 {
        return Err(last_errno());
    }
    Ok((
        fd,
        SocketAddrV4::new(*addr.ip(), u16::from_be(got.sin_port)),
    ))
}

/// Starts listening on a bound socket; its thread hands each request to the program.
pub(crate) fn listen(id: &Arc<Id>, fd: OwnedFd, backlog: c_int) -> Result<c_int, c_int> {
    let raw = std::os::fd::IntoRawFd::into_raw_fd(fd);
    // SAFETY: the bound socket, now owned by the listener made from it below.
    let listener = unsafe { TcpListener::from_raw_fd(raw) };
    // SAFETY: plain syscall on the listener's descriptor.
    if unsafe { libc::listen(raw, backlog.clamp(1, 4096)) } < 0 {
        return Err(last_errno());
    }
    let id = id.clone();
    std::thread::Builder::new()
        .name("rdmacm-listen".into())
        .spawn(move || accept_loop(&id, &listener))
        .map_err(|_| libc::EAGAIN)?;
    Ok(raw)
}

fn accept_loop(id: &Arc<Id>, listener: &TcpListener) {
    loop {
        let r = listener.accept();
        if id.lock().destroyed {
            return;
        }
        match r {
            Ok((s, peer)) => {
                let id = id.clone();
                let _ = std::thread::Builder::new()
                    .name("rdmacm-conn".into())
                    .spawn(move || passive(&id, s, peer));
            }
            Err(e) if errno_of(&e) == libc::EINVAL => return, // shut down
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Reads one `PeerInfo` before `deadline`.
fn read_info(s: &mut TcpStream, deadline: Instant) -> Result<PeerInfo, c_int> {
    let mut header = [0u8; 12];
    let map = |e: erdma::Error| match e {
        erdma::Error::Timeout { .. } => libc::ETIMEDOUT,
        erdma::Error::Protocol { .. } => libc::ECONNRESET,
        _ => libc::EIO,
    };
    erdma::connect::read_exact_by(s, &mut header, deadline, "a connection message").map_err(map)?;
    let len = PeerInfo::body_len(&header).map_err(|_| libc::EPROTO)?;
    let mut body = vec![0u8; len];
    erdma::connect::read_exact_by(s, &mut body, deadline, "a connection message").map_err(map)?;
    PeerInfo::decode_body(&body).map_err(|_| libc::EPROTO)
}

/// Writes one `PeerInfo`.
pub(crate) fn write_info(s: &TcpStream, info: &PeerInfo) -> Result<(), c_int> {
    let bytes = info.encode().map_err(|_| libc::EINVAL)?;
    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
    let mut w = s;
    w.write_all(&bytes).map_err(|e| errno_of(&e))
}

/// Writes the ready mark.
pub(crate) fn write_ready(s: &TcpStream) -> Result<(), c_int> {
    let mut w = s;
    w.write_all(b"R").map_err(|e| errno_of(&e))
}

/// Ends an identifier's connection attempt with `ev`.
fn fail(id: &Arc<Id>, ev: &Event<'_>) {
    let mut st = id.lock();
    st.phase = Phase::Over;
    if let Some(s) = st.stream.take() {
        let _ = s.shutdown(Shutdown::Both);
    }
    id.post(&st, ev);
}

/// A TCP connection from `src` (any port) to `dst`, within `timeout`.
fn tcp_connect(src: Ipv4Addr, dst: SocketAddrV4, timeout: Duration) -> Result<TcpStream, c_int> {
    let (fd, _) = bind_tcp(SocketAddrV4::new(src, 0))?;
    let raw = std::os::fd::IntoRawFd::into_raw_fd(fd);
    // SAFETY: the bound socket, now owned by the stream made from it.
    let s = unsafe { TcpStream::from_raw_fd(raw) };
    s.set_nonblocking(true).map_err(|e| errno_of(&e))?;
    let sa = sockaddr_in(dst);
    // SAFETY: a sockaddr_in of its size, on the open socket.
    let rc = unsafe {
        libc::connect(
            raw,
            (&raw const sa).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc < 0 && last_errno() != libc::EINPROGRESS {
        return Err(last_errno());
    }
    if rc < 0 {
        let mut p = libc::pollfd {
            fd: raw,
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, timeout.as_millis().min(i32::MAX as u128) as i32) };
        if n == 0 {
            return Err(libc::ETIMEDOUT);
        }
        let mut err: c_int = 0;
        let mut len = 4 as libc::socklen_t;
        // SAFETY: an int out-parameter with its length.
        unsafe {
            libc::getsockopt(
                raw,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&raw mut err).cast(),
                &mut len,
            )
        };
        if err != 0 {
            return Err(err);
        }
    }
    s.set_nonblocking(false).map_err(|e| errno_of(&e))?;
    let _ = s.set_nodelay(true);
    Ok(s)
}

/// The active side (`rdma_connect`), on a thread of its own.
pub(crate) fn spawn_active(id: Arc<Id>, dst: SocketAddrV4, src: Ipv4Addr, private: Vec<u8>) {
    let spawned = std::thread::Builder::new()
        .name("rdmacm-conn".into())
        .spawn({
            let id = id.clone();
            move || active(&id, dst, src, private)
        });
    if spawned.is_err() {
        fail(
            &id,
            &Event::plain(sys::RDMA_CM_EVENT_CONNECT_ERROR, -libc::EAGAIN),
        );
    }
}

fn active(id: &Arc<Id>, dst: SocketAddrV4, src: Ipv4Addr, private: Vec<u8>) {
    // A refusal is retried for `REFUSED_GRACE` first: a hardware CM resolves addresses and
    // routes over the network before its request leaves, which gives a peer that starts
    // listening "at the same time" (perftest's -R server after its handshake, for one) the
    // milliseconds it needs; here resolving takes none.
    let refused_until = Instant::now() + REFUSED_GRACE;
    let attempt = loop {
        match tcp_connect(src, dst, CONNECT_TIMEOUT) {
            Err(libc::ECONNREFUSED) if Instant::now() < refused_until => {
                if id.lock().destroyed {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            r => break r,
        }
    };
    let mut s = match attempt {
        Ok(s) => s,
        Err(libc::ECONNREFUSED) => {
            return fail(
                id,
                &Event::plain(sys::RDMA_CM_EVENT_REJECTED, REJ_NO_LISTENER),
            );
        }
        Err(e) => return fail(id, &Event::plain(sys::RDMA_CM_EVENT_UNREACHABLE, -e)),
    };
    let info = {
        let mut st = id.lock();
        if st.destroyed {
            return;
        }
        let Ok(w) = s.try_clone() else {
            drop(st);
            return fail(
                id,
                &Event::plain(sys::RDMA_CM_EVENT_CONNECT_ERROR, -libc::EMFILE),
            );
        };
        st.stream = Some(Arc::new(w));
        st.local = v4(s.local_addr()).or(st.local);
        id.set_addrs(&mut st);
        match id.endpoint(&st) {
            Ok(e) => PeerInfo {
                endpoints: vec![e],
                regions: Vec::new(),
                user: private,
            },
            Err(e) => {
                drop(st);
                return fail(id, &Event::plain(sys::RDMA_CM_EVENT_CONNECT_ERROR, -e));
            }
        }
    };
    if let Err(e) = write_info(&s, &info) {
        return fail(id, &Event::plain(sys::RDMA_CM_EVENT_CONNECT_ERROR, -e));
    }
    let resp = match read_info(&mut s, Instant::now() + RESPONSE_TIMEOUT) {
        Ok(r) => r,
        Err(libc::ETIMEDOUT) => {
            return fail(
                id,
                &Event::plain(sys::RDMA_CM_EVENT_UNREACHABLE, -libc::ETIMEDOUT),
            );
        }
        Err(e) => return fail(id, &Event::plain(sys::RDMA_CM_EVENT_CONNECT_ERROR, -e)),
    };
    let Some(peer) = resp.endpoints.first().copied() else {
        let ev = Event {
            kind: sys::RDMA_CM_EVENT_REJECTED,
            status: REJ_CONSUMER,
            private: &resp.user,
            pad: REJECT_PRIVATE,
            responder_resources: 0,
            initiator_depth: 0,
        };
        return fail(id, &ev);
    };
    // The passive side's answer as an event (CONNECT_RESPONSE, ESTABLISHED).
    let caps = id.lock().rd_max();
    let answer = |kind| Event {
        kind,
        status: 0,
        private: &resp.user,
        pad: ACCEPT_PRIVATE,
        responder_resources: caps.0,
        initiator_depth: caps.1,
    };
    let has_qp = {
        let mut st = id.lock();
        if st.destroyed {
            return;
        }
        st.peer = Some(peer);
        let has_qp = !id.qp().is_null();
        if has_qp {
            if let Err(e) = move_qp(id, &st, &[sys::IBV_QPS_RTR, sys::IBV_QPS_RTS]) {
                drop(st);
                return fail(id, &Event::plain(sys::RDMA_CM_EVENT_CONNECT_ERROR, -e));
            }
        } else {
            st.phase = Phase::Responded;
            id.post(&st, &answer(sys::RDMA_CM_EVENT_CONNECT_RESPONSE));
        }
        has_qp
    };
    if has_qp && write_ready(&s).is_err() {
        return fail(
            id,
            &Event::plain(sys::RDMA_CM_EVENT_CONNECT_ERROR, -libc::ECONNRESET),
        );
    }
    match read_ready(&mut s, id, Instant::now() + RESPONSE_TIMEOUT) {
        Ok(()) => {}
        Err(None) => return, // destroyed
        Err(Some(e)) => return fail(id, &Event::plain(sys::RDMA_CM_EVENT_CONNECT_ERROR, -e)),
    }
    {
        let mut st = id.lock();
        if st.destroyed {
            return;
        }
        if has_qp {
            st.phase = Phase::Connected;
            id.post(&st, &answer(sys::RDMA_CM_EVENT_ESTABLISHED));
        }
    }
    connected(id, s);
}

/// Reads the peer's ready mark: `Err(None)` when the identifier was destroyed meanwhile.
fn read_ready(s: &mut TcpStream, id: &Arc<Id>, deadline: Instant) -> Result<(), Option<c_int>> {
    let mut b = [0u8; 1];
    loop {
        if id.lock().destroyed {
            return Err(None);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Some(libc::ETIMEDOUT));
        }
        let _ = s.set_read_timeout(Some(left.min(Duration::from_millis(100))));
        match s.read(&mut b) {
            Ok(0) => return Err(Some(libc::ECONNRESET)),
            Ok(_) if b[0] == b'R' => return Ok(()),
            Ok(_) => return Err(Some(libc::EPROTO)),
            Err(e) if is_retry(&e) => {}
            Err(e) => return Err(Some(errno_of(&e))),
        }
    }
}

fn is_retry(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock
            | std::io::ErrorKind::TimedOut
            | std::io::ErrorKind::Interrupted
    )
}

/// Refuses a request this side cannot serve (no device): an answer without an endpoint.
fn refuse(s: &TcpStream, reason: String) {
    let _ = write_info(
        s,
        &PeerInfo {
            user: reason.into_bytes(),
            ..PeerInfo::default()
        },
    );
    let _ = s.shutdown(Shutdown::Both);
}

/// The passive side of one incoming connection, on a thread of its own.
fn passive(listen: &Arc<Id>, mut s: TcpStream, peer: SocketAddr) {
    let _ = s.set_nodelay(true);
    let req = match read_info(&mut s, Instant::now() + REQUEST_TIMEOUT) {
        Ok(r) if r.endpoints.len() == 1 => r,
        _ => return, // not a request: dropped, as a malformed CM message is
    };
    let (Some(local), SocketAddr::V4(peer)) = (v4(s.local_addr()), peer) else {
        return;
    };
    // The device of the address the peer connected to; on a loopback address that is no
    // device's, the listener's (see rdma_bind_addr), or for a listener on any address the one
    // a loopback bind would take.
    let listener_dev = listen.lock().dev;
    let dev = match (device::by_addr(*local.ip()), listener_dev) {
        (Some(dev), _) => dev,
        (None, Some((dev, _))) if local.ip().is_loopback() => dev,
        (None, None) if local.ip().is_loopback() => {
            match device::for_destination(*local.ip(), None) {
                Ok((dev, _)) => dev,
                Err(e) => {
                    let why = std::io::Error::from_raw_os_error(e);
                    return refuse(&s, format!("no soft device for {}: {why}", local.ip()));
                }
            }
        }
        _ => return refuse(&s, format!("no soft device at {}", local.ip())),
    };
    let opened = match dev.open() {
        Ok(o) => o,
        Err(e) => {
            let why = std::io::Error::from_raw_os_error(e);
            return refuse(
                &s,
                format!("the soft device at {} cannot open: {why}", local.ip()),
            );
        }
    };
    let Ok(w) = s.try_clone() else {
        return;
    };
    let child = {
        let lst = listen.lock();
        if lst.destroyed {
            return;
        }
        // SAFETY: reads of the listener's own struct (see `Id`'s `Sync` argument).
        let (cptr, context, ps) = unsafe {
            let c = &*listen.c();
            (c.channel, c.context, c.ps)
        };
        let Ok(child) = Id::new(Some((lst.chan.clone(), cptr)), context, ps) else {
            return;
        };
        let mut cst = child.lock();
        child.set_device(&mut cst, dev, opened);
        cst.local = Some(local);
        cst.remote = Some(peer);
        child.set_addrs(&mut cst);
        cst.peer = Some(req.endpoints[0]);
        cst.phase = Phase::Request;
        cst.stream = Some(Arc::new(w));
        cst.tos = lst.tos;
        cst.ack_timeout = lst.ack_timeout;
        let ev = Event {
            kind: sys::RDMA_CM_EVENT_CONNECT_REQUEST,
            status: 0,
            private: &req.user,
            pad: CONNECT_PRIVATE,
            responder_resources: opened.max_rd_atom,
            initiator_depth: opened.max_init_rd_atom,
        };
        // The program's reference to the request's identifier (given back by
        // rdma_destroy_id), made before the program can see the event.
        let _ = Id::into_c(child.clone());
        lst.chan.post(ev.make(&child, Some(listen)));
        drop(cst);
        child
    };
    // Wait for the program's answer, then the peer's ready mark.
    let mut b = [0u8; 1];
    loop {
        let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
        let r = s.read(&mut b);
        let mut st = child.lock();
        if st.destroyed || st.phase == Phase::Over {
            return;
        }
        match r {
            Err(e) if is_retry(&e) => continue,
            Ok(1) if b[0] == b'R' && st.phase == Phase::Accepting => {
                st.phase = Phase::Connected;
                let ev = Event {
                    kind: sys::RDMA_CM_EVENT_ESTABLISHED,
                    status: 0,
                    private: &[],
                    pad: 0,
                    responder_resources: opened.max_rd_atom,
                    initiator_depth: opened.max_init_rd_atom,
                };
                child.post(&st, &ev);
                break;
            }
            Ok(0) | Err(_) if st.phase == Phase::Request => {
                st.peer_gone = true;
                return;
            }
            _ => {
                drop(st);
                let e = if matches!(r, Ok(1)) {
                    libc::EPROTO
                } else {
                    libc::ECONNRESET
                };
                return fail(&child, &Event::plain(sys::RDMA_CM_EVENT_CONNECT_ERROR, -e));
            }
        }
    }
    connected(&child, s);
}

/// A connected identifier's lifeline: heartbeats out, the peer's heard, DISCONNECTED at the end.
fn connected(id: &Arc<Id>, mut s: TcpStream) {
    let mut heard = Instant::now();
    let mut sent = Instant::now() - DEFAULT_HEARTBEAT;
    let mut buf = [0u8; 64];
    loop {
        let (disconnecting, waiting) = {
            let st = id.lock();
            if st.destroyed {
                return;
            }
            (st.disconnecting, st.phase == Phase::Responded)
        };
        let now = Instant::now();
        if waiting {
            // The program has not called rdma_establish: no ready mark sent yet, so neither
            // heartbeats (the peer waits for the mark) nor a silence that counts.
            heard = now;
        } else if let Some(t) = disconnecting {
            if now >= t + DISCONNECT_GRACE {
                break;
            }
        } else if now >= sent + DEFAULT_HEARTBEAT {
            match (&s).write(b"H") {
                Ok(_) => sent = now,
                Err(e) if is_retry(&e) => sent = now,
                Err(_) => break,
            }
        }
        if now.saturating_duration_since(heard) >= DEFAULT_PEER_TIMEOUT {
            break;
        }
        let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => heard = Instant::now(),
            Err(e) if is_retry(&e) => {}
            Err(_) => break,
        }
    }
    let _ = s.shutdown(Shutdown::Both);
    let ctx = {
        let st = id.lock();
        if st.destroyed {
            return;
        }
        st.dev.map(|(_, o)| o.ctx)
    };
    // What the peer sent before it left reaches the completion queues before DISCONNECTED.
    if let Some(ctx) = ctx {
        device::take_in(ctx);
    }
    let mut st = id.lock();
    st.stream = None;
    if !st.disconnected_posted {
        st.disconnected_posted = true;
        st.phase = Phase::Over;
        id.post(&st, &Event::plain(sys::RDMA_CM_EVENT_DISCONNECTED, 0));
    }
}

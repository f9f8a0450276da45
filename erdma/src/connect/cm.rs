//! One-call connections through rdma_cm (librdmacm), and the same call on the soft device.
//!
//! [`connect`] (active side) and [`Listener::accept`] (passive side) each return a connected
//! [`Connection`]: a `Qp<Rts>`, the memory the peer granted ([`PeerInfo`] regions) and its user
//! data. The device is chosen by the address, as rdma_cm does it; the `setup` callback creates
//! the protection domain, completion queues and queue-pair configuration on the [`Context`] that
//! was chosen, so every request still goes through the SDK's limit checks and slot rings.
//!
//! ```no_run
//! use std::time::Duration;
//! use erdma::connect::cm::{self, Setup};
//! use erdma::{Access, QpConfig, SendWr};
//! # fn main() -> erdma::Result<()> {
//! // Active side; the passive side is `cm::Listener::bind("0.0.0.0:7471")?.accept(…)`.
//! let conn = cm::connect("10.0.0.2:7471", Duration::from_secs(5), |ctx| {
//!     let pd = ctx.alloc_pd()?;
//!     let cq = ctx.create_cq(256)?;
//!     let mr = pd.alloc(1 << 20, Access::ALL)?;
//!     Ok(Setup::new(&pd, QpConfig::new(&cq)).grant(mr.remote()).with((cq, mr)))
//! })?;
//! let (cq, mr) = conn.app();
//! let target = conn.remote_regions()[0].slice(0, 4096)?;
//! erdma::scope(|s| -> erdma::Result<()> {
//!     s.post_send(conn.qp(), SendWr::write(1, &[mr.slice(..4096)], target))?;
//!     cq.wait_one(Duration::from_secs(5))?.ok()?;
//!     Ok(())
//! })?;
//! # Ok(()) }
//! ```
//!
//! # Two providers, one call
//! - **verbs** (kernel devices): rdma_cm resolves the address and route, connects, and the
//!   connection's private data carries this side's [`PeerInfo`] (no endpoints: rdma_cm moves
//!   the queue pairs). This is the only way to connect on eRDMA in its default iWARP mode, where
//!   a plain `modify_qp` to RTS fails.
//! - **soft**: the project's TCP exchange ([`super::exchange`]) to the same address carries the
//!   full [`PeerInfo`] with the queue pair's endpoint; both sides then move their queue pairs to
//!   RTS and confirm with one byte each, and the TCP connection stays open as the connection's
//!   lifeline (closing it is the disconnect). A refusal is a [`PeerInfo`] with no endpoint whose
//!   user data says why.
//!
//! Which one: [`Options::device`] when set (`soft:<ipv4>` picks soft, any other name picks
//! rdma_cm and must be the device the address resolves to); otherwise `ERDMA_DEVICE` when it
//! names a soft device; otherwise rdma_cm when the kernel offers it (librdmacm loads and
//! `/dev/infiniband/rdma_cm` opens), else the soft device on the local address of the TCP
//! connection (the listener's address the peer reached, or the source address towards the peer).
//! Both ends must take the same path: a soft peer speaks TCP, not the InfiniBand connection
//! manager, so it cannot reach an rdma_cm listener on a kernel device (and the other way round).
//!
//! # Queue pairs
//! The SDK creates the queue pair (`ibv_create_qp` on the PD from `setup`) and drives its state
//! with the attributes rdma_cm computes (`rdma_init_qp_attr`), the "QP not created by rdma_cm"
//! mode of librdmacm: on InfiniBand/RoCE (rxe, eRDMA's RoCE modes) the SDK moves it to RTR/RTS
//! and completes the handshake (`rdma_establish`); on iWARP (eRDMA's default mode) the kernel's
//! connection manager finds the queue pair by number and moves it itself. Either way the queue
//! pair is an ordinary SDK queue pair, with the limit profile, the slot rings and the signaling
//! rules of [`crate::Pd::create_qp`]; the access rights of [`Setup::access`] replace rdma_cm's.
//! Both ends retry receiver-not-ready NAKs forever, so a SEND that arrives before the peer has
//! posted its receive waits for it. On iWARP the connecting side must send the first message
//! (an MPA rule).
//!
//! # Ownership
//! rdma_cm owns the `ibv_context` it resolved. The [`Context`] handed to `setup` wraps it without
//! owning it and keeps the rdma_cm identifier (and so the device) alive while any handle made from
//! it lives; the queue pair keeps the identifier alive too, and is destroyed before it. Dropping a
//! [`Connection`] disconnects and moves the queue pair to the error state (outstanding requests
//! are flushed); the handles stay valid until dropped. The protection domain `setup` returns may
//! belong to any context of the same device (one opened by name, or an earlier connection's), so
//! connections can share it; its completion queues must belong to its context, as always.
//!
//! # Limits of the private data
//! rdma_cm carries at most 56 bytes with a connection request and 196 with an accept on
//! InfiniBand/RoCE, 255 on iWARP. A [`PeerInfo`] takes 20 bytes plus 20 per region plus the user
//! data: on RoCE the connecting side can grant one region with 16 bytes of user data, the
//! accepting side eight regions. Larger descriptions are refused with a clear error; exchange them
//! over the connection itself.
//!
//! Must not: block without a deadline, or touch a queue pair of another device.

use std::any::Any;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use erdma_sys as sys;

use super::{HEADER_LEN, MAGIC, PeerInfo};
use crate::context::{Context, OpenOptions};
use crate::device::{ProviderKind, Transport};
use crate::error::{Error, Result};
use crate::limits::ProfileKind;
use crate::mr::{Access, RemoteMr};
use crate::pd::Pd;
use crate::provider::verbs::VerbsCtx;
use crate::provider::{CtxImpl, QpImpl};
use crate::qp::{ConnectOptions, InitAttr, Qp, QpConfig, Rts};

/// Largest private data of a connection request on InfiniBand/RoCE (92 bytes less rdma_cm's
/// 36-byte header).
pub const IB_CONNECT_PRIVATE_DATA: usize = 56;
/// Largest private data of an accept (REP) on InfiniBand/RoCE.
pub const IB_ACCEPT_PRIVATE_DATA: usize = 196;
/// Largest private data of a reject (REJ) on InfiniBand/RoCE.
pub const IB_REJECT_PRIVATE_DATA: usize = 148;
/// Largest private data rdma_cm passes on iWARP (its length field is one byte).
pub const IWARP_PRIVATE_DATA: usize = 255;

/// How a reject's private data starts when this SDK sent it; the rest is a UTF-8 message.
const REJECT_TAG: &[u8] = b"erdma-reject:";

/// Retries of the transport and of receiver-not-ready NAKs (7: RNR retries forever).
const RETRY_COUNT: u8 = 7;
const RNR_RETRY_COUNT: u8 = 7;

/// Which provider a connection went through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Via {
    /// rdma_cm on a kernel device.
    RdmaCm,
    /// The project's TCP exchange on a soft device.
    Soft,
}

/// Choices for [`connect_with`] and [`Listener::bind_with`]; the defaults pick everything from
/// the address.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// The device: `soft:<ipv4>` for the soft device, a kernel device name to insist on the
    /// device rdma_cm resolves (an error when the address resolves to another), or `None` to let
    /// the address decide.
    pub device: Option<String>,
    /// The local address to connect from (rdma_cm's source address; the soft device's address).
    pub source: Option<IpAddr>,
    /// Pending connection requests a listener queues (default 16).
    pub backlog: Option<u16>,
    /// The limit profile of the connection's [`Context`] (default: as [`Context::open`] picks).
    pub profile: Option<ProfileKind>,
}

impl Options {
    fn open_options(&self) -> OpenOptions {
        OpenOptions {
            profile: self.profile,
        }
    }
}

/// What `setup` returns: the protection domain and queue-pair configuration to connect with,
/// the access rights peers get, the regions and user data to send the peer, and any value of the
/// application's (`app`, handed back by [`Connection::app`]).
pub struct Setup<T = ()> {
    pd: Pd,
    config: QpConfig,
    access: Access,
    regions: Vec<RemoteMr>,
    user: Vec<u8>,
    app: T,
}

impl Setup<()> {
    /// Connect a queue pair made with `config` on `pd`; peers may READ and WRITE (subject to each
    /// region's own rights); nothing granted yet.
    pub fn new(pd: &Pd, config: QpConfig) -> Setup<()> {
        Setup {
            pd: pd.clone(),
            config,
            access: InitAttr::default().access,
            regions: Vec::new(),
            user: Vec::new(),
            app: (),
        }
    }
}

impl<T> Setup<T> {
    /// What peers may do to this queue pair's memory (checked together with each region's
    /// rights).
    pub fn access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// Tells the peer about a region it may reach.
    pub fn grant(mut self, region: RemoteMr) -> Self {
        self.regions.push(region);
        self
    }

    /// Opaque bytes for the peer.
    pub fn user_data(mut self, data: impl Into<Vec<u8>>) -> Self {
        self.user = data.into();
        self
    }

    /// Carries an application value (memory regions, completion queues, …) through to the
    /// [`Connection`].
    pub fn with<U>(self, app: U) -> Setup<U> {
        Setup {
            pd: self.pd,
            config: self.config,
            access: self.access,
            regions: self.regions,
            user: self.user,
            app,
        }
    }

    fn info(&self) -> PeerInfo {
        PeerInfo {
            endpoints: Vec::new(),
            regions: self.regions.clone(),
            user: self.user.clone(),
        }
    }
}

impl<T> std::fmt::Debug for Setup<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Setup")
            .field("pd", &self.pd)
            .field("access", &self.access)
            .field("regions", &self.regions)
            .field("user_len", &self.user.len())
            .finish_non_exhaustive()
    }
}

/// A connected queue pair with what the peer sent. Dropping it disconnects and moves the queue
/// pair to the error state.
pub struct Connection<T = ()> {
    qp: Qp<Rts>,
    peer: PeerInfo,
    app: Option<T>,
    link: Link,
    local: Option<SocketAddr>,
    remote: SocketAddr,
    done: AtomicBool,
}

enum Link {
    Cm(Arc<CmId>),
    Soft(Mutex<TcpStream>),
}

impl<T> Connection<T> {
    /// The connected queue pair.
    pub fn qp(&self) -> &Qp<Rts> {
        &self.qp
    }

    /// The device the connection runs on.
    pub fn context(&self) -> &Context {
        self.qp.pd().context()
    }

    /// What the peer sent: the regions it granted and its user data (no endpoints).
    pub fn peer(&self) -> &PeerInfo {
        &self.peer
    }

    /// The regions the peer granted, in its order.
    pub fn remote_regions(&self) -> &[RemoteMr] {
        &self.peer.regions
    }

    /// The application value from [`Setup::with`].
    pub fn app(&self) -> &T {
        self.app.as_ref().expect("present until into_app")
    }

    /// The application value, mutably.
    pub fn app_mut(&mut self) -> &mut T {
        self.app.as_mut().expect("present until into_app")
    }

    /// Disconnects (as dropping does) and returns the application value.
    pub fn into_app(mut self) -> T {
        self.app.take().expect("present until into_app")
    }

    /// Which provider carried the connection.
    pub fn via(&self) -> Via {
        match self.link {
            Link::Cm(_) => Via::RdmaCm,
            Link::Soft(_) => Via::Soft,
        }
    }

    /// The local address of the connection, where known.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.remote
    }

    /// Waits until the peer disconnects, then completes the disconnect here (the queue pair goes
    /// to the error state).
    ///
    /// # Errors
    /// [`Error::Timeout`] when the peer stays connected past `timeout`; [`Error::Protocol`] when
    /// the soft link carries unexpected bytes.
    pub fn wait_disconnected(&self, timeout: Duration) -> Result<()> {
        if self.done.load(Ordering::Acquire) {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        match &self.link {
            Link::Cm(id) => {
                id.wait_disconnected(deadline, &format!("{} to disconnect", self.remote))?
            }
            Link::Soft(stream) => {
                let mut s = stream.lock().unwrap_or_else(|e| e.into_inner());
                wait_eof(&mut s, deadline, &format!("{} to disconnect", self.remote))?;
            }
        }
        self.finish();
        Ok(())
    }

    /// Disconnects and waits up to `timeout` for the peer to acknowledge. The queue pair goes to
    /// the error state whatever happens.
    ///
    /// # Errors
    /// [`Error::Timeout`] when the peer does not acknowledge in time (this side is disconnected
    /// anyway).
    pub fn disconnect(self, timeout: Duration) -> Result<()> {
        if self.done.load(Ordering::Acquire) {
            // Already disconnected (the peer went first, and `wait_disconnected` saw it).
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        let what = format!("{} to acknowledge the disconnect", self.remote);
        let result = match &self.link {
            Link::Cm(id) => {
                id.disconnect_now();
                id.wait_disconnected(deadline, &what)
            }
            Link::Soft(stream) => {
                let mut s = stream.lock().unwrap_or_else(|e| e.into_inner());
                let _ = s.shutdown(Shutdown::Write);
                wait_eof(&mut s, deadline, &what)
            }
        };
        self.finish();
        result
    }

    fn finish(&self) {
        if self.done.swap(true, Ordering::AcqRel) {
            return;
        }
        match &self.link {
            Link::Cm(id) => id.disconnect_now(),
            Link::Soft(stream) => {
                let _ = stream
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .shutdown(Shutdown::Both);
            }
        }
        let _ = self.qp.to_error();
    }
}

impl<T> Drop for Connection<T> {
    fn drop(&mut self) {
        self.finish();
    }
}

impl<T> std::fmt::Debug for Connection<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("via", &self.via())
            .field("qp", &self.qp)
            .field("peer_addr", &self.remote)
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

/// Connects to a listener at `addr` (an rdma_cm port, or the TCP port of a soft listener), with
/// the device chosen by the address. `setup` runs once the device is known.
///
/// # Errors
/// [`Error::Library`] naming librdmacm when a kernel device is asked for and it is missing;
/// [`Error::NoDeviceForAddress`]; [`Error::Refused`] (nobody listening, or the peer rejected,
/// with its reason); [`Error::Unreachable`]; [`Error::Timeout`] past `timeout`;
/// [`Error::Protocol`] for a malformed answer; whatever `setup` returns; verb errors.
pub fn connect<T>(
    addr: impl ToSocketAddrs + std::fmt::Debug,
    timeout: Duration,
    setup: impl FnOnce(&Context) -> Result<Setup<T>>,
) -> Result<Connection<T>> {
    connect_with(addr, timeout, &Options::default(), setup)
}

/// [`connect`] with [`Options`].
///
/// # Errors
/// As [`connect`].
pub fn connect_with<T>(
    addr: impl ToSocketAddrs + std::fmt::Debug,
    timeout: Duration,
    options: &Options,
    setup: impl FnOnce(&Context) -> Result<Setup<T>>,
) -> Result<Connection<T>> {
    let deadline = Instant::now() + timeout;
    let dst = resolve(&addr)?;
    match route(options)? {
        Route::Cm(cm) => cm_connect(cm, dst, deadline, options, setup),
        Route::Soft(device) => soft_connect(dst, deadline, options, device, setup),
    }
}

/// A listening endpoint: rdma_cm on a kernel device, or a TCP listener for the soft device.
pub struct Listener {
    inner: ListenerInner,
    options: Options,
}

enum ListenerInner {
    Cm(Arc<CmId>),
    Soft(super::Listener),
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("via", &self.via())
            .field("local_addr", &self.local_addr().ok())
            .finish()
    }
}

impl Listener {
    /// Listens on `addr` (`0.0.0.0:7471`, a device's address; port 0 picks one).
    ///
    /// # Errors
    /// [`Error::NoDeviceForAddress`] when rdma_cm finds no device with that address,
    /// [`Error::Library`], [`Error::Io`]/[`Error::Verb`] (an address in use).
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Listener> {
        Listener::bind_with(addr, &Options::default())
    }

    /// [`Listener::bind`] with [`Options`].
    ///
    /// # Errors
    /// As [`Listener::bind`].
    pub fn bind_with(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        options: &Options,
    ) -> Result<Listener> {
        let local = resolve(&addr)?;
        let inner = match route(options)? {
            Route::Cm(cm) => ListenerInner::Cm(cm_listen(cm, local, options)?),
            Route::Soft(_) => ListenerInner::Soft(super::Listener::bind(local)?),
        };
        Ok(Listener {
            inner,
            options: options.clone(),
        })
    }

    /// Which provider the listener uses.
    pub fn via(&self) -> Via {
        match self.inner {
            ListenerInner::Cm(_) => Via::RdmaCm,
            ListenerInner::Soft(_) => Via::Soft,
        }
    }

    /// The bound address (with the port the system picked for port 0).
    ///
    /// # Errors
    /// [`Error::Io`] (soft), [`Error::Protocol`] when rdma_cm reports no address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        match &self.inner {
            ListenerInner::Cm(id) => id
                .local_addr()
                .ok_or_else(|| Error::protocol("rdma_cm reports no local address")),
            ListenerInner::Soft(l) => l.local_addr(),
        }
    }

    /// Waits up to `timeout` for one connection request and accepts it. `setup` runs once the
    /// request's device is known; when it (or anything else here) fails, the request is rejected
    /// with the error's text as the reason, and the error is returned.
    ///
    /// # Errors
    /// [`Error::Timeout`] when no request comes (or the peer does not complete the handshake) in
    /// time; [`Error::Protocol`] for a malformed request; whatever `setup` returns; verb errors.
    pub fn accept<T>(
        &self,
        timeout: Duration,
        setup: impl FnOnce(&Context) -> Result<Setup<T>>,
    ) -> Result<Connection<T>> {
        let deadline = Instant::now() + timeout;
        match &self.inner {
            ListenerInner::Cm(id) => cm_accept(id, deadline, &self.options, setup),
            ListenerInner::Soft(l) => soft_accept(l, deadline, &self.options, setup),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Choosing the provider.

enum Route {
    Cm(&'static sys::RdmaCm),
    Soft(Option<String>),
}

fn is_soft(name: &str) -> bool {
    name == "soft" || name.starts_with("soft:")
}

fn cm_lib() -> Result<&'static sys::RdmaCm> {
    sys::rdmacm().map_err(|e| Error::Library {
        library: "librdmacm.so.1",
        detail: e.to_string(),
    })
}

fn route(options: &Options) -> Result<Route> {
    match &options.device {
        Some(d) if is_soft(d) => return Ok(Route::Soft(Some(d.clone()))),
        Some(_) => return Ok(Route::Cm(cm_lib()?)),
        None => {}
    }
    if let Ok(d) = std::env::var("ERDMA_DEVICE") {
        if is_soft(&d) {
            return Ok(Route::Soft(Some(d)));
        }
    }
    match sys::rdmacm() {
        Ok(cm) if Channel::new(cm).is_ok() => Ok(Route::Cm(cm)),
        _ => Ok(Route::Soft(None)),
    }
}

fn resolve(addr: &(impl ToSocketAddrs + std::fmt::Debug)) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::io(format!("resolving {addr:?}"), e))?
        .next()
        .ok_or_else(|| Error::invalid(format!("{addr:?} resolves to no address")))
}

// ---------------------------------------------------------------------------------------------
// The soft provider: the project's TCP exchange.

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

fn soft_connect<T>(
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
    let s = setup(&ctx)?;
    let qp = s.pd.create_qp(&s.config)?.init(&InitAttr {
        access: s.access,
        ..InitAttr::default()
    })?;
    let mut info = s.info();
    info.endpoints.push(qp.endpoint()?);
    let mut peer = super::exchange(&mut stream, &info, remaining(deadline))?;
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
    Ok(Connection {
        qp,
        peer,
        app: Some(s.app),
        link: Link::Soft(Mutex::new(stream)),
        local,
        remote: dst,
        done: AtomicBool::new(false),
    })
}

fn soft_accept<T>(
    listener: &super::Listener,
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
        let s = setup(&ctx)?;
        let qp = s.pd.create_qp(&s.config)?.init(&InitAttr {
            access: s.access,
            ..InitAttr::default()
        })?;
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
                let _ = super::write_all_by(&mut stream, &bytes, deadline, "a refusal");
            }
            return Err(e);
        }
    };
    let mut info = s.info();
    info.endpoints.push(qp.endpoint()?);
    let mut peer = super::exchange(&mut stream, &info, remaining(deadline))?;
    let Some(endpoint) = peer.endpoints.first().copied() else {
        return Err(Error::protocol(format!(
            "{remote} sent no queue pair to connect to"
        )));
    };
    let qp = qp.connect(&endpoint, &ConnectOptions::default())?;
    ready_handshake(&mut stream, deadline)?;
    peer.endpoints.clear();
    Ok(Connection {
        qp,
        peer,
        app: Some(s.app),
        link: Link::Soft(Mutex::new(stream)),
        local,
        remote,
        done: AtomicBool::new(false),
    })
}

/// Both sides say "ready" once their queue pair is in RTS, so neither returns (and sends) before
/// the other can receive.
fn ready_handshake(stream: &mut TcpStream, deadline: Instant) -> Result<()> {
    super::write_all_by(stream, b"R", deadline, "the ready mark")?;
    let mut b = [0u8; 1];
    super::read_exact_by(stream, &mut b, deadline, "the peer's ready mark")?;
    if b[0] != b'R' {
        return Err(Error::protocol(format!(
            "the peer sent {:#04x} where its ready mark belongs",
            b[0]
        )));
    }
    Ok(())
}

/// Waits for the peer to close the TCP link.
fn wait_eof(stream: &mut TcpStream, deadline: Instant, what: &str) -> Result<()> {
    let mut buf = [0u8; 64];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout {
                what: what.to_string(),
            });
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| Error::io("setting a socket timeout", e))?;
        match stream.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => {
                return Err(Error::protocol(format!(
                    "the peer sent {n} unexpected bytes on a connection's link"
                )));
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::NotConnected
                ) =>
            {
                return Ok(());
            }
            Err(e) => return Err(Error::io(format!("waiting for {what}"), e)),
        }
    }
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

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

// ---------------------------------------------------------------------------------------------
// The rdma_cm provider.

/// One event, copied out of librdmacm and already acknowledged.
struct Event {
    kind: sys::rdma_cm_event_type,
    status: c_int,
    id: *mut sys::rdma_cm_id,
    private: Vec<u8>,
    responder_resources: u8,
    initiator_depth: u8,
}

/// An event channel (its fd non-blocking), destroyed on drop.
struct Channel {
    cm: &'static sys::RdmaCm,
    raw: *mut sys::rdma_event_channel,
}

impl Channel {
    fn new(cm: &'static sys::RdmaCm) -> Result<Channel> {
        // SAFETY: no arguments; returns NULL with errno set on failure.
        let raw = unsafe { (cm.rdma_create_event_channel)() };
        if raw.is_null() {
            return Err(Error::last_os("rdma_create_event_channel"));
        }
        let ch = Channel { cm, raw };
        let fd = ch.fd();
        // SAFETY: fcntl on the channel's open descriptor.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above; a non-blocking fd lets every wait have a deadline.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(Error::last_os(
                "fcntl(O_NONBLOCK) on an rdma_cm event channel",
            ));
        }
        Ok(ch)
    }

    fn fd(&self) -> c_int {
        // SAFETY: the channel is live while `self` is.
        unsafe { (*self.raw).fd }
    }

    /// The next event, waiting until `deadline`.
    fn next(&self, deadline: Instant, what: &str) -> Result<Event> {
        loop {
            let mut ev: *mut sys::rdma_cm_event = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; `ev` is a valid out-parameter.
            let rc = unsafe { (self.cm.rdma_get_cm_event)(self.raw, &mut ev) };
            if rc == 0 && !ev.is_null() {
                // SAFETY: `ev` is a live event until acknowledged below; the connection
                // parameters are meaningful for the connection events, whose private data pointer
                // (when not NULL) covers `private_data_len` bytes inside the event.
                let event = unsafe {
                    let e = &*ev;
                    let conn_event = matches!(
                        e.event,
                        sys::RDMA_CM_EVENT_CONNECT_REQUEST
                            | sys::RDMA_CM_EVENT_CONNECT_RESPONSE
                            | sys::RDMA_CM_EVENT_ESTABLISHED
                            | sys::RDMA_CM_EVENT_REJECTED
                    );
                    let conn = e.param.conn;
                    let private = if conn_event
                        && !conn.private_data.is_null()
                        && conn.private_data_len > 0
                    {
                        std::slice::from_raw_parts(
                            conn.private_data.cast::<u8>(),
                            conn.private_data_len as usize,
                        )
                        .to_vec()
                    } else {
                        Vec::new()
                    };
                    Event {
                        kind: e.event,
                        status: e.status,
                        id: e.id,
                        private,
                        responder_resources: if conn_event {
                            conn.responder_resources
                        } else {
                            0
                        },
                        initiator_depth: if conn_event { conn.initiator_depth } else { 0 },
                    }
                };
                // SAFETY: acknowledged once; nothing of it is used afterwards.
                unsafe { (self.cm.rdma_ack_cm_event)(ev) };
                return Ok(event);
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => {}
                _ => {
                    return Err(Error::Verb {
                        verb: "rdma_get_cm_event",
                        source: e,
                    });
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: what.to_string(),
                });
            }
            let mut pfd = libc::pollfd {
                fd: self.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as c_int;
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, ms) };
        }
    }

    fn event_name(&self, kind: sys::rdma_cm_event_type) -> String {
        // SAFETY: returns a static string for any value.
        let p = unsafe { (self.cm.rdma_event_str)(kind) };
        if p.is_null() {
            return format!("event {kind}");
        }
        // SAFETY: a NUL-terminated static string.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: every identifier on the channel is destroyed before it (their owners hold the
        // channel and destroy the identifier first); destroyed once.
        unsafe { (self.cm.rdma_destroy_event_channel)(self.raw) };
    }
}

/// An rdma_cm identifier with its own event channel.
struct CmId {
    cm: &'static sys::RdmaCm,
    raw: *mut sys::rdma_cm_id,
    /// Serialises readers of the channel.
    channel: Mutex<Channel>,
    disconnected: AtomicBool,
}

// SAFETY: librdmacm's calls on an identifier are thread-safe; event reading is serialised by the
// channel's mutex; the raw pointer is owned by this value alone and destroyed once.
unsafe impl Send for CmId {}
// SAFETY: as above.
unsafe impl Sync for CmId {}
// SAFETY: the channel is only used through `CmId`, which serialises it.
unsafe impl Send for Channel {}

impl CmId {
    fn create(cm: &'static sys::RdmaCm) -> Result<Arc<CmId>> {
        let channel = Channel::new(cm)?;
        let mut raw: *mut sys::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: the channel is live; `raw` is a valid out-parameter.
        let rc = unsafe {
            (cm.rdma_create_id)(
                channel.raw,
                &mut raw,
                std::ptr::null_mut(),
                sys::RDMA_PS_TCP,
            )
        };
        if rc != 0 || raw.is_null() {
            return Err(Error::last_os("rdma_create_id"));
        }
        Ok(Arc::new(CmId {
            cm,
            raw,
            channel: Mutex::new(channel),
            disconnected: AtomicBool::new(false),
        }))
    }

    fn next(&self, deadline: Instant, what: &str) -> Result<Event> {
        self.channel
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .next(deadline, what)
    }

    fn event_name(&self, kind: sys::rdma_cm_event_type) -> String {
        self.channel
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .event_name(kind)
    }

    fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the identifier is live; the address lives inside it.
        from_sockaddr(unsafe { sys::rdma_get_local_addr(self.raw) })
    }

    fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above.
        from_sockaddr(unsafe { sys::rdma_get_peer_addr(self.raw) })
    }

    /// `rdma_disconnect`, once.
    fn disconnect_now(&self) {
        if !self.disconnected.swap(true, Ordering::AcqRel) {
            // SAFETY: the identifier is live. Failure (never connected) leaves nothing to undo.
            unsafe { (self.cm.rdma_disconnect)(self.raw) };
        }
    }

    /// Waits for DISCONNECTED, then answers it.
    fn wait_disconnected(&self, deadline: Instant, what: &str) -> Result<()> {
        loop {
            let ev = self.next(deadline, what)?;
            match ev.kind {
                sys::RDMA_CM_EVENT_DISCONNECTED => {
                    self.disconnect_now();
                    return Ok(());
                }
                sys::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                    return Err(Error::protocol("the RDMA device was removed"));
                }
                _ => {}
            }
        }
    }

    /// Rejects a connection request (or a response), with `reason` for the peer. Best effort.
    fn reject(&self, transport: Transport, reason: &str) {
        let limit = if transport == Transport::Iwarp {
            IWARP_PRIVATE_DATA
        } else {
            IB_REJECT_PRIVATE_DATA
        };
        let mut data = REJECT_TAG.to_vec();
        data.extend_from_slice(reason.as_bytes());
        data.truncate(limit);
        // SAFETY: the identifier is live; the data outlives the call.
        unsafe {
            (self.cm.rdma_reject)(self.raw, data.as_ptr().cast(), data.len() as u8);
        }
    }

    fn transport(&self) -> Transport {
        // SAFETY: the identifier is live; `verbs` is NULL or a live context with its device.
        unsafe {
            let verbs = (*self.raw).verbs;
            if verbs.is_null() {
                return Transport::Ib;
            }
            match (*(*verbs).device).transport_type {
                1 => Transport::Iwarp,
                _ => Transport::Ib,
            }
        }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: every queue pair that depends on the identifier holds it, so none is left;
        // every event was acknowledged when read; destroyed once, before its channel (a field).
        unsafe { (self.cm.rdma_destroy_id)(self.raw) };
    }
}

/// The [`Context`] of the device an identifier resolved to; it keeps the identifier alive.
fn cm_context(id: &Arc<CmId>, options: &Options) -> Result<Context> {
    // SAFETY: the identifier is live; `verbs` is set once the address is bound or resolved.
    let verbs = unsafe { (*id.raw).verbs };
    if verbs.is_null() {
        return Err(Error::protocol("rdma_cm resolved the address to no device"));
    }
    let anchor: Arc<dyn Any + Send + Sync> = id.clone();
    // SAFETY: librdmacm keeps `verbs` open while the identifier (held by the anchor) lives.
    let (imp, name) = unsafe { VerbsCtx::borrowed(verbs, anchor)? };
    if let Some(want) = &options.device {
        if *want != name {
            return Err(Error::invalid(format!(
                "the address resolves to RDMA device {name}, not {want}"
            )));
        }
    }
    Context::from_imp(
        CtxImpl::Verbs(imp),
        ProviderKind::Verbs,
        name,
        options.open_options(),
    )
}

/// READ/atomic depths this side offers: (responder resources, initiator depth).
fn rd_depths(ctx: &Context) -> (u8, u8) {
    let l = ctx.limits();
    (
        l.max_dest_rd_atomic.clamp(1, 16) as u8,
        l.max_rd_atomic.clamp(1, 16) as u8,
    )
}

/// Values that replace what `rdma_init_qp_attr` says.
#[derive(Default, Clone, Copy)]
struct Overrides {
    access: Option<Access>,
    max_dest_rd_atomic: Option<u8>,
    max_rd_atomic: Option<u8>,
}

/// Moves `qp` to `state` with the attributes rdma_cm computes for the identifier.
fn cm_modify(
    id: &CmId,
    qp: *mut sys::ibv_qp,
    state: sys::ibv_qp_state,
    o: Overrides,
) -> Result<()> {
    let init_qp_attr = id.cm.rdma_init_qp_attr.ok_or(Error::Library {
        library: "librdmacm.so.1",
        detail: "it lacks rdma_init_qp_attr (RDMACM_1.2; rdma-core too old)".into(),
    })?;
    let verbs = sys::ibverbs().map_err(|e| Error::Library {
        library: "libibverbs.so.1",
        detail: e.to_string(),
    })?;
    // SAFETY: a zeroed ibv_qp_attr is a valid value.
    let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = state;
    let mut mask: c_int = 0;
    // SAFETY: the identifier is live; both out-parameters are valid.
    if unsafe { init_qp_attr(id.raw, &mut attr, &mut mask) } != 0 {
        return Err(Error::last_os("rdma_init_qp_attr"));
    }
    if let Some(a) = o.access {
        attr.qp_access_flags = a.bits();
        mask |= sys::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0 as c_int;
    }
    if let Some(v) = o.max_dest_rd_atomic {
        if mask & sys::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0 as c_int != 0 {
            attr.max_dest_rd_atomic = v;
        }
    }
    if let Some(v) = o.max_rd_atomic {
        if mask & sys::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0 as c_int != 0 {
            attr.max_rd_atomic = v;
        }
    }
    // SAFETY: `qp` is live (its SDK handle is held by the caller); `attr` is valid for `mask`.
    let rc = unsafe { (verbs.ibv_modify_qp)(qp, &mut attr, mask) };
    if rc != 0 {
        return Err(Error::errno("ibv_modify_qp", rc));
    }
    Ok(())
}

/// Creates the queue pair of `s` and moves it to INIT for the identifier.
fn cm_qp<T>(
    id: &Arc<CmId>,
    ctx: &Context,
    s: &Setup<T>,
) -> Result<(crate::qp::Qp<crate::qp::Reset>, *mut sys::ibv_qp)> {
    let pd_ctx = s.pd.context();
    if pd_ctx.provider() != ProviderKind::Verbs || pd_ctx.name() != ctx.name() {
        return Err(Error::invalid(format!(
            "the protection domain belongs to device {}, and the connection runs on {}",
            pd_ctx.name(),
            ctx.name()
        )));
    }
    s.access.validate()?;
    let qp = s.pd.create_qp(&s.config)?;
    let _ = qp.shared.anchor.set(id.clone());
    let raw = match &qp.shared.imp {
        QpImpl::Verbs(v) => v.as_raw(),
        QpImpl::Soft(_) => return Err(Error::invalid("a soft queue pair cannot use rdma_cm")),
    };
    cm_modify(
        id,
        raw,
        sys::IBV_QPS_INIT,
        Overrides {
            access: Some(s.access),
            ..Overrides::default()
        },
    )?;
    Ok((qp, raw))
}

fn private_limit(t: Transport, accept: bool) -> usize {
    match (t, accept) {
        (Transport::Iwarp, _) => IWARP_PRIVATE_DATA,
        (_, false) => IB_CONNECT_PRIVATE_DATA,
        (_, true) => IB_ACCEPT_PRIVATE_DATA,
    }
}

fn encode_private(info: &PeerInfo, limit: usize, step: &str) -> Result<Vec<u8>> {
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
fn reject_reason(t: Transport, status: c_int, private: &[u8]) -> String {
    let code = if t == Transport::Iwarp {
        match -status {
            libc::ECONNREFUSED => {
                "refused (ECONNREFUSED: nobody listening, or rejected)".to_string()
            }
            e => format!("rejected ({})", std::io::Error::from_raw_os_error(e)),
        }
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

fn os_status(status: c_int) -> String {
    std::io::Error::from_raw_os_error(status.saturating_abs()).to_string()
}

fn kernel_devices() -> Vec<String> {
    crate::provider::verbs::list_devices()
        .map(|l| l.into_iter().map(|d| d.name).collect())
        .unwrap_or_default()
}

fn address_error(addr: SocketAddr, errno: i32, step: &str) -> Error {
    match errno {
        libc::ENODEV | libc::EADDRNOTAVAIL | libc::ENOENT => Error::NoDeviceForAddress {
            addr: addr.ip().to_string(),
            available: kernel_devices(),
        },
        libc::ETIMEDOUT | libc::ENODATA => Error::Unreachable {
            peer: addr.to_string(),
            detail: format!("rdma_cm {step} got no answer (no neighbour answered, or no path)"),
        },
        _ => Error::Unreachable {
            peer: addr.to_string(),
            detail: format!("rdma_cm {step} failed: {}", os_status(errno)),
        },
    }
}

/// The time rdma_cm gets for a resolution step: most of what is left, so that its own error
/// (which says what failed) comes before the caller's deadline.
fn ms_until(deadline: Instant) -> c_int {
    (remaining(deadline).as_millis() * 3 / 4).clamp(1, i32::MAX as u128) as c_int
}

fn cm_connect<T>(
    cm: &'static sys::RdmaCm,
    dst: SocketAddr,
    deadline: Instant,
    options: &Options,
    setup: impl FnOnce(&Context) -> Result<Setup<T>>,
) -> Result<Connection<T>> {
    let id = CmId::create(cm)?;
    let (mut dst_sa, _) = to_sockaddr(dst);
    let mut src_sa = options
        .source
        .map(|ip| to_sockaddr(SocketAddr::new(ip, 0)).0);
    let src_ptr = src_sa.as_mut().map_or(std::ptr::null_mut(), |s| {
        (s as *mut libc::sockaddr_storage).cast()
    });
    // SAFETY: the identifier is live; both addresses are valid sockaddr_storage values.
    let rc = unsafe {
        (cm.rdma_resolve_addr)(
            id.raw,
            src_ptr,
            (&mut dst_sa as *mut libc::sockaddr_storage).cast(),
            ms_until(deadline),
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(address_error(
            dst,
            e.raw_os_error().unwrap_or(0),
            "address resolution",
        ));
    }
    let ev = id.next(deadline, &format!("rdma_cm address resolution of {dst}"))?;
    match ev.kind {
        sys::RDMA_CM_EVENT_ADDR_RESOLVED => {}
        sys::RDMA_CM_EVENT_ADDR_ERROR => {
            return Err(address_error(dst, -ev.status, "address resolution"));
        }
        k => return Err(unexpected(&id, k, "address resolution")),
    }
    // SAFETY: the identifier is live.
    if unsafe { (cm.rdma_resolve_route)(id.raw, ms_until(deadline)) } != 0 {
        return Err(Error::last_os("rdma_resolve_route"));
    }
    let ev = id.next(deadline, &format!("rdma_cm route resolution to {dst}"))?;
    match ev.kind {
        sys::RDMA_CM_EVENT_ROUTE_RESOLVED => {}
        sys::RDMA_CM_EVENT_ROUTE_ERROR => {
            return Err(Error::Unreachable {
                peer: dst.to_string(),
                detail: format!("rdma_cm route resolution failed: {}", os_status(ev.status)),
            });
        }
        k => return Err(unexpected(&id, k, "route resolution")),
    }
    let ctx = cm_context(&id, options)?;
    let transport = ctx.transport();
    let s = setup(&ctx)?;
    let (qp, raw_qp) = cm_qp(&id, &ctx, &s)?;
    let private = encode_private(
        &s.info(),
        private_limit(transport, false),
        "a connection request",
    )?;
    let (resp, init) = rd_depths(&ctx);
    // SAFETY: a zeroed rdma_conn_param is a valid value.
    let mut param: sys::rdma_conn_param = unsafe { std::mem::zeroed() };
    param.private_data = private.as_ptr().cast();
    param.private_data_len = private.len() as u8;
    param.responder_resources = resp;
    param.initiator_depth = init;
    param.flow_control = 1;
    param.retry_count = RETRY_COUNT;
    param.rnr_retry_count = RNR_RETRY_COUNT;
    param.qp_num = qp.qp_num();
    // SAFETY: the identifier is live and route-resolved; `param` and its private data outlive
    // the call (librdmacm copies them).
    if unsafe { (cm.rdma_connect)(id.raw, &mut param) } != 0 {
        return Err(Error::last_os("rdma_connect"));
    }
    let ev = id.next(
        deadline,
        &format!("{dst} to answer the rdma_cm connection request"),
    )?;
    let peer = match ev.kind {
        sys::RDMA_CM_EVENT_CONNECT_RESPONSE => {
            // InfiniBand/RoCE with a queue pair of our own: move it, then complete.
            let done = (|| -> Result<PeerInfo> {
                let peer = decode_private(&ev.private)?;
                cm_modify(&id, raw_qp, sys::IBV_QPS_RTR, Overrides::default())?;
                cm_modify(&id, raw_qp, sys::IBV_QPS_RTS, Overrides::default())?;
                let establish = cm.rdma_establish.ok_or(Error::Library {
                    library: "librdmacm.so.1",
                    detail: "it lacks rdma_establish (RDMACM_1.2; rdma-core too old)".into(),
                })?;
                // SAFETY: the identifier is live and has just had its connect response.
                if unsafe { establish(id.raw) } != 0 {
                    return Err(Error::last_os("rdma_establish"));
                }
                Ok(peer)
            })();
            match done {
                Ok(p) => p,
                Err(e) => {
                    id.reject(transport, &e.to_string());
                    return Err(e);
                }
            }
        }
        // iWARP: the kernel moved the queue pair; the connection is up.
        sys::RDMA_CM_EVENT_ESTABLISHED => match decode_private(&ev.private) {
            Ok(p) => p,
            Err(e) => {
                id.disconnect_now();
                return Err(e);
            }
        },
        sys::RDMA_CM_EVENT_REJECTED => {
            return Err(Error::Refused {
                peer: dst.to_string(),
                reason: reject_reason(transport, ev.status, &ev.private),
            });
        }
        sys::RDMA_CM_EVENT_UNREACHABLE => {
            return Err(Error::Unreachable {
                peer: dst.to_string(),
                detail: format!(
                    "no answer to the connection request ({})",
                    os_status(ev.status)
                ),
            });
        }
        sys::RDMA_CM_EVENT_CONNECT_ERROR => {
            return Err(Error::Unreachable {
                peer: dst.to_string(),
                detail: format!("the connection failed ({})", os_status(ev.status)),
            });
        }
        k => return Err(unexpected(&id, k, "the connection request")),
    };
    let local = id.local_addr();
    Ok(Connection {
        qp: Qp::from_shared(qp.shared.clone()),
        peer,
        app: Some(s.app),
        link: Link::Cm(id),
        local,
        remote: dst,
        done: AtomicBool::new(false),
    })
}

fn unexpected(id: &CmId, kind: sys::rdma_cm_event_type, step: &str) -> Error {
    Error::protocol(format!(
        "rdma_cm reported {} during {step}",
        id.event_name(kind)
    ))
}

fn cm_listen(cm: &'static sys::RdmaCm, local: SocketAddr, options: &Options) -> Result<Arc<CmId>> {
    let id = CmId::create(cm)?;
    let (mut sa, _) = to_sockaddr(local);
    // SAFETY: the identifier is live; `sa` is a valid address.
    if unsafe { (cm.rdma_bind_addr)(id.raw, (&mut sa as *mut libc::sockaddr_storage).cast()) } != 0
    {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENODEV) | Some(libc::EADDRNOTAVAIL) => Error::NoDeviceForAddress {
                addr: local.ip().to_string(),
                available: kernel_devices(),
            },
            _ => Error::Verb {
                verb: "rdma_bind_addr",
                source: e,
            },
        });
    }
    if let Some(want) = &options.device {
        // SAFETY: the identifier is live; `verbs` is NULL (wildcard address) or a live context.
        let verbs = unsafe { (*id.raw).verbs };
        if !verbs.is_null() {
            // SAFETY: a live context's device and its name.
            let name = unsafe {
                std::ffi::CStr::from_ptr((*(*verbs).device).name.as_ptr())
                    .to_string_lossy()
                    .into_owned()
            };
            if *want != name {
                return Err(Error::invalid(format!(
                    "{} belongs to RDMA device {name}, not {want}",
                    local.ip()
                )));
            }
        }
    }
    let backlog = options.backlog.unwrap_or(16) as c_int;
    // SAFETY: the identifier is live and bound.
    if unsafe { (cm.rdma_listen)(id.raw, backlog) } != 0 {
        return Err(Error::last_os("rdma_listen"));
    }
    Ok(id)
}

fn cm_accept<T>(
    listener: &Arc<CmId>,
    deadline: Instant,
    options: &Options,
    setup: impl FnOnce(&Context) -> Result<Setup<T>>,
) -> Result<Connection<T>> {
    let cm = listener.cm;
    let what = format!(
        "a connection request on {}",
        listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default()
    );
    let ev = loop {
        let ev = listener.next(deadline, &what)?;
        if ev.kind == sys::RDMA_CM_EVENT_CONNECT_REQUEST && !ev.id.is_null() {
            break ev;
        }
    };
    // The request's identifier gets a channel of its own, so its events never mix with the
    // listener's.
    let adopt = (|| -> Result<Channel> {
        let channel = Channel::new(cm)?;
        // SAFETY: both live; the identifier has no unacknowledged event (the request was
        // acknowledged when read).
        if unsafe { (cm.rdma_migrate_id)(ev.id, channel.raw) } != 0 {
            return Err(Error::last_os("rdma_migrate_id"));
        }
        Ok(channel)
    })();
    let channel = match adopt {
        Ok(c) => c,
        Err(e) => {
            // SAFETY: the request's identifier is live and ours to reject and destroy, once.
            unsafe {
                (cm.rdma_reject)(ev.id, std::ptr::null(), 0);
                (cm.rdma_destroy_id)(ev.id);
            }
            return Err(e);
        }
    };
    let id = Arc::new(CmId {
        cm,
        raw: ev.id,
        channel: Mutex::new(channel),
        disconnected: AtomicBool::new(false),
    });
    let transport = id.transport();
    let remote = id
        .peer_addr()
        .unwrap_or(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0));
    let prepared = (|| -> Result<_> {
        let peer = decode_private(&ev.private)?;
        let ctx = cm_context(&id, options)?;
        let s = setup(&ctx)?;
        let (qp, raw_qp) = cm_qp(&id, &ctx, &s)?;
        let (mine_resp, mine_init) = rd_depths(&ctx);
        // The peer's initiator depth is what it may have outstanding at us, and the other way.
        let resp = mine_resp.min(ev.initiator_depth);
        let init = mine_init.min(ev.responder_resources);
        if transport != Transport::Iwarp {
            cm_modify(
                &id,
                raw_qp,
                sys::IBV_QPS_RTR,
                Overrides {
                    max_dest_rd_atomic: Some(resp),
                    ..Overrides::default()
                },
            )?;
            cm_modify(
                &id,
                raw_qp,
                sys::IBV_QPS_RTS,
                Overrides {
                    max_rd_atomic: Some(init),
                    ..Overrides::default()
                },
            )?;
        }
        let private = encode_private(&s.info(), private_limit(transport, true), "an accept")?;
        // SAFETY: a zeroed rdma_conn_param is a valid value.
        let mut param: sys::rdma_conn_param = unsafe { std::mem::zeroed() };
        param.private_data = private.as_ptr().cast();
        param.private_data_len = private.len() as u8;
        param.responder_resources = resp;
        param.initiator_depth = init;
        param.flow_control = 1;
        param.retry_count = RETRY_COUNT;
        param.rnr_retry_count = RNR_RETRY_COUNT;
        param.qp_num = qp.qp_num();
        // SAFETY: the identifier is live with a pending request; `param` and its data outlive
        // the call.
        if unsafe { (cm.rdma_accept)(id.raw, &mut param) } != 0 {
            return Err(Error::last_os("rdma_accept"));
        }
        Ok((peer, s, qp))
    })();
    let (peer, s, qp) = match prepared {
        Ok(v) => v,
        Err(e) => {
            id.reject(transport, &e.to_string());
            return Err(e);
        }
    };
    let ev = id.next(
        deadline,
        &format!("{remote} to complete the rdma_cm connection"),
    )?;
    match ev.kind {
        sys::RDMA_CM_EVENT_ESTABLISHED => {}
        sys::RDMA_CM_EVENT_REJECTED => {
            return Err(Error::Refused {
                peer: remote.to_string(),
                reason: reject_reason(transport, ev.status, &ev.private),
            });
        }
        sys::RDMA_CM_EVENT_CONNECT_ERROR | sys::RDMA_CM_EVENT_UNREACHABLE => {
            return Err(Error::Unreachable {
                peer: remote.to_string(),
                detail: format!(
                    "the peer did not complete the connection ({})",
                    os_status(ev.status)
                ),
            });
        }
        k => return Err(unexpected(&id, k, "the accept")),
    }
    let local = id.local_addr();
    Ok(Connection {
        qp: Qp::from_shared(qp.shared.clone()),
        peer,
        app: Some(s.app),
        link: Link::Cm(id),
        local,
        remote,
        done: AtomicBool::new(false),
    })
}

// ---------------------------------------------------------------------------------------------
// Socket addresses.

fn to_sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_storage is a valid (AF_UNSPEC) value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn from_sockaddr(p: *const libc::sockaddr) -> Option<SocketAddr> {
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` points to a socket address inside a live rdma_cm identifier, whose storage
    // (a union of sockaddr_in/in6/ib/storage) is large enough for the family it states.
    unsafe {
        match (*p).sa_family as c_int {
            libc::AF_INET => {
                let sin = &*(p.cast::<libc::sockaddr_in>());
                Some(SocketAddr::new(
                    IpAddr::V4(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes())),
                    u16::from_be(sin.sin_port),
                ))
            }
            libc::AF_INET6 => {
                let sin6 = &*(p.cast::<libc::sockaddr_in6>());
                Some(SocketAddr::new(
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
                    u16::from_be(sin6.sin6_port),
                ))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                gid: crate::device::Gid::ZERO,
                lid: 0,
                mtu: crate::device::Mtu::Mtu1024,
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

    #[test]
    fn socket_addresses_round_trip() {
        for a in ["10.1.2.3:7471", "[fe80::1]:18515", "0.0.0.0:0"] {
            let a: SocketAddr = a.parse().unwrap();
            let (ss, _) = to_sockaddr(a);
            let back = from_sockaddr((&ss as *const libc::sockaddr_storage).cast());
            assert_eq!(back, Some(a));
        }
    }
}

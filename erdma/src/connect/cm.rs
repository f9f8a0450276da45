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
//!     Ok(Setup::new(&pd, QpConfig::new(&cq))
//!         .access(Access::ALL)
//!         .grant(mr.remote())
//!         .with((cq, mr)))
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
//! Why not `rdma_create_qp`: it would build the queue pair outside the SDK's create path (no limit
//! checks, no slot rings) and tie its destruction to the identifier, while the kernel needs only
//! the queue pair's number (`rdma_connect`/`rdma_accept` carry it) on both transports.
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
//! InfiniBand/RoCE, 251 either way on iWARP ([`IWARP_PRIVATE_DATA`]). A [`PeerInfo`] takes 20 bytes plus 20 per region plus the user
//! data: on RoCE the connecting side can grant one region with 16 bytes of user data, the
//! accepting side eight regions. Larger descriptions are refused with a clear error; exchange them
//! over the connection itself.
//!
//! Must not: block without a deadline, or touch a queue pair of another device.
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use erdma_sys as sys;

use super::PeerInfo;
use crate::context::{Context, OpenOptions};
use crate::error::{Error, Result};
use crate::limits::ProfileKind;
use crate::mr::RemoteMr;
use crate::pd::Pd;
use crate::qp::{Init, InitOptions, Qp, QpConfig, Rts};
use crate::vocab::{Access, PeerLoss};

mod iwarp;
mod private;
mod rdma;
mod soft;
mod watch;

pub use iwarp::device_ipv4;
pub use private::decode_private;
use rdma::{Channel, CmId, cm_accept, cm_connect, cm_listen};
use soft::{soft_accept, soft_connect};
use watch::Watch;
pub use watch::{DEFAULT_HEARTBEAT, DEFAULT_PEER_TIMEOUT};

/// Largest private data of a connection request on InfiniBand/RoCE (92 bytes less rdma_cm's
/// 36-byte header).
pub const IB_CONNECT_PRIVATE_DATA: usize = 56;
/// Largest private data of an accept (REP) on InfiniBand/RoCE.
pub const IB_ACCEPT_PRIVATE_DATA: usize = 196;
/// Largest private data of a reject (REJ) on InfiniBand/RoCE.
pub const IB_REJECT_PRIVATE_DATA: usize = 148;
/// Largest private data of a connection request, an accept or a reject on iWARP. An MPA frame
/// carries at most 256 bytes (`RDMA_MAX_PRIVATE_DATA`), and MPA version 2 spends 4 of them on
/// the IRD/ORD negotiation, which leaves 252; siw then counts the 4 bytes into a one-byte
/// length, so 252 bytes go out as a frame announcing none, and the peer rejects it. 251 is what
/// every iWARP device carries.
pub const IWARP_PRIVATE_DATA: usize = 251;

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
    /// How often each side of a soft connection tells the other it is alive (default
    /// [`DEFAULT_HEARTBEAT`], 500 ms: one byte on the TCP link each time). Not used by rdma_cm.
    pub heartbeat: Option<Duration>,
    /// How long a soft connection's peer may stay silent before it is declared lost and the
    /// queue pair is moved to the error state (default [`DEFAULT_PEER_TIMEOUT`], 5 s: ten
    /// heartbeats, so a peer stalled for a moment is not declared lost). The bound for a peer
    /// whose host or network vanishes without closing the connection; a peer process that exits
    /// or is killed is noticed when its kernel closes the connection, at once. Not used by
    /// rdma_cm.
    pub peer_timeout: Option<Duration>,
}

impl Options {
    fn open_options(&self) -> OpenOptions {
        OpenOptions {
            profile: self.profile,
        }
    }
}

/// What [`Setup::on_init`] runs.
type InitHook = Box<dyn FnOnce(&Qp<Init>) -> Result<()> + Send>;

/// What `setup` returns: the protection domain and queue-pair configuration to connect with,
/// the access rights peers get, the regions and user data to send the peer, and any value of the
/// application's (`app`, handed back by [`Connection::app`]).
pub struct Setup<T = ()> {
    pd: Pd,
    config: QpConfig,
    access: Access,
    regions: Vec<RemoteMr>,
    user: Vec<u8>,
    on_init: Option<InitHook>,
    app: T,
}

impl Setup<()> {
    /// Connect a queue pair made with `config` on `pd`. Peers get no remote access to it (they
    /// may SEND) until [`Setup::access`] grants it — least privilege, as
    /// [`InitOptions::default`]; nothing granted yet.
    pub fn new(pd: &Pd, config: QpConfig) -> Setup<()> {
        Setup {
            pd: pd.clone(),
            config,
            access: InitOptions::default().access,
            regions: Vec::new(),
            user: Vec::new(),
            on_init: None,
            app: (),
        }
    }
}

impl<T> Setup<T> {
    /// What peers may do to this queue pair's memory (checked together with each region's
    /// rights; default: nothing). A peer that READs or WRITEs the regions this side grants
    /// needs `Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ` (or
    /// [`Access::ALL`] with atomics).
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

    /// Runs `f` on the queue pair once it is in INIT, before the connection is requested or
    /// accepted: the place to post the receives the peer's first messages land in. On iWARP a
    /// SEND that finds no receive posted breaks the connection (there is no receiver-not-ready
    /// retry), and the peer may send the moment it is connected, before this side's
    /// [`connect`] or [`Listener::accept`] has returned. An error from `f` fails the connection
    /// (the passive side rejects with it).
    ///
    /// The receives' memory must outlive them: a `'static` region ([`Qp::post_recv`]), or one
    /// that lives as long as the queue pair, posted with [`Qp::post_recv_raw`].
    pub fn on_init(mut self, f: impl FnOnce(&Qp<Init>) -> Result<()> + Send + 'static) -> Self {
        self.on_init = Some(Box::new(f));
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
            on_init: self.on_init,
            app,
        }
    }

    /// Runs the [`Setup::on_init`] hook, once.
    fn run_on_init(&mut self, qp: &Qp<Init>) -> Result<()> {
        match self.on_init.take() {
            Some(f) => f(qp),
            None => Ok(()),
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
            .field("on_init", &self.on_init.is_some())
            .finish_non_exhaustive()
    }
}

/// A connected queue pair with what the peer sent. Dropping it disconnects and moves the queue
/// pair to the error state.
///
/// # Liveness
/// The connection watches its peer for as long as it lives (a thread of its own): when the peer
/// goes away, the SDK moves the queue pair to the error state, so every request still
/// outstanding — receives included, which RC itself never times out — completes with
/// `WR_FLUSH_ERR` whose [`crate::Completion::cause`] is [`crate::QpFailure::PeerLost`], and later
/// posts fail with [`Error::QpInError`]. When:
/// - the peer's process exits or is killed (soft: its kernel closes the TCP link): as the close
///   arrives, after at most 100 ms more while sends of this side still wait for their
///   completions (their acknowledgements may be on the way) — on loopback, flushes complete
///   within a few milliseconds
///   (`erdma/tests/liveness.rs` asserts under 500 ms after the peer's death);
/// - the peer's host or the network vanishes silently (soft): after [`Options::peer_timeout`]
///   (5 s by default) without a heartbeat, plus at most one [`Options::heartbeat`];
/// - the peer disconnects ([`Connection::disconnect`] or dropping its connection): at once (with
///   the same 100 ms for outstanding sends);
/// - rdma_cm: when the identifier reports DISCONNECTED (the peer disconnected, or the kernel's
///   connection manager gave up on it: its timeouts, not the SDK's, bound that case).
///
/// Outstanding sends fail anyway within (retry_cnt + 1) × the ACK timeout of a peer that stops
/// answering (`RETRY_EXC_ERR`, 7 retries of ~67 ms by default); the liveness channel is what
/// bounds posted receives, and sends that find the peer gone sooner.
pub struct Connection<T = ()> {
    qp: Qp<Rts>,
    peer: PeerInfo,
    app: Option<T>,
    link: Link,
    local: Option<SocketAddr>,
    remote: SocketAddr,
    done: AtomicBool,
    watch: Arc<Watch>,
    watcher: Mutex<Option<std::thread::JoinHandle<()>>>,
}

enum Link {
    Cm(Arc<CmId>),
    Soft(Mutex<TcpStream>),
}

impl<T> Connection<T> {
    /// A connection over `link`, watched from now on.
    fn start(
        qp: Qp<Rts>,
        peer: PeerInfo,
        app: T,
        link: Link,
        local: Option<SocketAddr>,
        remote: SocketAddr,
        options: &Options,
    ) -> Result<Connection<T>> {
        let watch = Arc::new(Watch::default());
        let watcher = match &link {
            Link::Cm(id) => watch::spawn_cm(id.clone(), &qp, watch.clone()),
            Link::Soft(stream) => {
                let stream = stream
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .try_clone()
                    .map_err(|e| Error::io("duplicating a connection's socket", e))?;
                watch::spawn_soft(
                    stream,
                    qp.clone(),
                    watch.clone(),
                    options.heartbeat.unwrap_or(DEFAULT_HEARTBEAT),
                    options.peer_timeout.unwrap_or(DEFAULT_PEER_TIMEOUT),
                )
            }
        }?;
        Ok(Connection {
            qp,
            peer,
            app: Some(app),
            link,
            local,
            remote,
            done: AtomicBool::new(false),
            watch,
            watcher: Mutex::new(Some(watcher)),
        })
    }

    /// How the peer was lost, once it has been (its queue pair is then in the error state).
    /// `None` while it is connected, and after this side disconnected first.
    pub fn peer_lost(&self) -> Option<PeerLoss> {
        // The queue pair's cause is recorded before its flushes exist, so a flush seen naming
        // the peer means this says so too.
        match self.qp.failure() {
            Some(crate::vocab::QpFailure::PeerLost(how)) => Some(how),
            _ => None,
        }
    }

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

    /// Waits until the peer disconnects (or is lost), then completes the disconnect here (the
    /// queue pair is in the error state).
    ///
    /// # Errors
    /// [`Error::Timeout`] when the peer stays connected past `timeout`.
    pub fn wait_disconnected(&self, timeout: Duration) -> Result<()> {
        if self.done.load(Ordering::Acquire) {
            return Ok(());
        }
        let deadline = crate::sync::deadline(timeout);
        self.watch
            .wait_end(deadline, &format!("{} to disconnect", self.remote))?;
        self.finish();
        Ok(())
    }

    /// Disconnects and waits up to `timeout` for the peer to acknowledge. The queue pair goes to
    /// the error state whatever happens.
    ///
    /// As with any RC teardown, the side that sends last should disconnect first, once its sends
    /// have completed: a message whose receive completion this side has just seen may not be
    /// acknowledged yet, and leaving RTS can drop that acknowledgement (the peer's send then
    /// fails with a retry error although the data arrived).
    ///
    /// # Errors
    /// [`Error::Timeout`] when the peer does not acknowledge in time (this side is disconnected
    /// anyway).
    pub fn disconnect(self, timeout: Duration) -> Result<()> {
        if self.done.load(Ordering::Acquire) {
            // Already disconnected (the peer went first, and `wait_disconnected` saw it).
            return Ok(());
        }
        let deadline = crate::sync::deadline(timeout);
        let what = format!("{} to acknowledge the disconnect", self.remote);
        self.watch.set_closing();
        match &self.link {
            Link::Cm(id) => id.disconnect_now(),
            Link::Soft(stream) => {
                let _ = stream
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .shutdown(Shutdown::Write);
            }
        }
        let result = self.watch.wait_end(deadline, &what).map(|_| ());
        self.finish();
        result
    }

    fn finish(&self) {
        if self.done.swap(true, Ordering::AcqRel) {
            return;
        }
        self.watch.stop();
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
        let watcher = self
            .watcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let (Some(w), Link::Soft(_)) = (watcher, &self.link) {
            // The link is shut: the watcher's next read returns at once. (An rdma_cm watcher
            // ends by itself within its 50 ms tick; it is not waited for.)
            let _ = w.join();
        }
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
    let deadline = crate::sync::deadline(timeout);
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

#[derive(Clone)]
enum ListenerInner {
    Cm(Arc<CmId>),
    Soft(Arc<super::Listener>),
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
            Route::Soft(_) => ListenerInner::Soft(Arc::new(super::Listener::bind(local)?)),
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
        let deadline = crate::sync::deadline(timeout);
        match &self.inner {
            ListenerInner::Cm(id) => cm_accept(id, deadline, &self.options, setup),
            ListenerInner::Soft(l) => soft_accept(l, deadline, &self.options, setup),
        }
    }

    /// [`Listener::accept`] for async code (tokio): the accept runs on tokio's blocking pool,
    /// so the task's thread stays free.
    ///
    /// Cancel-safety: dropping the future does not stop the accept; it goes on until it
    /// succeeds, fails or times out, and a connection it made is then dropped (disconnected, its
    /// queue pair moved to the error state). Bound that with `timeout`.
    ///
    /// # Errors
    /// As [`Listener::accept`].
    #[cfg(feature = "tokio")]
    pub async fn accept_async<T, F>(&self, timeout: Duration, setup: F) -> Result<Connection<T>>
    where
        T: Send + 'static,
        F: FnOnce(&Context) -> Result<Setup<T>> + Send + 'static,
    {
        let listener = Listener {
            inner: self.inner.clone(),
            options: self.options.clone(),
        };
        blocking(move || listener.accept(timeout, setup)).await
    }
}

/// [`connect_with`] for async code (tokio): the connection is made on tokio's blocking pool, so
/// the task's thread stays free. The connection that comes back is the same, with its liveness
/// watch ([`Connection`]).
///
/// Cancel-safety: dropping the future does not stop the attempt; it goes on until it succeeds,
/// fails or times out, and a connection it made is then dropped (disconnected, its queue pair
/// moved to the error state). Bound that with `timeout`.
///
/// # Errors
/// As [`connect`].
#[cfg(feature = "tokio")]
pub async fn connect_async<T, A, F>(
    addr: A,
    timeout: Duration,
    options: Options,
    setup: F,
) -> Result<Connection<T>>
where
    T: Send + 'static,
    A: ToSocketAddrs + std::fmt::Debug + Send + 'static,
    F: FnOnce(&Context) -> Result<Setup<T>> + Send + 'static,
{
    blocking(move || connect_with(addr, timeout, &options, setup)).await
}

/// Runs `f` on tokio's blocking pool; a panic there is the caller's panic.
#[cfg(feature = "tokio")]
async fn blocking<R: Send + 'static>(f: impl FnOnce() -> Result<R> + Send + 'static) -> Result<R> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(Error::io(
            "connecting on tokio's blocking pool",
            std::io::Error::other(e.to_string()),
        )),
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

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

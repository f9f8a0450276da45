//! Reliable-connected queue pairs, with their states as types.
//!
//! Owns: [`Qp`] and its state markers ([`Reset`] → [`Init`] → [`Rtr`] → [`Rts`]), the
//! attributes of each transition, [`QpCaps`]/[`QpConfig`], [`QpEndpoint`] (what peers exchange to
//! connect) and the bookkeeping that maps device completions back to the application's requests.
//!
//! Posting sends needs `Qp<Rts>`; posting receives needs `Init` or later. The error state is not a
//! type: a queue pair can fall into it at any moment (a peer's NAK, retries exhausted), and the
//! SDK reports it through completion statuses and [`Qp::state`], never hides it.
//!
//! Every posted request takes one slot of a per-queue ring; the device sees the slot's sequence
//! number as its `wr_id`. That is what lets a scope know when the device is done with its memory,
//! and what keeps an unsignaled send queue from stalling: the SDK signals at least every half
//! queue on its own and hides those completions.

#![allow(unsafe_code)] // the raw posting path

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::cq::Cq;
use crate::error::{Error, Result};
use crate::owned::check_user_wr_id;
use crate::pd::Pd;
use crate::provider::{Batch, RecvReq, SendReq};
use crate::vocab::Limit;
use crate::vocab::{Access, Gid, Mtu, QpAttr};
use crate::vocab::{AddressVector, QpCaps, QpState};
use crate::wr::{RawRecvWr, RawSendWr, RecvWr, SendWr};

/// How to create a queue pair: its completion queues and capacities.
#[derive(Debug, Clone)]
pub struct QpConfig {
    pub(crate) send_cq: Cq,
    pub(crate) recv_cq: Cq,
    pub(crate) caps: QpCaps,
    pub(crate) sig_all: bool,
}

impl QpConfig {
    /// Both queues complete into `cq`; default capacities (128 deep, 1 SGE, 64 inline bytes).
    pub fn new(cq: &Cq) -> QpConfig {
        QpConfig {
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            caps: QpCaps::default(),
            sig_all: false,
        }
    }

    /// Send completions go to `cq`.
    pub fn send_cq(mut self, cq: &Cq) -> Self {
        self.send_cq = cq.clone();
        self
    }

    /// Receive completions go to `cq`.
    pub fn recv_cq(mut self, cq: &Cq) -> Self {
        self.recv_cq = cq.clone();
        self
    }

    /// All capacities at once.
    pub fn caps(mut self, caps: QpCaps) -> Self {
        self.caps = caps;
        self
    }

    /// Send queue depth.
    pub fn max_send_wr(mut self, n: u32) -> Self {
        self.caps.max_send_wr = n;
        self
    }

    /// Receive queue depth.
    pub fn max_recv_wr(mut self, n: u32) -> Self {
        self.caps.max_recv_wr = n;
        self
    }

    /// SGEs per send request.
    pub fn max_send_sge(mut self, n: u32) -> Self {
        self.caps.max_send_sge = n;
        self
    }

    /// SGEs per receive request.
    pub fn max_recv_sge(mut self, n: u32) -> Self {
        self.caps.max_recv_sge = n;
        self
    }

    /// Inline bytes per send request.
    pub fn max_inline_data(mut self, n: u32) -> Self {
        self.caps.max_inline_data = n;
        self
    }

    /// Signal every send request, whatever its flags say.
    pub fn signal_all(mut self, yes: bool) -> Self {
        self.sig_all = yes;
        self
    }
}

/// Transition to INIT.
///
/// The default: port 1, P_Key index 0, and no remote access — peers may SEND to the queue pair
/// but not READ, WRITE or run atomics on its memory until the application asks for it:
///
/// ```
/// use erdma::{Access, InitOptions};
/// // A queue pair whose peer WRITEs into and READs from this side's regions.
/// let init = InitOptions {
///     access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
///     ..InitOptions::default()
/// };
/// assert_eq!(InitOptions::default().access, Access::empty());
/// # let _ = init;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitOptions {
    /// Physical port (1-based; default 1).
    pub port: u8,
    /// P_Key index (0 on RoCE and eRDMA; default 0).
    pub pkey_index: u16,
    /// What peers may do to this queue pair's memory (checked together with each region's
    /// rights). Default: nothing (least privilege); `REMOTE_WRITE` and `REMOTE_ATOMIC` need
    /// `LOCAL_WRITE` as well.
    pub access: Access,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            port: 1,
            pkey_index: 0,
            access: Access::empty(),
        }
    }
}

/// Transition to RTR (ready to receive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrOptions {
    /// The peer's queue pair number.
    pub dest_qp_num: u32,
    /// The first PSN expected from the peer (its send PSN).
    pub rq_psn: u32,
    /// Path MTU; both ends must agree.
    pub path_mtu: Mtu,
    /// Route to the peer.
    pub av: AddressVector,
    /// READ/atomics the peer may have outstanding at us (IRD).
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code sent when no receive is posted (IB encoding: 12 = 0.64 ms).
    pub min_rnr_timer: u8,
}

/// Transition to RTS (ready to send).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsOptions {
    /// Our first send PSN (what the peer put in its `rq_psn`).
    pub sq_psn: u32,
    /// Local ACK timeout: 4.096 µs × 2^timeout (0 = none; [`RtsOptions::new`]: 14 ≈ 67 ms).
    pub timeout: u8,
    /// Transport retries before RETRY_EXC_ERR (0..7; [`RtsOptions::new`]: 7). A peer that stops
    /// answering fails the oldest outstanding send after (retry_cnt + 1) × the ACK timeout
    /// (≈ 537 ms by default); posted receives never time out on their own.
    pub retry_cnt: u8,
    /// RNR retries (0..6; 7 = retry forever; [`RtsOptions::new`]: 7).
    pub rnr_retry: u8,
    /// READ/atomics we may have outstanding (ORD).
    pub max_rd_atomic: u8,
}

impl RtsOptions {
    /// The usual values: timeout 14, 7 retries, infinite RNR retries.
    pub fn new(sq_psn: u32, max_rd_atomic: u8) -> RtsOptions {
        RtsOptions {
            sq_psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic,
        }
    }
}

/// What a peer needs to connect to a queue pair: exchanged out of band.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEndpoint {
    /// Queue pair number.
    pub qp_num: u32,
    /// First send PSN.
    pub psn: u32,
    /// GID to send to.
    pub gid: Gid,
    /// LID (InfiniBand only).
    pub lid: u16,
    /// The largest path MTU this side can use.
    pub mtu: Mtu,
}

/// Options for [`Qp::connect`]; the defaults suit eRDMA, rxe and the soft device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Local GID index (default: the IPv4-mapped RoCEv2 GID, found in the table).
    pub sgid_index: Option<u8>,
    /// Path MTU (default: the smaller of the two ends' MTUs).
    pub path_mtu: Option<Mtu>,
    /// Local ACK timeout code: 4.096 µs × 2^timeout (default 14 ≈ 67 ms; 0 = none).
    pub timeout: u8,
    /// Transport retries before RETRY_EXC_ERR (default 7). A peer that stops answering fails
    /// the oldest outstanding send after (retry_cnt + 1) × the ACK timeout (≈ 537 ms by
    /// default). Posted receives never time out on their own: a connection from
    /// [`crate::connect::cm`] watches the peer and flushes them when it goes away.
    pub retry_cnt: u8,
    /// RNR retries (default 7 = forever).
    pub rnr_retry: u8,
    /// RNR NAK timer code sent when no receive is posted (default 12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// Our outstanding READ/atomics (default: the device's limit, at most 16).
    pub max_rd_atomic: Option<u8>,
    /// The peer's outstanding READ/atomics at us (default: the device's limit, at most 16).
    pub max_dest_rd_atomic: Option<u8>,
    /// IP traffic class (default 0).
    pub traffic_class: u8,
    /// IP hop limit (default 64).
    pub hop_limit: u8,
    /// Local port (default 1).
    pub port: u8,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            sgid_index: None,
            path_mtu: None,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: None,
            max_dest_rd_atomic: None,
            traffic_class: 0,
            hop_limit: 64,
            port: 1,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A queue pair state that is known at compile time.
pub trait StateMarker: sealed::Sealed + Send + Sync + 'static {
    /// The state it stands for.
    const STATE: QpState;
}

/// A state in which receives may be posted (INIT, RTR, RTS).
pub trait CanRecv: StateMarker {}

macro_rules! state_marker {
    ($(#[$doc:meta])* $name:ident, $state:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy)]
        pub enum $name {}
        impl sealed::Sealed for $name {}
        impl StateMarker for $name {
            const STATE: QpState = $state;
        }
    };
}

state_marker!(
    /// RESET: just created.
    Reset,
    QpState::Reset
);
state_marker!(
    /// INIT: receives may be posted.
    Init,
    QpState::Init
);
state_marker!(
    /// RTR: ready to receive.
    Rtr,
    QpState::Rtr
);
state_marker!(
    /// RTS: ready to send.
    Rts,
    QpState::Rts
);

impl CanRecv for Init {}
impl CanRecv for Rtr {}
impl CanRecv for Rts {}

/// A reliable-connected queue pair in state `S`.
///
/// Only `Qp<Rts>` is `Clone`: the earlier states are steps of a transition sequence owned by one
/// piece of code, while a connected queue pair may be shared by many threads.
pub struct Qp<S: StateMarker = Rts> {
    pub(crate) shared: Arc<QpShared>,
    _state: PhantomData<S>,
}

impl Clone for Qp<Rts> {
    fn clone(&self) -> Self {
        Qp {
            shared: self.shared.clone(),
            _state: PhantomData,
        }
    }
}

impl<S: StateMarker> fmt::Debug for Qp<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Qp")
            .field("qp_num", &format_args!("{:#x}", self.shared.qp_num))
            .field("state", &S::STATE)
            .field("device", &self.shared.pd.context().name())
            .finish()
    }
}

/// A failed state transition: the error, and the queue pair back in its previous state.
pub struct TransitionError<S: StateMarker> {
    /// What went wrong.
    pub error: Error,
    /// The queue pair, unchanged.
    pub qp: Qp<S>,
}

impl<S: StateMarker> fmt::Debug for TransitionError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransitionError")
            .field("error", &self.error)
            .field("qp", &self.qp)
            .finish()
    }
}

impl<S: StateMarker> fmt::Display for TransitionError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "queue pair {:#x}: transition from {} failed: {}",
            self.qp.shared.qp_num,
            S::STATE,
            self.error
        )
    }
}

impl<S: StateMarker> std::error::Error for TransitionError<S> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<S: StateMarker> From<TransitionError<S>> for Error {
    fn from(e: TransitionError<S>) -> Error {
        e.error
    }
}

type Transition<T, S> = std::result::Result<Qp<T>, TransitionError<S>>;

impl<S: StateMarker> Qp<S> {
    pub(crate) fn from_shared(shared: Arc<QpShared>) -> Qp<S> {
        Qp {
            shared,
            _state: PhantomData,
        }
    }

    fn into_state<T: StateMarker>(self) -> Qp<T> {
        Qp {
            shared: self.shared,
            _state: PhantomData,
        }
    }

    fn transition<T: StateMarker>(self, attr: QpAttr) -> Transition<T, S> {
        match self.shared.modify(&attr) {
            Ok(()) => Ok(self.into_state()),
            Err(error) => Err(TransitionError { error, qp: self }),
        }
    }

    /// The queue pair number.
    pub fn qp_num(&self) -> u32 {
        self.shared.qp_num
    }

    /// The capacities the device granted.
    pub fn caps(&self) -> QpCaps {
        self.shared.caps
    }

    /// The protection domain.
    pub fn pd(&self) -> &Pd {
        &self.shared.pd
    }

    /// The send completion queue.
    pub fn send_cq(&self) -> &Cq {
        &self.shared.send_cq
    }

    /// The receive completion queue.
    pub fn recv_cq(&self) -> &Cq {
        &self.shared.recv_cq
    }

    /// The PSN this queue pair starts sending with (random, chosen at creation; what
    /// [`Qp::endpoint`] advertises).
    pub fn initial_psn(&self) -> u32 {
        self.shared.initial_psn
    }

    /// The state the device reports now (it may be ERR whatever the type says).
    ///
    /// # Errors
    /// [`Error::MissingCapability`] on a device that does not report it (siw);
    /// [`Error::Verb`] when the query fails.
    pub fn state(&self) -> Result<QpState> {
        let ctx = self.shared.pd.context();
        ctx.limits()
            .require(crate::Capability::QpStateQuery, ctx.name())?;
        self.shared.imp.query_state(self.shared.ctx())
    }

    /// What a peer needs to connect to this queue pair: its number, initial PSN, the
    /// IPv4-mapped GID of `port` (or the first GID) and the port's active MTU.
    ///
    /// # Errors
    /// [`Error::Verb`] when the port or GID table cannot be read.
    pub fn endpoint(&self) -> Result<QpEndpoint> {
        let ctx = self.shared.pd.context();
        let port = ctx.query_port(1)?;
        let gid = match ctx.ipv4_gid(1) {
            Ok(e) => e.gid,
            Err(_) => ctx
                .gid_table(1)?
                .first()
                .map(|e| e.gid)
                .unwrap_or(Gid::ZERO),
        };
        Ok(QpEndpoint {
            qp_num: self.shared.qp_num,
            psn: self.shared.initial_psn,
            gid,
            lid: port.lid,
            mtu: port.active_mtu,
        })
    }

    /// What put the queue pair in the error state, as far as the SDK saw it: the first request
    /// that failed (once its completion has been polled), a lost peer (a connection's liveness
    /// channel, see [`crate::connect::cm`]) or [`Qp::to_error`]. `None` while it has not failed.
    pub fn failure(&self) -> Option<crate::vocab::QpFailure> {
        self.shared.failure()
    }

    /// Moves the queue pair to the error state: every outstanding request, receives included,
    /// completes with `WR_FLUSH_ERR` (whose [`crate::Completion::cause`] says
    /// [`crate::QpFailure::Local`] unless an earlier failure was known), nothing more is sent,
    /// and later posts fail at once with [`Error::QpInError`].
    ///
    /// # Errors
    /// [`Error::Verb`] when the device refuses.
    pub fn to_error(&self) -> Result<()> {
        self.shared.modify(&QpAttr {
            state: Some(QpState::Err),
            ..QpAttr::EMPTY
        })
    }
}

impl Qp<Reset> {
    /// RESET → INIT.
    ///
    /// # Errors
    /// A [`TransitionError`] with the queue pair back.
    pub fn init(self, attr: &InitOptions) -> Transition<Init, Reset> {
        if let Err(error) = crate::mr::check_access(attr.access) {
            return Err(TransitionError { error, qp: self });
        }
        self.transition(QpAttr {
            state: Some(QpState::Init),
            port: Some(attr.port),
            pkey_index: Some(attr.pkey_index),
            access: Some(attr.access),
            ..QpAttr::EMPTY
        })
    }
}

impl Qp<Init> {
    /// INIT → RTR.
    ///
    /// # Errors
    /// A [`TransitionError`] (limits are checked first) with the queue pair back.
    pub fn rtr(self, attr: &RtrOptions) -> Transition<Rtr, Init> {
        if let Err(error) = self.shared.check_rtr(attr) {
            return Err(TransitionError { error, qp: self });
        }
        self.transition(QpAttr {
            state: Some(QpState::Rtr),
            path_mtu: Some(attr.path_mtu),
            dest_qp_num: Some(attr.dest_qp_num),
            rq_psn: Some(attr.rq_psn),
            max_dest_rd_atomic: Some(attr.max_dest_rd_atomic),
            min_rnr_timer: Some(attr.min_rnr_timer),
            av: Some(attr.av),
            ..QpAttr::EMPTY
        })
    }

    /// INIT → RTR → RTS in one call, from the peer's [`QpEndpoint`].
    ///
    /// # Errors
    /// A [`TransitionError`] with the queue pair back in INIT (a failure at RTS leaves the device
    /// in RTR; the returned handle then reports INIT, and the queue pair should be dropped).
    pub fn connect(self, remote: &QpEndpoint, opts: &ConnectOptions) -> Transition<Rts, Init> {
        let plan = match self.shared.plan_connect(remote, opts) {
            Ok(p) => p,
            Err(error) => return Err(TransitionError { error, qp: self }),
        };
        let rtr = self.rtr(&plan.0)?;
        match rtr.rts(&plan.1) {
            Ok(qp) => Ok(qp),
            Err(e) => Err(TransitionError {
                error: e.error,
                qp: e.qp.into_state(),
            }),
        }
    }
}

impl Qp<Rtr> {
    /// RTR → RTS.
    ///
    /// # Errors
    /// A [`TransitionError`] with the queue pair back.
    pub fn rts(self, attr: &RtsOptions) -> Transition<Rts, Rtr> {
        if let Err(error) = check_rts(&self.shared, attr) {
            return Err(TransitionError { error, qp: self });
        }
        self.transition(QpAttr {
            state: Some(QpState::Rts),
            sq_psn: Some(attr.sq_psn),
            timeout: Some(attr.timeout),
            retry_cnt: Some(attr.retry_cnt),
            rnr_retry: Some(attr.rnr_retry),
            max_rd_atomic: Some(attr.max_rd_atomic),
            ..QpAttr::EMPTY
        })
    }
}

fn check_rts(shared: &QpShared, attr: &RtsOptions) -> Result<()> {
    check_psn("sq_psn", attr.sq_psn)?;
    check_field("timeout", attr.timeout as u32, 31)?;
    check_field("retry_cnt", attr.retry_cnt as u32, 7)?;
    check_field("rnr_retry", attr.rnr_retry as u32, 7)?;
    shared
        .pd
        .context()
        .limits()
        .check_rd_atomic(Some(attr.max_rd_atomic), None)
}

fn check_psn(name: &str, psn: u32) -> Result<()> {
    check_field(name, psn, 0xff_ffff)
}

fn check_field(name: &str, v: u32, max: u32) -> Result<()> {
    if v > max {
        Err(Error::invalid(format!("{name} {v} exceeds {max}")))
    } else {
        Ok(())
    }
}

impl Qp<Rts> {
    /// Posts a send request whose local memory lives forever (`'static` regions) or that carries
    /// no registered memory at all (inline data, zero-length operations). Requests over borrowed
    /// memory go through [`crate::scope`].
    ///
    /// # Errors
    /// Limits ([`Error::LimitExceeded`]), [`Error::QueueFull`], or the device's refusal;
    /// [`Error::InvalidArgument`] for a `wr_id` whose top 16 bits are `0xE4D3` (reserved for
    /// owned-buffer requests, whose completions must reach only their owners).
    pub fn post_send(&self, wr: SendWr<'static, '_>) -> Result<()> {
        check_user_wr_id(wr.wr_id)?;
        self.shared.post_send_wrs(std::iter::once(wr), false).1
    }

    /// Posts send requests over raw addresses, as one chain (one doorbell).
    ///
    /// # Safety
    /// For every request, until its completion has been polled (or the queue pair has been
    /// destroyed):
    /// - each SGE's memory `[addr, addr+length)` must stay allocated and inside a live memory
    ///   region whose `lkey` it names (inline requests: only during this call);
    /// - memory the device writes (READ and atomic targets) must not be read or written by the
    ///   CPU, and memory the device reads (SEND/WRITE sources) must not be written by the CPU.
    ///
    /// The SDK still checks every limit, and the device still checks every key and bound.
    ///
    /// # Errors
    /// As [`Qp::post_send`]. A request the SDK refuses (a limit, a full queue) posts none of
    /// the chain; one the device refuses leaves the requests before it posted and none after.
    pub unsafe fn post_send_raw(&self, wrs: &[RawSendWr<'_>]) -> Result<()> {
        let mut reqs = Batch::of(wrs, |w| SendReq {
            wr_id: w.wr_id,
            opcode: w.opcode,
            flags: w.flags,
            sges: w.sges,
            remote_addr: w.remote.addr,
            rkey: w.remote.rkey,
            imm: w.imm,
            invalidate_rkey: w.invalidate_rkey,
            compare_add: w.compare_add,
            swap: w.swap,
        });
        for r in reqs.iter() {
            check_user_wr_id(r.wr_id)?;
            self.shared.validate_send(r, None)?;
        }
        // SAFETY: the caller's contract covers the inline bytes (readable during this call).
        unsafe { self.shared.post_reqs(&mut reqs, false) }.1
    }
}

impl<S: CanRecv> Qp<S> {
    /// Posts a receive into memory that lives forever (`'static` regions), or a receive with no
    /// buffer. Receives over borrowed memory go through [`crate::scope`].
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for too many SGEs, [`Error::QueueFull`], or the device's refusal;
    /// [`Error::InvalidArgument`] for a reserved `wr_id` (as [`Qp::post_send`]).
    pub fn post_recv(&self, wr: RecvWr<'static>) -> Result<()> {
        check_user_wr_id(wr.wr_id)?;
        self.shared.post_recv_wrs(std::iter::once(wr)).1
    }

    /// Posts receives over raw addresses.
    ///
    /// # Safety
    /// Until each receive's completion has been polled (or the queue pair destroyed), its SGEs'
    /// memory must stay allocated, inside a live region whose `lkey` it names, and untouched by
    /// the CPU.
    ///
    /// # Errors
    /// As [`Qp::post_recv`].
    pub unsafe fn post_recv_raw(&self, wrs: &[RawRecvWr<'_>]) -> Result<()> {
        let reqs = Batch::of(wrs, |w| RecvReq {
            wr_id: w.wr_id,
            sges: w.sges,
        });
        for r in reqs.iter() {
            check_user_wr_id(r.wr_id)?;
            self.shared.validate_recv(r.sges)?;
        }
        self.shared.post_recv_reqs(&reqs).1
    }
}

mod shared;

pub(crate) use shared::QpShared;

/// Connecting: the checks and the attributes of the transitions to RTR and RTS.
impl QpShared {
    fn check_rtr(&self, attr: &RtrOptions) -> Result<()> {
        self.check_manual_connect()?;
        check_psn("rq_psn", attr.rq_psn)?;
        check_field("dest_qp_num", attr.dest_qp_num, 0xff_ffff)?;
        check_field("min_rnr_timer", attr.min_rnr_timer as u32, 31)?;
        check_field("flow_label", attr.av.flow_label, 0xf_ffff)?;
        let ctx = self.pd.context();
        ctx.limits()
            .check_rd_atomic(None, Some(attr.max_dest_rd_atomic))?;
        let port = ctx.query_port(attr.av.port)?;
        if attr.path_mtu > port.max_mtu {
            return Err(Error::LimitExceeded {
                limit: Limit::PathMtu,
                requested: attr.path_mtu.bytes() as u64,
                max: port.max_mtu.bytes() as u64,
            });
        }
        Ok(())
    }

    /// An iWARP queue pair reaches RTS only through the connection manager.
    fn check_manual_connect(&self) -> Result<()> {
        let ctx = self.pd.context();
        ctx.limits()
            .require(crate::Capability::ManualConnect, ctx.name())
    }

    fn plan_connect(
        &self,
        remote: &QpEndpoint,
        opts: &ConnectOptions,
    ) -> Result<(RtrOptions, RtsOptions)> {
        self.check_manual_connect()?;
        let ctx = self.pd.context();
        let port = ctx.query_port(opts.port)?;
        let sgid_index = match opts.sgid_index {
            Some(i) => i,
            None => ctx.ipv4_gid(opts.port).map(|e| e.index).unwrap_or(0),
        };
        let path_mtu = opts
            .path_mtu
            .unwrap_or_else(|| port.active_mtu.min(remote.mtu));
        let limits = ctx.limits();
        let rd = |v: Option<u8>, max: u32| -> u8 { v.unwrap_or(max.clamp(1, 16) as u8) };
        let mut av = AddressVector::new(remote.gid, sgid_index);
        av.dlid = remote.lid;
        av.hop_limit = opts.hop_limit;
        av.traffic_class = opts.traffic_class;
        av.port = opts.port;
        Ok((
            RtrOptions {
                dest_qp_num: remote.qp_num,
                rq_psn: remote.psn,
                path_mtu,
                av,
                max_dest_rd_atomic: rd(opts.max_dest_rd_atomic, limits.max_dest_rd_atomic),
                min_rnr_timer: opts.min_rnr_timer,
            },
            RtsOptions {
                sq_psn: self.initial_psn,
                timeout: opts.timeout,
                retry_cnt: opts.retry_cnt,
                rnr_retry: opts.rnr_retry,
                max_rd_atomic: rd(opts.max_rd_atomic, limits.max_rd_atomic),
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::shared::random_psn;
    use super::*;

    #[test]
    fn psns_are_24_bit() {
        for _ in 0..100 {
            assert!(random_psn() <= 0xff_ffff);
        }
        assert!(check_psn("sq_psn", 0x100_0000).is_err());
        assert!(check_psn("sq_psn", 0xff_ffff).is_ok());
    }
}

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

use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use smallvec::SmallVec;

use crate::cq::{Completion, Cq, RECV_TAG, RawWc, WC_WITH_IMM, WC_WITH_INV, WcOpcode, WcStatus};
use crate::device::{Gid, Mtu};
use crate::error::{Error, Result, WorkQueue};
use crate::limits::{self, Limit};
use crate::mr::Access;
use crate::pd::Pd;
use crate::provider::QpImpl;
use crate::wr::{
    Batch, RawRecvWr, RawSendWr, RecvReq, RecvWr, SendFlags, SendReq, SendWr, Sge, WrOpcode,
};

/// A queue pair's state (the `IBV_QPS_*` numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created or reset.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained.
    Sqd,
    /// Send queue error.
    Sqe,
    /// Error: every outstanding request is flushed.
    Err,
    /// A value this SDK does not know.
    Unknown(u32),
}

impl QpState {
    /// From the verbs value.
    pub fn from_raw(v: u32) -> QpState {
        match v {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            4 => QpState::Sqd,
            5 => QpState::Sqe,
            6 => QpState::Err,
            n => QpState::Unknown(n),
        }
    }

    /// The verbs value.
    pub fn as_raw(self) -> u32 {
        match self {
            QpState::Reset => 0,
            QpState::Init => 1,
            QpState::Rtr => 2,
            QpState::Rts => 3,
            QpState::Sqd => 4,
            QpState::Sqe => 5,
            QpState::Err => 6,
            QpState::Unknown(n) => n,
        }
    }
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QpState::Reset => f.write_str("RESET"),
            QpState::Init => f.write_str("INIT"),
            QpState::Rtr => f.write_str("RTR"),
            QpState::Rts => f.write_str("RTS"),
            QpState::Sqd => f.write_str("SQD"),
            QpState::Sqe => f.write_str("SQE"),
            QpState::Err => f.write_str("ERR"),
            QpState::Unknown(n) => write!(f, "UNKNOWN({n})"),
        }
    }
}

/// Queue capacities of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send request.
    pub max_send_sge: u32,
    /// SGEs per receive request.
    pub max_recv_sge: u32,
    /// Inline bytes per send request.
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        }
    }
}

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitAttr {
    /// Physical port (1-based).
    pub port: u8,
    /// P_Key index (0 on RoCE and eRDMA).
    pub pkey_index: u16,
    /// What peers may do to this queue pair's memory (checked together with each region's
    /// rights).
    pub access: Access,
}

impl Default for InitAttr {
    fn default() -> Self {
        InitAttr {
            port: 1,
            pkey_index: 0,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        }
    }
}

/// How to reach the peer (the RoCE global route header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressVector {
    /// The peer's GID.
    pub dgid: Gid,
    /// Which entry of the local GID table to send from.
    pub sgid_index: u8,
    /// IP TTL / hop limit.
    pub hop_limit: u8,
    /// IP traffic class (DSCP + ECN).
    pub traffic_class: u8,
    /// IPv6 flow label (also picks the UDP source port on RoCE).
    pub flow_label: u32,
    /// Service level.
    pub sl: u8,
    /// Destination LID (InfiniBand only; 0 on RoCE).
    pub dlid: u16,
    /// Local port.
    pub port: u8,
}

impl AddressVector {
    /// A route to `dgid` from local GID `sgid_index`, with the usual defaults.
    pub fn new(dgid: Gid, sgid_index: u8) -> AddressVector {
        AddressVector {
            dgid,
            sgid_index,
            hop_limit: 64,
            traffic_class: 0,
            flow_label: 0,
            sl: 0,
            dlid: 0,
            port: 1,
        }
    }
}

/// Transition to RTR (ready to receive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrAttr {
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
pub struct RtsAttr {
    /// Our first send PSN (what the peer put in its `rq_psn`).
    pub sq_psn: u32,
    /// Local ACK timeout: 4.096 µs × 2^timeout (0 = none; 14 ≈ 67 ms).
    pub timeout: u8,
    /// Transport retries before RETRY_EXC_ERR (0..7).
    pub retry_cnt: u8,
    /// RNR retries (0..6; 7 = retry forever).
    pub rnr_retry: u8,
    /// READ/atomics we may have outstanding (ORD).
    pub max_rd_atomic: u8,
}

impl RtsAttr {
    /// The usual values: timeout 14, 7 retries, infinite RNR retries.
    pub fn new(sq_psn: u32, max_rd_atomic: u8) -> RtsAttr {
        RtsAttr {
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
    /// Local ACK timeout code.
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = forever).
    pub rnr_retry: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Our outstanding READ/atomics (default: the device's limit, at most 16).
    pub max_rd_atomic: Option<u8>,
    /// The peer's outstanding READ/atomics at us (default: the device's limit, at most 16).
    pub max_dest_rd_atomic: Option<u8>,
    /// IP traffic class.
    pub traffic_class: u8,
    /// IP hop limit.
    pub hop_limit: u8,
    /// Local port.
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

/// The attributes of one `modify` call, provider-neutral.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ModifyAttr {
    pub state: Option<QpState>,
    pub port: Option<u8>,
    pub pkey_index: Option<u16>,
    pub access: Option<Access>,
    pub path_mtu: Option<Mtu>,
    pub dest_qp_num: Option<u32>,
    pub rq_psn: Option<u32>,
    pub max_dest_rd_atomic: Option<u8>,
    pub min_rnr_timer: Option<u8>,
    pub av: Option<AddressVector>,
    pub sq_psn: Option<u32>,
    pub timeout: Option<u8>,
    pub retry_cnt: Option<u8>,
    pub rnr_retry: Option<u8>,
    pub max_rd_atomic: Option<u8>,
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

/// Runs `f` and sends the packets that this thread's posts inside it make ready together, when
/// `f` returns.
///
/// On a soft device every post normally hands its packets to the kernel before it returns (one
/// system call per post). Inside `coalesce_sends` they wait in the thread's batch, so that a
/// thread feeding several queue pairs (a striped link, a fan-out) sends them all in one call,
/// and equal-size packets of different queue pairs to one peer travel in one UDP GSO message:
/// a WRITE of several packets is three packet sizes (first, middle, last), so posted one by one
/// each WRITE costs up to three messages, and coalesced, a batch of WRITEs costs about three
/// plus one per 64 KB. The packets still leave early when the batch fills up or the thread
/// posts to another soft device; they leave when `f` unwinds, too. Nested calls send at the
/// end of the outermost one.
///
/// Use it around a burst of posts, not around waiting: nothing the posts inside `f` send has
/// left before `f` returns, so waiting inside it for their completions waits forever (or until
/// the batch fills up). Until then the queue pairs posted to also send nothing else (a
/// retransmission, a READ response, another thread's post): their packets leave in order, so
/// those wait behind the batch and leave right after it. Kernel (verbs) devices ring their doorbell on every post regardless;
/// there it only runs `f`.
pub fn coalesce_sends<R>(f: impl FnOnce() -> R) -> R {
    crate::soft::coalesce_sends(f)
}

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

    fn transition<T: StateMarker>(self, attr: ModifyAttr) -> Transition<T, S> {
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
            .require(limits::Capability::QpStateQuery, ctx.name())?;
        self.shared.imp.query_state()
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

    /// Moves the queue pair to the error state: every outstanding request completes with
    /// `WR_FLUSH_ERR` and nothing more is sent.
    ///
    /// # Errors
    /// [`Error::Verb`] when the device refuses.
    pub fn to_error(&self) -> Result<()> {
        self.shared.modify(&ModifyAttr {
            state: Some(QpState::Err),
            ..ModifyAttr::default()
        })
    }
}

impl Qp<Reset> {
    /// RESET → INIT.
    ///
    /// # Errors
    /// A [`TransitionError`] with the queue pair back.
    pub fn init(self, attr: &InitAttr) -> Transition<Init, Reset> {
        if let Err(error) = attr.access.validate() {
            return Err(TransitionError { error, qp: self });
        }
        self.transition(ModifyAttr {
            state: Some(QpState::Init),
            port: Some(attr.port),
            pkey_index: Some(attr.pkey_index),
            access: Some(attr.access),
            ..ModifyAttr::default()
        })
    }
}

impl Qp<Init> {
    /// INIT → RTR.
    ///
    /// # Errors
    /// A [`TransitionError`] (limits are checked first) with the queue pair back.
    pub fn rtr(self, attr: &RtrAttr) -> Transition<Rtr, Init> {
        if let Err(error) = self.shared.check_rtr(attr) {
            return Err(TransitionError { error, qp: self });
        }
        self.transition(ModifyAttr {
            state: Some(QpState::Rtr),
            path_mtu: Some(attr.path_mtu),
            dest_qp_num: Some(attr.dest_qp_num),
            rq_psn: Some(attr.rq_psn),
            max_dest_rd_atomic: Some(attr.max_dest_rd_atomic),
            min_rnr_timer: Some(attr.min_rnr_timer),
            av: Some(attr.av),
            ..ModifyAttr::default()
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
    pub fn rts(self, attr: &RtsAttr) -> Transition<Rts, Rtr> {
        if let Err(error) = check_rts(&self.shared, attr) {
            return Err(TransitionError { error, qp: self });
        }
        self.transition(ModifyAttr {
            state: Some(QpState::Rts),
            sq_psn: Some(attr.sq_psn),
            timeout: Some(attr.timeout),
            retry_cnt: Some(attr.retry_cnt),
            rnr_retry: Some(attr.rnr_retry),
            max_rd_atomic: Some(attr.max_rd_atomic),
            ..ModifyAttr::default()
        })
    }
}

fn check_rts(shared: &QpShared, attr: &RtsAttr) -> Result<()> {
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
    /// Limits ([`Error::LimitExceeded`]), [`Error::QueueFull`], or the device's refusal.
    pub fn post_send(&self, wr: SendWr<'static, '_>) -> Result<()> {
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
        let mut reqs = Batch::of(wrs, SendReq::from_raw);
        for r in reqs.iter() {
            self.shared.validate_send(r, None)?;
        }
        self.shared.post_reqs(&mut reqs, false).1
    }
}

impl<S: CanRecv> Qp<S> {
    /// Posts a receive into memory that lives forever (`'static` regions), or a receive with no
    /// buffer. Receives over borrowed memory go through [`crate::scope`].
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] for too many SGEs, [`Error::QueueFull`], or the device's refusal.
    pub fn post_recv(&self, wr: RecvWr<'static>) -> Result<()> {
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
            self.shared.validate_recv(r.sges)?;
        }
        self.shared.post_recv_reqs(&reqs).1
    }
}

/// Ring of in-flight requests of one work queue.
struct Ring {
    /// User `wr_id` and whether the user asked for a completion, per slot.
    slots: Box<[(u64, bool)]>,
    /// Sequence number of the next request.
    head: u64,
    /// Every request below this has completed.
    retired: u64,
    /// Requests posted without a device-level signal since the last signaled one.
    unsignaled_run: u32,
}

impl Ring {
    fn new(depth: u32) -> Ring {
        Ring {
            slots: vec![(0u64, false); depth.max(1) as usize].into_boxed_slice(),
            head: 0,
            retired: 0,
            unsignaled_run: 0,
        }
    }

    fn depth(&self) -> u64 {
        self.slots.len() as u64
    }

    fn outstanding(&self) -> u64 {
        self.head - self.retired
    }

    fn slot(&mut self, seq: u64) -> &mut (u64, bool) {
        let d = self.slots.len();
        &mut self.slots[(seq % d as u64) as usize]
    }
}

/// A queue pair's shared state: what every handle of it points to.
pub(crate) struct QpShared {
    pub(crate) pd: Pd,
    pub(crate) send_cq: Cq,
    pub(crate) recv_cq: Cq,
    pub(crate) imp: QpImpl,
    pub(crate) qp_num: u32,
    pub(crate) caps: QpCaps,
    pub(crate) sig_all: bool,
    pub(crate) initial_psn: u32,
    sq: Mutex<Ring>,
    rq: Mutex<Ring>,
    /// Set once the queue pair is known to be in the error state (a completion with an error
    /// status, or a move to ERR): on a device that never completes later posts, they are refused.
    failed: std::sync::atomic::AtomicBool,
    /// What the queue pair's connection depends on (rdma_cm's identifier), released only after
    /// the queue pair is destroyed.
    pub(crate) anchor: std::sync::OnceLock<Arc<dyn std::any::Any + Send + Sync>>,
}

impl Drop for QpShared {
    fn drop(&mut self) {
        // Destroy first: once the device has let go, nothing can complete into the rings.
        self.imp.destroy(&self.pd);
        self.send_cq.unregister_qp(self.qp_num);
        self.recv_cq.unregister_qp(self.qp_num);
    }
}

/// The largest number of SGEs a safe request carries without a heap allocation.
const INLINE_SGES: usize = 8;
/// Work requests a post lays out on the stack before spilling to the heap.
const INLINE_WRS: usize = 4;

impl QpShared {
    pub(crate) fn new(
        pd: Pd,
        config: &QpConfig,
        imp: QpImpl,
        qp_num: u32,
        caps: QpCaps,
    ) -> Arc<QpShared> {
        let shared = Arc::new(QpShared {
            pd,
            send_cq: config.send_cq.clone(),
            recv_cq: config.recv_cq.clone(),
            imp,
            qp_num,
            caps,
            sig_all: config.sig_all,
            initial_psn: random_psn(),
            sq: Mutex::new(Ring::new(caps.max_send_wr)),
            rq: Mutex::new(Ring::new(caps.max_recv_wr)),
            failed: std::sync::atomic::AtomicBool::new(false),
            anchor: std::sync::OnceLock::new(),
        });
        shared.send_cq.register_qp(qp_num, Arc::downgrade(&shared));
        if !Arc::ptr_eq(&shared.send_cq.inner, &shared.recv_cq.inner) {
            shared.recv_cq.register_qp(qp_num, Arc::downgrade(&shared));
        }
        shared
    }

    pub(crate) fn modify(&self, attr: &ModifyAttr) -> Result<()> {
        self.imp.modify(&self.pd, attr)?;
        if attr.state == Some(QpState::Err) {
            self.mark_failed();
        }
        Ok(())
    }

    fn mark_failed(&self) {
        self.failed
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Refuses a post that would never complete: the queue pair is in the error state on a
    /// device that leaves later posts in its queues (siw).
    fn check_postable(&self) -> Result<()> {
        if self.failed.load(std::sync::atomic::Ordering::Acquire)
            && !self.pd.context().limits().late_posts_flushed
        {
            return Err(Error::QpInError {
                qp_num: self.qp_num,
            });
        }
        Ok(())
    }

    fn check_rtr(&self, attr: &RtrAttr) -> Result<()> {
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
            .require(limits::Capability::ManualConnect, ctx.name())
    }

    fn plan_connect(
        &self,
        remote: &QpEndpoint,
        opts: &ConnectOptions,
    ) -> Result<(RtrAttr, RtsAttr)> {
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
            RtrAttr {
                dest_qp_num: remote.qp_num,
                rq_psn: remote.psn,
                path_mtu,
                av,
                max_dest_rd_atomic: rd(opts.max_dest_rd_atomic, limits.max_dest_rd_atomic),
                min_rnr_timer: opts.min_rnr_timer,
            },
            RtsAttr {
                sq_psn: self.initial_psn,
                timeout: opts.timeout,
                retry_cnt: opts.retry_cnt,
                rnr_retry: opts.rnr_retry,
                max_rd_atomic: rd(opts.max_rd_atomic, limits.max_rd_atomic),
            },
        ))
    }

    /// Checks one send request against the limits. `remote_len_check` is the local length to
    /// compare with the remote region's length (safe requests know both).
    pub(crate) fn validate_send(&self, r: &SendReq<'_>, local_len: Option<u64>) -> Result<()> {
        let limits = self.pd.context().limits();
        limits.check_opcode(r.opcode, self.pd.context().name())?;
        let n = r.sges.len() as u32;
        let total = r.total_len();
        if r.flags.contains(SendFlags::INLINE) {
            if r.opcode.writes_local() {
                return Err(Error::invalid("READ and atomics cannot be inline"));
            }
            limits::check_max64(
                Limit::MaxInlineData,
                total,
                self.caps.max_inline_data as u64,
            )?;
        } else {
            limits::check_max(Limit::MaxSendSge, n, self.caps.max_send_sge)?;
        }
        limits::check_max64(Limit::MaxMsgSize, total, limits.max_msg_size)?;
        match r.opcode {
            WrOpcode::RdmaRead => {
                limits::check_max(Limit::MaxSgeRd, n, limits.max_sge_rd)?;
                if n == 0 {
                    return Err(Error::invalid(
                        "RDMA READ needs one local SGE (use a zero-length one for a zero-byte read)",
                    ));
                }
            }
            WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
                if n != 1 {
                    return Err(Error::LimitExceeded {
                        limit: Limit::AtomicSge,
                        requested: n as u64,
                        max: 1,
                    });
                }
                if r.sges[0].length != 8 {
                    return Err(Error::invalid(format!(
                        "an atomic's local buffer must be 8 bytes, not {}",
                        r.sges[0].length
                    )));
                }
                if r.remote.addr % 8 != 0 {
                    return Err(Error::invalid(format!(
                        "atomic target {:#x} is not 8-byte aligned",
                        r.remote.addr
                    )));
                }
            }
            _ => {}
        }
        if let Some(len) = local_len {
            if r.opcode.is_remote() {
                let need = if r.opcode.is_atomic() { 8 } else { len };
                if need > r.remote.len {
                    return Err(Error::OutOfBounds {
                        what: "remote region",
                        offset: 0,
                        len: need,
                        available: r.remote.len,
                    });
                }
            }
        }
        Ok(())
    }

    /// Checks one receive against the limits: its SGE count and its total length.
    fn validate_recv(&self, sges: &[Sge]) -> Result<()> {
        limits::check_max(Limit::MaxRecvSge, sges.len() as u32, self.caps.max_recv_sge)?;
        let total: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
        let max_msg = self.pd.context().limits().max_msg_size;
        limits::check_max64(Limit::MaxMsgSize, total, max_msg)
    }

    /// Validates and posts safe send requests as one chain. `signal_each` forces a
    /// device-level signal on every request: a scope needs a completion for the last request
    /// the device accepts, whichever that turns out to be.
    ///
    /// Returns the sequence number of the last request the device accepted (none when it
    /// accepted none) with the outcome. A request the SDK refuses posts nothing of the chain.
    pub(crate) fn post_send_wrs<'m: 'i, 'i>(
        &self,
        wrs: impl IntoIterator<Item = SendWr<'m, 'i>>,
        signal_each: bool,
    ) -> (Option<u64>, Result<()>) {
        // A post of a few requests (the usual case) builds its lists on the stack.
        let mut sges: SmallVec<[Sge; INLINE_SGES]> = SmallVec::new();
        let mut meta: SmallVec<[(SendWr<'m, 'i>, usize, usize); INLINE_WRS]> = SmallVec::new();
        for wr in wrs {
            let start = sges.len();
            if let Err(e) = wr.sges(&mut sges) {
                return (None, Err(e));
            }
            meta.push((wr, start, sges.len()));
        }
        let mut reqs: SmallVec<[SendReq<'_>; INLINE_WRS]> = SmallVec::with_capacity(meta.len());
        for (wr, start, end) in &meta {
            let req = SendReq {
                wr_id: wr.wr_id,
                opcode: wr.opcode,
                flags: wr.flags,
                sges: &sges[*start..*end],
                remote: wr.remote,
                imm: wr.imm,
                invalidate_rkey: wr.invalidate_rkey,
                compare_add: wr.compare_add,
                swap: wr.swap,
            };
            if let Err(e) = self.validate_send(&req, Some(wr.local_len())) {
                return (None, Err(e));
            }
            reqs.push(req);
        }
        self.post_reqs(&mut reqs, signal_each)
    }

    /// Posts provider-level send requests as one chain, assigning sequence numbers. Returns the
    /// sequence number of the last request the device accepted, if any, with the outcome.
    pub(crate) fn post_reqs(
        &self,
        reqs: &mut [SendReq<'_>],
        signal_each: bool,
    ) -> (Option<u64>, Result<()>) {
        if reqs.is_empty() {
            return (None, Ok(()));
        }
        if let Err(e) = self.check_postable() {
            return (None, Err(e));
        }
        let mut sq = self.sq.lock().unwrap_or_else(|e| e.into_inner());
        let room = sq.depth() - sq.outstanding();
        if (reqs.len() as u64) > room {
            let full = Error::QueueFull {
                queue: WorkQueue::Send,
                depth: sq.depth() as u32,
            };
            return (None, Err(full));
        }
        let first = sq.head;
        let threshold = (sq.depth() / 2).max(1) as u32;
        for (i, r) in reqs.iter_mut().enumerate() {
            let seq = first + i as u64;
            let user_signaled = self.sig_all || r.flags.contains(SendFlags::SIGNALED);
            *sq.slot(seq) = (r.wr_id, user_signaled);
            let mut device_signal = user_signaled || signal_each;
            if !device_signal && sq.unsignaled_run + 1 >= threshold {
                device_signal = true;
            }
            if device_signal {
                sq.unsignaled_run = 0;
                r.flags.insert(SendFlags::SIGNALED);
            } else {
                sq.unsignaled_run += 1;
                r.flags.remove(SendFlags::SIGNALED);
            }
            r.wr_id = seq;
        }
        let (accepted, result) = match self.imp.post_send(&self.pd, reqs) {
            Ok(()) => (reqs.len(), Ok(())),
            Err((accepted, e)) => (accepted, Err(e)),
        };
        sq.head = first + accepted as u64;
        ((accepted > 0).then(|| sq.head - 1), result)
    }

    /// Validates and posts safe receives; returns as [`QpShared::post_send_wrs`] does.
    pub(crate) fn post_recv_wrs<'m>(
        &self,
        wrs: impl IntoIterator<Item = RecvWr<'m>>,
    ) -> (Option<u64>, Result<()>) {
        let mut sges: SmallVec<[Sge; INLINE_SGES]> = SmallVec::new();
        let mut spans: SmallVec<[(u64, usize, usize); INLINE_WRS]> = SmallVec::new();
        let mut held: SmallVec<[RecvWr<'m>; INLINE_WRS]> = SmallVec::new();
        for wr in wrs {
            let start = sges.len();
            let checked = wr
                .sges(&mut sges)
                .and_then(|()| self.validate_recv(&sges[start..]));
            if let Err(e) = checked {
                return (None, Err(e));
            }
            spans.push((wr.wr_id, start, sges.len()));
            held.push(wr);
        }
        let reqs: SmallVec<[RecvReq<'_>; INLINE_WRS]> = spans
            .iter()
            .map(|&(wr_id, s, e)| RecvReq {
                wr_id,
                sges: &sges[s..e],
            })
            .collect();
        let posted = self.post_recv_reqs(&reqs);
        drop(held);
        posted
    }

    /// Posts provider-level receives; returns as [`QpShared::post_reqs`] does.
    pub(crate) fn post_recv_reqs(&self, reqs: &[RecvReq<'_>]) -> (Option<u64>, Result<()>) {
        if reqs.is_empty() {
            return (None, Ok(()));
        }
        if let Err(e) = self.check_postable() {
            return (None, Err(e));
        }
        let mut rq = self.rq.lock().unwrap_or_else(|e| e.into_inner());
        let room = rq.depth() - rq.outstanding();
        if (reqs.len() as u64) > room {
            let full = Error::QueueFull {
                queue: WorkQueue::Recv,
                depth: rq.depth() as u32,
            };
            return (None, Err(full));
        }
        let first = rq.head;
        let mut tagged: SmallVec<[RecvReq<'_>; INLINE_WRS]> = SmallVec::with_capacity(reqs.len());
        for (i, r) in reqs.iter().enumerate() {
            let seq = first + i as u64;
            *rq.slot(seq) = (r.wr_id, true);
            tagged.push(RecvReq {
                wr_id: seq | RECV_TAG,
                sges: r.sges,
            });
        }
        let (accepted, result) = match self.imp.post_recv(&self.pd, &tagged) {
            Ok(()) => (reqs.len(), Ok(())),
            Err((accepted, e)) => (accepted, Err(e)),
        };
        rq.head = first + accepted as u64;
        ((accepted > 0).then(|| rq.head - 1), result)
    }

    /// Maps a device completion back to the application's request, retiring every request up
    /// to it. `None` for completions nobody asked for (SDK-forced signals) and stale entries.
    pub(crate) fn translate(&self, wc: &RawWc) -> Option<Completion> {
        let recv = wc.wr_id & RECV_TAG != 0;
        let seq = wc.wr_id & !RECV_TAG;
        let (wr_id, wanted) = {
            let mut ring = if recv { &self.rq } else { &self.sq }
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if seq < ring.retired || seq >= ring.head {
                return None;
            }
            let slot = *ring.slot(seq);
            ring.retired = seq + 1;
            slot
        };
        let status = WcStatus::from_raw(wc.status);
        if !status.is_success() {
            // Any error completion leaves the queue pair in the error state.
            self.mark_failed();
        }
        if !wanted && status.is_success() {
            return None;
        }
        let opcode = if status.is_success() {
            WcOpcode::from_raw(wc.opcode)
        } else if recv {
            WcOpcode::Recv
        } else {
            WcOpcode::from_raw(wc.opcode)
        };
        Some(Completion {
            wr_id,
            status,
            opcode,
            vendor_err: wc.vendor_err,
            byte_len: wc.byte_len,
            imm: (wc.wc_flags & WC_WITH_IMM != 0).then_some(wc.imm),
            invalidated_rkey: (wc.wc_flags & WC_WITH_INV != 0).then_some(wc.invalidated_rkey),
            qp_num: self.qp_num,
            src_qp: wc.src_qp,
        })
    }

    /// Retires every outstanding request of both queues without a completion: for a queue pair
    /// the device has reset, which dropped them. Their late completions, if any were queued,
    /// are ignored as stale.
    pub(crate) fn abandon_outstanding(&self) {
        for ring in [&self.sq, &self.rq] {
            let mut ring = ring.lock().unwrap_or_else(|e| e.into_inner());
            ring.retired = ring.head;
            ring.unsignaled_run = 0;
        }
    }

    /// Whether every request up to `sq_hi` / `rq_hi` has completed.
    pub(crate) fn retired_past(&self, sq_hi: Option<u64>, rq_hi: Option<u64>) -> bool {
        let sq_done =
            sq_hi.is_none_or(|hi| self.sq.lock().unwrap_or_else(|e| e.into_inner()).retired > hi);
        let rq_done =
            rq_hi.is_none_or(|hi| self.rq.lock().unwrap_or_else(|e| e.into_inner()).retired > hi);
        sq_done && rq_done
    }
}

/// A random 24-bit PSN (from the kernel's generator).
fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: `b` is a valid, writable 4-byte buffer for the duration of the call.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 4 {
        // Fall back on the clock; PSNs need not be secret, only unlikely to repeat.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0x5a5a5a);
        return t & 0xff_ffff;
    }
    u32::from_ne_bytes(b) & 0xff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_numbers_and_names() {
        for v in 0..7 {
            assert_eq!(QpState::from_raw(v).as_raw(), v);
        }
        assert_eq!(QpState::Rts.to_string(), "RTS");
        assert_eq!(QpState::Err.to_string(), "ERR");
        assert_eq!(QpState::from_raw(9), QpState::Unknown(9));
    }

    #[test]
    fn psns_are_24_bit() {
        for _ in 0..100 {
            assert!(random_psn() <= 0xff_ffff);
        }
        assert!(check_psn("sq_psn", 0x100_0000).is_err());
        assert!(check_psn("sq_psn", 0xff_ffff).is_ok());
    }
}

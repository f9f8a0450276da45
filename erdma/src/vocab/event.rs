//! Asynchronous events: what a device reports outside any completion ([`AsyncEvent`]: its
//! [`AsyncEventKind`] and the [`EventElement`] it concerns), as values.

use core::fmt;

/// What happened (the `IBV_EVENT_*` numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AsyncEventKind {
    /// A completion queue overran: completions were lost, and its queue pairs are in error.
    CqErr,
    /// A queue pair failed outside any request (a catastrophic local error).
    QpFatal,
    /// A queue pair's responder found an invalid request.
    QpReqErr,
    /// A queue pair's responder found an access violation.
    QpAccessErr,
    /// A first packet arrived on a queue pair in RTR.
    CommEst,
    /// A queue pair in SQD has drained its send queue.
    SqDrained,
    /// A path migrated.
    PathMig,
    /// A path migration failed.
    PathMigErr,
    /// The device stopped working: every object of the context is unusable.
    DeviceFatal,
    /// A port became active.
    PortActive,
    /// A port went down.
    PortErr,
    /// A port's LID changed.
    LidChange,
    /// A port's P_Key table changed.
    PkeyChange,
    /// The subnet manager changed.
    SmChange,
    /// A shared receive queue failed.
    SrqErr,
    /// A shared receive queue fell below its limit.
    SrqLimitReached,
    /// The last request of a queue pair on a shared receive queue was consumed.
    QpLastWqeReached,
    /// The subnet manager asks for re-registration.
    ClientReregister,
    /// A port's GID table changed.
    GidChange,
    /// A work queue failed.
    WqFatal,
    /// An event this SDK does not know (the raw value).
    Other(u32),
}

impl AsyncEventKind {
    /// From the verbs value.
    pub fn from_raw(v: u32) -> AsyncEventKind {
        use AsyncEventKind::*;
        match v {
            0 => CqErr,
            1 => QpFatal,
            2 => QpReqErr,
            3 => QpAccessErr,
            4 => CommEst,
            5 => SqDrained,
            6 => PathMig,
            7 => PathMigErr,
            8 => DeviceFatal,
            9 => PortActive,
            10 => PortErr,
            11 => LidChange,
            12 => PkeyChange,
            13 => SmChange,
            14 => SrqErr,
            15 => SrqLimitReached,
            16 => QpLastWqeReached,
            17 => ClientReregister,
            18 => GidChange,
            19 => WqFatal,
            n => Other(n),
        }
    }

    /// The verbs value.
    pub fn as_raw(self) -> u32 {
        use AsyncEventKind::*;
        match self {
            CqErr => 0,
            QpFatal => 1,
            QpReqErr => 2,
            QpAccessErr => 3,
            CommEst => 4,
            SqDrained => 5,
            PathMig => 6,
            PathMigErr => 7,
            DeviceFatal => 8,
            PortActive => 9,
            PortErr => 10,
            LidChange => 11,
            PkeyChange => 12,
            SmChange => 13,
            SrqErr => 14,
            SrqLimitReached => 15,
            QpLastWqeReached => 16,
            ClientReregister => 17,
            GidChange => 18,
            WqFatal => 19,
            Other(n) => n,
        }
    }

    /// What the event's element is, by the verbs rules (which union member it carries).
    pub fn element_class(self) -> ElementClass {
        use AsyncEventKind::*;
        match self {
            CqErr => ElementClass::Cq,
            QpFatal | QpReqErr | QpAccessErr | CommEst | SqDrained | PathMig | PathMigErr
            | QpLastWqeReached => ElementClass::Qp,
            SrqErr | SrqLimitReached => ElementClass::Srq,
            WqFatal => ElementClass::Wq,
            PortActive | PortErr | LidChange | PkeyChange | SmChange | ClientReregister
            | GidChange => ElementClass::Port,
            DeviceFatal | Other(_) => ElementClass::Device,
        }
    }
}

/// Which member of the verbs event's union (`ibv_async_event.element`) is meaningful.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementClass {
    /// `element.cq`.
    Cq,
    /// `element.qp`.
    Qp,
    /// `element.srq`.
    Srq,
    /// `element.wq`.
    Wq,
    /// `element.port_num`.
    Port,
    /// Nothing: the device as a whole.
    Device,
}

/// What an event concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventElement {
    /// A completion queue, by the id its context gave it (`Cq::id` in the SDK).
    Cq(u64),
    /// A queue pair, by number.
    Qp(u32),
    /// A shared receive queue (this SDK creates none).
    Srq,
    /// A work queue (this SDK creates none).
    Wq,
    /// A port, by number.
    Port(u8),
    /// The device as a whole.
    Device,
}

/// One asynchronous event: what a device reports outside any completion.
///
/// A device reports through this channel what no work request's completion can carry: a
/// completion queue that overran and lost completions (`CqErr`), a queue pair that failed outside
/// any request, a port going down or up, a device that died. Each context keeps the events in
/// a bounded queue (the oldest go first when it is full, and are counted) until the application
/// reads them; no event is needed for the SDK's own correctness, so an application that never
/// reads them loses nothing but the events.
///
/// The SDK acts on two of them itself, whether or not the application reads them: a `CqErr`
/// and a `DeviceFatal` make the completion queues concerned report the failure to their next
/// poll that finds them empty, and wake every thread and task waiting on them. Without that, a
/// waiter whose completion was lost in an overrun would sleep until its timeout.
///
/// Reading: `Context::next_async_event` (blocking, with a timeout),
/// `Context::recv_async_event` (async, with the `tokio` feature), or an event loop of one's own
/// on `Context::async_event_fd`, which is readable while events wait.
///
/// Kernel devices: one thread per process reads every open device's events (libibverbs'
/// `ibv_get_async_event`), acknowledging each at once. Soft devices report a completion-queue
/// overrun (`CqErr`, as rxe does) and a responder's error that no receive request can carry
/// (IBTA C9-222.1.1: a bad R_Key in an RDMA WRITE without immediate, a READ or an atomic is
/// `QpAccessErr`, an invalid request `QpReqErr`, an operational failure `QpFatal`), naming the
/// queue pair; the requester's side learns of it from its error completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct AsyncEvent {
    /// What happened.
    pub kind: AsyncEventKind,
    /// What it happened to.
    pub element: EventElement,
}

impl fmt::Display for AsyncEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.kind)?;
        match self.element {
            EventElement::Cq(id) => write!(f, " on completion queue {id}"),
            EventElement::Qp(n) => write!(f, " on queue pair {n:#x}"),
            EventElement::Srq => f.write_str(" on a shared receive queue"),
            EventElement::Wq => f.write_str(" on a work queue"),
            EventElement::Port(p) => write!(f, " on port {p}"),
            EventElement::Device => f.write_str(" on the device"),
        }
    }
}

impl AsyncEvent {
    /// The event `kind` about `element`.
    pub const fn new(kind: AsyncEventKind, element: EventElement) -> AsyncEvent {
        AsyncEvent { kind, element }
    }
}

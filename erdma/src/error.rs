//! The SDK's one error type.
//!
//! Errors say which verb failed, which limit was hit (with the requested value and the maximum),
//! or which argument was wrong, and carry the OS error as their `source`. Completion statuses are
//! values ([`crate::WcStatus`]), not errors: a failed work request is reported by its completion.
//!
//! One message style: lower case, what failed first, then why, then what to do; numbers that
//! name things (queue-pair numbers, request ids, keys) in hex (`0x…`), in `Display` and `Debug`
//! alike; sizes and counts in decimal.

use std::fmt;
use std::io;

use crate::vocab::{Completion, Limit, ParseError, QpFailure, WorkQueue};

/// A specialised `Result` for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The outcome of posting a chain of requests: on failure, how many the device took before the
/// one it refused, and why.
pub(crate) type PostResult = std::result::Result<(), (usize, Error)>;

/// Everything that can go wrong in the SDK.
///
/// `Clone`: the OS errors inside are copied by their error number (or their kind and text when
/// they have none), so a clone prints and compares as the original does.
#[non_exhaustive]
pub enum Error {
    /// A shared library the verbs provider needs could not be loaded.
    Library {
        /// The library's file name, e.g. `libibverbs.so.1`.
        library: &'static str,
        /// What the dynamic loader said.
        detail: String,
    },
    /// No device has this name.
    DeviceNotFound {
        /// The name asked for.
        name: String,
        /// The names that do exist.
        available: Vec<String>,
    },
    /// A verb (a call into the device's driver or the soft device) failed.
    Verb {
        /// The verb, e.g. `ibv_create_qp`.
        verb: &'static str,
        /// The OS error it returned.
        source: io::Error,
    },
    /// A request exceeds a limit of the device's profile (the device's maximum). Checked before
    /// the device is called.
    LimitExceeded {
        /// The limit.
        limit: Limit,
        /// The value asked for.
        requested: u64,
        /// The largest value the device accepts.
        max: u64,
    },
    /// A work request exceeds a capacity this queue pair was created with (its SGEs, its inline
    /// bytes): raise it in [`crate::QpConfig`], up to the device's maximum. Checked before the
    /// device is called.
    QpCapacityExceeded {
        /// The capacity (`max_send_sge`, `max_recv_sge`, `max_inline_data`).
        limit: Limit,
        /// The value asked for.
        requested: u64,
        /// What this queue pair was created with.
        capacity: u64,
        /// The largest value the device allows a queue pair.
        device_max: u64,
    },
    /// A request is below a limit's minimum (for example a queue depth of zero).
    LimitBelowMinimum {
        /// The limit.
        limit: Limit,
        /// The value asked for.
        requested: u64,
        /// The smallest value the device accepts.
        min: u64,
    },
    /// The device does not offer this feature (for example SRQ or atomics on eRDMA).
    Unsupported {
        /// The feature.
        feature: &'static str,
        /// The device that lacks it.
        device: String,
    },
    /// The device lacks a capability the request needs (immediate data or atomics on siw, a
    /// hand-made connection on any iWARP device). Checked before the device is called.
    MissingCapability {
        /// What is missing.
        capability: crate::vocab::Capability,
        /// The device that lacks it.
        device: String,
    },
    /// An argument is malformed.
    InvalidArgument(String),
    /// A work queue has no room for the request.
    QueueFull {
        /// Which queue.
        queue: WorkQueue,
        /// Its depth.
        depth: u32,
    },
    /// The queue pair is in the error state: the request was not posted (it could only have
    /// been flushed). A queue pair does not leave the error state; connect a new one.
    QpInError {
        /// The queue pair's number.
        qp_num: u32,
        /// What put it there, when the SDK saw it.
        cause: Option<crate::vocab::QpFailure>,
    },
    /// Memory used in a work request does not belong to the given memory region, or lies outside it.
    OutOfBounds {
        /// What was out of bounds.
        what: &'static str,
        /// First byte asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The bytes that exist.
        available: u64,
    },
    /// A work request finished with an error status.
    Completion(Completion),
    /// A completion did not arrive in time.
    Timeout {
        /// What was being waited for.
        what: String,
    },
    /// A peer broke the connection protocol (out-of-band exchange or rdma_cm).
    Protocol {
        /// What was wrong.
        what: String,
    },
    /// No RDMA device has this IP address, or a route to it (rdma_cm picks the device by address).
    NoDeviceForAddress {
        /// The address.
        addr: String,
        /// The kernel devices that exist.
        available: Vec<String>,
    },
    /// The peer refused the connection: nobody listens at the address, or the listening
    /// application rejected the request (the reason says which, with the peer's words).
    Refused {
        /// The address that refused.
        peer: String,
        /// Why: the reject reason and any message the peer sent.
        reason: String,
    },
    /// The peer cannot be reached: no route to it, or no answer to address resolution, route
    /// resolution or the connection request.
    Unreachable {
        /// The address that could not be reached.
        peer: String,
        /// What failed.
        detail: String,
    },
    /// GPU memory could not be used.
    Gpu {
        /// What failed.
        what: String,
    },
    /// An I/O error outside the verbs (sockets, files).
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        source: io::Error,
    },
}

impl Error {
    /// Builds [`Error::Verb`] from the calling thread's `errno`.
    pub(crate) fn last_os(verb: &'static str) -> Self {
        Error::Verb {
            verb,
            source: io::Error::last_os_error(),
        }
    }

    /// Builds [`Error::Verb`] from a positive errno value (as `ibv_post_send` and friends return).
    pub(crate) fn errno(verb: &'static str, errno: i32) -> Self {
        Error::Verb {
            verb,
            source: io::Error::from_raw_os_error(errno.abs()),
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn protocol(what: impl Into<String>) -> Self {
        Error::Protocol { what: what.into() }
    }

    pub(crate) fn invalid(what: impl Into<String>) -> Self {
        Error::InvalidArgument(what.into())
    }

    /// The OS error number inside this error, if it carries one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Verb { source, .. } | Error::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Library { library, detail } => write!(
                f,
                "{library} could not be loaded (install rdma-core's userspace libraries, e.g. \
                 `apt-get install ibverbs-providers librdmacm1`): {detail}"
            ),
            Error::DeviceNotFound { name, available } => {
                write!(f, "no RDMA device named `{name}`")?;
                if available.is_empty() {
                    write!(f, " (no devices found)")
                } else {
                    write!(f, " (available: {})", available.join(", "))
                }
            }
            Error::Verb { verb, source } => write!(f, "{verb} failed: {source}"),
            Error::LimitExceeded {
                limit,
                requested,
                max,
            } => write!(
                f,
                "{limit}: requested {requested}, the device allows at most {max}"
            ),
            Error::QpCapacityExceeded {
                limit,
                requested,
                capacity,
                device_max,
            } => {
                write!(
                    f,
                    "{limit}: requested {requested}, this queue pair was created with {capacity} \
                     (QpConfig::{limit}; "
                )?;
                if *device_max >= u64::from(u32::MAX) {
                    write!(f, "the device sets no maximum)")
                } else {
                    write!(f, "the device allows {device_max})")
                }
            }
            Error::LimitBelowMinimum {
                limit,
                requested,
                min,
            } => write!(
                f,
                "{limit}: requested {requested}, the device needs at least {min}"
            ),
            Error::Unsupported { feature, device } => {
                write!(f, "{feature} is not supported by device {device}")
            }
            Error::MissingCapability { capability, device } => write!(
                f,
                "device {device} lacks {capability}: {}",
                capability.advice()
            ),
            Error::InvalidArgument(what) => write!(f, "invalid argument: {what}"),
            Error::QueueFull { queue, depth } => {
                let knob = match queue {
                    WorkQueue::Send => "max_send_wr",
                    WorkQueue::Recv => "max_recv_wr",
                };
                write!(
                    f,
                    "{queue} is full ({depth} work requests outstanding): wait for completions, \
                     or create the queue pair with a larger QpConfig::{knob}"
                )
            }
            Error::QpInError { qp_num, cause } => {
                write!(f, "queue pair {qp_num:#x} is in the error state")?;
                if let Some(cause) = cause {
                    write!(f, " ({cause})")?;
                }
                write!(f, "; nothing was posted: connect a new queue pair")
            }
            Error::OutOfBounds {
                what,
                offset,
                len,
                available,
            } => write!(
                f,
                "{what}: bytes {offset}..{} are outside the {available} bytes available",
                offset.saturating_add(*len)
            ),
            Error::Completion(c) => fmt_completion(f, c),
            Error::Timeout { what } => write!(f, "timed out waiting for {what}"),
            Error::Protocol { what } => write!(f, "protocol error: {what}"),
            Error::NoDeviceForAddress { addr, available } => {
                write!(f, "no RDMA device has the address {addr} or a route to it")?;
                if available.is_empty() {
                    write!(f, " (no kernel RDMA devices found)")
                } else {
                    write!(f, " (devices: {})", available.join(", "))
                }
            }
            Error::Refused { peer, reason } => write!(f, "{peer} refused the connection: {reason}"),
            Error::Unreachable { peer, detail } => write!(f, "{peer} is unreachable: {detail}"),
            Error::Gpu { what } => write!(f, "GPU: {what}"),
            Error::Io { context, source } => write!(f, "{context}: {source}"),
        }
    }
}

/// A failed completion: what failed, and why the queue pair failed when this is a consequence.
fn fmt_completion(f: &mut fmt::Formatter<'_>, c: &Completion) -> fmt::Result {
    let (wr_id, qp_num) = (c.wr_id, c.qp_num);
    if c.status == crate::vocab::WcStatus::WrFlushErr {
        write!(
            f,
            "work request {wr_id:#x} on queue pair {qp_num:#x} was flushed"
        )?;
        return match c.cause() {
            Some(cause) => write!(f, ": the queue pair had failed ({cause})"),
            None => write!(f, ": the queue pair is in the error state"),
        };
    }
    write!(
        f,
        "work request {wr_id:#x} on queue pair {qp_num:#x} failed: {}",
        c.status
    )?;
    if c.vendor_err != 0 {
        write!(f, " (vendor error {:#x})", c.vendor_err)?;
    }
    if let Some(hint) = c.status.hint() {
        write!(f, " — {hint}")?;
    }
    match c.cause() {
        Some(QpFailure::Request { wr_id, status, .. })
            if wr_id == c.wr_id && status == c.status =>
        {
            write!(f, "; the queue pair is now in the error state")
        }
        Some(cause) => write!(f, "; the queue pair had failed before ({cause})"),
        None => write!(f, "; the queue pair is now in the error state"),
    }
}

/// Copies an OS error: by its number when it has one, else by kind and text.
fn clone_io(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(n) => io::Error::from_raw_os_error(n),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

impl Clone for Error {
    fn clone(&self) -> Error {
        match self {
            Error::Library { library, detail } => Error::Library {
                library,
                detail: detail.clone(),
            },
            Error::DeviceNotFound { name, available } => Error::DeviceNotFound {
                name: name.clone(),
                available: available.clone(),
            },
            Error::Verb { verb, source } => Error::Verb {
                verb,
                source: clone_io(source),
            },
            Error::LimitExceeded {
                limit,
                requested,
                max,
            } => Error::LimitExceeded {
                limit: *limit,
                requested: *requested,
                max: *max,
            },
            Error::QpCapacityExceeded {
                limit,
                requested,
                capacity,
                device_max,
            } => Error::QpCapacityExceeded {
                limit: *limit,
                requested: *requested,
                capacity: *capacity,
                device_max: *device_max,
            },
            Error::LimitBelowMinimum {
                limit,
                requested,
                min,
            } => Error::LimitBelowMinimum {
                limit: *limit,
                requested: *requested,
                min: *min,
            },
            Error::Unsupported { feature, device } => Error::Unsupported {
                feature,
                device: device.clone(),
            },
            Error::MissingCapability { capability, device } => Error::MissingCapability {
                capability: *capability,
                device: device.clone(),
            },
            Error::InvalidArgument(what) => Error::InvalidArgument(what.clone()),
            Error::QueueFull { queue, depth } => Error::QueueFull {
                queue: *queue,
                depth: *depth,
            },
            Error::QpInError { qp_num, cause } => Error::QpInError {
                qp_num: *qp_num,
                cause: *cause,
            },
            Error::OutOfBounds {
                what,
                offset,
                len,
                available,
            } => Error::OutOfBounds {
                what,
                offset: *offset,
                len: *len,
                available: *available,
            },
            Error::Completion(c) => Error::Completion(*c),
            Error::Timeout { what } => Error::Timeout { what: what.clone() },
            Error::Protocol { what } => Error::Protocol { what: what.clone() },
            Error::NoDeviceForAddress { addr, available } => Error::NoDeviceForAddress {
                addr: addr.clone(),
                available: available.clone(),
            },
            Error::Refused { peer, reason } => Error::Refused {
                peer: peer.clone(),
                reason: reason.clone(),
            },
            Error::Unreachable { peer, detail } => Error::Unreachable {
                peer: peer.clone(),
                detail: detail.clone(),
            },
            Error::Gpu { what } => Error::Gpu { what: what.clone() },
            Error::Io { context, source } => Error::Io {
                context: context.clone(),
                source: clone_io(source),
            },
        }
    }
}

/// `Debug` names the variant and its fields as `#[derive(Debug)]` would, with queue-pair
/// numbers in hex as `Display` has them.
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Library { library, detail } => f
                .debug_struct("Library")
                .field("library", library)
                .field("detail", detail)
                .finish(),
            Error::DeviceNotFound { name, available } => f
                .debug_struct("DeviceNotFound")
                .field("name", name)
                .field("available", available)
                .finish(),
            Error::Verb { verb, source } => f
                .debug_struct("Verb")
                .field("verb", verb)
                .field("source", source)
                .finish(),
            Error::LimitExceeded {
                limit,
                requested,
                max,
            } => f
                .debug_struct("LimitExceeded")
                .field("limit", limit)
                .field("requested", requested)
                .field("max", max)
                .finish(),
            Error::QpCapacityExceeded {
                limit,
                requested,
                capacity,
                device_max,
            } => f
                .debug_struct("QpCapacityExceeded")
                .field("limit", limit)
                .field("requested", requested)
                .field("capacity", capacity)
                .field("device_max", device_max)
                .finish(),
            Error::LimitBelowMinimum {
                limit,
                requested,
                min,
            } => f
                .debug_struct("LimitBelowMinimum")
                .field("limit", limit)
                .field("requested", requested)
                .field("min", min)
                .finish(),
            Error::Unsupported { feature, device } => f
                .debug_struct("Unsupported")
                .field("feature", feature)
                .field("device", device)
                .finish(),
            Error::MissingCapability { capability, device } => f
                .debug_struct("MissingCapability")
                .field("capability", capability)
                .field("device", device)
                .finish(),
            Error::InvalidArgument(what) => f.debug_tuple("InvalidArgument").field(what).finish(),
            Error::QueueFull { queue, depth } => f
                .debug_struct("QueueFull")
                .field("queue", queue)
                .field("depth", depth)
                .finish(),
            Error::QpInError { qp_num, cause } => f
                .debug_struct("QpInError")
                .field("qp_num", &format_args!("{qp_num:#x}"))
                .field("cause", cause)
                .finish(),
            Error::OutOfBounds {
                what,
                offset,
                len,
                available,
            } => f
                .debug_struct("OutOfBounds")
                .field("what", what)
                .field("offset", offset)
                .field("len", len)
                .field("available", available)
                .finish(),
            Error::Completion(c) => f.debug_tuple("Completion").field(c).finish(),
            Error::Timeout { what } => f.debug_struct("Timeout").field("what", what).finish(),
            Error::Protocol { what } => f.debug_struct("Protocol").field("what", what).finish(),
            Error::NoDeviceForAddress { addr, available } => f
                .debug_struct("NoDeviceForAddress")
                .field("addr", addr)
                .field("available", available)
                .finish(),
            Error::Refused { peer, reason } => f
                .debug_struct("Refused")
                .field("peer", peer)
                .field("reason", reason)
                .finish(),
            Error::Unreachable { peer, detail } => f
                .debug_struct("Unreachable")
                .field("peer", peer)
                .field("detail", detail)
                .finish(),
            Error::Gpu { what } => f.debug_struct("Gpu").field("what", what).finish(),
            Error::Io { context, source } => f
                .debug_struct("Io")
                .field("context", context)
                .field("source", source)
                .finish(),
        }
    }
}

impl From<ParseError> for Error {
    fn from(e: ParseError) -> Error {
        Error::InvalidArgument(e.to_string())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Verb { source, .. } | Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::{PeerLoss, WcOpcode, WcStatus};

    #[test]
    fn limit_errors_say_whose_limit_and_how_to_raise_it() {
        let e = Error::QpCapacityExceeded {
            limit: Limit::MaxSendSge,
            requested: 2,
            capacity: 1,
            device_max: 6,
        };
        assert_eq!(
            e.to_string(),
            "max_send_sge: requested 2, this queue pair was created with 1 \
             (QpConfig::max_send_sge; the device allows 6)"
        );
        let e = Error::LimitExceeded {
            limit: Limit::MaxSendSge,
            requested: 7,
            max: 6,
        };
        assert_eq!(
            e.to_string(),
            "max_send_sge: requested 7, the device allows at most 6"
        );
        let e = Error::QueueFull {
            queue: WorkQueue::Recv,
            depth: 4,
        };
        assert!(e.to_string().contains("QpConfig::max_recv_wr"), "{e}");
    }

    #[test]
    fn numbers_are_hex_in_display_and_debug() {
        let mut c = Completion::new(0x2a, WcStatus::RetryExcErr, WcOpcode::Send, 0x11);
        c.vendor_err = 0x81;
        let e = Error::Completion(c);
        let (shown, debug) = (e.to_string(), format!("{e:?}"));
        for s in [&shown, &debug] {
            assert!(s.contains("0x2a") && s.contains("0x11"), "{s}");
            assert!(!s.contains("42") && !s.contains("17"), "{s}");
        }
        assert!(shown.contains("stopped acknowledging"), "{shown}");
        assert!(shown.contains("now in the error state"), "{shown}");
        // The first failure names itself as the cause: still "now", not "before".
        c.cause = Some(QpFailure::Request {
            wr_id: 0x2a,
            status: WcStatus::RetryExcErr,
            opcode: WcOpcode::Send,
            vendor_err: 0x81,
        });
        let shown = Error::Completion(c).to_string();
        assert!(shown.contains("now in the error state"), "{shown}");
        assert!(!shown.contains("before"), "{shown}");
        let e = Error::QpInError {
            qp_num: 0x11,
            cause: None,
        };
        assert!(format!("{e:?}").contains("0x11"), "{e:?}");
        assert!(e.to_string().contains("0x11"), "{e}");
    }

    #[test]
    fn a_flush_names_what_killed_the_queue_pair() {
        let mut c = Completion::new(3, WcStatus::WrFlushErr, WcOpcode::Recv, 0x11);
        c.cause = Some(QpFailure::Request {
            wr_id: 1,
            status: WcStatus::RetryExcErr,
            opcode: WcOpcode::Send,
            vendor_err: 0,
        });
        let s = Error::Completion(c).to_string();
        assert!(
            s.starts_with("work request 0x3 on queue pair 0x11 was flushed"),
            "{s}"
        );
        assert!(
            s.contains("work request 0x1 (Send) failed: transport retry counter exceeded"),
            "{s}"
        );
        c.cause = Some(QpFailure::PeerLost(PeerLoss::Closed));
        let s = Error::Completion(c).to_string();
        assert!(
            s.contains("peer lost: the peer closed the connection"),
            "{s}"
        );
        let e = Error::QpInError {
            qp_num: 0x11,
            cause: Some(QpFailure::PeerLost(PeerLoss::Silent(
                std::time::Duration::from_millis(2000),
            ))),
        };
        assert!(e.to_string().contains("sent nothing for 2000 ms"), "{e}");
    }

    #[test]
    fn clones_print_and_carry_the_os_error_as_the_original() {
        let e = Error::errno("ibv_post_send", libc::ENOMEM);
        let c = e.clone();
        assert_eq!(c.to_string(), e.to_string());
        assert_eq!(c.raw_os_error(), Some(libc::ENOMEM));
        let e = Error::io("reading", io::Error::other("boom"));
        let c = e.clone();
        assert_eq!(c.to_string(), e.to_string());
        assert!(std::error::Error::source(&c).is_some());
    }
}

//! The SDK's one error type.
//!
//! Errors say which verb failed, which limit was hit (with the requested value and the maximum),
//! or which argument was wrong, and carry the OS error as their `source`. Completion statuses are
//! values ([`crate::WcStatus`]), not errors: a failed work request is reported by its completion.

use std::fmt;
use std::io;

use crate::vocab::{Completion, Limit, ParseError, WorkQueue};

/// A specialised `Result` for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The outcome of posting a chain of requests: on failure, how many the device took before the
/// one it refused, and why.
pub(crate) type PostResult = std::result::Result<(), (usize, Error)>;

/// Everything that can go wrong in the SDK.
#[derive(Debug)]
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
    /// A request exceeds a limit of the device's profile. Checked before the device is called.
    LimitExceeded {
        /// The limit.
        limit: Limit,
        /// The value asked for.
        requested: u64,
        /// The largest value the device accepts.
        max: u64,
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
    /// The queue pair is in the error state: the request was not posted.
    QpInError {
        /// The queue pair's number.
        qp_num: u32,
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
            } => write!(f, "{limit}: requested {requested}, maximum is {max}"),
            Error::LimitBelowMinimum {
                limit,
                requested,
                min,
            } => write!(f, "{limit}: requested {requested}, minimum is {min}"),
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
                write!(f, "{queue} is full ({depth} work requests outstanding)")
            }
            Error::QpInError { qp_num } => {
                write!(f, "queue pair {qp_num:#x} is in the error state")
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
            Error::Completion(c) => write!(
                f,
                "work request {} on queue pair {:#x} failed: {} (vendor error {:#x})",
                c.wr_id, c.qp_num, c.status, c.vendor_err
            ),
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

//! What rdma_cm does differently on iWARP devices (eRDMA's default mode, siw, Chelsio, Intel in
//! iWARP mode), and how the connection path copes.
//!
//! - The connection is a TCP connection the kernel makes. siw makes it inside `rdma_connect`,
//!   blocking: towards an address that never answers the call returns only when the kernel's
//!   TCP connect gives up (minutes). [`connect`] makes that call on a helper thread and waits
//!   for it only until the caller's deadline.
//! - Nobody listening is that TCP connect refused: `rdma_connect` itself fails with
//!   `ECONNREFUSED` (InfiniBand/RoCE report it later, as a reject with reason 8).
//! - An application's reject is an MPA reject: the connecting side sees `REJECTED` with status
//!   `ECONNRESET`, and the reject's private data.
//! - A queue pair whose connection attempt is still open cannot be destroyed at once: siw's
//!   `destroy_qp` waits until the attempt lets go of it (the peer answers or closes, or the
//!   kernel's TCP connect gives up). [`Detach`] drops such a queue pair, and its identifier, on
//!   a thread of its own, so a failed connect returns at its deadline.
//! - The device has one GID, its MAC address, and no IP-based GID: [`device_ipv4`] finds the
//!   address rdma_cm reaches it by through the netdev with that MAC.
//!
//! Must not: block past a deadline the caller gave.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use super::rdma::{CmId, conn_param};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::vocab::Transport;

/// The connection parameters of one `rdma_connect`, owned, so the call can run elsewhere.
pub(super) struct ConnectCall {
    pub private: Vec<u8>,
    pub resp: u8,
    pub init: u8,
    pub qp_num: u32,
}

/// `rdma_connect` on an iWARP identifier, bounded by `deadline`: the call runs on a helper
/// thread (siw's TCP connect blocks inside it), which keeps the identifier alive until the
/// kernel returns.
///
/// # Errors
/// [`Error::Refused`] when nobody listens at `dst`; [`Error::Unreachable`] when the kernel finds
/// no way there; [`Error::Timeout`] when the call has not returned by `deadline`; other
/// failures as [`Error::Verb`].
pub(super) fn connect(
    id: &Arc<CmId>,
    call: ConnectCall,
    dst: SocketAddr,
    deadline: Instant,
) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    let held = id.clone();
    std::thread::Builder::new()
        .name("erdma-iwarp-connect".into())
        .spawn(move || {
            let mut param = conn_param(&call.private, call.resp, call.init, call.qp_num);
            // librdmacm copies `param` and its private data during the call.
            // SAFETY: the identifier is live (held here) and route-resolved; `param` and its
            // data outlive the call.
            let rc = unsafe { (held.cm.rdma_connect)(held.raw, &mut param) };
            let errno = if rc == 0 {
                0
            } else {
                std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
            };
            let _ = tx.send(errno);
            // `held` goes here, after the kernel has let go of the attempt.
        })
        .map_err(|e| Error::io("starting the iWARP connect thread", e))?;
    match rx.recv_timeout(super::remaining(deadline)) {
        Ok(0) => Ok(()),
        Ok(errno) => Err(connect_error(dst, errno)),
        Err(_) => Err(Error::Timeout {
            what: format!(
                "the TCP connection of an iWARP connection to {dst} (the kernel goes on trying \
                 in the background until it gives up)"
            ),
        }),
    }
}

/// What a failed iWARP `rdma_connect` means.
fn connect_error(dst: SocketAddr, errno: i32) -> Error {
    match errno {
        libc::ECONNREFUSED => Error::Refused {
            peer: dst.to_string(),
            reason: "nobody is listening there (iWARP: the TCP connection was refused)".into(),
        },
        libc::ETIMEDOUT | libc::EHOSTUNREACH | libc::ENETUNREACH => Error::Unreachable {
            peer: dst.to_string(),
            detail: format!(
                "the TCP connection failed ({})",
                std::io::Error::from_raw_os_error(errno)
            ),
        },
        e => Error::errno("rdma_connect", e),
    }
}

/// Why an iWARP peer rejected, from the `REJECTED` event's status.
pub(super) fn reject_code(status: i32) -> String {
    match -status {
        libc::ECONNRESET => "rejected by the peer (ECONNRESET: an MPA reject)".to_string(),
        libc::ECONNREFUSED => {
            "refused (ECONNREFUSED: nobody listening, or the MPA negotiation failed)".to_string()
        }
        e => format!("rejected ({})", std::io::Error::from_raw_os_error(e)),
    }
}

/// An identifier (and what must go before it) that, when dropped while armed on an iWARP
/// device, is destroyed on a thread of its own: `destroy_qp` and `rdma_destroy_id` wait there for
/// the connection attempt the kernel still runs.
pub(super) struct Detach {
    id: Option<Arc<CmId>>,
    /// Dropped first, on the same thread (the queue pair).
    before: Vec<Box<dyn Send>>,
    armed: bool,
}

impl Detach {
    pub(super) fn new(id: Arc<CmId>) -> Detach {
        Detach {
            id: Some(id),
            before: Vec::new(),
            armed: false,
        }
    }

    /// The identifier.
    pub(super) fn id(&self) -> &Arc<CmId> {
        self.id.as_ref().expect("present until dropped")
    }

    /// From now on a drop goes to a thread where the transport is iWARP; `before` (a handle of
    /// the queue pair) goes first, there.
    pub(super) fn arm(&mut self, transport: Transport, before: impl Send + 'static) {
        self.armed = transport == Transport::Iwarp;
        self.before.push(Box::new(before));
    }

    /// Keeps the identifier (the connection succeeded); the rest goes now.
    pub(super) fn into_inner(mut self) -> Arc<CmId> {
        self.before.clear();
        self.id.take().expect("present until dropped")
    }
}

impl Drop for Detach {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else { return };
        let before = std::mem::take(&mut self.before);
        let release = move || {
            drop(before);
            drop(id);
        };
        if self.armed {
            // Should no thread start, the closure, and what it holds, goes here.
            let _ = std::thread::Builder::new()
                .name("erdma-iwarp-release".into())
                .spawn(release);
        } else {
            release();
        }
    }
}

/// The IPv4 address rdma_cm reaches a device by: the address of the netdev under it.
///
/// On InfiniBand/RoCE it is the address in the port's IPv4-mapped GID. An iWARP device has one
/// GID, the MAC address of its netdev; the netdev is found by that MAC under
/// `/sys/class/net`, and its first IPv4 address is the answer.
///
/// # Errors
/// [`Error::InvalidArgument`] when the device has no such address (a soft device: use its own
/// address; a netdev without IPv4).
pub fn device_ipv4(ctx: &Context) -> Result<Ipv4Addr> {
    if ctx.transport() != Transport::Iwarp {
        let gid = ctx.ipv4_gid(1)?.gid;
        return gid.to_ipv4().ok_or_else(|| {
            Error::invalid(format!("the IPv4 GID of {} holds no address", ctx.name()))
        });
    }
    let table = ctx.gid_table(1)?;
    let mac: [u8; 6] = table
        .first()
        .and_then(|g| g.gid.0[..6].try_into().ok())
        .ok_or_else(|| Error::invalid(format!("{} reports no GID", ctx.name())))?;
    let netdev = netdev_with_mac(&mac).ok_or_else(|| {
        Error::invalid(format!(
            "no network interface has the MAC address {} of {}'s GID",
            mac_text(&mac),
            ctx.name()
        ))
    })?;
    ipv4_of(&netdev).ok_or_else(|| {
        Error::invalid(format!(
            "{netdev}, the network interface under {}, has no IPv4 address",
            ctx.name()
        ))
    })
}

fn mac_text(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The network interface whose hardware address is `mac`.
fn netdev_with_mac(mac: &[u8; 6]) -> Option<String> {
    let want = mac_text(mac);
    std::fs::read_dir("/sys/class/net").ok()?.find_map(|e| {
        let e = e.ok()?;
        let addr = std::fs::read_to_string(e.path().join("address")).ok()?;
        (addr.trim() == want).then(|| e.file_name().to_string_lossy().into_owned())
    })
}

/// The first IPv4 address of interface `name`.
fn ipv4_of(name: &str) -> Option<Ipv4Addr> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: a valid out-parameter; the list is freed below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut at = list;
    while !at.is_null() {
        // SAFETY: `at` is an entry of the list getifaddrs returned, not yet freed.
        let entry = unsafe { &*at };
        // SAFETY: `ifa_name` is a NUL-terminated string inside the entry.
        let ifname = unsafe { std::ffi::CStr::from_ptr(entry.ifa_name) };
        let addr = entry.ifa_addr;
        // SAFETY: a non-null `ifa_addr` points at a sockaddr whose family says its type.
        let inet = !addr.is_null() && unsafe { (*addr).sa_family } as i32 == libc::AF_INET;
        if inet && ifname.to_bytes() == name.as_bytes() {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let sin = unsafe { &*(addr as *const libc::sockaddr_in) };
            found = Some(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()));
            break;
        }
        at = entry.ifa_next;
    }
    // SAFETY: the list came from getifaddrs and is freed once; no entry is used after.
    unsafe { libc::freeifaddrs(list) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_has_its_address() {
        // Every Linux host (and network namespace with lo up) has 127.0.0.1 on lo.
        if let Some(a) = ipv4_of("lo") {
            assert_eq!(a, Ipv4Addr::LOCALHOST);
        }
        assert_eq!(ipv4_of("no-such-interface-here"), None);
    }

    #[test]
    fn connect_errors_name_the_cause() {
        let dst: SocketAddr = "10.0.3.15:7471".parse().unwrap();
        assert!(matches!(
            connect_error(dst, libc::ECONNREFUSED),
            Error::Refused { .. }
        ));
        assert!(matches!(
            connect_error(dst, libc::ETIMEDOUT),
            Error::Unreachable { .. }
        ));
        assert!(matches!(
            connect_error(dst, libc::EINVAL),
            Error::Verb { .. }
        ));
        assert!(reject_code(-libc::ECONNRESET).contains("MPA reject"));
        assert!(reject_code(-libc::ECONNREFUSED).contains("ECONNREFUSED"));
    }
}

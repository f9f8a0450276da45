//! The few operating-system calls the standard library does not offer: the host's IPv4
//! addresses, a TCP connect that does not block, and TCP keepalive timings. Unsafe code lives
//! here and in the `ffi` module only.
#![allow(unsafe_code)]

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Every IPv4 address of the host's interfaces, with the interface's name.
pub fn ipv4_addresses() -> Vec<(String, Ipv4Addr)> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` is a valid out-parameter; on success it points to a list freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is an element of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: `ifa_addr` points to a sockaddr whose family field is readable.
            let family = unsafe { (*ifa.ifa_addr).sa_family };
            if i32::from(family) == libc::AF_INET && !ifa.ifa_name.is_null() {
                // SAFETY: an AF_INET address is a sockaddr_in; the name is a C string, both
                // alive until freeifaddrs.
                let (sin, name) = unsafe {
                    (
                        &*(ifa.ifa_addr as *const libc::sockaddr_in),
                        std::ffi::CStr::from_ptr(ifa.ifa_name),
                    )
                };
                let a = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                out.push((name.to_string_lossy().into_owned(), a));
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// Starts a TCP connection without waiting for it: the socket is non-blocking, and
/// [`connect_finished`] tells when it is up.
///
/// # Errors
/// The socket call's error, or the connect's when it fails at once (anything but "in
/// progress").
pub fn connect_start(addr: SocketAddr) -> io::Result<TcpStream> {
    let (family, storage, len) = sockaddr(addr);
    // SAFETY: plain socket creation; the result is checked.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nobody else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `storage` holds a valid sockaddr of `len` bytes for this family.
    let rc = unsafe { libc::connect(fd, (&raw const storage).cast::<libc::sockaddr>(), len) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
    }
    Ok(TcpStream::from(owned))
}

/// Whether a connection [`connect_start`] began is up: `Ok(true)` up, `Ok(false)` still
/// connecting.
///
/// # Errors
/// The connection's failure (refused, unreachable, timed out).
pub fn connect_finished(s: &TcpStream) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no waiting.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n == 0 {
        return Ok(false);
    }
    match s.take_error()? {
        Some(e) => Err(e),
        None => Ok(true),
    }
}

/// Turns TCP keepalive on with short timings (first probe after 10 s idle, then every 5 s, 3
/// probes): a peer host that vanishes without closing is noticed in about 25 s.
pub fn keepalive(s: &TcpStream) {
    let fd = s.as_raw_fd();
    for (level, opt, val) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 10),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3),
    ] {
        let v: libc::c_int = val;
        // SAFETY: an int option of the right size on a socket we own; failure is harmless.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                opt,
                (&raw const v).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
}

fn sockaddr(addr: SocketAddr) -> (libc::c_int, libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large enough and suitably aligned for sockaddr_in.
            unsafe { std::ptr::write((&raw mut storage).cast::<libc::sockaddr_in>(), sin) };
            (
                libc::AF_INET,
                storage,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is large enough and suitably aligned for sockaddr_in6.
            unsafe { std::ptr::write((&raw mut storage).cast::<libc::sockaddr_in6>(), sin6) };
            (
                libc::AF_INET6,
                storage,
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::{Duration, Instant};

    #[test]
    fn loopback_is_listed() {
        assert!(ipv4_addresses().iter().any(|(_, a)| a.is_loopback()));
    }

    #[test]
    fn non_blocking_connect_comes_up_or_fails() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = connect_start(l.local_addr().unwrap()).unwrap();
        let t = Instant::now();
        while !connect_finished(&s).unwrap() {
            assert!(t.elapsed() < Duration::from_secs(5));
            std::thread::sleep(Duration::from_millis(1));
        }
        keepalive(&s);
        let port = l.local_addr().unwrap().port();
        drop(l);
        // Nobody listens any more: refused, at once or on the first check.
        let r = connect_start(SocketAddr::from(([127, 0, 0, 1], port))).and_then(|s| {
            let t = Instant::now();
            loop {
                if connect_finished(&s)? {
                    return Ok(());
                }
                assert!(t.elapsed() < Duration::from_secs(5));
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::ConnectionRefused);
    }
}

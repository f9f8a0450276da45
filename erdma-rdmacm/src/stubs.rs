//! What this library does not offer, failing as rdma-core does where a device lacks a feature:
//! multicast and UD (the soft device is RC only), shared receive queues through rdma_cm,
//! enhanced connection establishment, and rsockets. `rpoll` and `rselect` serve ordinary
//! descriptors as `poll` and `select` (rsockets' own behaviour for a descriptor that is not an
//! rsocket): programs such as rping and ucmatose import them.

use std::os::raw::{c_int, c_void};

use erdma_sys as sys;

use crate::set_errno;

fn fail(e: c_int) -> c_int {
    set_errno(e);
    -1
}

fn fail_isize(e: c_int) -> isize {
    set_errno(e);
    -1
}

#[unsafe(no_mangle)]
pub extern "C" fn rdma_join_multicast(
    _id: *mut sys::rdma_cm_id,
    _addr: *mut sys::sockaddr,
    _context: *mut c_void,
) -> c_int {
    fail(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
pub extern "C" fn rdma_join_multicast_ex(
    _id: *mut sys::rdma_cm_id,
    _attr: *mut sys::rdma_cm_join_mc_attr_ex,
    _context: *mut c_void,
) -> c_int {
    fail(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
pub extern "C" fn rdma_leave_multicast(
    _id: *mut sys::rdma_cm_id,
    _addr: *mut sys::sockaddr,
) -> c_int {
    // Nothing was joined.
    fail(libc::EADDRNOTAVAIL)
}

#[unsafe(no_mangle)]
pub extern "C" fn rdma_create_srq(
    _id: *mut sys::rdma_cm_id,
    _pd: *mut sys::ibv_pd,
    _attr: *mut sys::ibv_srq_init_attr,
) -> c_int {
    fail(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
pub extern "C" fn rdma_create_srq_ex(
    _id: *mut sys::rdma_cm_id,
    _attr: *mut sys::ibv_srq_init_attr_ex,
) -> c_int {
    fail(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
pub extern "C" fn rdma_destroy_srq(_id: *mut sys::rdma_cm_id) {}

#[unsafe(no_mangle)]
pub extern "C" fn rdma_set_local_ece(_id: *mut sys::rdma_cm_id, _ece: *mut c_void) -> c_int {
    fail(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
pub extern "C" fn rdma_get_remote_ece(_id: *mut sys::rdma_cm_id, _ece: *mut c_void) -> c_int {
    fail(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_reject_ece(
    id: *mut sys::rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    // SAFETY: the program's arguments, passed on (the C contract is the same).
    unsafe { crate::calls::rdma_reject(id, private_data, private_data_len) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rpoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: c_int,
) -> c_int {
    // SAFETY: the program's arguments, passed on (poll's contract).
    unsafe { libc::poll(fds, nfds, timeout) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    // SAFETY: the program's arguments, passed on (select's contract).
    unsafe { libc::select(nfds, readfds, writefds, exceptfds, timeout) }
}

#[unsafe(no_mangle)]
pub extern "C" fn rsocket(_domain: c_int, _type: c_int, _protocol: c_int) -> c_int {
    fail(libc::EOPNOTSUPP)
}

/// The rsocket calls on a descriptor: no descriptor is an rsocket here.
macro_rules! not_rsocket {
    ($($name:ident ( $($arg:ident : $t:ty),* ) -> $ret:ident;)*) => {$(
        #[unsafe(no_mangle)]
        pub extern "C" fn $name(_socket: c_int, $($arg: $t),*) -> not_rsocket!(@ty $ret) {
            $(let _ = $arg;)*
            not_rsocket!(@fail $ret)
        }
    )*};
    (@ty int) => { c_int };
    (@ty ssize) => { isize };
    (@ty off) => { libc::off_t };
    (@ty size) => { usize };
    (@fail int) => { fail(libc::EBADF) };
    (@fail ssize) => { fail_isize(libc::EBADF) };
    (@fail off) => { fail_isize(libc::EBADF) as libc::off_t };
    (@fail size) => { { set_errno(libc::EBADF); 0 } };
}

not_rsocket! {
    rbind(addr: *const libc::sockaddr, len: libc::socklen_t) -> int;
    rlisten(backlog: c_int) -> int;
    raccept(addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> int;
    rconnect(addr: *const libc::sockaddr, len: libc::socklen_t) -> int;
    rshutdown(how: c_int) -> int;
    rclose() -> int;
    rrecv(buf: *mut c_void, len: usize, flags: c_int) -> ssize;
    rrecvfrom(buf: *mut c_void, len: usize, flags: c_int, src: *mut libc::sockaddr, alen: *mut libc::socklen_t) -> ssize;
    rrecvmsg(msg: *mut libc::msghdr, flags: c_int) -> ssize;
    rsend(buf: *const c_void, len: usize, flags: c_int) -> ssize;
    rsendto(buf: *const c_void, len: usize, flags: c_int, dst: *const libc::sockaddr, alen: libc::socklen_t) -> ssize;
    rsendmsg(msg: *const libc::msghdr, flags: c_int) -> ssize;
    rread(buf: *mut c_void, count: usize) -> ssize;
    rreadv(iov: *const libc::iovec, iovcnt: c_int) -> ssize;
    rwrite(buf: *const c_void, count: usize) -> ssize;
    rwritev(iov: *const libc::iovec, iovcnt: c_int) -> ssize;
    rgetpeername(addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> int;
    rgetsockname(addr: *mut libc::sockaddr, len: *mut libc::socklen_t) -> int;
    rsetsockopt(level: c_int, name: c_int, val: *const c_void, len: libc::socklen_t) -> int;
    rgetsockopt(level: c_int, name: c_int, val: *mut c_void, len: *mut libc::socklen_t) -> int;
    rfcntl(cmd: c_int, arg: c_int) -> int;
    riomap(buf: *mut c_void, len: usize, prot: c_int, flags: c_int, offset: libc::off_t) -> off;
    riounmap(buf: *mut c_void, len: usize) -> int;
    riowrite(buf: *const c_void, count: usize, offset: libc::off_t, flags: c_int) -> size;
}

/// `RDMACM_1.4` (rdma-core 48 and later): resolving through the kernel's address-info service
/// (`rdma_resolve_addrinfo`, `rdma_query_addrinfo`) and user events (`rdma_write_cm_event`) are
/// not offered; present so that programs built against a newer librdmacm load.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_resolve_addrinfo(
    _id: *mut sys::rdma_cm_id,
    _node: *const std::os::raw::c_char,
    _service: *const std::os::raw::c_char,
    _hints: *const sys::rdma_addrinfo,
) -> c_int {
    fail(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
pub extern "C" fn rdma_query_addrinfo(
    _id: *mut sys::rdma_cm_id,
    _info: *mut *mut sys::rdma_addrinfo,
) -> c_int {
    fail(libc::EOPNOTSUPP)
}

#[unsafe(no_mangle)]
pub extern "C" fn rdma_write_cm_event(
    _id: *mut sys::rdma_cm_id,
    _event: sys::rdma_cm_event_type,
    _status: c_int,
    _arg: u64,
) -> c_int {
    fail(libc::EOPNOTSUPP)
}

/// `RDMACM_1.5`: rsockets' epoll. With no rsockets, every descriptor is an ordinary one, which
/// rsockets hand to `epoll` as these do.
#[unsafe(no_mangle)]
pub extern "C" fn repoll_create1(flags: c_int) -> c_int {
    // SAFETY: plain syscall.
    unsafe { libc::epoll_create1(flags) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn repoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    event: *mut libc::epoll_event,
) -> c_int {
    // SAFETY: the program's arguments, passed on (epoll_ctl's contract).
    unsafe { libc::epoll_ctl(epfd, op, fd, event) }
}

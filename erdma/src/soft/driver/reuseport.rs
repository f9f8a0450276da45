//! A device's several sockets on one address: the claim that keeps the address this process's,
//! and the steering program that sends each datagram to the socket of the engine serving its
//! queue pair.
//!
//! A device of N > 1 engines binds N UDP sockets to `<addr>:4791` in one `SO_REUSEPORT` group.
//! The kernel admits into a group any socket of the same user that asks, so another process of
//! that user (a second program opening the same soft device) would join it and take a share of
//! the datagrams instead of failing as it does with one socket. [`claim`] prevents that: before
//! binding, the device binds an abstract Unix socket named after the address (per network
//! namespace, like the port; released by the kernel when the process dies), and a second
//! process finds the name taken and fails with `EADDRINUSE`. A socket without `SO_REUSEPORT`
//! holding the port (a one-engine device, a kernel rxe device, any other program) still makes
//! the group's first bind fail with `EADDRINUSE`, and a group holding it makes a one-engine
//! device's bind fail the same way.
//!
//! [`steer_by_qpn`] attaches a classic BPF program to the group (`SO_ATTACH_REUSEPORT_CBPF`):
//! for UDP it sees the payload, so the BTH's destination QPN is the low 24 bits of the
//! big-endian word at offset 4, and it returns `qpn % N`, the index of the socket (in the order
//! the sockets joined) of the engine that serves it. Until it is attached, or where the kernel
//! refuses it, the kernel spreads datagrams by a hash of their addresses and ports, and the
//! engine hands each one to the lane serving its queue pair (`soft::engine::lane`).

#![allow(unsafe_code)] // the socket syscalls

use std::io;
use std::mem;
use std::net::Ipv4Addr;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// `SOL_SOCKET` option: a classic BPF program choosing the socket of a reuseport group.
const SO_ATTACH_REUSEPORT_CBPF: libc::c_int = 51;

// Classic BPF opcodes (linux/bpf_common.h): class | size/op | mode/source.
/// `BPF_LD | BPF_W | BPF_ABS`.
const BPF_LD_W_ABS: u16 = 0x20;
/// `BPF_ALU | BPF_AND | BPF_K`.
const BPF_ALU_AND_K: u16 = 0x54;
/// `BPF_ALU | BPF_MOD | BPF_K`.
const BPF_ALU_MOD_K: u16 = 0x94;
/// `BPF_RET | BPF_A`.
const BPF_RET_A: u16 = 0x16;

/// The abstract Unix socket name that claims `addr`'s RoCE port for this process.
fn claim_name(addr: Ipv4Addr) -> String {
    format!("erdma-soft/{addr}:{}", super::ROCE_PORT)
}

/// Claims `addr` for this process's soft device (see the module's documentation); the claim
/// lasts as long as the returned descriptor.
///
/// # Errors
/// `EADDRINUSE` when another process holds the claim; other socket errors as they come.
pub(crate) fn claim(addr: Ipv4Addr) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call with constant arguments.
    let raw = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: sockaddr_un is plain old data; all-zero is a valid (empty) value.
    let mut sa: libc::sockaddr_un = unsafe { mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let name = claim_name(addr);
    // The abstract namespace: a leading NUL, then the name (not NUL-terminated).
    let max = sa.sun_path.len() - 1;
    let bytes = &name.as_bytes()[..name.len().min(max)];
    for (d, s) in sa.sun_path[1..].iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = mem::size_of::<libc::sa_family_t>() + 1 + bytes.len();
    // SAFETY: `sa` is a valid sockaddr_un and `len` covers its family and the used path bytes.
    let r = unsafe {
        libc::bind(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            (&sa as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// The steering program's instructions for a group of `lanes` sockets.
fn program(lanes: u32) -> [libc::sock_filter; 4] {
    let ins = |code: u16, k: u32| libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    [
        // A = the BTH's second word (flags byte and destination QPN).
        ins(BPF_LD_W_ABS, 4),
        ins(BPF_ALU_AND_K, 0x00ff_ffff),
        ins(BPF_ALU_MOD_K, lanes.max(1)),
        // The socket's index in the group.
        ins(BPF_RET_A, 0),
    ]
}

/// Attaches the QPN steering program to the reuseport group of bound socket `fd` (see the
/// module's documentation).
///
/// # Errors
/// The kernel's refusal (an old kernel, a group without `SO_REUSEPORT`).
pub(crate) fn steer_by_qpn(fd: RawFd, lanes: u32) -> io::Result<()> {
    let mut prog = program(lanes);
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: `fprog` points at `prog`, live for the call; the kernel copies the program.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_ATTACH_REUSEPORT_CBPF,
            (&fprog as *const libc::sock_fprog).cast(),
            mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_is_exclusive_and_released_with_its_descriptor() {
        // A loopback address no other test uses.
        let addr = Ipv4Addr::new(127, 77, 41, 1);
        let first = claim(addr).expect("claiming a free address");
        let again = claim(addr).expect_err("a second claim must fail");
        assert_eq!(again.raw_os_error(), Some(libc::EADDRINUSE));
        drop(first);
        claim(addr).expect("the claim is free again once dropped");
    }

    #[test]
    fn the_program_reads_the_destination_qpn() {
        let p = program(4);
        assert_eq!((p[0].code, p[0].k), (BPF_LD_W_ABS, 4));
        assert_eq!((p[1].code, p[1].k), (BPF_ALU_AND_K, 0xff_ffff));
        assert_eq!((p[2].code, p[2].k), (BPF_ALU_MOD_K, 4));
        assert_eq!(p[3].code, BPF_RET_A);
        assert_eq!(program(0)[2].k, 1, "never a division by zero");
    }
}

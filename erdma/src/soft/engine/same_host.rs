//! Soft devices on one host finding each other, so that payloads move with one copy.
//!
//! Two soft devices in different processes (or the same one) on one host exchange four small
//! datagrams on the RoCEv2 port, with an opcode from the range IBTA leaves to manufacturers
//! (rxe drops it as unknown and is never sent one: they go only to addresses of this host):
//!
//! 1. the side that will send references (A) says HELLO when a queue pair of its is pointed at
//!    a local address;
//! 2. the device there (B) answers CHALLENGE with a fresh unpredictable nonce;
//! 3. A writes `(nonce, B's address)` into a slot of its own memory and answers PROOF with its
//!    process id and the slot's address;
//! 4. B reads that slot out of process `pid` (`process_vm_readv`) and, when it holds the
//!    nonce and B's own address, records A's address as served by `pid` and answers ACCEPT.
//!
//! From then on A's queue pairs towards B send SEND and WRITE payloads as reference lists
//! (`wire::peer_ref`) carrying the nonce as their token, and B copies the bytes straight out of
//! A's memory into its own: one copy, where the datagram path copies each byte three times and
//! checksums it twice.
//!
//! 5. B answers a reference packet it cannot take (no proof from A's address, or another
//!    token: B's device was closed and opened again since) with REFUSED and the token it
//!    refused, at most once a millisecond per address. A, when that is the token it sends,
//!    forgets the acceptance, turns references off for its queue pairs towards B (messages
//!    begun from then on carry their bytes) and says HELLO again; a message begun by reference
//!    is resent with the token B accepts next. Without it A went on sending references B
//!    dropped until its requests ran out of retries.
//!
//! 6. An exchange of A's left unfinished (no CHALLENGE came, or a PROOF or ACCEPT was lost)
//!    starts again from HELLO [`RETRY_NS`] after its last HELLO, at A's next receive round
//!    ([`SameHost::retry`]); [`TRIES`] HELLOs per peer in all.
//!
//! Why B can trust a reference packet from A's address: only the process bound to A's address
//! and port receives B's CHALLENGE, and only a process able to write the memory of `pid` can
//! put the nonce there with B's address beside it (a process that forwards the challenge to
//! another soft device gets a slot naming itself as the challenger, which B refuses). Reading
//! another process's memory needs the kernel's ptrace permission (same user, Yama's scope
//! allowing it, same PID namespace): where any of that fails, the slot cannot be read, B never
//! accepts, and the bytes stay on the wire. B keeps a pidfd of `pid` and refuses references
//! once that process has exited, so a reused process id is never read; and it refuses a list
//! whose token is not the nonce A proved, so whoever binds A's address after A's device closed
//! (A's process still running) cannot make B read A's memory. A reference packet from an
//! address B has not verified, or with another token, is dropped (`drop_peer_ref_refused`).
//!
//! Must not: send these datagrams to an address that is not this host's, or block.

#![allow(unsafe_code)] // process_vm_readv, pidfd_open, poll

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

// Plain std atomics, not the crate's model-checked ones: other processes read these bytes.
use std::sync::atomic::{AtomicU64, Ordering};

use super::lock;
use crate::soft::wire::peer_ref::PeerRefs;

/// The opcode of the exchange's datagrams (manufacturer-specific range).
pub(crate) const OPCODE: u8 = 0xF5;
/// The exchange's version byte.
const VERSION: u8 = 1;
const HELLO: u8 = 1;
const CHALLENGE: u8 = 2;
const PROOF: u8 = 3;
const ACCEPT: u8 = 4;
const REFUSED: u8 = 5;
/// A producer's nudge to a device that sleeps while packets wait in a ring of its
/// (`driver::shm`); nothing to answer.
const WAKE: u8 = 6;
/// Length of the datagrams' header: opcode, kind, version, five zero bytes (the BTH's
/// destination QPN bytes stay 0, so a device of several lanes hands them to lane 0).
const HEAD: usize = 8;
/// Largest datagram of the exchange.
pub(crate) const MAX_LEN: usize = HEAD + 24;
/// Proof slots (a challenge takes the next; one older than this many challenges is reused).
const SLOTS: usize = 64;
/// Nanoseconds before an unanswered HELLO may be said again.
const RETRY_NS: u64 = 200_000_000;
/// HELLOs said to one address before giving up on it.
const TRIES: u8 = 5;
/// Addresses challenged and not yet proved, at most (HELLOs from further ones are ignored
/// until some prove).
const MAX_CHALLENGED: usize = 1024;
/// Nanoseconds between two REFUSED sent to one address.
const REFUSE_EVERY_NS: u64 = 1_000_000;

/// A slot another process reads to check a proof: the nonce and the challenger's address.
#[repr(C, align(16))]
struct Slot {
    nonce: AtomicU64,
    challenger: AtomicU64,
}

/// Where we stand with a peer we want to send references to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    /// HELLO said (`tries` times, the last at `at` ns).
    Asked { at: u64, tries: u8 },
    /// Challenged with `nonce` and proved, after `tries` HELLOs (the last at `at` ns): the
    /// peer's ACCEPT has not come yet.
    Proved { nonce: u64, at: u64, tries: u8 },
    /// The peer reads our references carrying `token` (the nonce it accepted).
    Accepted { token: u64 },
}

impl Out {
    /// An exchange not accepted yet: when our last HELLO went out, and how many we said.
    fn asked(self) -> Option<(u64, u8)> {
        match self {
            Out::Asked { at, tries } | Out::Proved { at, tries, .. } => Some((at, tries)),
            Out::Accepted { .. } => None,
        }
    }

    /// HELLOs said so far, when the exchange may be started again at `now`.
    fn due(self, now: u64) -> Option<u8> {
        self.asked()
            .filter(|&(at, tries)| tries < TRIES && now.saturating_sub(at) >= RETRY_NS)
            .map(|(_, tries)| tries)
    }
}

/// A peer that proved it lives in process `pid`, with `token` (its references carry it).
struct Verified {
    pid: i32,
    token: u64,
    /// Becomes readable when the process exits (shared, so that a lookup polls it unlocked).
    pidfd: Arc<OwnedFd>,
}

#[derive(Default)]
struct Peers {
    out: HashMap<Ipv4Addr, Out>,
    challenged: HashMap<Ipv4Addr, u64>,
    verified: HashMap<Ipv4Addr, Verified>,
    /// When each address was last sent REFUSED (at most [`MAX_CHALLENGED`] addresses).
    refused: HashMap<Ipv4Addr, u64>,
    next_slot: usize,
    nonces: u64,
}

/// A datagram of the exchange to send to `dst`'s RoCEv2 port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) dst: Ipv4Addr,
    pub(crate) len: usize,
    pub(crate) bytes: [u8; MAX_LEN],
}

/// What a datagram of the exchange changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Outcome {
    /// What to answer.
    pub(crate) reply: Option<Reply>,
    /// This peer now reads our references, with this token: turn them on for the queue pairs
    /// pointed at it.
    pub(crate) accepted: Option<(Ipv4Addr, u64)>,
    /// This peer no longer reads our references: turn them off for the queue pairs pointed at
    /// it.
    pub(crate) refused: Option<Ipv4Addr>,
    /// Our own HELLO, said again: the peer's HELLO shows it now listens, and ours to it went
    /// unanswered (sent before its port was bound, say).
    pub(crate) again: Option<Reply>,
}

/// Shared-memory rings between devices of this host, where the driver offers them
/// (`driver::shm`). The exchange carries their set-up: A offers a ring in its PROOF (by
/// descriptor number), B takes it when it accepts the proof and says so in its ACCEPT.
pub(crate) trait Channels: Send + Sync {
    /// A new ring for packets to `peer`; the descriptor number `peer` takes it by.
    fn offer(&self, peer: Ipv4Addr) -> Option<u32>;
    /// Takes descriptor `fd` of the process behind `pidfd` (which proved it serves `peer`) as
    /// the ring `peer`'s packets come in by. Returns whether it did.
    fn take(&self, peer: Ipv4Addr, pidfd: &OwnedFd, fd: u32) -> bool;
    /// `peer` took the ring offered to it (`taken`), or did not: send by it, or forget it.
    fn settle(&self, peer: Ipv4Addr, taken: bool);
    /// Stop sending by the ring to `peer` (it no longer reads what we send).
    fn forget(&self, peer: Ipv4Addr);
    /// Packets written to rings, packets read from them, and messages sent by the socket
    /// instead because their ring was full, so far.
    fn counts(&self) -> [u64; 3];
}

/// The WAKE datagram a ring's producer sends to its sleeping consumer.
pub(crate) fn wake_datagram() -> [u8; HEAD] {
    let mut b = [0u8; HEAD];
    b[0] = OPCODE;
    b[1] = WAKE;
    b[2] = VERSION;
    b
}

/// A device's side of the exchange.
pub(crate) struct SameHost {
    addr: Ipv4Addr,
    slots: Box<[Slot]>,
    keys: RandomState,
    state: Mutex<Peers>,
    /// When the earliest exchange left unfinished may be started again ([`SameHost::retry`]),
    /// ns on the device's clock; `u64::MAX`: none is. Read without the lock on every round.
    retry_at: AtomicU64,
}

fn datagram(dst: Ipv4Addr, kind: u8, body: &[u8]) -> Reply {
    let mut bytes = [0u8; MAX_LEN];
    bytes[0] = OPCODE;
    bytes[1] = kind;
    bytes[2] = VERSION;
    bytes[HEAD..HEAD + body.len()].copy_from_slice(body);
    Reply {
        dst,
        len: HEAD + body.len(),
        bytes,
    }
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Whether `ip` is an address of this host: loopback, or assigned to one of its interfaces.
pub(crate) fn is_local(ip: Ipv4Addr) -> bool {
    if ip.is_loopback() {
        return true;
    }
    // Binding a socket to an address succeeds only for this host's addresses (port 0: any).
    std::net::UdpSocket::bind((ip, 0)).is_ok()
}

impl SameHost {
    /// The exchange for the device on `addr`.
    pub(crate) fn new(addr: Ipv4Addr) -> SameHost {
        SameHost {
            addr,
            slots: (0..SLOTS)
                .map(|_| Slot {
                    nonce: AtomicU64::new(0),
                    challenger: AtomicU64::new(0),
                })
                .collect(),
            keys: RandomState::new(),
            state: Mutex::new(Peers::default()),
            retry_at: AtomicU64::new(u64::MAX),
        }
    }

    /// An exchange with some peer left unfinished at `at` may be started again
    /// [`RETRY_NS`] later.
    fn retry_from(&self, at: u64) {
        self.retry_at
            .fetch_min(at.saturating_add(RETRY_NS), Ordering::Relaxed);
    }

    /// Starts again every exchange of ours left unfinished [`RETRY_NS`] or more before `now`
    /// (within [`TRIES`] HELLOs per peer), passing each HELLO to `send`. A datagram of the
    /// exchange can be lost like any other (a full socket buffer): a HELLO whose CHALLENGE
    /// never came, or a PROOF or ACCEPT lost, would otherwise leave references and rings off
    /// towards that peer until one of our queue pairs is modified again, which may never be.
    /// The device's rounds call it; without a lock unless a retry is due.
    pub(crate) fn retry(&self, now: u64, mut send: impl FnMut(Reply)) {
        if now < self.retry_at.load(Ordering::Relaxed) {
            return;
        }
        let mut st = lock(&self.state);
        let mut next = u64::MAX;
        for (&peer, out) in st.out.iter_mut() {
            if let Some(tries) = out.due(now) {
                *out = Out::Asked {
                    at: now,
                    tries: tries + 1,
                };
                send(datagram(peer, HELLO, &[]));
            }
            if let Some((at, tries)) = out.asked()
                && tries < TRIES
            {
                next = next.min(at.saturating_add(RETRY_NS));
            }
        }
        self.retry_at.store(next, Ordering::Relaxed);
    }

    /// A queue pair of this device now points at `peer` (`now`: ns on the device's clock).
    /// Returns the token of the references the peer already reads, if it does, and the HELLO
    /// to send if it should be asked (first time, or the last HELLO went unanswered a while).
    pub(crate) fn want(&self, peer: Ipv4Addr, now: u64) -> (Option<u64>, Option<Reply>) {
        let mut st = lock(&self.state);
        let hello = |st: &mut Peers, tries: u8| {
            st.out.insert(peer, Out::Asked { at: now, tries });
            self.retry_from(now);
            (None, Some(datagram(peer, HELLO, &[])))
        };
        match st.out.get(&peer).copied() {
            Some(Out::Accepted { token }) => (Some(token), None),
            Some(o) => match o.due(now) {
                Some(tries) => hello(&mut st, tries + 1),
                None => (None, None),
            },
            None if is_local(peer) => hello(&mut st, 1),
            None => (None, None),
        }
    }

    /// The process to read a reference packet's payload (`list`, its encoded reference list)
    /// out of: the one the peer on `src` proved it lives in, while it lives, when the list
    /// carries that peer's token.
    pub(crate) fn verified(&self, src: Ipv4Addr, list: &[u8]) -> Option<i32> {
        let token = PeerRefs::parse(list).ok()?.token();
        let (pid, pidfd) = {
            let st = lock(&self.state);
            let v = st.verified.get(&src)?;
            if v.token != token {
                return None;
            }
            (v.pid, v.pidfd.clone())
        };
        // Outside the lock: the lanes of a device look up their packets' senders at once.
        process_alive(&pidfd).then_some(pid)
    }

    /// The REFUSED to answer a reference packet from `src` (its encoded reference list `list`)
    /// that [`SameHost::verified`] turned down, unless `src` had one within the last
    /// [`REFUSE_EVERY_NS`] before `now` or is not this host's.
    pub(crate) fn refuse(&self, src: Ipv4Addr, list: &[u8], now: u64) -> Option<Reply> {
        let token = PeerRefs::parse(list).ok()?.token();
        {
            let mut st = lock(&self.state);
            if st
                .refused
                .get(&src)
                .is_some_and(|&at| now.saturating_sub(at) < REFUSE_EVERY_NS)
            {
                return None;
            }
            if st.refused.len() >= MAX_CHALLENGED {
                st.refused.clear();
            }
            st.refused.insert(src, now);
        }
        is_local(src).then(|| datagram(src, REFUSED, &token.to_be_bytes()))
    }

    fn nonce(&self, st: &mut Peers) -> u64 {
        st.nonces += 1;
        let mut h = self.keys.build_hasher();
        h.write_u64(st.nonces);
        h.write_u32(u32::from(self.addr));
        // Never 0: a fresh slot holds 0.
        h.finish() | 1
    }

    /// Handles a datagram of the exchange from `src` (its opcode byte is [`OPCODE`]) at `now`
    /// (ns on the device's clock). Anything malformed, unexpected or unproved is ignored.
    /// `chan`: the device's shared-memory rings, if it has them.
    pub(crate) fn on_datagram(
        &self,
        src: Ipv4Addr,
        data: &[u8],
        now: u64,
        chan: Option<&dyn Channels>,
    ) -> Outcome {
        let mut out = Outcome::default();
        if data.len() < HEAD
            || data[0] != OPCODE
            || data[2] != VERSION
            || src == Ipv4Addr::UNSPECIFIED
        {
            return out;
        }
        let body = &data[HEAD..];
        let mut st = lock(&self.state);
        match data[1] {
            HELLO => {
                if !is_local(src)
                    || (st.challenged.len() >= MAX_CHALLENGED && !st.challenged.contains_key(&src))
                {
                    return out;
                }
                let n = self.nonce(&mut st);
                st.challenged.insert(src, n);
                out.reply = Some(datagram(src, CHALLENGE, &n.to_be_bytes()));
                // Our HELLO to it may have gone out before it listened (its device binds its
                // port with its first connected queue pair, and its program may connect later
                // than ours): say it again now rather than wait for a queue pair of ours to
                // be modified again, which may never come. Bounded by the tries.
                if let Some(&Out::Asked { tries, .. }) = st.out.get(&src)
                    && tries < TRIES
                {
                    st.out.insert(
                        src,
                        Out::Asked {
                            at: now,
                            tries: tries + 1,
                        },
                    );
                    self.retry_from(now);
                    out.again = Some(datagram(src, HELLO, &[]));
                }
            }
            CHALLENGE => {
                let Some(n) = u64_at(body, 0) else { return out };
                // Only peers this device asked (HELLO) get a proof.
                let Some((at, tries)) = st.out.get(&src).and_then(|o| o.asked()) else {
                    return out;
                };
                let i = st.next_slot % SLOTS;
                st.next_slot += 1;
                let slot = &self.slots[i];
                slot.nonce.store(0, Ordering::SeqCst);
                slot.challenger
                    .store(u64::from(u32::from(src)), Ordering::SeqCst);
                slot.nonce.store(n, Ordering::SeqCst);
                st.out.insert(
                    src,
                    Out::Proved {
                        nonce: n,
                        at,
                        tries,
                    },
                );
                let mut b = [0u8; 24];
                b[..8].copy_from_slice(&n.to_be_bytes());
                b[8..12].copy_from_slice(&std::process::id().to_be_bytes());
                // A ring offered, by descriptor number plus one (0: none).
                let ring = chan
                    .and_then(|c| c.offer(src))
                    .map_or(0, |fd| fd.saturating_add(1));
                b[12..16].copy_from_slice(&ring.to_be_bytes());
                b[16..].copy_from_slice(&(slot as *const Slot as u64).to_be_bytes());
                out.reply = Some(datagram(src, PROOF, &b));
            }
            PROOF => {
                let (Some(n), Some(addr)) = (u64_at(body, 0), u64_at(body, 16)) else {
                    return out;
                };
                let pid = u32::from_be_bytes([body[8], body[9], body[10], body[11]]);
                if st.challenged.get(&src) != Some(&n) {
                    return out;
                }
                st.challenged.remove(&src);
                let Ok(pid) = i32::try_from(pid) else {
                    return out;
                };
                if pid <= 0 {
                    return out;
                }
                // The pidfd first: if the process exits after the check, the pidfd says so.
                let Some(pidfd) = pidfd_open(pid) else {
                    return out;
                };
                let Some((nonce, challenger)) = read_slot(pid, addr) else {
                    return out;
                };
                if nonce != n || challenger != u64::from(u32::from(self.addr)) {
                    return out;
                }
                let ring = u32::from_be_bytes([body[12], body[13], body[14], body[15]]);
                let took = match (chan, ring) {
                    (Some(c), 1..) => c.take(src, &pidfd, ring - 1),
                    _ => false,
                };
                st.verified.insert(
                    src,
                    Verified {
                        pid,
                        token: n,
                        pidfd: Arc::new(pidfd),
                    },
                );
                let mut b = [0u8; 9];
                b[..8].copy_from_slice(&n.to_be_bytes());
                b[8] = u8::from(took);
                out.reply = Some(datagram(src, ACCEPT, &b));
            }
            ACCEPT => {
                let Some(n) = u64_at(body, 0) else { return out };
                if matches!(st.out.get(&src), Some(&Out::Proved { nonce, .. }) if nonce == n) {
                    st.out.insert(src, Out::Accepted { token: n });
                    out.accepted = Some((src, n));
                    if let Some(c) = chan {
                        c.settle(src, body.get(8) == Some(&1));
                    }
                }
            }
            REFUSED => {
                let Some(n) = u64_at(body, 0) else { return out };
                // Only the token in use counts: a late REFUSED of an older one changes nothing.
                if st.out.get(&src) == Some(&Out::Accepted { token: n }) {
                    // Asked now (the HELLO below); unanswered, asked again by `retry`.
                    st.out.insert(src, Out::Asked { at: now, tries: 1 });
                    self.retry_from(now);
                    if let Some(c) = chan {
                        c.forget(src);
                    }
                    out.refused = Some(src);
                    out.reply = Some(datagram(src, HELLO, &[]));
                }
            }
            _ => {}
        }
        out
    }
}

/// A pidfd of process `pid`, `None` when it cannot be opened.
pub(crate) fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // pidfd_open takes a pid and flags and returns a new descriptor or -1.
    // SAFETY: no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = i32::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the process behind `pidfd` is still running (a pidfd polls readable once it exits).
pub(crate) fn process_alive(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 0
}

/// The 16 bytes of a proof slot at `addr` in process `pid`.
fn read_slot(pid: i32, addr: u64) -> Option<(u64, u64)> {
    let mut buf = [0u64; 2];
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: 16,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: 16,
    };
    // The kernel checks `remote` against the other process's mappings and fails on a bad range.
    // SAFETY: `local` describes `buf`, 16 writable bytes that live across the call.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    (n == 16).then(|| (buf[0], buf[1]))
}

/// Copies the bytes `pieces` name in process `pid` into `[dst, dst + len)` of this one, where
/// `len` is the pieces' total. Returns whether every byte came.
///
/// # Safety
/// `[dst, dst + len)` must be writable memory of this process for the call (a registered
/// region, under the region table's lock), which the device may write.
pub(crate) unsafe fn copy_from_process(
    pid: i32,
    pieces: &[crate::soft::wire::peer_ref::Piece],
    dst: u64,
    len: usize,
) -> bool {
    let local = libc::iovec {
        iov_base: dst as *mut libc::c_void,
        iov_len: len,
    };
    let mut remote = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; crate::soft::wire::peer_ref::MAX_PIECES];
    let mut total = 0usize;
    for (r, p) in remote.iter_mut().zip(pieces) {
        r.iov_base = p.addr as *mut libc::c_void;
        r.iov_len = p.len as usize;
        total += p.len as usize;
    }
    if total != len || pieces.len() > remote.len() {
        return false;
    }
    // The kernel checks every remote range against the other process's mappings and copies
    // nothing outside them. A short count (a remote range ran into unmapped memory) is a
    // failure.
    let count = pieces.len() as _;
    // SAFETY: `local` is writable for `len` bytes (the caller's contract).
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, remote.as_ptr(), count, 0) };
    usize::try_from(n).is_ok_and(|n| n == len)
}

#[cfg(test)]
impl super::Engine {
    /// Whether this device's exchange with `peer` is over both ways: the peer accepted its
    /// proof, and it verified the peer's (or the device takes no part in the exchange). A test
    /// that counts a device's send calls waits for it, so that no datagram of the exchange is
    /// among them.
    pub(crate) fn same_host_settled(&self, peer: Ipv4Addr) -> bool {
        self.same_host.as_ref().is_none_or(|sh| {
            let st = lock(&sh.state);
            matches!(st.out.get(&peer), Some(Out::Accepted { .. }))
                && st.verified.contains_key(&peer)
        })
    }

    /// Hands this device a CHALLENGE from `peer` that the peer never made (as if the real
    /// one's PROOF had been lost on its way): the device proves it and waits for an ACCEPT
    /// that cannot come. The PROOF it answers with is dropped.
    pub(crate) fn same_host_forge_challenge(&self, peer: Ipv4Addr, nonce: u64) {
        if let Some(sh) = &self.same_host {
            let ch = datagram(self.addr, CHALLENGE, &nonce.to_be_bytes());
            let _dropped = sh.on_datagram(peer, &ch.bytes[..ch.len], self.now().as_nanos(), None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl SameHost {
        /// The exchange without rings.
        fn on(&self, src: Ipv4Addr, data: &[u8]) -> Outcome {
            self.on_datagram(src, data, 0, None)
        }
    }

    /// The whole exchange between two devices of this process: A asks, B challenges, A proves,
    /// B reads A's slot out of this process and accepts.
    #[test]
    fn two_devices_agree() {
        let (a_ip, b_ip) = (Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(127, 0, 0, 2));
        let (a, b) = (SameHost::new(a_ip), SameHost::new(b_ip));
        let (ready, hello) = a.want(b_ip, 0);
        assert_eq!(ready, None);
        let hello = hello.expect("asks a local peer");
        let ch = b
            .on(a_ip, &hello.bytes[..hello.len])
            .reply
            .expect("challenge");
        let proof = a.on(b_ip, &ch.bytes[..ch.len]).reply.expect("proof");
        let nonce = u64_at(&ch.bytes[..ch.len], HEAD).unwrap();
        assert_eq!(
            b.verified(a_ip, &list(nonce)),
            None,
            "not before the proof is checked"
        );
        let acc = b.on(a_ip, &proof.bytes[..proof.len]);
        let acc = acc.reply.expect("accept");
        let done = a.on(b_ip, &acc.bytes[..acc.len]);
        assert_eq!(done.accepted, Some((b_ip, nonce)));
        assert_eq!(a.want(b_ip, 1), (Some(nonce), None));
        // B reads references from A's address that carry the token, and no others.
        let me = Some(std::process::id() as i32);
        assert_eq!(b.verified(a_ip, &list(nonce)), me);
        assert_eq!(b.verified(a_ip, &list(nonce ^ 1)), None, "another token");
        let other = Ipv4Addr::new(127, 0, 0, 9);
        assert_eq!(b.verified(other, &list(nonce)), None, "another address");
        assert_eq!(b.verified(a_ip, &[1, 2, 3]), None, "no list");
        // Asking again soon says nothing; a remote address is never asked.
        let c = SameHost::new(a_ip);
        assert!(c.want(b_ip, 0).1.is_some());
        assert_eq!(c.want(b_ip, 1).1, None);
        assert_eq!(c.want(Ipv4Addr::new(192, 0, 2, 1), 0), (None, None));
    }

    /// An encoded one-piece reference list carrying `token`.
    fn list(token: u64) -> Vec<u8> {
        let mut r = PeerRefs::new(token);
        assert!(r.push(0x1000, 8));
        let mut buf = vec![0u8; r.buffer_len()];
        r.emit(&mut buf);
        buf
    }

    /// A proof that names a slot without the challenge's nonce and this device as challenger is
    /// refused: a forwarded challenge, a forged address, a stale nonce.
    #[test]
    fn forged_proofs_are_refused() {
        let (a_ip, b_ip, h_ip) = (
            Ipv4Addr::new(127, 0, 0, 1),
            Ipv4Addr::new(127, 0, 0, 2),
            Ipv4Addr::new(127, 0, 0, 3),
        );
        let (a, b) = (SameHost::new(a_ip), SameHost::new(b_ip));
        // H says HELLO to B, gets a challenge, and forwards it to A as its own.
        let ch = b
            .on(h_ip, &datagram(b_ip, HELLO, &[]).bytes[..HEAD])
            .reply
            .unwrap();
        let _ = a.want(h_ip, 0);
        let proof = a
            .on(h_ip, &ch.bytes[..ch.len])
            .reply
            .expect("A proves to H");
        // H replays A's proof to B: the slot names H as the challenger, not B.
        let r = b.on(h_ip, &proof.bytes[..proof.len]);
        assert_eq!(r.reply, None);
        let n = u64_at(&ch.bytes[..ch.len], HEAD).unwrap();
        assert_eq!(b.verified(h_ip, &list(n)), None);
        // A challenge A never asked for gets no proof.
        let ch2 = b
            .on(h_ip, &datagram(b_ip, HELLO, &[]).bytes[..HEAD])
            .reply
            .unwrap();
        assert_eq!(a.on(b_ip, &ch2.bytes[..ch2.len]).reply, None);
        // Garbage: short, wrong version, unknown kind.
        assert_eq!(b.on(a_ip, &[OPCODE]), Outcome::default());
        let mut bad = datagram(b_ip, HELLO, &[]);
        bad.bytes[2] = 9;
        assert_eq!(b.on(a_ip, &bad.bytes[..HEAD]), Outcome::default());
        assert_eq!(
            b.on(a_ip, &datagram(b_ip, 77, &[]).bytes[..HEAD]),
            Outcome::default()
        );
        // A proof with a wrong address reads nothing useful.
        let ch3 = b
            .on(a_ip, &datagram(b_ip, HELLO, &[]).bytes[..HEAD])
            .reply
            .unwrap();
        let mut p = [0u8; 24];
        p[..8].copy_from_slice(&ch3.bytes[HEAD..HEAD + 8]);
        p[8..12].copy_from_slice(&std::process::id().to_be_bytes());
        p[16..].copy_from_slice(&8u64.to_be_bytes());
        assert_eq!(b.on(a_ip, &datagram(b_ip, PROOF, &p).bytes[..]).reply, None);
        let n3 = u64_at(&ch3.bytes[..ch3.len], HEAD).unwrap();
        assert_eq!(b.verified(a_ip, &list(n3)), None);
    }

    /// Runs the exchange from A's `hello` to B's acceptance; returns the token A then sends.
    fn agree(a: &SameHost, b: &SameHost, hello: &Reply) -> u64 {
        let (a_ip, b_ip) = (a.addr, b.addr);
        let reply = |from: &SameHost, src, r: &Reply| from.on(src, &r.bytes[..r.len]);
        let ch = reply(b, a_ip, hello).reply.expect("challenge");
        let proof = reply(a, b_ip, &ch).reply.expect("proof");
        let acc = reply(b, a_ip, &proof).reply.expect("accept");
        reply(a, b_ip, &acc).accepted.expect("accepted").1
    }

    /// A's HELLO went out before B listened (lost), and A's queue pairs are not modified
    /// again: B's own HELLO, once B connects, makes A say its HELLO again, and the exchange
    /// runs both ways. A second HELLO is bounded by the tries, and one from a peer A never
    /// asked makes A ask nothing.
    #[test]
    fn a_hello_lost_before_the_peer_listened_is_said_again_when_the_peer_speaks() {
        let (a_ip, b_ip) = (Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(127, 0, 0, 2));
        let (a, b) = (SameHost::new(a_ip), SameHost::new(b_ip));
        let _lost = a.want(b_ip, 0).1.expect("asks a local peer");
        let b_hello = b.want(a_ip, 5).1.expect("B asks too");
        let o = a.on(b_ip, &b_hello.bytes[..b_hello.len]);
        let ch = o.reply.expect("A challenges B");
        assert_eq!(&ch.bytes[..2], &[OPCODE, CHALLENGE]);
        let again = o.again.expect("A asks B again");
        assert_eq!(&again.bytes[..2], &[OPCODE, HELLO]);
        assert_eq!(again.dst, b_ip);
        // Both directions agree.
        let ab = agree(&a, &b, &again);
        assert_eq!(a.want(b_ip, 6).0, Some(ab));
        let proof = b.on(a_ip, &ch.bytes[..ch.len]).reply.expect("B proves");
        let acc = a
            .on(b_ip, &proof.bytes[..proof.len])
            .reply
            .expect("A accepts");
        let ba = b
            .on(a_ip, &acc.bytes[..acc.len])
            .accepted
            .expect("accepted")
            .1;
        assert_eq!(b.want(a_ip, 7).0, Some(ba));
        // Accepted: B's next HELLO makes A say nothing again.
        let o = a.on(b_ip, &b_hello.bytes[..b_hello.len]);
        assert!(o.reply.is_some() && o.again.is_none());
        // Bounded: a peer that keeps saying HELLO draws at most TRIES of ours in all.
        let c = SameHost::new(Ipv4Addr::new(127, 0, 0, 3));
        let _ = c.want(b_ip, 0);
        let agains = (0..3 * TRIES)
            .filter(|_| c.on(b_ip, &b_hello.bytes[..b_hello.len]).again.is_some())
            .count();
        assert_eq!(agains, usize::from(TRIES) - 1);
        // Never asked: nothing said again.
        let d = SameHost::new(Ipv4Addr::new(127, 0, 0, 4));
        assert!(d.on(b_ip, &b_hello.bytes[..b_hello.len]).again.is_none());
    }

    /// Every HELLO `retry` says at `now`.
    fn retried(a: &SameHost, now: u64) -> Vec<Reply> {
        let mut said = Vec::new();
        a.retry(now, |r| said.push(r));
        said
    }

    /// A PROOF or an ACCEPT lost (or a CHALLENGE) left A waiting for an ACCEPT that never came,
    /// with references off towards B until a queue pair of A's was modified again: the
    /// device's rounds now start the exchange again a while later, and it completes; the old
    /// token stays refused. A peer that never answers draws at most TRIES HELLOs in all.
    #[test]
    fn an_exchange_whose_proof_or_accept_was_lost_starts_again() {
        let (a_ip, b_ip) = (Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(127, 0, 0, 2));
        let (a, b) = (SameHost::new(a_ip), SameHost::new(b_ip));
        let reply = |from: &SameHost, src, r: &Reply, now| {
            from.on_datagram(src, &r.bytes[..r.len], now, None)
        };
        // The PROOF is lost.
        let hello = a.want(b_ip, 0).1.expect("asks");
        let ch = reply(&b, a_ip, &hello, 1).reply.expect("challenge");
        let _lost_proof = reply(&a, b_ip, &ch, 2).reply.expect("proof");
        assert_eq!(a.want(b_ip, 3), (None, None), "waits for an ACCEPT");
        assert!(retried(&a, RETRY_NS - 1).is_empty(), "not yet");
        let again = retried(&a, RETRY_NS);
        assert_eq!(again.len(), 1);
        assert_eq!(
            (again[0].dst, &again[0].bytes[..2]),
            (b_ip, &[OPCODE, HELLO][..])
        );
        assert!(retried(&a, RETRY_NS + 1).is_empty(), "once per RETRY_NS");
        let n = agree(&a, &b, &again[0]);
        assert_eq!(a.want(b_ip, RETRY_NS + 2).0, Some(n));
        assert!(
            retried(&a, 10 * RETRY_NS).is_empty(),
            "accepted: nothing to retry"
        );

        // The ACCEPT is lost: B verified A, A never learned it.
        let (a, b) = (SameHost::new(a_ip), SameHost::new(b_ip));
        let hello = a.want(b_ip, 0).1.expect("asks");
        let ch = reply(&b, a_ip, &hello, 1).reply.expect("challenge");
        let proof = reply(&a, b_ip, &ch, 2).reply.expect("proof");
        let _lost_accept = reply(&b, a_ip, &proof, 3).reply.expect("accept");
        let old = u64_at(&ch.bytes[..ch.len], HEAD).unwrap();
        assert_eq!(a.want(b_ip, 4).0, None, "A sends no references yet");
        let again = retried(&a, RETRY_NS + 5);
        assert_eq!(again.len(), 1);
        let n = agree(&a, &b, &again[0]);
        assert_ne!(n, old);
        assert_eq!(a.want(b_ip, RETRY_NS + 6).0, Some(n));
        assert_eq!(b.verified(a_ip, &list(n)), Some(std::process::id() as i32));
        assert_eq!(
            b.verified(a_ip, &list(old)),
            None,
            "the old token is refused"
        );

        // B never answers: TRIES HELLOs in all (the first by `want`), then none.
        let c = SameHost::new(Ipv4Addr::new(127, 0, 0, 3));
        assert!(c.want(b_ip, 0).1.is_some());
        let more: usize = (1..=4 * u64::from(TRIES))
            .map(|k| retried(&c, k * RETRY_NS).len())
            .sum();
        assert_eq!(more, usize::from(TRIES) - 1);
        assert_eq!(
            c.retry_at.load(Ordering::Relaxed),
            u64::MAX,
            "nothing left to retry"
        );
    }

    /// B's device closed and opened again (a new exchange on its address) refuses A's
    /// references; A, told so, stops sending them and asks again; the refusal is rate-limited
    /// and only the token in use counts.
    #[test]
    fn a_refused_token_is_forgotten_and_asked_again() {
        let (a_ip, b_ip) = (Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(127, 0, 0, 2));
        let (a, b) = (SameHost::new(a_ip), SameHost::new(b_ip));
        let n = agree(&a, &b, &a.want(b_ip, 0).1.unwrap());
        assert_eq!(a.want(b_ip, 1).0, Some(n));
        // B starts over: it knows A no more.
        let b = SameHost::new(b_ip);
        assert_eq!(b.verified(a_ip, &list(n)), None);
        let r = b.refuse(a_ip, &list(n), 10).expect("refused, and told");
        assert_eq!(b.refuse(a_ip, &list(n), 20), None, "once a millisecond");
        assert!(b.refuse(a_ip, &list(n), 10 + REFUSE_EVERY_NS).is_some());
        assert_eq!(b.refuse(a_ip, &[1, 2], 1 << 40), None, "no list, no answer");
        // A REFUSED of another token changes nothing.
        let other = datagram(a_ip, REFUSED, &(n ^ 2).to_be_bytes());
        let o = a.on(b_ip, &other.bytes[..other.len]);
        assert_eq!(o, Outcome::default());
        assert_eq!(a.want(b_ip, 2).0, Some(n));
        let o = a.on(b_ip, &r.bytes[..r.len]);
        assert_eq!(o.refused, Some(b_ip));
        let hello = o.reply.expect("asks again");
        assert_eq!(&hello.bytes[..2], &[OPCODE, HELLO]);
        let off = a.want(b_ip, 3).0;
        assert_eq!(off, None, "references off until B accepts again");
        // The exchange runs again, with a new token.
        let n2 = agree(&a, &b, &hello);
        assert_ne!(n2, n);
        assert_eq!(b.verified(a_ip, &list(n2)), Some(std::process::id() as i32));
    }

    #[test]
    fn copies_out_of_a_process() {
        let src = *b"0123456789abcdef";
        let mut dst = [0u8; 10];
        let pieces = [
            crate::soft::wire::peer_ref::Piece {
                addr: src.as_ptr() as u64 + 2,
                len: 4,
            },
            crate::soft::wire::peer_ref::Piece {
                addr: src.as_ptr() as u64 + 10,
                len: 6,
            },
        ];
        let me = std::process::id() as i32;
        // SAFETY: `dst` is 10 writable bytes of this process.
        assert!(unsafe { copy_from_process(me, &pieces, dst.as_mut_ptr() as u64, 10) });
        assert_eq!(&dst, b"2345abcdef");
        let bad = [crate::soft::wire::peer_ref::Piece { addr: 8, len: 4 }];
        // SAFETY: as above.
        assert!(!unsafe { copy_from_process(me, &bad, dst.as_mut_ptr() as u64, 4) });
    }
}

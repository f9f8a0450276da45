//! The plugin library driven as NCCL drives it, over soft devices on loopback: both the v8 and
//! the v11 tables; listen/connect/accept polling; isend/irecv/test with sizes from 0 B to 64 MiB
//! that are not multiples of the MTU, received into larger buffers; grouped receives; many
//! connections at once; closing in every order; bad input through the C interface; a peer
//! killed mid-transfer (separate processes); and the same traffic with one queue pair, with
//! SEND notices (siw's mode) and with queue pairs connected through rdma_cm. Every byte is
//! checked, with canaries past each received message.
//!
//! Run inside a private network namespace (the soft devices bind 127.0.0.x:4791):
//! `unshare -n sh -c 'ip link set lo up; cargo test -p erdma-nccl'`.
#![allow(unsafe_code)]
// `call!`'s arguments are plain values: nothing unsafe hides in them.
#![allow(clippy::macro_metavars_in_unsafe)]

mod common;

use std::ffi::c_int;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use common::*;

const LIMIT: Duration = Duration::from_secs(60);
const CANARY: u8 = 0xa5;

static ENV: Once = Once::new();
static LIB: OnceLock<Lib> = OnceLock::new();

/// The library, loaded once, with this process's devices: two soft devices (the child
/// processes of the multi-process tests pick their own with `ERDMA_NCCL_DEVICES`).
fn lib() -> &'static Lib {
    ENV.call_once(|| {
        if std::env::var("ERDMA_NCCL_DEVICES").is_err() {
            // SAFETY: set once, before any thread of this process reads the environment
            // through the plugin (the first test to get here holds the Once).
            unsafe { std::env::set_var("ERDMA_NCCL_DEVICES", "soft:127.0.0.2,soft:127.0.0.3") };
        }
    });
    LIB.get_or_init(Lib::open)
}

/// One table version behind one interface, so every scenario runs on both.
trait Net {
    fn ndev(&self) -> c_int;
    fn listen(&self, dev: c_int) -> ([u8; 128], Ptr);
    fn connect(&self, dev: c_int, h: &mut [u8; 128], out: &mut Ptr) -> c_int;
    fn accept(&self, l: Ptr, out: &mut Ptr) -> c_int;
    fn reg(&self, comm: Ptr, buf: Ptr, len: usize) -> Ptr;
    fn dereg(&self, comm: Ptr, mh: Ptr) -> c_int;
    fn isend(&self, comm: Ptr, data: Ptr, size: usize, tag: c_int, mh: Ptr, req: &mut Ptr)
    -> c_int;
    fn irecv(
        &self,
        comm: Ptr,
        data: &[Ptr],
        sizes: &[usize],
        tags: &[c_int],
        mhs: &[Ptr],
        req: &mut Ptr,
    ) -> c_int;
    fn test(&self, req: Ptr, done: &mut c_int, sizes: &mut [c_int; 8]) -> c_int;
    fn close_send(&self, c: Ptr) -> c_int;
    fn close_recv(&self, c: Ptr) -> c_int;
    fn close_listen(&self, c: Ptr) -> c_int;
}

struct V8(&'static NetV8);
struct V11(&'static NetV11, Ptr);

impl V8 {
    fn new() -> V8 {
        let t = lib().v8();
        assert_eq!(call!(t, init(std::ptr::null_mut())), SUCCESS);
        V8(t)
    }
}

impl V11 {
    fn new() -> V11 {
        let t = lib().v11();
        let mut ctx: Ptr = std::ptr::null_mut();
        let mut config = [-1i32; 1];
        assert_eq!(
            call!(
                t,
                init(
                    &mut ctx,
                    0x1234,
                    config.as_mut_ptr().cast(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut()
                )
            ),
            SUCCESS
        );
        assert!(!ctx.is_null());
        V11(t, ctx)
    }
}

impl Drop for V11 {
    fn drop(&mut self) {
        assert_eq!(call!(self.0, finalize(self.1)), SUCCESS);
    }
}

impl Net for V8 {
    fn ndev(&self) -> c_int {
        let mut n = 0;
        assert_eq!(call!(self.0, devices(&mut n)), SUCCESS);
        n
    }
    fn listen(&self, dev: c_int) -> ([u8; 128], Ptr) {
        let mut h = [0u8; 128];
        let mut l = std::ptr::null_mut();
        assert_eq!(
            call!(self.0, listen(dev, h.as_mut_ptr().cast(), &mut l)),
            SUCCESS
        );
        assert!(!l.is_null());
        (h, l)
    }
    fn connect(&self, dev: c_int, h: &mut [u8; 128], out: &mut Ptr) -> c_int {
        let mut devcomm = std::ptr::null_mut();
        call!(
            self.0,
            connect(dev, h.as_mut_ptr().cast(), out, &mut devcomm)
        )
    }
    fn accept(&self, l: Ptr, out: &mut Ptr) -> c_int {
        let mut devcomm = std::ptr::null_mut();
        call!(self.0, accept(l, out, &mut devcomm))
    }
    fn reg(&self, comm: Ptr, buf: Ptr, len: usize) -> Ptr {
        let mut mh = std::ptr::null_mut();
        assert_eq!(
            call!(self.0, reg_mr(comm, buf, len, PTR_HOST, &mut mh)),
            SUCCESS
        );
        mh
    }
    fn dereg(&self, comm: Ptr, mh: Ptr) -> c_int {
        call!(self.0, dereg_mr(comm, mh))
    }
    fn isend(
        &self,
        comm: Ptr,
        data: Ptr,
        size: usize,
        tag: c_int,
        mh: Ptr,
        req: &mut Ptr,
    ) -> c_int {
        call!(self.0, isend(comm, data, size as c_int, tag, mh, req))
    }
    fn irecv(
        &self,
        comm: Ptr,
        data: &[Ptr],
        sizes: &[usize],
        tags: &[c_int],
        mhs: &[Ptr],
        req: &mut Ptr,
    ) -> c_int {
        let mut d = data.to_vec();
        let mut s: Vec<c_int> = sizes.iter().map(|&s| s as c_int).collect();
        let mut t = tags.to_vec();
        let mut m = mhs.to_vec();
        call!(
            self.0,
            irecv(
                comm,
                d.len() as c_int,
                d.as_mut_ptr(),
                s.as_mut_ptr(),
                t.as_mut_ptr(),
                m.as_mut_ptr(),
                req
            )
        )
    }
    fn test(&self, req: Ptr, done: &mut c_int, sizes: &mut [c_int; 8]) -> c_int {
        call!(self.0, test(req, done, sizes.as_mut_ptr()))
    }
    fn close_send(&self, c: Ptr) -> c_int {
        call!(self.0, close_send(c))
    }
    fn close_recv(&self, c: Ptr) -> c_int {
        call!(self.0, close_recv(c))
    }
    fn close_listen(&self, c: Ptr) -> c_int {
        call!(self.0, close_listen(c))
    }
}

impl Net for V11 {
    fn ndev(&self) -> c_int {
        let mut n = 0;
        assert_eq!(call!(self.0, devices(&mut n)), SUCCESS);
        n
    }
    fn listen(&self, dev: c_int) -> ([u8; 128], Ptr) {
        let mut h = [0u8; 128];
        let mut l = std::ptr::null_mut();
        assert_eq!(
            call!(self.0, listen(self.1, dev, h.as_mut_ptr().cast(), &mut l)),
            SUCCESS
        );
        assert!(!l.is_null());
        (h, l)
    }
    fn connect(&self, dev: c_int, h: &mut [u8; 128], out: &mut Ptr) -> c_int {
        let mut devcomm = std::ptr::null_mut();
        call!(
            self.0,
            connect(self.1, dev, h.as_mut_ptr().cast(), out, &mut devcomm)
        )
    }
    fn accept(&self, l: Ptr, out: &mut Ptr) -> c_int {
        let mut devcomm = std::ptr::null_mut();
        call!(self.0, accept(l, out, &mut devcomm))
    }
    fn reg(&self, comm: Ptr, buf: Ptr, len: usize) -> Ptr {
        let mut mh = std::ptr::null_mut();
        assert_eq!(
            call!(self.0, reg_mr(comm, buf, len, PTR_HOST, &mut mh)),
            SUCCESS
        );
        mh
    }
    fn dereg(&self, comm: Ptr, mh: Ptr) -> c_int {
        call!(self.0, dereg_mr(comm, mh))
    }
    fn isend(
        &self,
        comm: Ptr,
        data: Ptr,
        size: usize,
        tag: c_int,
        mh: Ptr,
        req: &mut Ptr,
    ) -> c_int {
        call!(
            self.0,
            isend(comm, data, size, tag, mh, std::ptr::null_mut(), req)
        )
    }
    fn irecv(
        &self,
        comm: Ptr,
        data: &[Ptr],
        sizes: &[usize],
        tags: &[c_int],
        mhs: &[Ptr],
        req: &mut Ptr,
    ) -> c_int {
        let mut d = data.to_vec();
        let mut s = sizes.to_vec();
        let mut t = tags.to_vec();
        let mut m = mhs.to_vec();
        let mut ph = vec![std::ptr::null_mut(); d.len()];
        // NCCL may pass its optional-completion marker in the request on entry.
        *req = 1usize as Ptr;
        call!(
            self.0,
            irecv(
                comm,
                d.len() as c_int,
                d.as_mut_ptr(),
                s.as_mut_ptr(),
                t.as_mut_ptr(),
                m.as_mut_ptr(),
                ph.as_mut_ptr(),
                req
            )
        )
    }
    fn test(&self, req: Ptr, done: &mut c_int, sizes: &mut [c_int; 8]) -> c_int {
        call!(self.0, test(req, done, sizes.as_mut_ptr()))
    }
    fn close_send(&self, c: Ptr) -> c_int {
        call!(self.0, close_send(c))
    }
    fn close_recv(&self, c: Ptr) -> c_int {
        call!(self.0, close_recv(c))
    }
    fn close_listen(&self, c: Ptr) -> c_int {
        call!(self.0, close_listen(c))
    }
}

/// A connected pair: send connection on `sdev`, receive connection on `rdev`, made as NCCL
/// makes them (connect and accept polled until both return a connection).
fn pair(net: &dyn Net, sdev: c_int, rdev: c_int) -> (Ptr, Ptr) {
    let (mut h, l) = net.listen(rdev);
    let (mut s, mut r): (Ptr, Ptr) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mut polls = 0;
    poll("connect/accept", LIMIT, || {
        if s.is_null() {
            assert_eq!(net.connect(sdev, &mut h, &mut s), SUCCESS);
        }
        if r.is_null() {
            assert_eq!(net.accept(l, &mut r), SUCCESS);
        }
        polls += 1;
        (!s.is_null() && !r.is_null()).then_some(())
    });
    assert!(
        polls > 1,
        "connect and accept must not block until the peer answers"
    );
    assert_eq!(net.close_listen(l), SUCCESS);
    (s, r)
}

/// Sends each size from `s` to `r`, up to `window` at once, each into a receive buffer larger
/// than the message; checks sizes, bytes and the canary after each message.
fn traffic(net: &dyn Net, s: Ptr, r: Ptr, sizes: &[usize], window: usize, seed: u64) {
    let max = sizes.iter().copied().max().unwrap_or(0);
    let extra = 4096 + 13;
    let slots = window.max(1);
    let sbuf: Vec<HostBuf> = (0..slots).map(|_| HostBuf::new(max)).collect();
    let rbuf: Vec<HostBuf> = (0..slots).map(|_| HostBuf::new(max + extra)).collect();
    let smh: Vec<Ptr> = sbuf.iter().map(|b| net.reg(s, b.ptr(), b.len())).collect();
    let rmh: Vec<Ptr> = rbuf.iter().map(|b| net.reg(r, b.ptr(), b.len())).collect();
    struct Flight {
        i: usize,
        slot: usize,
        sreq: Ptr,
        rreq: Ptr,
        sdone: bool,
        rdone: bool,
    }
    let mut free: Vec<usize> = (0..slots).rev().collect();
    let mut flights: Vec<Flight> = Vec::new();
    let mut next = 0;
    let t0 = Instant::now();
    while next < sizes.len() || !flights.is_empty() {
        assert!(t0.elapsed() < LIMIT * 3, "traffic timed out");
        // Post receives and sends for free slots, in order.
        while next < sizes.len() && !free.is_empty() {
            let slot = free.pop().unwrap();
            let size = sizes[next];
            let data = pattern(seed + next as u64, size);
            sbuf[slot].write(0, &data);
            rbuf[slot].write(0, &vec![CANARY; size + extra]);
            let mut rreq = std::ptr::null_mut();
            poll("irecv", LIMIT, || {
                assert_eq!(
                    net.irecv(
                        r,
                        &[rbuf[slot].ptr()],
                        &[size + extra],
                        &[7],
                        &[rmh[slot]],
                        &mut rreq
                    ),
                    SUCCESS
                );
                (!rreq.is_null()).then_some(())
            });
            let mut sreq = std::ptr::null_mut();
            poll("isend", LIMIT, || {
                assert_eq!(
                    net.isend(s, sbuf[slot].ptr(), size, 7, smh[slot], &mut sreq),
                    SUCCESS
                );
                (!sreq.is_null()).then_some(())
            });
            flights.push(Flight {
                i: next,
                slot,
                sreq,
                rreq,
                sdone: false,
                rdone: false,
            });
            next += 1;
        }
        // Test everything in flight, oldest first, as NCCL's proxy does; let other threads run
        // between rounds (the tests run in parallel on few CPUs).
        std::thread::yield_now();
        let mut k = 0;
        while k < flights.len() {
            let f = &mut flights[k];
            let size = sizes[f.i];
            let mut sz = [-1; 8];
            let mut done = 0;
            if !f.sdone {
                assert_eq!(net.test(f.sreq, &mut done, &mut sz), SUCCESS);
                if done == 1 {
                    assert_eq!(sz[0] as usize, size, "send size reported");
                    f.sdone = true;
                }
            }
            if !f.rdone {
                let mut sz = [-1; 8];
                assert_eq!(net.test(f.rreq, &mut done, &mut sz), SUCCESS);
                if done == 1 {
                    assert_eq!(
                        sz[0] as usize, size,
                        "received size reported for message {}",
                        f.i
                    );
                    f.rdone = true;
                }
            }
            if f.sdone && f.rdone {
                let got = rbuf[f.slot].read(0, size);
                let want = pattern(seed + f.i as u64, size);
                if got != want {
                    let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
                    panic!("message {} ({size} bytes): first wrong byte at {at}", f.i);
                }
                let tail = rbuf[f.slot].read(size, extra);
                assert!(
                    tail.iter().all(|&b| b == CANARY),
                    "message {}: bytes written past its size",
                    f.i
                );
                free.push(f.slot);
                flights.remove(k);
            } else {
                k += 1;
            }
        }
    }
    for (b, m) in smh.iter().zip(&sbuf) {
        assert_eq!(net.dereg(s, *b), SUCCESS);
        let _ = m;
    }
    for m in rmh {
        assert_eq!(net.dereg(r, m), SUCCESS);
    }
}

const SIZES: [usize; 12] = [
    0,
    1,
    7,
    4095,
    4097,
    65_537,
    (1 << 20) + 3,
    3 << 20,
    (2 << 20) - 1,
    (2 << 20) + 1,
    (16 << 20) + 5,
    (64 << 20) - 1,
];

/// The devices a suite connects: `ERDMA_NCCL_TEST_PAIR` (`SEND,RECV` device indices; `0,0`
/// for one kernel device in a guest), else the two soft devices.
fn test_pair() -> (c_int, c_int) {
    match std::env::var("ERDMA_NCCL_TEST_PAIR") {
        Ok(v) => {
            let (a, b) = v.split_once(',').expect("ERDMA_NCCL_TEST_PAIR=SEND,RECV");
            (a.trim().parse().unwrap(), b.trim().parse().unwrap())
        }
        Err(_) => (0, 1),
    }
}

fn suite(net: &dyn Net, seed: u64) {
    let (sdev, rdev) = test_pair();
    assert!(net.ndev() > sdev.max(rdev), "the devices of the pair exist");
    let (s, r) = pair(net, sdev, rdev);
    traffic(net, s, r, &SIZES, 1, seed);
    // Many in flight at once (NCCL keeps up to 8 steps per connection).
    let small: Vec<usize> = (0..200).map(|i| (i * 7919) % 150_000 + i % 3).collect();
    traffic(net, s, r, &small, 8, seed + 1000);
    grouped(net, s, r, seed + 2000);
    assert_eq!(net.close_send(s), SUCCESS);
    assert_eq!(net.close_recv(r), SUCCESS);
}

/// Grouped receives: one `irecv` of four receives with distinct tags; the sends come in another
/// order and each lands in the receive with its tag; sizes are reported per receive.
fn grouped(net: &dyn Net, s: Ptr, r: Ptr, seed: u64) {
    let sizes = [100_000usize, 0, 3 << 20, 4097];
    let tags = [3, 1, 4, 2];
    let rb: Vec<HostBuf> = sizes.iter().map(|&n| HostBuf::new(n + 64)).collect();
    let sb: Vec<HostBuf> = sizes.iter().map(|&n| HostBuf::new(n)).collect();
    let rm: Vec<Ptr> = rb.iter().map(|b| net.reg(r, b.ptr(), b.len())).collect();
    let sm: Vec<Ptr> = sb.iter().map(|b| net.reg(s, b.ptr(), b.len())).collect();
    for round in 0..3u64 {
        for (i, b) in sb.iter().enumerate() {
            b.write(0, &pattern(seed + round * 10 + i as u64, sizes[i]));
        }
        let mut rreq = std::ptr::null_mut();
        let data: Vec<Ptr> = rb.iter().map(|b| b.ptr()).collect();
        let cap: Vec<usize> = sizes.iter().map(|n| n + 64).collect();
        poll("grouped irecv", LIMIT, || {
            assert_eq!(net.irecv(r, &data, &cap, &tags, &rm, &mut rreq), SUCCESS);
            (!rreq.is_null()).then_some(())
        });
        let mut sreqs = Vec::new();
        for i in [2usize, 0, 3, 1] {
            let mut q = std::ptr::null_mut();
            poll("grouped isend", LIMIT, || {
                assert_eq!(
                    net.isend(s, sb[i].ptr(), sizes[i], tags[i], sm[i], &mut q),
                    SUCCESS
                );
                (!q.is_null()).then_some(())
            });
            sreqs.push((i, q));
        }
        let mut got = [0; 8];
        let mut rdone = false;
        poll("grouped receive", LIMIT, || {
            if !rdone {
                let mut done = 0;
                assert_eq!(net.test(rreq, &mut done, &mut got), SUCCESS);
                rdone = done == 1;
            }
            for (i, q) in sreqs.iter_mut() {
                if !q.is_null() {
                    let mut d = 0;
                    let mut sz = [0; 8];
                    assert_eq!(net.test(*q, &mut d, &mut sz), SUCCESS);
                    if d == 1 {
                        assert_eq!(sz[0] as usize, sizes[*i]);
                        *q = std::ptr::null_mut();
                    }
                }
            }
            (rdone && sreqs.iter().all(|(_, q)| q.is_null())).then_some(())
        });
        for i in 0..4 {
            assert_eq!(got[i] as usize, sizes[i], "grouped receive {i}: size");
            assert_eq!(
                rb[i].read(0, sizes[i]),
                pattern(seed + round * 10 + i as u64, sizes[i])
            );
        }
    }
    for (m, _) in rm.iter().zip(&rb) {
        assert_eq!(net.dereg(r, *m), SUCCESS);
    }
    for m in sm {
        assert_eq!(net.dereg(s, m), SUCCESS);
    }
}

#[test]
fn tables_and_properties() {
    let l = lib();
    for v in [
        "ncclNetPlugin_v8",
        "ncclNetPlugin_v9",
        "ncclNetPlugin_v10",
        "ncclNetPlugin_v11",
    ] {
        assert!(!l.symbol(v).is_null(), "{v} is exported");
    }
    assert!(l.symbol("ncclNetPlugin_v12").is_null());
    let v8 = V8::new();
    assert_eq!(name_of(v8.0.name), "erdma");
    assert_eq!(v8.ndev(), 2);
    let mut p: PropsV8 = unsafe_zeroed();
    assert_eq!(call!(v8.0, get_properties(0, &mut p)), SUCCESS);
    assert_eq!(name_of(p.name), "soft:127.0.0.2");
    assert!(p.pci_path.is_null(), "a soft device has no PCI path");
    assert_eq!(p.ptr_support, PTR_HOST);
    assert_eq!(p.max_recvs, 8);
    assert_eq!(p.port, 1);
    assert!(p.speed > 0 && p.max_comms > 0 && p.guid != 0);
    assert_eq!(p.net_device_type, 0);
    assert_eq!(call!(v8.0, get_properties(2, &mut p)), INVALID_ARGUMENT);
    assert_eq!(call!(v8.0, get_properties(-1, &mut p)), INVALID_ARGUMENT);
    assert!(v8.0.get_device_mr.is_none() && v8.0.irecv_consumed.is_none());

    let v11 = V11::new();
    assert_eq!(name_of(v11.0.name), "erdma");
    let mut q: PropsV11 = unsafe_zeroed();
    assert_eq!(call!(v11.0, get_properties(1, &mut q)), SUCCESS);
    assert_eq!(name_of(q.name), "soft:127.0.0.3");
    assert_ne!(q.guid, p.guid, "two devices, two GUIDs");
    assert_eq!((q.vdev_ndevs, q.vdev_devs[0]), (1, 1));
    assert_eq!(q.max_p2p_bytes, 1 << 30);
    assert_eq!(q.max_multi_request_size, 1);
    assert_eq!(q.force_flush, 0);
    assert!(
        v11.0.finalize.is_some() && v11.0.set_net_attr.is_none() && v11.0.make_vdevice.is_none()
    );
}

fn unsafe_zeroed<T>() -> T {
    // SAFETY: only used for the plain-data property structs (integers and pointers).
    unsafe { std::mem::zeroed() }
}

#[test]
fn v8_table_moves_every_size() {
    suite(&V8::new(), 1);
}

#[test]
fn v11_table_moves_every_size() {
    suite(&V11::new(), 2);
}

#[test]
fn many_connections_at_once() {
    let net = V11::new();
    let pairs: Vec<(Ptr, Ptr)> = (0..12).map(|i| pair(&net, i % 2, 1 - i % 2)).collect();
    let sizes: Vec<usize> = (0..6).map(|i| 1000 * i + 333).collect();
    // Interleave: one message on each connection, then the next round.
    for round in 0..sizes.len() {
        for (i, &(s, r)) in pairs.iter().enumerate() {
            traffic(
                &net,
                s,
                r,
                &sizes[round..round + 1],
                1,
                (i * 100 + round) as u64,
            );
        }
    }
    for (i, (s, r)) in pairs.into_iter().enumerate() {
        // Close in both orders.
        if i % 2 == 0 {
            assert_eq!(net.close_send(s), SUCCESS);
            assert_eq!(net.close_recv(r), SUCCESS);
        } else {
            assert_eq!(net.close_recv(r), SUCCESS);
            assert_eq!(net.close_send(s), SUCCESS);
        }
    }
}

#[test]
fn closing_in_every_order_and_using_closed_objects() {
    let net = V8::new();
    // A listen closed before anyone connects.
    let (_h, l) = net.listen(0);
    assert_eq!(net.close_listen(l), SUCCESS);
    let mut out = std::ptr::null_mut();
    assert_eq!(
        net.accept(l, &mut out),
        INTERNAL_ERROR,
        "accept on a closed listen"
    );
    assert_eq!(net.close_listen(l), INTERNAL_ERROR, "closing twice");

    // Receive side closed first, with a receive outstanding: its request dies with it.
    let (s, r) = pair(&net, 0, 1);
    let b = HostBuf::new(4096);
    let rm = net.reg(r, b.ptr(), 4096);
    let mut rreq = std::ptr::null_mut();
    assert_eq!(
        net.irecv(r, &[b.ptr()], &[4096], &[0], &[rm], &mut rreq),
        SUCCESS
    );
    assert!(!rreq.is_null());
    assert_eq!(net.dereg(r, rm), SUCCESS);
    assert_eq!(net.close_recv(r), SUCCESS);
    let (mut done, mut sz) = (0, [0; 8]);
    assert_eq!(
        net.test(rreq, &mut done, &mut sz),
        INTERNAL_ERROR,
        "a request of a closed connection"
    );
    assert_eq!(net.close_recv(r), INTERNAL_ERROR);
    // The sender sees nothing wrong until it is closed (NCCL closes both sides at the end).
    let sb = HostBuf::new(16);
    let sm = net.reg(s, sb.ptr(), 16);
    assert_eq!(net.dereg(s, sm), SUCCESS);
    assert_eq!(net.dereg(s, sm), INTERNAL_ERROR, "deregistering twice");
    assert_eq!(net.close_send(s), SUCCESS);
    let mut q = std::ptr::null_mut();
    assert_eq!(
        net.isend(s, sb.ptr(), 16, 0, std::ptr::null_mut(), &mut q),
        INTERNAL_ERROR
    );

    // Send side closed first, then the receive side; a connect abandoned half-way.
    let (s, r) = pair(&net, 1, 0);
    assert_eq!(net.close_send(s), SUCCESS);
    assert_eq!(net.close_recv(r), SUCCESS);
    let (mut h, l) = net.listen(1);
    let mut s = std::ptr::null_mut();
    assert_eq!(net.connect(0, &mut h, &mut s), SUCCESS);
    assert_eq!(net.close_listen(l), SUCCESS);
    // The receiver is gone: connecting fails (refused or the exchange breaks), never hangs.
    let rc = poll("a failed connect", LIMIT, || {
        let rc = net.connect(0, &mut h, &mut s);
        (rc != SUCCESS || !s.is_null()).then_some(rc)
    });
    assert_ne!(rc, SUCCESS, "connecting to a closed listen must fail");
}

#[test]
fn bad_input_is_an_error_not_a_crash() {
    let net = V11::new();
    let t = net.0;
    let null = std::ptr::null_mut();
    // A handle that is not this plugin's, and one whose connect stage is forged.
    let mut h = [0u8; 128];
    let mut s = null;
    assert_eq!(net.connect(0, &mut h, &mut s), INVALID_ARGUMENT);
    let (mut good, l) = net.listen(1);
    good[64..72].copy_from_slice(&0x8400_0001_0001_0000u64.to_ne_bytes());
    assert_eq!(net.connect(0, &mut good, &mut s), INTERNAL_ERROR);
    assert_eq!(net.close_listen(l), SUCCESS);
    // Unknown devices.
    let mut hh = [0u8; 128];
    let mut lc = null;
    assert_eq!(
        call!(t, listen(net.1, 9, hh.as_mut_ptr().cast(), &mut lc)),
        INVALID_ARGUMENT
    );
    assert_eq!(call!(t, listen(net.1, 0, null, &mut lc)), INVALID_ARGUMENT);
    assert_eq!(
        call!(t, listen(null, 0, hh.as_mut_ptr().cast(), &mut lc)),
        INTERNAL_ERROR,
        "no context"
    );
    // Forged objects.
    let fake = 0xdead_beef_usize as Ptr;
    let mut q = null;
    let (mut done, mut sz) = (0, [0; 8]);
    assert_eq!(net.isend(fake, null, 0, 0, null, &mut q), INTERNAL_ERROR);
    assert_eq!(
        net.irecv(fake, &[null], &[0], &[0], &[null], &mut q),
        INTERNAL_ERROR
    );
    assert_eq!(net.test(fake, &mut done, &mut sz), INTERNAL_ERROR);
    assert_eq!(net.test(null, &mut done, &mut sz), INVALID_ARGUMENT);
    assert_eq!(net.close_send(fake), INTERNAL_ERROR);
    let mut mh = null;
    assert_eq!(
        call!(t, reg_mr(fake, fake, 8, PTR_HOST, &mut mh)),
        INTERNAL_ERROR
    );

    let (s, r) = pair(&net, 0, 1);
    let b = HostBuf::new(1 << 20);
    let rm = net.reg(r, b.ptr(), 1 << 20);
    let sm = net.reg(s, b.ptr(), 1 << 20);
    assert_eq!(
        call!(t, reg_mr(s, b.ptr(), 8, 7, &mut mh)),
        INVALID_ARGUMENT,
        "unknown memory type"
    );
    assert_eq!(
        call!(t, reg_mr(s, b.ptr(), 8, 2, &mut mh)),
        INVALID_ARGUMENT,
        "GPU memory on a host-only device"
    );
    // Wrong counts of grouped receives, buffers outside their registration, a forged handle.
    assert_eq!(net.irecv(r, &[], &[], &[], &[], &mut q), INVALID_ARGUMENT);
    let nine = [b.ptr(); 9];
    assert_eq!(
        net.irecv(r, &nine, &[1; 9], &[0; 9], &[rm; 9], &mut q),
        INVALID_ARGUMENT
    );
    assert_eq!(
        net.irecv(r, &[b.ptr()], &[(1 << 20) + 1], &[0], &[rm], &mut q),
        INVALID_ARGUMENT
    );
    assert_eq!(
        net.irecv(r, &[b.ptr()], &[16], &[0], &[fake], &mut q),
        INVALID_ARGUMENT
    );
    assert_eq!(
        net.irecv(r, &[b.ptr()], &[16], &[0], &[null], &mut q),
        INVALID_ARGUMENT
    );
    assert_eq!(
        call!(t, isend(s, b.ptr(), 8, 0, sm, null, std::ptr::null_mut())),
        INVALID_ARGUMENT,
        "NULL request pointer"
    );
    assert_eq!(
        call!(t, test(fake, std::ptr::null_mut(), std::ptr::null_mut())),
        INVALID_ARGUMENT
    );

    // A send larger than its receive: both sides fail, with an error rather than a hang.
    let mut rreq = null;
    assert_eq!(
        net.irecv(r, &[b.ptr()], &[100], &[5], &[rm], &mut rreq),
        SUCCESS
    );
    assert!(!rreq.is_null());
    let rc = poll("a refused send", LIMIT, || {
        let mut q = null;
        let rc = net.isend(s, b.ptr(), 101, 5, sm, &mut q);
        (rc != SUCCESS || !q.is_null()).then_some(rc)
    });
    assert_eq!(rc, INTERNAL_ERROR);
    let rc = poll("the refused receive", LIMIT, || {
        let mut d = 0;
        let rc = net.test(rreq, &mut d, &mut sz);
        (rc != SUCCESS || d == 1).then_some(rc)
    });
    assert_eq!(
        rc, INTERNAL_ERROR,
        "the receiver learns that its sender refused"
    );
    assert_eq!(net.close_send(s), SUCCESS);
    assert_eq!(net.close_recv(r), SUCCESS);
    // finalize of something that is not a context.
    assert_eq!(call!(t, finalize(fake)), INTERNAL_ERROR);
}

// ---------------------------------------------------------------------------------------------
// Multi-process: each role below is a test that does nothing unless its parent test started it
// with the variables it needs.

fn role_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn spawn_role(role: &str, devices: &str, env: &[(&str, &str)]) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--ignored",
        "--exact",
        role,
        "--nocapture",
        "--test-threads=1",
    ])
    .env("ERDMA_NCCL_DEVICES", devices)
    .env("ERDMA_NCCL_ROLE", role)
    .env("NCCL_DEBUG", "WARN")
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().expect("spawning a role")
}

fn read_line(child: &mut Child, prefix: &str) -> String {
    let out = child.stdout.as_mut().unwrap();
    let mut r = BufReader::new(out);
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).unwrap() == 0 {
            let mut err = String::new();
            let _ = std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err);
            panic!("the role ended before printing {prefix}:\n{err}");
        }
        // libtest prints "test NAME ... " before the role's first line, on the same line.
        if let Some(at) = line.find(prefix) {
            return line[at + prefix.len()..].trim().to_string();
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> [u8; 128] {
    let mut h = [0u8; 128];
    for (i, b) in h.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    h
}

fn finish(child: Child, what: &str) -> String {
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what} failed:\n{text}");
    assert!(text.contains("1 passed"), "{what} did not run:\n{text}");
    text
}

/// Receiver role: listens, prints the handle, accepts, receives until an error, which must be
/// the remote error, within bounded time; prints what it saw.
#[test]
#[ignore = "a role of peer_killed_mid_transfer"]
fn role_receiver() {
    if role_env("ERDMA_NCCL_ROLE").as_deref() != Some("role_receiver") {
        return;
    }
    let net = V11::new();
    let (h, l) = net.listen(0);
    println!("HANDLE {}", hex(&h));
    let mut r = std::ptr::null_mut();
    poll("accept", LIMIT, || {
        assert_eq!(net.accept(l, &mut r), SUCCESS);
        (!r.is_null()).then_some(())
    });
    let b = HostBuf::new(64 << 20);
    let m = net.reg(r, b.ptr(), 64 << 20);
    let mut received = 0u64;
    loop {
        let mut q = std::ptr::null_mut();
        let rc = net.irecv(r, &[b.ptr()], &[64 << 20], &[0], &[m], &mut q);
        if rc != SUCCESS {
            println!("FAILED irecv {rc}");
            break;
        }
        let t = Instant::now();
        let mut done = 0;
        let mut sz = [0; 8];
        let rc = loop {
            let rc = net.test(q, &mut done, &mut sz);
            if rc != SUCCESS || done == 1 {
                break rc;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "a receive from a dead peer hung"
            );
        };
        if rc != SUCCESS {
            println!("FAILED test {rc} after {:?}", t.elapsed());
            assert_eq!(rc, REMOTE_ERROR);
            break;
        }
        received += 1;
        println!("RECEIVED {received} {}", sz[0]);
        std::io::stdout().flush().unwrap();
    }
    assert!(received >= 1);
}

/// Sender role: connects to `ERDMA_NCCL_PEER_HANDLE` and sends 64 MiB messages until killed.
#[test]
#[ignore = "a role of peer_killed_mid_transfer"]
fn role_sender() {
    if role_env("ERDMA_NCCL_ROLE").as_deref() != Some("role_sender") {
        return;
    }
    let mut h = unhex(&role_env("ERDMA_NCCL_PEER_HANDLE").unwrap());
    let net = V11::new();
    let mut s = std::ptr::null_mut();
    poll("connect", LIMIT, || {
        assert_eq!(net.connect(0, &mut h, &mut s), SUCCESS);
        (!s.is_null()).then_some(())
    });
    let b = HostBuf::new(64 << 20);
    let m = net.reg(s, b.ptr(), 64 << 20);
    for i in 0.. {
        let mut q: Ptr = std::ptr::null_mut();
        let t = Instant::now();
        while q.is_null() {
            let rc = net.isend(s, b.ptr(), 64 << 20, 0, m, &mut q);
            if rc != SUCCESS {
                println!("FAILED isend {rc}");
                assert_eq!(rc, REMOTE_ERROR);
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "isend to a dead peer hung"
            );
        }
        println!("SENDING {i}");
        std::io::stdout().flush().unwrap();
        let mut done = 0;
        let mut sz = [0; 8];
        loop {
            let rc = net.test(q, &mut done, &mut sz);
            if rc != SUCCESS {
                println!("FAILED test {rc}");
                assert_eq!(rc, REMOTE_ERROR);
                return;
            }
            if done == 1 {
                break;
            }
        }
    }
}

/// The devices of the killed-peer test's two processes: `ERDMA_NCCL_TEST_KILL_DEVICE` for
/// both (a kernel device in a guest), else soft devices of their own.
fn kill_devices(first: u8) -> (String, String) {
    match std::env::var("ERDMA_NCCL_TEST_KILL_DEVICE") {
        Ok(d) => (d.clone(), d),
        Err(_) => (
            format!("soft:127.0.0.{first}"),
            format!("soft:127.0.0.{}", first + 1),
        ),
    }
}

#[test]
fn peer_killed_mid_transfer() {
    // The sender dies: the receiver's outstanding receive fails with ncclRemoteError, logged.
    let (rdev, sdev) = kill_devices(20);
    let mut rx = spawn_role("role_receiver", &rdev, &[]);
    let handle = read_line(&mut rx, "HANDLE ");
    let mut tx = spawn_role("role_sender", &sdev, &[("ERDMA_NCCL_PEER_HANDLE", &handle)]);
    read_line(&mut tx, "SENDING 1");
    tx.kill().unwrap();
    tx.wait().unwrap();
    let text = finish(rx, "the receiver after its sender died");
    assert!(
        text.contains("FAILED test 6") || text.contains("FAILED irecv 6"),
        "{text}"
    );
    assert!(
        text.contains("exited or was killed"),
        "the log names the cause:\n{text}"
    );

    // The receiver dies: the sender's transfer (or its wait for the next receive) fails.
    let (rdev, sdev) = kill_devices(22);
    let mut rx = spawn_role("role_receiver", &rdev, &[]);
    let handle = read_line(&mut rx, "HANDLE ");
    let mut tx = spawn_role("role_sender", &sdev, &[("ERDMA_NCCL_PEER_HANDLE", &handle)]);
    read_line(&mut tx, "SENDING 1");
    rx.kill().unwrap();
    rx.wait().unwrap();
    let t = Instant::now();
    let text = finish(tx, "the sender after its receiver died");
    assert!(t.elapsed() < Duration::from_secs(30));
    assert!(
        text.contains("FAILED test 6") || text.contains("FAILED isend 6"),
        "{text}"
    );
    assert!(
        text.contains("erdma-nccl WARN NET/erdma:"),
        "the failure is logged:\n{text}"
    );
}

/// The whole suite in a child process with other settings.
#[test]
#[ignore = "a role of other_settings"]
fn role_suite() {
    if role_env("ERDMA_NCCL_ROLE").as_deref() != Some("role_suite") {
        return;
    }
    suite(&V11::new(), 7);
}

#[test]
fn other_settings() {
    let runs: [(&str, &[(&str, &str)]); 3] = [
        ("one queue pair", &[("ERDMA_NCCL_QPS", "1")]),
        (
            "SEND notices (siw)",
            &[
                ("ERDMA_NCCL_NOTICE", "send"),
                ("ERDMA_NCCL_QPS", "3"),
                ("ERDMA_NCCL_CHUNK", "4K"),
            ],
        ),
        (
            "rdma_cm connections",
            &[("ERDMA_NCCL_CM", "1"), ("ERDMA_NCCL_QPS", "2")],
        ),
    ];
    for (i, (what, env)) in runs.iter().enumerate() {
        let devices = format!("soft:127.0.0.{},soft:127.0.0.{}", 30 + 2 * i, 31 + 2 * i);
        let child = spawn_role("role_suite", &devices, env);
        finish(child, what);
    }
}

//! The rings on their own and between two devices of this process: order, bounds, a hostile
//! producer, spilling, waking.

use super::*;
use crate::soft::engine::batch::{LentBytes, Outgoing};

/// A ring's two ends in this process: the producer's mapping and the consumer's.
fn ends() -> (OutRing, InRing) {
    let (fd, map) = create().unwrap();
    let theirs = Map::new(&fd).unwrap();
    let out = OutRing {
        map,
        tail: 0,
        head: 0,
        consumer: None,
        spilling: false,
    };
    let inr = InRing {
        map: theirs,
        peer: Ipv4Addr::new(127, 0, 0, 1),
        head: 0,
        broken: false,
    };
    (out, inr)
}

fn push(out: &mut OutRing, bytes: &[u8]) -> Pushed {
    // SAFETY: `bytes` is readable for its length.
    let r = unsafe { out.push(&[(bytes.as_ptr(), bytes.len())]) };
    out.publish();
    r
}

fn packet(seq: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seq * 31 + i * 7) as u8).collect()
}

/// Packets of every size up to the largest keep their bytes and their order through
/// several laps of the ring (records padded at its end).
#[test]
fn a_ring_carries_packets_in_order_across_its_end() {
    let (mut out, mut inr) = ends();
    let mut buf = vec![0u8; MAX_PACKET];
    let mut sent = 0usize;
    let mut seq = 0usize;
    let mut laps_bytes = 0usize;
    while laps_bytes < 3 * RING_BYTES {
        // A few in flight at a time, of sizes that do not divide the ring.
        let lens: Vec<usize> = (0..5)
            .map(|k| 1 + (seq * 977 + k * 4093) % MAX_PACKET)
            .collect();
        for (k, &len) in lens.iter().enumerate() {
            assert_eq!(push(&mut out, &packet(seq + k, len)), Pushed::Written);
            laps_bytes += padded(len);
        }
        for (k, &len) in lens.iter().enumerate() {
            let n = inr.pop(&mut buf).expect("a packet");
            assert_eq!(n, len);
            assert!(
                buf[..n] == packet(seq + k, len)[..],
                "packet {} differs",
                seq + k
            );
            sent += 1;
        }
        seq += lens.len();
        assert_eq!(inr.pop(&mut buf), None);
    }
    assert!(!inr.broken);
    assert!(sent > 500, "{sent} packets");
}

/// A ring the consumer does not read fills up: further packets are dropped (as a full
/// socket drops them), and room comes back as the consumer reads. A packet larger than
/// any datagram is never written.
#[test]
fn a_full_ring_drops_until_it_is_read() {
    let (mut out, mut inr) = ends();
    let pkt = packet(1, 4096);
    let mut written = 0;
    while push(&mut out, &pkt) == Pushed::Written {
        written += 1;
    }
    assert_eq!(written, RING_BYTES / padded(4096));
    assert_eq!(push(&mut out, &pkt), Pushed::Full);
    let mut buf = vec![0u8; MAX_PACKET];
    assert_eq!(inr.pop(&mut buf), Some(4096));
    assert_eq!(push(&mut out, &pkt), Pushed::Written);
    assert_eq!(push(&mut out, &vec![0; MAX_PACKET + 1]), Pushed::Full);
    let mut n = 0;
    while inr.pop(&mut buf).is_some() {
        n += 1;
    }
    assert_eq!(n, written);
}

/// Whatever a producer writes, the consumer reads no byte outside the ring and stops
/// reading a ring whose counters or records break its rules.
#[test]
fn a_consumer_stops_reading_a_ring_that_breaks_its_rules() {
    let mut buf = vec![0u8; MAX_PACKET];
    type Spoil = fn(&OutRing);
    let set_tail = |o: &OutRing, t: u64| o.map.header().tail.store(t, Ordering::Release);
    let rec = |o: &OutRing, at: usize, len: u32, kind: u32| {
        // SAFETY: `at` is 8-aligned and REC short of the data area's end.
        unsafe { write_rec(o.map.data().add(at), len, kind) }
    };
    let cases: [(&str, Spoil); 6] = [
        ("tail past a whole ring", |o| {
            o.map
                .header()
                .tail
                .store(RING_BYTES as u64 + 8, Ordering::Release)
        }),
        ("a record longer than a datagram", |o| {
            // SAFETY: offset 0 of the data area.
            unsafe { write_rec(o.map.data(), MAX_PACKET as u32 + 1, PACKET) };
            o.map.header().tail.store(4096, Ordering::Release);
        }),
        ("a record past the tail", |o| {
            // SAFETY: offset 0 of the data area.
            unsafe { write_rec(o.map.data(), 100, PACKET) };
            o.map.header().tail.store(16, Ordering::Release);
        }),
        ("an unknown kind", |o| {
            // SAFETY: offset 0 of the data area.
            unsafe { write_rec(o.map.data(), 8, 77) };
            o.map.header().tail.store(16, Ordering::Release);
        }),
        ("a tail that is not whole records", |o| {
            o.map.header().tail.store(3, Ordering::Release)
        }),
        ("padding beyond the tail", |o| {
            // SAFETY: offset 0 of the data area.
            unsafe { write_rec(o.map.data(), 0, PAD) };
            o.map.header().tail.store(64, Ordering::Release);
        }),
    ];
    for (what, spoil) in cases {
        let (out, mut inr) = ends();
        spoil(&out);
        assert_eq!(inr.pop(&mut buf), None, "{what}");
        assert!(inr.broken, "{what}: the ring is read no more");
        // Even once the producer writes a good packet after it.
        rec(&out, 0, 8, PACKET);
        set_tail(&out, 16);
        assert_eq!(inr.pop(&mut buf), None, "{what}");
    }
    // A record running past the end of the ring (its start near the end).
    let (out, mut inr) = ends();
    let at = RING_BYTES - 64;
    inr.head = at as u64;
    rec(&out, at, 200, PACKET);
    set_tail(&out, (at + 256) as u64);
    assert_eq!(inr.pop(&mut buf), None);
    assert!(inr.broken);
}

/// `shm` sends `b`.
fn send(shm: &Shm, b: &mut TxBatch, now: u64) -> Sent {
    let mut sent = Sent::default();
    shm.send(&[b], now, &mut sent);
    sent
}

/// Two devices' rings in this process, set up as the exchange sets them up.
fn channel(a_ip: Ipv4Addr, b_ip: Ipv4Addr) -> (Arc<Shm>, Arc<Shm>) {
    let (a, b) = (Arc::new(Shm::new(a_ip)), Arc::new(Shm::new(b_ip)));
    let fd = a.offer(b_ip).expect("a ring");
    let me = same_host::pidfd_open(std::process::id() as i32).unwrap();
    assert!(b.take(a_ip, &me, fd), "B maps A's ring");
    a.settle(b_ip, true);
    assert!(a.sends());
    (a, b)
}

/// A batch of one 8-byte-payload packet to `dst`, and one to `other`, and one whose
/// payload is lent from `lent`.
fn batch(dst: Ipv4Addr, other: Ipv4Addr, lent: &[u8]) -> TxBatch {
    let mut b = TxBatch::new(1 << 16, 4096, false);
    for (to, tag) in [(dst, 1u8), (other, 2)] {
        b.space()[..40].fill(tag);
        let p = b.place(Outgoing {
            len: 40,
            dst: SocketAddrV4::new(to, 4791),
            flow: u32::from(tag),
            middle: false,
        });
        b.commit(p);
    }
    b.space()[..40 + lent.len()].fill(3);
    let p = b.place(Outgoing {
        len: 40 + lent.len(),
        dst: SocketAddrV4::new(dst, 4791),
        flow: 3,
        middle: false,
    });
    let l = LentBytes {
        at: 20,
        len: lent.len(),
        addr: lent.as_ptr() as u64,
    };
    // SAFETY: `lent` outlives the batch's send below.
    unsafe { b.commit_lent(p, l) };
    b
}

/// Packets for a peer that took a ring go into it (a lent payload with them), others are
/// left for the socket; a consumer about to sleep is woken once, by the first send after
/// it said so; a consumer that lets its ring go is sent nothing more by it.
#[test]
fn a_device_sends_by_the_ring_its_peer_took_and_wakes_it_once() {
    let (a_ip, b_ip, c_ip) = (
        Ipv4Addr::new(127, 0, 97, 1),
        Ipv4Addr::new(127, 0, 97, 2),
        Ipv4Addr::new(127, 0, 97, 3),
    );
    let (a, b) = channel(a_ip, b_ip);
    let mut rx = RingRx::new(b.clone());
    assert!(b.park(), "nothing waits: B may sleep");
    let lent = vec![9u8; 100];
    let mut one = batch(b_ip, c_ip, &lent);
    let sent = send(&a, &mut one, 1);
    assert_eq!(sent.taken, [true, false, true]);
    assert_eq!(sent.wake, [b_ip], "B said it sleeps");
    let mut two = batch(b_ip, c_ip, &lent);
    assert!(send(&a, &mut two, 2).wake.is_empty(), "B was woken already");
    assert!(!b.park(), "packets wait: B must not sleep");
    b.unpark();
    assert_eq!(rx.fill(8, false), (4, false));
    let mut got = Vec::new();
    rx.for_each(&mut |src, bytes| got.push((src, bytes.to_vec())));
    assert!(got.iter().all(|(s, _)| *s == SocketAddrV4::new(a_ip, 4791)));
    assert_eq!(got[0].1, vec![1u8; 40]);
    let mut third = vec![3u8; 140];
    third[20..120].fill(9);
    assert_eq!(got[1].1, third, "the lent payload between its headers");
    // B's device closes: A's next packets for it go to the socket.
    drop(rx);
    drop(b);
    let mut three = batch(b_ip, c_ip, &lent);
    assert_eq!(send(&a, &mut three, 3).taken, [false, false, false]);
    assert!(!a.sends());
}

/// A ring taken while its consumer's engine thread sleeps (another thread's round took it)
/// wakes that thread with its first packet: the sleep said nothing about a ring it did not
/// know yet. (Two processes' async programs waited on a packet in such a ring until their
/// requests ran out of retries.)
#[test]
fn a_ring_taken_while_its_consumer_sleeps_wakes_it() {
    let (a_ip, b_ip) = (Ipv4Addr::new(127, 0, 97, 9), Ipv4Addr::new(127, 0, 97, 10));
    let (a, b) = (Arc::new(Shm::new(a_ip)), Arc::new(Shm::new(b_ip)));
    assert!(b.park(), "B sleeps, knowing no ring");
    let fd = a.offer(b_ip).unwrap();
    let me = same_host::pidfd_open(std::process::id() as i32).unwrap();
    assert!(b.take(a_ip, &me, fd));
    a.settle(b_ip, true);
    assert_eq!(send(&a, &mut big(b_ip, 100), 1).wake, [b_ip]);
    b.unpark();
    assert_eq!(RingRx::new(b.clone()).fill(8, false).0, 1);
}

/// A batch of one `len`-byte packet to `dst`.
fn big(dst: Ipv4Addr, len: usize) -> TxBatch {
    let mut b = TxBatch::new(1 << 16, 8192, false);
    b.space()[..len].fill(7);
    let p = b.place(Outgoing {
        len,
        dst: SocketAddrV4::new(dst, 4791),
        flow: 1,
        middle: false,
    });
    b.commit(p);
    b
}

/// A full ring sends its peer's messages to the socket until the peer has read every
/// packet in it, so that none overtakes one still in the ring; then the ring again.
#[test]
fn a_full_ring_spills_to_the_socket_until_it_is_read_out() {
    let (a_ip, b_ip) = (Ipv4Addr::new(127, 0, 97, 7), Ipv4Addr::new(127, 0, 97, 8));
    let (a, b) = channel(a_ip, b_ip);
    let mut rx = RingRx::new(b.clone());
    let mut n = 0;
    while send(&a, &mut big(b_ip, 4096), 1).taken == [true] {
        n += 1;
    }
    assert!(n > 200, "{n} messages before it filled");
    // Read most of it: still the socket.
    let mut read = 0;
    while read < n - 4 {
        read += rx.fill((n - 4 - read).min(8), false).0;
    }
    assert_eq!(send(&a, &mut big(b_ip, 4096), 2).taken, [false]);
    while rx.fill(8, false).0 != 0 {}
    assert_eq!(send(&a, &mut big(b_ip, 4096), 3).taken, [true]);
    let [written, taken, spilled] = a.counts.each_ref().map(|c| c.load(Ordering::Relaxed));
    assert_eq!((written, spilled), (n as u64 + 1, 2));
    assert_eq!(b.counts[1].load(Ordering::Relaxed), n as u64);
    assert_eq!(taken, 0);
}

/// An unsealed memfd of `len` bytes.
fn tempfile_of(len: usize) -> OwnedFd {
    // SAFETY: a NUL-terminated name and flags; returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(c"erdma-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: the descriptor was just returned by the kernel and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    std::fs::File::from(fd.try_clone().unwrap())
        .set_len(len as u64)
        .unwrap();
    fd
}

/// A descriptor that is not a ring of ours is not taken: not a regular file, too short, not
/// sealed against shrinking, or without the ring's header.
#[test]
fn only_a_ring_is_taken() {
    let b = Shm::new(Ipv4Addr::new(127, 0, 97, 5));
    let me = same_host::pidfd_open(std::process::id() as i32).unwrap();
    let peer = Ipv4Addr::new(127, 0, 97, 6);
    let (r, _w) = std::io::pipe().unwrap();
    assert!(!b.take(peer, &me, r.as_raw_fd() as u32));
    let short = tempfile_of(4096);
    assert!(!b.take(peer, &me, short.as_raw_fd() as u32));
    // A file that is not sealed against shrinking (its owner could truncate it under the
    // mapping) is not even mapped.
    let plain = tempfile_of(MAP_BYTES);
    assert!(Map::new(&plain).is_err(), "an unsealed file is not mapped");
    assert!(!b.take(peer, &me, plain.as_raw_fd() as u32));
    let (blank, map) = create().unwrap();
    map.header().magic.store(0, Ordering::Release);
    assert!(!b.take(peer, &me, blank.as_raw_fd() as u32));
    assert!(!b.take(peer, &me, 1 << 30), "no such descriptor");
    assert!(lock(&b.inbound).is_empty());
}

/// A consumer that writes nonsense into its head word harms only itself: the producer never
/// overflows (this runs in debug builds too) and never writes outside the ring; a head ahead
/// of the tail leaves it no room (its packets then go by the socket).
#[test]
fn a_producer_never_trusts_the_consumer() {
    for head in [
        u64::MAX,
        u64::MAX - (1 << 30),
        RING_BYTES as u64 + 1,
        1 << 40,
    ] {
        let (mut out, _inr) = ends();
        push(&mut out, &packet(1, 100));
        out.map.header().head.store(head, Ordering::Release);
        out.head = head;
        for k in 0..3 * RING_BYTES / 4096 {
            let r = push(&mut out, &packet(k, 4000));
            assert!(out.tail % 8 == 0, "head {head}: {r:?}");
            let _ = out.room(256);
        }
        if out.tail.wrapping_sub(head) > RING_BYTES as u64 {
            assert_eq!(push(&mut out, &packet(2, 100)), Pushed::Full, "head {head}");
            assert!(!out.room(256), "head {head}");
        }
    }
}

/// With rings to read, a polling thread's empty rounds make no system call: the socket is read
/// when the engine thread says datagrams arrived there (or, as a floor, every
/// [`SOCKET_EVERY`] rounds), and only once the rings are read out, so a word that came while
/// they were not is kept until they are.
#[test]
fn the_socket_is_read_when_told_and_once_the_rings_are_read_out() {
    let (a_ip, b_ip) = (Ipv4Addr::new(127, 0, 97, 9), Ipv4Addr::new(127, 0, 97, 10));
    let (a, b) = channel(a_ip, b_ip);
    let mut rx = RingRx::new(b);
    // Empty rounds, not told: no socket read short of the floor.
    for round in 1..SOCKET_EVERY {
        assert_eq!(rx.fill(8, false), (0, false), "round {round}");
    }
    assert_eq!(rx.fill(8, false), (0, true), "the floor");
    // A stream: the fill after SOCKET_EVERY_BUSY in a row that took packets reads the socket
    // too (once the rings are read out, leaving it a slot).
    for i in 0..=SOCKET_EVERY_BUSY {
        assert_eq!(send(&a, &mut big(b_ip, 64), u64::from(i)).taken, [true]);
        let want = (1, i == SOCKET_EVERY_BUSY);
        assert_eq!(rx.fill(8, false), want, "stream fill {i}");
    }
    // A fill that took its packet after empty ones (a ping-pong) starts the count again.
    assert_eq!(rx.fill(8, false), (0, false));
    assert_eq!(send(&a, &mut big(b_ip, 64), 99).taken, [true]);
    assert_eq!(
        rx.fill(8, false),
        (1, false),
        "one packet after an empty fill"
    );
    // Told: read in that very round.
    assert_eq!(rx.fill(8, true), (0, true));
    assert_eq!(rx.fill(8, false), (0, false), "told once, read once");
    // Told while the rings hold more than a round takes: the rings first, the socket after,
    // though nothing says so again.
    for i in 0..5 {
        assert_eq!(send(&a, &mut big(b_ip, 64), i).taken, [true]);
    }
    // (A round that will read the socket leaves it one of its slots.)
    assert_eq!(rx.fill(3, true), (2, false), "rings first");
    assert_eq!(rx.fill(8, false), (3, true), "read out: now the socket");
    assert_eq!(rx.fill(8, false), (0, false));
}

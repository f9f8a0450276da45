//! The socket's unit tests: options, GSO/GRO batches, lent payloads.

use super::*;
use crate::soft::engine::batch::{LentBytes, Outgoing};

fn opts(gso: bool, gro: bool) -> SockOptions {
    SockOptions {
        gso,
        gro,
        buffer_bytes: 1 << 20,
        reuseport: false,
    }
}

#[test]
fn kernel_drops_come_from_the_sockets_own_row() {
    let table = "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   \
                 uid  timeout inode ref pointer drops\n\
        7: 0100007F:12B7 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        \
        0 4242 2 0000000000000000 17\n\
        8: 0200007F:12B7 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        \
        0 4243 2 0000000000000000 5\n";
    assert_eq!(udp_table_drops(table, "4242"), Some(17));
    assert_eq!(udp_table_drops(table, "4243"), Some(5));
    assert_eq!(udp_table_drops(table, "99"), None);
    assert_eq!(udp_table_drops("", "4242"), None);
    // A live socket has a row (no drops yet) where procfs is mounted.
    if std::path::Path::new("/proc/net/udp").exists() {
        let sock = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(false, false)).unwrap();
        assert_eq!(sock.kernel_drops(), Some(0));
    }
}

/// Also with the receiver taking one message per call (`recvmsg` instead of `recvmmsg`):
/// a GRO message is split the same way.
#[test]
fn gso_batches_group_equal_packets_and_split_on_receive() {
    let cases = [(false, false), (true, false), (true, true), (false, true)];
    for ((gso, gro), one) in cases.into_iter().flat_map(|c| [(c, false), (c, true)]) {
        let a = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(gso, gro)).unwrap();
        let b = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(gso, gro)).unwrap();
        let mut tx = TxBatch::new(1 << 20, 2000, a.gso());
        let sizes = [1000usize, 1000, 1000, 700, 1000, 1000, 1];
        for (i, &len) in sizes.iter().enumerate() {
            let pkt = Outgoing {
                len,
                dst: b.local(),
                flow: 1,
                middle: false,
            };
            let at = tx.place(pkt);
            let idx = at.segment_index();
            let space = tx.space();
            space[..len].fill(i as u8);
            tx.commit(at);
            if gso {
                let expect = [0u16, 1, 2, 3, 0, 1, 2][i];
                assert_eq!(idx, expect, "packet {i}");
            } else {
                assert_eq!(idx, 0);
            }
        }
        assert_eq!(tx.packets(), sizes.len());
        a.send_batch(&mut tx).unwrap();
        assert!(tx.is_empty());
        let mut rx = RxBatch::new(8, 65536);
        let mut got: Vec<Vec<u8>> = Vec::new();
        for _ in 0..200 {
            b.recv_batch_up_to(&mut rx, if one { 1 } else { usize::MAX })
                .unwrap();
            for d in rx.datagrams() {
                assert_eq!(d.src, a.local());
                got.push(rx.data(d).to_vec());
            }
            if got.len() == sizes.len() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert_eq!(got.len(), sizes.len(), "gso={gso} gro={gro} one={one}");
        for (i, (g, &len)) in got.iter().zip(&sizes).enumerate() {
            assert_eq!(
                g.len(),
                len,
                "datagram {i} length (gso={gso} gro={gro} one={one})"
            );
            assert!(g.iter().all(|&x| x == i as u8));
        }
    }
}

/// Receives `count` datagrams on `sock` (or fails after a while).
fn receive(sock: &UdpSock, count: usize) -> Vec<Vec<u8>> {
    let mut rx = RxBatch::new(8, 65536);
    let mut got = Vec::new();
    for _ in 0..500 {
        sock.recv_batch(&mut rx).unwrap();
        got.extend(rx.datagrams().iter().map(|d| rx.data(d).to_vec()));
        if got.len() >= count {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    got
}

/// Fills a batch with one packet of each length, bytes `first`, `first + 1`, ….
fn batch_of(lens: &[usize], dst: SocketAddrV4, gso: bool, first: u8) -> TxBatch {
    let mut tx = TxBatch::new(1 << 20, 2000, gso);
    for (i, &len) in lens.iter().enumerate() {
        let at = tx.place(Outgoing {
            len,
            dst,
            flow: 1,
            middle: false,
        });
        tx.space()[..len].fill(first.wrapping_add(i as u8));
        tx.commit(at);
    }
    tx
}

#[test]
fn a_receive_takes_no_more_messages_than_asked() {
    let a = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(false, false)).unwrap();
    let b = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(false, false)).unwrap();
    let mut tx = batch_of(&[10, 20, 30], b.local(), false, 7);
    a.send_batch(&mut tx).unwrap();
    let mut rx = RxBatch::new(8, 2048);
    let mut first = 0;
    for _ in 0..500 {
        first = b.recv_batch_up_to(&mut rx, 1).unwrap();
        if first > 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert_eq!((first, rx.messages()), (1, 1));
    assert_eq!(rx.data(&rx.datagrams()[0]), &[7u8; 10][..]);
    let rest = receive(&b, 2);
    assert_eq!(rest, vec![vec![8u8; 20], vec![9u8; 30]]);
}

/// Packets of `len` bytes, every other one with its bytes `at..at+lent` lent from `src`
/// (packet `i` lends `src[i * lent..]`); the rest of packet `i` is byte `i`. Returns the
/// batch and the datagrams it must put on the wire.
fn lending_batch(
    lens: &[usize],
    at: usize,
    lent: usize,
    src: &[u8],
    dst: SocketAddrV4,
    gso: bool,
) -> (TxBatch, Vec<Vec<u8>>) {
    let mut tx = TxBatch::new(1 << 20, 2000, gso);
    let mut want = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let at_ = tx.place(Outgoing {
            len,
            dst,
            flow: 1,
            middle: false,
        });
        let space = &mut tx.space()[..len];
        space.fill(i as u8);
        let mut w = space.to_vec();
        if i % 2 == 0 {
            // What the buffer holds where the payload goes must not reach the wire.
            space[at..at + lent].fill(0xEE);
            let from = &src[i * lent..(i + 1) * lent];
            w[at..at + lent].copy_from_slice(from);
            let l = LentBytes {
                at,
                len: lent,
                addr: from.as_ptr() as u64,
            };
            // SAFETY: `src` outlives the batch's send (the caller sends before dropping it).
            unsafe { tx.commit_lent(at_, l) };
        } else {
            tx.commit(at_);
        }
        want.push(w);
    }
    (tx, want)
}

#[test]
fn lent_payloads_go_on_the_wire_in_place() {
    for gso in [false, true] {
        let a = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(gso, true)).unwrap();
        let b = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(gso, true)).unwrap();
        let src: Vec<u8> = (0..64 * 1000).map(|i| (i * 7 + 1) as u8).collect();
        // Equal sizes share GSO messages (three iovecs per lent packet, runs joined
        // across the others); more packets than one message takes.
        let lens = vec![1000usize; 70];
        let (mut tx, want) = lending_batch(&lens, 12, 900, &src, b.local(), gso);
        assert!(tx.has_lent());
        a.send_batch(&mut tx).unwrap();
        assert!(tx.is_empty() && !tx.has_lent());
        let got = receive(&b, want.len());
        assert_eq!(got.len(), want.len(), "gso={gso}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w, "datagram {i} (gso={gso})");
        }
    }
}

#[test]
fn owning_lent_payloads_copies_them_before_the_memory_changes() {
    let a = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(true, true)).unwrap();
    let b = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(true, true)).unwrap();
    let mut src: Vec<u8> = (0..8 * 100).map(|i| (i % 251) as u8).collect();
    let (mut tx, want) = lending_batch(&[300; 8], 40, 100, &src, b.local(), true);
    tx.own_lent();
    assert!(!tx.has_lent());
    // The lender may reuse its memory now: the batch holds its own copy.
    src.fill(0x5A);
    a.send_batch(&mut tx).unwrap();
    let got = receive(&b, want.len());
    assert_eq!(got, want);
    drop(src);
}

/// A batch still holding lent payloads where it may hold none is emptied, not sent; one
/// whose payloads were copied (or never lent) is left alone.
#[test]
fn a_batch_left_with_lent_payloads_is_discarded() {
    let b = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(true, true)).unwrap();
    let src: Vec<u8> = (0..8 * 100).map(|i| (i % 251) as u8).collect();
    let (mut stale, _) = lending_batch(&[300; 8], 40, 100, &src, b.local(), true);
    assert!(stale.has_lent());
    assert!(stale.discard_stale_lent());
    assert!(stale.is_empty() && !stale.has_lent());
    let (mut owned, _) = lending_batch(&[300; 8], 40, 100, &src, b.local(), true);
    owned.own_lent();
    assert!(!owned.discard_stale_lent());
    assert!(!owned.is_empty());
}

#[test]
fn several_batches_leave_in_their_order_and_are_emptied() {
    for gso in [false, true] {
        let a = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(gso, true)).unwrap();
        let b = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(gso, true)).unwrap();
        // More messages than one sendmmsg takes, the first call ending inside the second
        // batch; then a short pair (a reply and one held answer).
        for (n1, n2) in [(MAX_MSGS - 3, 10), (1, 1)] {
            let lens1: Vec<usize> = (0..n1).map(|i| 100 + i % 3).collect();
            let lens2: Vec<usize> = (0..n2).map(|i| 40 + i % 2).collect();
            let mut one = batch_of(&lens1, b.local(), gso, 0);
            let mut two = batch_of(&lens2, b.local(), gso, n1 as u8);
            let (m1, m2) = (one.messages() as u64, two.messages() as u64);
            a.send_batches(&mut [&mut one, &mut two]).unwrap();
            assert!(one.is_empty() && two.is_empty());
            assert_eq!((one.sent(), two.sent()), (m1, m2));
            let want: Vec<usize> = lens1.iter().chain(&lens2).copied().collect();
            let got = receive(&b, want.len());
            assert_eq!(got.len(), want.len(), "gso={gso} {n1}+{n2}");
            for (i, (g, &len)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.len(), len, "datagram {i} (gso={gso} {n1}+{n2})");
                assert!(g.iter().all(|&x| x == i as u8), "datagram {i} out of order");
            }
        }
    }
}

#[test]
fn packets_of_several_flows_share_messages_and_each_flow_keeps_its_order() {
    let a = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(true, true)).unwrap();
    let b = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(true, true)).unwrap();
    let mut tx = TxBatch::new(1 << 20, 2000, true);
    // Three flows, each a message of a first packet, three middle ones and a last one of
    // three different sizes (as a WRITE WITH IMM is), committed one flow after the other.
    let shape = [
        (1016usize, false),
        (1000, true),
        (1000, true),
        (1000, true),
        (1004, false),
    ];
    let mut sent = Vec::new();
    for flow in 0..3u32 {
        for (i, &(len, middle)) in shape.iter().enumerate() {
            let pkt = Outgoing {
                len,
                dst: b.local(),
                flow,
                middle,
            };
            let at = tx.place(pkt);
            let idx = at.segment_index();
            // The first packets, the middle ones and the last ones form one message each:
            // the segment index counts the flows before this one (three middles each).
            let expect = if middle {
                flow * 3 + i as u32 - 1
            } else {
                flow
            };
            assert_eq!(u32::from(idx), expect, "flow {flow} packet {i}");
            let tag = (flow * 16 + i as u32) as u8;
            tx.space()[..len].fill(tag);
            tx.commit(at);
            sent.push((flow, tag, len));
        }
    }
    assert_eq!(tx.packets(), 15);
    assert_eq!(tx.messages(), 3, "one message per packet size");
    a.send_batch(&mut tx).unwrap();
    let got = receive(&b, 15);
    assert_eq!(got.len(), 15);
    for d in &got {
        assert!(d.iter().all(|&x| x == d[0]), "a datagram is one packet");
    }
    // Each flow's packets arrive in the order they were committed.
    for flow in 0..3u32 {
        let mine: Vec<(u8, usize)> = got
            .iter()
            .filter(|d| u32::from(d[0]) / 16 == flow)
            .map(|d| (d[0], d.len()))
            .collect();
        let expect: Vec<(u8, usize)> = sent
            .iter()
            .filter(|s| s.0 == flow)
            .map(|s| (s.1, s.2))
            .collect();
        assert_eq!(mine, expect, "flow {flow}");
    }
}

#[test]
fn a_packet_never_joins_a_message_ahead_of_its_own_flow() {
    let a = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(true, true)).unwrap();
    let b = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(true, true)).unwrap();
    let mut tx = TxBatch::new(1 << 20, 2000, true);
    // Flow 1 sends 500, 700, 500 bytes: the second 500 may not join the first one's
    // message, which leaves before the 700. Flow 2's 500 may.
    for (flow, len, expect) in [(1u32, 500, 0u16), (1, 700, 0), (1, 500, 0), (2, 500, 1)] {
        let pkt = Outgoing {
            len,
            dst: b.local(),
            flow,
            middle: true,
        };
        let at = tx.place(pkt);
        assert_eq!(at.segment_index(), expect, "flow {flow}, {len} bytes");
        tx.space()[..len].fill(flow as u8);
        tx.commit(at);
    }
    assert_eq!(tx.messages(), 3);
    a.send_batch(&mut tx).unwrap();
    let lens: Vec<(u8, usize)> = receive(&b, 4).iter().map(|d| (d[0], d.len())).collect();
    let flow1: Vec<usize> = lens.iter().filter(|d| d.0 == 1).map(|d| d.1).collect();
    assert_eq!(flow1, [500, 700, 500]);
    assert_eq!(lens.len(), 4);
}

/// A message the kernel refuses (here EACCES: a broadcast destination) is dropped alone
/// and counted. Before, any errno outside a short list cleared the whole batch, other
/// queue pairs' packets and held acknowledgements included.
#[test]
fn a_refused_message_is_dropped_alone() {
    let a = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(false, false)).unwrap();
    let b = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(false, false)).unwrap();
    let mut tx = TxBatch::new(1 << 16, 2000, false);
    let broadcast = SocketAddrV4::new(Ipv4Addr::new(127, 255, 255, 255), 4791);
    for (i, dst) in [b.local(), broadcast, b.local(), b.local()]
        .into_iter()
        .enumerate()
    {
        let at = tx.place(Outgoing {
            len: 10 + i,
            dst,
            flow: i as u32,
            middle: false,
        });
        tx.space()[..10 + i].fill(i as u8);
        tx.commit(at);
    }
    a.send_batch(&mut tx).unwrap();
    let lens: Vec<usize> = receive(&b, 3).iter().map(Vec::len).collect();
    assert_eq!(lens, [10, 12, 13]);
    assert_eq!(a.refused(), 1);
}

/// A GSO train the kernel cannot segment (here: checksums off on the socket; an IPsec
/// route does the same) is dropped, and GSO goes off for the socket and the batch, so the
/// retransmission of the same packets goes one datagram each and arrives.
#[test]
fn a_refused_gso_train_turns_gso_off() {
    let a = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(true, false)).unwrap();
    let b = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(false, false)).unwrap();
    if !a.gso() {
        return; // No GSO on this kernel: nothing to refuse.
    }
    setsockopt_int(a.raw_fd(), libc::SOL_SOCKET, libc::SO_NO_CHECK, 1).unwrap();
    let mut tx = batch_of(&[1000; 5], b.local(), true, 1);
    assert_eq!(tx.messages(), 1, "one train");
    a.send_batch(&mut tx).unwrap();
    assert!(receive(&b, 1).is_empty(), "the train was refused");
    assert_eq!(a.refused(), 1);
    assert!(
        !a.gso() && !tx.gso(),
        "GSO is off for the socket and the batch"
    );
    for (i, len) in [1000; 5].into_iter().enumerate() {
        let at = tx.place(Outgoing {
            len,
            dst: b.local(),
            flow: 1,
            middle: false,
        });
        tx.space()[..len].fill(i as u8);
        tx.commit(at);
    }
    assert_eq!(tx.messages(), 5, "one datagram each");
    a.send_batch(&mut tx).unwrap();
    assert_eq!(receive(&b, 5).len(), 5);
}

#[test]
fn unreachable_destinations_do_not_fail_the_batch() {
    let a = UdpSock::bind(Ipv4Addr::LOCALHOST, 0, opts(true, true)).unwrap();
    let mut tx = TxBatch::new(1 << 16, 2000, true);
    let space = tx.space();
    space[..10].fill(1);
    // A packet larger than the loopback MTU is refused with EMSGSIZE by IP_PMTUDISC_DO;
    // a too-large single datagram stands in for it here.
    let at = tx.place(Outgoing {
        len: 10,
        dst: SocketAddrV4::new(Ipv4Addr::new(0, 0, 0, 0), 9),
        flow: 1,
        middle: false,
    });
    tx.commit(at);
    a.send_batch(&mut tx).unwrap();
}

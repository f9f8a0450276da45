//! The SDK on an iWARP device: the kernel's soft-iWARP (siw) in the test guest
//! (`tests/vm/siw.sh`). Every test here is a role driven by the environment:
//!
//! - `iwarp_device_role` (`ERDMA_IWARP_DEVICE`, `ERDMA_IWARP_NETDEV`, `ERDMA_IWARP_IP`): what the
//!   device reports (iWARP transport, one GID holding the netdev's MAC, siw's limits) and what
//!   the limits layer refuses before the kernel is called (a hand-made connection, more inline
//!   bytes than siw takes).
//! - `iwarp_server_role` (`ERDMA_CM_LISTEN`) / `iwarp_client_role` (`ERDMA_CM_PEER`): every
//!   operation siw carries, 0 B to 1 MiB, through rdma_cm; the operations it lacks refused by
//!   the limits layer; SEND WITH INVALIDATE and what it does to the peer's region.
//! - `iwarp_private_server_role` / `iwarp_private_client_role`: private data at the iWARP limit
//!   (251 bytes) both ways, and one byte over, refused up front on either side.
//! - `iwarp_raw_server_role` / `iwarp_wire_limit_role`: librdmacm without the SDK, to show that
//!   the limit is siw's: 251 bytes connect, 252 never reach the listening application.
//! - `iwarp_vanishing_server_role` / `iwarp_abandoned_client_role`: a peer process that exits
//!   without disconnecting; the survivor's outstanding requests are flushed.

mod common;

use std::time::{Duration, Instant};

use erdma::Capability;
use erdma::PortState;
use erdma::connect::cm::{self, Connection, Setup, Via};
use erdma::profile::{SIW_MAX_INLINE_DATA, SIW_VENDOR_ID};
use erdma::{
    Access, Context, Cq, Error, GidType, Limit, Mr, QpConfig, RecvWr, SendWr, Transport, WcOpcode,
    WcStatus, scope,
};

const WAIT: Duration = Duration::from_secs(30);

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("this role needs {name}"))
}

// ---------------------------------------------------------------------------------------------
// The device.

#[test]
#[ignore = "siw device check of tests/vm/siw.sh (ERDMA_IWARP_DEVICE, ERDMA_IWARP_NETDEV)"]
fn iwarp_device_role() {
    let name = env("ERDMA_IWARP_DEVICE");
    let netdev = env("ERDMA_IWARP_NETDEV");
    let ctx = Context::open(&name).unwrap();
    assert_eq!(ctx.transport(), Transport::Iwarp);
    assert_eq!(ctx.attr().vendor_id, SIW_VENDOR_ID);
    assert_eq!(ctx.attr().atomic_cap, erdma::AtomicCap::None);

    let port = ctx.query_port(1).unwrap();
    assert_eq!(port.state, PortState::Active);
    assert_eq!(port.max_msg_sz, u32::MAX);
    let mtu: usize = std::fs::read_to_string(format!("/sys/class/net/{netdev}/mtu"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // The largest IB MTU that fits the netdev's (1500 -> 1024, 9000 -> 4096).
    let want = [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|m| *m <= mtu)
        .unwrap();
    assert_eq!(port.active_mtu.bytes() as usize, want, "netdev MTU {mtu}");

    // One GID: the netdev's MAC address, the rest zero; no IPv4-mapped GID.
    let mac: Vec<u8> = std::fs::read_to_string(format!("/sys/class/net/{netdev}/address"))
        .unwrap()
        .trim()
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).unwrap())
        .collect();
    let table = ctx.gid_table(1).unwrap();
    assert_eq!(table.len(), 1, "{table:?}");
    assert_eq!(table[0].gid_type, GidType::Iwarp);
    assert_eq!(&table[0].gid.0[..6], &mac[..]);
    assert!(table[0].gid.0[6..].iter().all(|b| *b == 0), "{table:?}");
    assert!(matches!(ctx.ipv4_gid(1), Err(Error::InvalidArgument(_))));
    // rdma_cm reaches the device by its netdev's address, found through that MAC.
    let ip: std::net::Ipv4Addr = env("ERDMA_IWARP_IP").parse().unwrap();
    assert_eq!(cm::device_ipv4(&ctx).unwrap(), ip);

    // What the limits layer knows of siw, in either profile.
    for profile in [erdma::ProfileKind::Device, erdma::ProfileKind::Erdma] {
        let ctx = Context::open_with(
            &name,
            erdma::OpenOptions {
                profile: Some(profile),
            },
        )
        .unwrap();
        let l = ctx.limits();
        assert!(
            !l.immediate_data && !l.atomics && !l.manual_connect,
            "{l:?}"
        );
        assert_eq!(l.max_inline_data, SIW_MAX_INLINE_DATA);
        assert_eq!(l.max_sge_rd, 1);
        check_qp_limits(&ctx);
    }
    check_memlock(&ctx);
    println!(
        "device: {name} is iWARP, GID {:?} = MAC of {netdev}",
        table[0].gid
    );
}

/// siw counts registrations against RLIMIT_MEMLOCK even for root: a region larger than the
/// limit is refused by the limits layer, naming it (the kernel would say only ENOMEM).
fn check_memlock(ctx: &Context) {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid out- and in-parameters; only this process's soft limit changes.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut old), 0);
        let low = libc::rlimit {
            rlim_cur: 1 << 20,
            rlim_max: old.rlim_max,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_MEMLOCK, &low), 0);
    }
    let pd = ctx.alloc_pd().unwrap();
    let over = pd.alloc(2 << 20, Access::LOCAL_WRITE);
    let within = pd.alloc(512 << 10, Access::LOCAL_WRITE);
    // SAFETY: as above, back to the limit it was.
    unsafe { assert_eq!(libc::setrlimit(libc::RLIMIT_MEMLOCK, &old), 0) };
    match over {
        Err(Error::LimitExceeded {
            limit: Limit::LockedMemory,
            requested,
            max,
        }) => assert_eq!((requested, max), (2 << 20, 1 << 20)),
        other => panic!("2 MiB under a 1 MiB RLIMIT_MEMLOCK: {other:?}"),
    }
    within.unwrap();
}

/// Inline capacity and the hand-made connection, on one context.
fn check_qp_limits(ctx: &Context) {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    // One byte more inline than siw takes: refused before the kernel (which would say EINVAL).
    match pd.create_qp(&QpConfig::new(&cq).max_inline_data(SIW_MAX_INLINE_DATA + 1)) {
        Err(Error::LimitExceeded {
            limit: Limit::MaxInlineData,
            requested,
            max,
        }) => assert_eq!((requested, max), (81, 80)),
        other => panic!("81 inline bytes: {other:?}"),
    }
    let qp = pd
        .create_qp(&QpConfig::new(&cq).max_inline_data(SIW_MAX_INLINE_DATA))
        .unwrap();
    assert_eq!(qp.caps().max_inline_data, SIW_MAX_INLINE_DATA);
    let a = qp.init(&erdma::InitOptions::default()).unwrap();
    let b = pd
        .create_qp(&QpConfig::new(&cq))
        .unwrap()
        .init(&erdma::InitOptions::default())
        .unwrap();
    // The out-of-band path: endpoints swapped, then modify_qp to RTR/RTS. siw's kernel refuses
    // RTS without a connection manager's socket; the SDK says so first, and how to connect.
    let eb = b.endpoint().unwrap();
    let e = a.connect(&eb, &Default::default()).unwrap_err();
    match &e.error {
        Error::MissingCapability { capability, device } => {
            assert_eq!(*capability, Capability::ManualConnect);
            assert_eq!(device, ctx.name());
        }
        other => panic!("a hand-made connection on iWARP: {other:?}"),
    }
    let text = e.error.to_string();
    assert!(text.contains("rdma_cm") && text.contains("iWARP"), "{text}");
    // The queue pair came back in INIT, untouched: the same refusal from RTR directly.
    let rtr = erdma::RtrOptions {
        dest_qp_num: eb.qp_num,
        rq_psn: eb.psn,
        path_mtu: erdma::Mtu::Mtu1024,
        av: erdma::AddressVector::new(eb.gid, 0),
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
    };
    assert!(matches!(
        e.qp.rtr(&rtr).unwrap_err().error,
        Error::MissingCapability {
            capability: Capability::ManualConnect,
            ..
        }
    ));
}

// ---------------------------------------------------------------------------------------------
// Every operation siw carries, through rdma_cm.

/// Message sizes every operation is tried with.
const SIZES: [usize; 6] = [0, 1, 80, 4095, 65_537, 1 << 20];
/// Server: receive slots (one per SEND) and write targets, one MiB each.
const SLOT: usize = 1 << 20;
/// Server: the SENDs the client makes (one per size, one inline, one gathered), then "check",
/// then the SEND WITH INVALIDATE.
const SENDS: usize = SIZES.len() + 2;
const CHECK_SLOT: usize = SENDS;
const INV_SLOT: usize = SENDS + 1;
/// Server: where the client WRITEs (after the receive slots).
const WRITES: usize = (INV_SLOT + 1) * SLOT;
const SERVER_REGION: usize = WRITES + SENDS * SLOT;
/// Client: sources, READ targets, the server's answer and the receive for its "ok".
const SRC: usize = 0;
const READS: usize = 2 << 20;
const ANSWER: usize = 3 << 20;
const ANSWER_LEN: usize = 64 << 10;
const OK_RECV: usize = ANSWER + ANSWER_LEN;
const CLIENT_REGION: usize = 4 << 20;
/// The gathered SEND/WRITE: six SGEs (siw's `max_send_sge`) of these (offset, length).
const GATHER: [(usize, usize); 6] = [
    (0, 1),
    (10_000, 100),
    (20_000, 4096),
    (100_000, 7),
    (200_000, 65_536),
    (300_000, 3000),
];
const INLINE: usize = SIW_MAX_INLINE_DATA as usize;

/// What one side keeps.
struct Side {
    cq: Cq,
    mr: Mr<'static>,
    /// Server: a small region granted to the client, for SEND WITH INVALIDATE to revoke.
    victim: Option<Mr<'static>>,
}

/// The six pieces of the source area GATHER names, as SGEs of a request.
fn gather<'a>(mr: &'a Mr<'static>) -> Vec<erdma::MrSlice<'a>> {
    GATHER
        .iter()
        .map(|&(o, l)| mr.slice(SRC + o..SRC + o + l))
        .collect()
}

/// What the client's requests of one kind carry, in order, their seeds counted from `seed`: one
/// request per size, one inline, one gathered (the SENDs from 10, the WRITEs from 30).
fn expected(seed: u32) -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> = SIZES
        .iter()
        .enumerate()
        .map(|(i, &n)| common::pattern(seed + i as u32, n))
        .collect();
    v.push(common::pattern(seed + SIZES.len() as u32 + 4, INLINE));
    v.push(gathered(seed + SIZES.len() as u32 + 5));
    v
}

/// The bytes a gathered request carries when the source area holds `seed`'s pattern.
fn gathered(seed: u32) -> Vec<u8> {
    let src = common::pattern(seed, 400_000);
    GATHER
        .iter()
        .flat_map(|&(o, l)| src[o..o + l].to_vec())
        .collect()
}

fn side_setup(ctx: &Context, server: bool) -> erdma::Result<Setup<Side>> {
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(256)?;
    let len = if server { SERVER_REGION } else { CLIENT_REGION };
    let mr = pd.alloc(len, Access::ALL)?;
    let config = QpConfig::new(&cq)
        .max_send_sge(6)
        .max_recv_sge(1)
        .max_inline_data(SIW_MAX_INLINE_DATA);
    let mut s = Setup::new(&pd, config)
        .access(Access::ALL)
        .grant(mr.remote());
    let mut victim = None;
    if server {
        // Every receive the client's SENDs need, before the client can send.
        let recvs: Vec<_> = (0..=INV_SLOT).map(|i| (i as u64, i * SLOT, SLOT)).collect();
        s = s.on_init(common::prepost(&mr, &recvs));
        let v = pd.alloc(4096, Access::ALL)?;
        s = s.grant(v.remote());
        victim = Some(v);
    }
    Ok(s.with(Side { cq, mr, victim }))
}

fn wait(cq: &Cq) -> erdma::Completion {
    cq.wait_one(WAIT).unwrap()
}

/// Posts one request on `qp` and waits for its completion on `cq`: a success of `opcode`.
fn run_one(qp: &erdma::Qp, cq: &Cq, wr: SendWr<'_, '_>, opcode: WcOpcode) {
    let what = format!("{wr:?}");
    scope(|s| {
        s.post_send(qp, wr).unwrap();
        let c = wait(cq);
        assert_eq!((c.status, c.opcode), (WcStatus::Success, opcode), "{what}");
    });
}

#[test]
#[ignore = "server role of tests/vm/siw.sh (ERDMA_CM_LISTEN)"]
fn iwarp_server_role() {
    let listener = cm::Listener::bind(env("ERDMA_CM_LISTEN")).unwrap();
    assert_eq!(listener.via(), Via::RdmaCm);
    let mut conn = listener
        .accept(Duration::from_secs(60), |ctx| side_setup(ctx, true))
        .unwrap();
    assert_eq!(conn.context().transport(), Transport::Iwarp);
    let client = conn.remote_regions()[0];
    let qp = conn.qp().clone();
    // The SENDs, in order (a queue pair's receives complete in the order they were posted).
    let want = expected(10);
    for (i, bytes) in want.iter().enumerate() {
        let c = wait(&conn.app().cq);
        assert_eq!(
            (c.status, c.opcode, c.wr_id),
            (WcStatus::Success, WcOpcode::Recv, i as u64),
            "{c:?}"
        );
        assert_eq!(c.byte_len as usize, bytes.len(), "SEND {i}");
        assert!(c.imm.is_none(), "siw carries no immediate data");
        let got = conn.app().mr.to_vec(i * SLOT..i * SLOT + bytes.len());
        assert!(
            got == *bytes,
            "SEND {i} of {} bytes arrived changed",
            bytes.len()
        );
    }
    // "check": the client's WRITEs are all in.
    let c = wait(&conn.app().cq);
    assert_eq!((c.status, c.wr_id), (WcStatus::Success, CHECK_SLOT as u64));
    let writes = expected(30);
    for (i, bytes) in writes.iter().enumerate() {
        let at = WRITES + i * SLOT;
        assert!(
            conn.app().mr.to_vec(at..at + bytes.len()) == *bytes,
            "WRITE {i} of {} bytes arrived changed",
            bytes.len()
        );
    }
    println!("server: {SENDS} SENDs and {} WRITEs verified", writes.len());
    // The passive side sends too, now that the initiator has.
    let answer = common::pattern(50, ANSWER_LEN);
    conn.app_mut().mr.write_at(0, &answer).unwrap();
    let target = client.slice(ANSWER as u64, ANSWER_LEN as u64).unwrap();
    let side = conn.app();
    scope(|s| {
        let src = [side.mr.slice(..ANSWER_LEN)];
        s.post_send(&qp, SendWr::write(1, &src, target)).unwrap();
        s.post_send(&qp, SendWr::send_inline(2, b"ok")).unwrap();
        for _ in 0..2 {
            assert_eq!(wait(&side.cq).status, WcStatus::Success);
        }
    });
    // The SEND WITH INVALIDATE: a receive like any other; libsiw reports no invalidated key
    // (its completions carry no flags), but the key is revoked (below).
    let c = wait(&conn.app().cq);
    assert_eq!(
        (c.status, c.opcode, c.wr_id, c.byte_len, c.invalidated_rkey),
        (WcStatus::Success, WcOpcode::Recv, INV_SLOT as u64, 0, None),
        "{c:?}"
    );
    println!("server: SEND WITH INVALIDATE arrived: {c:?}");
    // The client's WRITE into the revoked region was refused here: nothing landed, and the
    // connection goes down (siw terminates it).
    conn.wait_disconnected(WAIT).unwrap();
    let victim = conn.app().victim.as_ref().unwrap().to_vec(..);
    assert!(
        victim.iter().all(|b| *b == 0),
        "a WRITE landed in a revoked region"
    );
    println!("server: the revoked region is untouched; the client's connection is gone");
}

#[test]
#[ignore = "client role of tests/vm/siw.sh (ERDMA_CM_PEER)"]
fn iwarp_client_role() {
    let mut conn = connect_retrying(&env("ERDMA_CM_PEER"), |ctx| side_setup(ctx, false));
    assert_eq!(conn.via(), Via::RdmaCm);
    let (server, victim) = (conn.remote_regions()[0], conn.remote_regions()[1]);
    let qp = conn.qp().clone();
    let name = conn.context().name().to_string();
    let side = conn.app_mut();
    // SENDs of every size, inline, gathered.
    for (i, &n) in SIZES.iter().enumerate() {
        side.mr
            .write_at(SRC, &common::pattern(10 + i as u32, n))
            .unwrap();
        let src = [side.mr.slice(SRC..SRC + n)];
        let list: &[_] = if n == 0 { &[] } else { &src };
        run_one(&qp, &side.cq, SendWr::send(1, list), WcOpcode::Send);
    }
    run_one(
        &qp,
        &side.cq,
        SendWr::send_inline(2, &common::pattern(20, INLINE)),
        WcOpcode::Send,
    );
    side.mr
        .write_at(SRC, &common::pattern(21, 400_000))
        .unwrap();
    let pieces = gather(&side.mr);
    run_one(&qp, &side.cq, SendWr::send(3, &pieces), WcOpcode::Send);
    drop(pieces);
    println!("client: SENDs of {SIZES:?} bytes, {INLINE} inline and 6 gathered completed");

    // WRITEs of every size, each READ back into zeroed memory and compared.
    for (i, &n) in SIZES.iter().enumerate() {
        let bytes = common::pattern(30 + i as u32, n);
        side.mr.write_at(SRC, &bytes).unwrap();
        side.mr.fill(READS..READS + SLOT, 0);
        let target = server.slice((WRITES + i * SLOT) as u64, n as u64).unwrap();
        let src = [side.mr.slice(SRC..SRC + n)];
        let list: &[_] = if n == 0 { &[] } else { &src };
        run_one(
            &qp,
            &side.cq,
            SendWr::write(4, list, target),
            WcOpcode::RdmaWrite,
        );
        let dest = side.mr.slice_mut(READS..READS + n);
        run_one(
            &qp,
            &side.cq,
            SendWr::read(5, dest, target),
            WcOpcode::RdmaRead,
        );
        let back = side.mr.to_vec(READS..READS + n);
        assert!(back == bytes, "{n} bytes WRITTEN and READ back differ");
    }
    let inline = common::pattern(40, INLINE);
    let target = server
        .slice((WRITES + 6 * SLOT) as u64, INLINE as u64)
        .unwrap();
    run_one(
        &qp,
        &side.cq,
        SendWr::write_inline(6, &inline, target),
        WcOpcode::RdmaWrite,
    );
    side.mr
        .write_at(SRC, &common::pattern(41, 400_000))
        .unwrap();
    let pieces = gather(&side.mr);
    let total: usize = GATHER.iter().map(|g| g.1).sum();
    let target = server
        .slice((WRITES + 7 * SLOT) as u64, total as u64)
        .unwrap();
    run_one(
        &qp,
        &side.cq,
        SendWr::write(7, &pieces, target),
        WcOpcode::RdmaWrite,
    );
    drop(pieces);
    println!("client: WRITE + READ back of {SIZES:?} bytes, inline and gathered WRITEs done");

    // "check", with the receive for the server's "ok" posted first.
    scope(|s| {
        s.post_recv(
            &qp,
            RecvWr::new(9, side.mr.slice_mut(OK_RECV..OK_RECV + 64)),
        )
        .unwrap();
        s.post_send(&qp, SendWr::send_inline(8, b"check")).unwrap();
        let mut got: Vec<_> = (0..2).map(|_| wait(&side.cq)).collect();
        got.sort_by_key(|c| c.wr_id);
        assert!(got.iter().all(|c| c.status == WcStatus::Success), "{got:?}");
        assert_eq!((got[1].opcode, got[1].byte_len), (WcOpcode::Recv, 2));
    });
    assert_eq!(side.mr.to_vec(OK_RECV..OK_RECV + 2), b"ok");
    assert!(
        side.mr.to_vec(ANSWER..ANSWER + ANSWER_LEN) == common::pattern(50, ANSWER_LEN),
        "the server's WRITE arrived changed"
    );

    // What siw lacks, refused by the limits layer: nothing is posted, the queue pair stays up.
    let refused = |r: erdma::Result<()>, what: &str, cap: Capability| match r {
        Err(Error::MissingCapability { capability, device }) => {
            assert_eq!(
                (capability, device.as_str()),
                (cap, name.as_str()),
                "{what}"
            )
        }
        other => panic!("{what}: expected MissingCapability, got {other:?}"),
    };
    let target = server.slice(WRITES as u64, 8).unwrap();
    refused(
        qp.post_send(SendWr::write_inline(10, b"x", target).with_imm(7)),
        "WRITE WITH IMM",
        Capability::ImmediateData,
    );
    refused(
        qp.post_send(SendWr::send_inline(11, b"x").with_imm(7)),
        "SEND WITH IMM",
        Capability::ImmediateData,
    );
    scope(|s| {
        let (a, b) = side.mr.slice_mut(READS..READS + 16).split_at(8);
        refused(
            s.post_send(&qp, SendWr::compare_swap(12, a, target, 0, 1)),
            "compare-and-swap",
            Capability::Atomics,
        );
        refused(
            s.post_send(&qp, SendWr::fetch_add(13, b, target, 1)),
            "fetch-and-add",
            Capability::Atomics,
        );
    });
    // A READ lands in one SGE on iWARP (siw's max_sge_rd): two are refused by the limit.
    let sges = [
        erdma::Sge {
            addr: side.mr.addr() + READS as u64,
            length: 4,
            lkey: side.mr.lkey(),
        },
        erdma::Sge {
            addr: side.mr.addr() + READS as u64 + 4,
            length: 4,
            lkey: side.mr.lkey(),
        },
    ];
    let mut read2 = erdma::RawSendWr::new(15, erdma::WrOpcode::RdmaRead, &sges);
    read2.remote = target;
    // The SGEs lie inside the client's region, which outlives the queue pair's use of it; the
    // SDK refuses the request before anything is posted anyway.
    // SAFETY: as above.
    match unsafe { qp.post_send_raw(std::slice::from_ref(&read2)) } {
        Err(Error::LimitExceeded {
            limit: Limit::MaxSgeRd,
            requested: 2,
            max: 1,
        }) => {}
        other => panic!("a two-SGE READ: {other:?}"),
    }
    let mut none = [erdma::Completion::default(); 4];
    assert_eq!(
        side.cq.poll(&mut none).unwrap(),
        0,
        "a refused request completed"
    );
    // The queue pair is fine: a READ of the one-byte WRITE still works.
    side.mr.fill(READS..READS + 1, 0);
    scope(|s| {
        let dest = side.mr.slice_mut(READS..READS + 1);
        let one = server.slice((WRITES + SLOT) as u64, 1).unwrap();
        s.post_send(&qp, SendWr::read(16, dest, one)).unwrap();
        assert_eq!(wait(&side.cq).status, WcStatus::Success);
    });
    assert_eq!(side.mr.to_vec(READS..READS + 1), common::pattern(31, 1));
    println!("client: immediate data, atomics and a two-SGE READ refused up front");

    // SEND WITH INVALIDATE of the server's second region, then a WRITE into it: siw revokes
    // the key at the peer, so the WRITE is refused there and nothing lands.
    run_one(
        &qp,
        &side.cq,
        SendWr::send_with_invalidate(17, &[], victim.rkey),
        WcOpcode::Send,
    );
    // The WRITE and a READ after it, in one chain: both are in the send queue before the
    // peer's answer can arrive (siw flushes what its queue holds when the connection fails).
    let bad = [0xee; 8];
    let (w, r) = scope(|s| {
        let dest = side.mr.slice_mut(READS..READS + 8);
        let write = SendWr::write_inline(18, &bad, victim.slice(0, 8).unwrap());
        let read = SendWr::read(19, dest, server.slice(0, 8).unwrap());
        s.post_send_batch(&qp, [write, read]).unwrap();
        (wait(&side.cq), wait(&side.cq))
    });
    // An iWARP WRITE completes once it is sent: its success says nothing of the peer's
    // placement (RoCE's completes on the peer's acknowledgement). The peer refuses the revoked
    // key and terminates the connection; the READ behind the WRITE is flushed.
    assert_eq!((w.wr_id, w.status), (18, WcStatus::Success), "{w:?}");
    assert_eq!((r.wr_id, r.status), (19, WcStatus::WrFlushErr), "{r:?}");
    println!(
        "client: the WRITE into the revoked region completed as sent; the READ after it was flushed"
    );
    conn.wait_disconnected(WAIT).unwrap();
    println!("client: disconnected");
}

/// Connects to `peer`, retrying while nobody listens there yet.
fn connect_retrying<T>(
    peer: &str,
    setup: impl Fn(&Context) -> erdma::Result<Setup<T>>,
) -> Connection<T> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match cm::connect(peer, WAIT, &setup) {
            Ok(c) => return c,
            Err(Error::Refused { reason, .. })
                if reason.contains("nobody is listening") && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => panic!("connecting to {peer}: {e}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Private data at the iWARP limit.

/// User bytes that make a [`erdma::connect::PeerInfo`] of `total` bytes (no regions).
fn user_for(total: usize, seed: u32) -> Vec<u8> {
    let user = common::pattern(seed, total - 20);
    let info = erdma::connect::PeerInfo {
        user: user.clone(),
        ..Default::default()
    };
    assert_eq!(info.encode().unwrap().len(), total);
    user
}

fn tiny_with(user: Vec<u8>) -> impl FnOnce(&Context) -> erdma::Result<Setup<Cq>> {
    move |ctx| {
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(16)?;
        Ok(Setup::new(&pd, QpConfig::new(&cq))
            .access(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)
            .user_data(user)
            .with(cq))
    }
}

/// How the SDK's refusal names the limit.
fn limit_text() -> String {
    format!("{} bytes", cm::IWARP_PRIVATE_DATA)
}

#[test]
#[ignore = "private-data server of tests/vm/siw.sh (ERDMA_CM_LISTEN)"]
fn iwarp_private_server_role() {
    let listener = cm::Listener::bind(env("ERDMA_CM_LISTEN")).unwrap();
    // The requests, in the order they must come: the one-byte-over one the client tries between
    // the first two never leaves it.
    let at_limit = user_for(cm::IWARP_PRIVATE_DATA, 50);
    let conn = listener.accept(WAIT, tiny_with(Vec::new())).unwrap();
    assert_eq!(
        conn.peer().user,
        at_limit,
        "the request at the limit arrived changed"
    );
    conn.wait_disconnected(WAIT).unwrap();
    println!(
        "server: a request of {} bytes arrived intact",
        cm::IWARP_PRIVATE_DATA
    );
    // An accept at the limit.
    let conn = listener
        .accept(WAIT, tiny_with(user_for(cm::IWARP_PRIVATE_DATA, 52)))
        .unwrap();
    assert_eq!(conn.peer().user, b"accept-at-limit");
    conn.wait_disconnected(WAIT).unwrap();
    // One byte over in the accept: refused here, before the kernel; the client is rejected
    // with the reason.
    let e = listener
        .accept(WAIT, tiny_with(user_for(cm::IWARP_PRIVATE_DATA + 1, 53)))
        .unwrap_err();
    println!("server: an accept one byte over refused: {e}");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains(&limit_text()), "{e}");
}

#[test]
#[ignore = "private-data client of tests/vm/siw.sh (ERDMA_CM_PEER)"]
fn iwarp_private_client_role() {
    let peer = env("ERDMA_CM_PEER");
    let conn = connect_retrying(&peer, |ctx| {
        tiny_with(user_for(cm::IWARP_PRIVATE_DATA, 50))(ctx)
    });
    conn.disconnect(WAIT).unwrap();
    // One byte over: refused before rdma_connect (the server sees the next request next).
    let t0 = Instant::now();
    let e = cm::connect(
        peer.as_str(),
        WAIT,
        tiny_with(user_for(cm::IWARP_PRIVATE_DATA + 1, 51)),
    )
    .unwrap_err();
    println!(
        "client: a request one byte over refused in {:?}: {e}",
        t0.elapsed()
    );
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(e.to_string().contains(&limit_text()), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    // The accept at the limit comes back whole.
    let conn = cm::connect(peer.as_str(), WAIT, tiny_with(b"accept-at-limit".to_vec())).unwrap();
    assert_eq!(conn.peer().user, user_for(cm::IWARP_PRIVATE_DATA, 52));
    conn.disconnect(WAIT).unwrap();
    println!(
        "client: an accept of {} bytes arrived intact",
        cm::IWARP_PRIVATE_DATA
    );
    // One byte over in the accept: the server refuses to accept, and rejects with why.
    let e = cm::connect(peer.as_str(), WAIT, tiny_with(b"accept-over".to_vec())).unwrap_err();
    println!("client: {e}");
    match &e {
        Error::Refused { reason, .. } => {
            assert!(
                reason.contains("MPA reject") && reason.contains(&limit_text()),
                "{e}"
            )
        }
        other => panic!("expected a refusal, got {other}"),
    }
}

#[test]
#[ignore = "listener of tests/vm/siw.sh's librdmacm check (ERDMA_CM_LISTEN)"]
fn iwarp_raw_server_role() {
    let listener = cm::Listener::bind(env("ERDMA_CM_LISTEN")).unwrap();
    // Only the request at the limit reaches the application: siw refuses the longer one first.
    let conn = listener
        .accept(Duration::from_secs(60), tiny_with(Vec::new()))
        .unwrap();
    assert_eq!(conn.peer().user, raw_private(cm::IWARP_PRIVATE_DATA));
    conn.wait_disconnected(WAIT).unwrap();
    println!("server: only the raw request at the limit arrived, intact");
}

/// Private data the raw client sends: no SDK header, so the listener keeps it as user data.
fn raw_private(len: usize) -> Vec<u8> {
    let mut v = common::pattern(60, len);
    v[0] = b'-';
    v
}

/// The kernel's own limit, without the SDK's check: librdmacm connects to
/// `iwarp_raw_server_role` with one byte more than the limit (the listener never sees it), then
/// with the limit.
#[test]
#[ignore = "librdmacm check of tests/vm/siw.sh (ERDMA_CM_PEER)"]
fn iwarp_wire_limit_role() {
    let peer: std::net::SocketAddr = env("ERDMA_CM_PEER").parse().unwrap();
    // The listener may not listen yet: a refused TCP connection fails rdma_connect itself.
    let deadline = Instant::now() + Duration::from_secs(60);
    let over = loop {
        match raw::connect(peer, &raw_private(cm::IWARP_PRIVATE_DATA + 1)) {
            Err(e) if e.contains("ECONNREFUSED") && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200))
            }
            r => break r,
        }
    };
    println!("raw client: {} bytes: {over:?}", cm::IWARP_PRIVATE_DATA + 1);
    // siw sends the request announcing no private data (its one-byte length wrapped), and the
    // peer answers with an MPA reject.
    assert_eq!(over.unwrap(), "RDMA_CM_EVENT_REJECTED (status -104)");
    let at = raw::connect(peer, &raw_private(cm::IWARP_PRIVATE_DATA)).unwrap();
    println!("raw client: {} bytes: {at}", cm::IWARP_PRIVATE_DATA);
    assert_eq!(at, "RDMA_CM_EVENT_ESTABLISHED");
}

#[path = "iwarp/raw.rs"]
mod raw;

// ---------------------------------------------------------------------------------------------
// A peer that vanishes.

#[test]
#[ignore = "server of tests/vm/siw.sh that exits without disconnecting (ERDMA_CM_LISTEN)"]
fn iwarp_vanishing_server_role() {
    let listener = cm::Listener::bind(env("ERDMA_CM_LISTEN")).unwrap();
    let _conn = listener
        .accept(Duration::from_secs(60), |ctx| {
            let pd = ctx.alloc_pd()?;
            let cq = ctx.create_cq(16)?;
            Ok(Setup::new(&pd, QpConfig::new(&cq))
                .access(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)
                .with(cq))
        })
        .unwrap();
    println!("server: exiting without a disconnect");
    // No destructor runs: the kernel tears the connection down with the process.
    std::process::exit(0);
}

#[test]
#[ignore = "client of iwarp_vanishing_server_role (ERDMA_CM_PEER)"]
fn iwarp_abandoned_client_role() {
    // The receives are posted before the connection exists, so the peer may leave at once.
    let conn = connect_retrying(&env("ERDMA_CM_PEER"), |ctx| {
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(16)?;
        let mr = pd.alloc(4096, Access::LOCAL_WRITE)?;
        let recvs = common::prepost(&mr, &[(1, 0, 64), (2, 64, 64)]);
        Ok(Setup::new(&pd, QpConfig::new(&cq))
            .access(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)
            .on_init(recvs)
            .with((cq, mr)))
    });
    let cq = &conn.app().0;
    // Both receives end with a flush once the peer's process is gone, in bounded time.
    let t0 = Instant::now();
    let mut flushed = Vec::new();
    for _ in 0..2 {
        let c = cq.wait_one(Duration::from_secs(20)).unwrap();
        assert_eq!(c.status, WcStatus::WrFlushErr, "{c:?}");
        flushed.push(c.wr_id);
    }
    flushed.sort_unstable();
    assert_eq!(flushed, [1, 2]);
    println!(
        "client: both receives flushed {:?} after the connection",
        t0.elapsed()
    );
    conn.wait_disconnected(WAIT).unwrap();
    // siw does not report the state; the SDK says so rather than answer RESET.
    assert!(matches!(
        conn.qp().state(),
        Err(Error::MissingCapability {
            capability: Capability::QpStateQuery,
            ..
        })
    ));
    // A SEND now would stay in siw's queue without a completion: the SDK, having seen the
    // flushes, refuses it.
    let r = conn.qp().post_send(SendWr::send_inline(4, b"late"));
    println!("client: a SEND after the peer left: {r:?}");
    assert!(
        matches!(r, Err(Error::QpInError { qp_num, .. }) if qp_num == conn.qp().qp_num()),
        "{r:?}"
    );
}

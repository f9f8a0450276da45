//! The ring AllReduce across ranks on soft devices over loopback: every element type, both
//! operators, 2 to 8 ranks, sizes from one element up (including sizes that divide evenly by
//! nothing: ranks, queue pairs, chunk), each result checked element by element against a
//! locally computed reference; and a rank killed mid-collective makes the others fail with a
//! clear error in bounded time.
//!
//! Ranks run as threads of this process (each on its own soft device), except in the kill
//! test, where they are processes: this binary re-run with the `#[ignore]`d `rank_process`
//! entry point. Large sizes (up to 64 MiB) are in the `#[ignore]`d `large_sizes`, which the
//! benchmark script runs in release mode.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use erdma::Context;
use erdma::collective::{
    Bootstrap, Communicator, DType, MasterSocket, RankInfo, ReduceOp, RingConfig,
};

const BOOT: Duration = Duration::from_secs(60);

/// One test job: a fresh block of loopback addresses (127.77.<n>.1..) for its soft devices, so
/// tests running in parallel (and other programs using 127.0.0.x) never share a soft device,
/// and rank 0's socket, listening on a port the system picked before any rank starts, so no
/// other connection or job can take the port in between.
#[derive(Clone)]
struct Job {
    block: u16,
    port: u16,
    master: Arc<Mutex<Option<TcpListener>>>,
}

/// A fresh block of loopback addresses (see [`Job`]).
fn fresh_block() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    ((std::process::id() as u16 % 100) * 2 + n) % 250 + 1
}

fn fresh_job() -> Job {
    let master = TcpListener::bind("127.0.0.1:0").expect("a listening socket");
    Job {
        block: fresh_block(),
        port: master.local_addr().unwrap().port(),
        master: Arc::new(Mutex::new(Some(master))),
    }
}

impl Job {
    /// Bootstraps `rank` of `world`: rank 0 hosts on the job's socket, the others dial it.
    fn boot(&self, rank: usize, world: usize) -> erdma::Result<Bootstrap> {
        if rank == 0 {
            let l = self
                .master
                .lock()
                .unwrap()
                .take()
                .expect("one rank 0 per job");
            Bootstrap::host(l, world, BOOT)
        } else {
            let info = RankInfo {
                rank,
                world,
                master: format!("127.0.0.1:{}", self.port),
            };
            Bootstrap::join(info, BOOT)
        }
    }
}

fn device(block: u16, rank: usize) -> String {
    format!("soft:127.77.{block}.{}", rank + 1)
}

/// The input of `rank` at element `i`: small integers, so that every sum of up to 32 ranks is
/// exact in every type and the check can demand bit equality.
fn input(rank: usize, i: usize, salt: usize) -> f64 {
    ((i * 7 + rank * 13 + salt * 5) % 17) as f64 - 8.0
}

fn expected(world: usize, i: usize, salt: usize, op: ReduceOp) -> f64 {
    let vals = (0..world).map(|r| input(r, i, salt));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Max => vals.fold(f64::MIN, f64::max),
    }
}

fn fill(buf: &mut [u8], rank: usize, count: usize, t: DType, salt: usize) {
    for i in 0..count {
        t.encode(input(rank, i, salt), &mut buf[i * t.size()..]);
    }
}

/// Elements that differ from the reference, bit for bit.
fn wrong(buf: &[u8], world: usize, count: usize, t: DType, op: ReduceOp, salt: usize) -> usize {
    let mut e = vec![0u8; t.size()];
    (0..count)
        .filter(|&i| {
            t.encode(expected(world, i, salt, op), &mut e);
            buf[i * t.size()..(i + 1) * t.size()] != e[..]
        })
        .count()
}

/// One AllReduce case: a count, a type, an operator.
#[derive(Clone, Copy, Debug)]
struct Case {
    count: usize,
    dtype: DType,
    op: ReduceOp,
}

/// Runs every case on `world` ranks (threads), returning the wrong elements per case.
/// Joins rank `rank` of a `world`-rank job on its soft device and builds its communicator.
fn join(job: &Job, rank: usize, world: usize, cfg: RingConfig) -> erdma::Result<Communicator> {
    let ctx = Context::open(&device(job.block, rank))?;
    let mut boot = job.boot(rank, world)?;
    Communicator::new(&ctx, &mut boot, cfg)
}

fn run_ring(world: usize, cfg: RingConfig, cases: &[Case]) -> Vec<usize> {
    let job = fresh_job();
    let cases = cases.to_vec();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let cfg = cfg.clone();
            let cases = cases.clone();
            let job = job.clone();
            std::thread::spawn(move || -> erdma::Result<Vec<usize>> {
                let mut comm = join(&job, rank, world, cfg)?;
                let mut out = Vec::new();
                for (salt, c) in cases.iter().enumerate() {
                    fill(comm.buffer_mut(), rank, c.count, c.dtype, salt);
                    comm.all_reduce_in_place(c.count, c.dtype, c.op)?;
                    out.push(wrong(comm.buffer(), world, c.count, c.dtype, c.op, salt));
                }
                Ok(out)
            })
        })
        .collect();
    let mut total = vec![0; cases.len()];
    for (rank, h) in handles.into_iter().enumerate() {
        let w = h
            .join()
            .expect("rank thread panicked")
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        for (t, x) in total.iter_mut().zip(w) {
            *t += x;
        }
    }
    total
}

fn small_config(qps: usize, chunk: usize) -> RingConfig {
    RingConfig {
        qps_per_connection: qps,
        chunk_bytes: chunk,
        slots: 2,
        max_bytes: 1 << 20,
        timeout: Duration::from_secs(30),
        ..RingConfig::default()
    }
}

fn assert_all_right(world: usize, cases: &[Case], wrong: &[usize]) {
    for (c, w) in cases.iter().zip(wrong) {
        assert_eq!(*w, 0, "{world} ranks, {c:?}: {w} wrong elements");
    }
}

#[test]
fn every_type_and_operator_on_three_ranks() {
    // 3 ranks x 3 queue pairs x 4 KiB chunks: these counts split unevenly everywhere.
    let counts = [1, 2, 3, 1000, 3 * 3 * 1024 + 1, 40_000];
    let mut cases = Vec::new();
    for dtype in DType::ALL {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            for &count in &counts {
                cases.push(Case { count, dtype, op });
            }
        }
    }
    let w = run_ring(3, small_config(3, 4096), &cases);
    assert_all_right(3, &cases, &w);
}

#[test]
fn two_to_eight_ranks() {
    for world in 2..=8 {
        let cases: Vec<Case> = [1, world - 1, world * 8 * 1024 + 3, 100_003]
            .iter()
            .map(|&count| Case {
                count,
                dtype: if world % 2 == 0 {
                    DType::F32
                } else {
                    DType::Bf16
                },
                op: ReduceOp::Sum,
            })
            .collect();
        let w = run_ring(world, small_config(2, 4096), &cases);
        assert_all_right(world, &cases, &w);
    }
}

#[test]
fn default_configuration_one_mebibyte() {
    // Eight queue pairs per link, default chunks and slots; many calls in a row, so the call
    // parity and slot rotation wrap around.
    let cases: Vec<Case> = (0..6)
        .map(|i| Case {
            count: (1 << 18) - i * 77,
            dtype: DType::F32,
            op: if i % 2 == 0 {
                ReduceOp::Sum
            } else {
                ReduceOp::Max
            },
        })
        .collect();
    let cfg = RingConfig {
        max_bytes: 1 << 20,
        ..RingConfig::default()
    };
    let w = run_ring(4, cfg, &cases);
    assert_all_right(4, &cases, &w);
}

#[test]
fn chunk_floor_and_window() {
    // A floor of 3 chunks' worth per segment on 4 queue pairs (so steps use 1-3 of them, in
    // rotation), and windows of one chunk, two chunks and less than a chunk: the sender must
    // hold chunks back yet deliver every one, in every step, across several calls.
    let cases: Vec<Case> = [5 * 4096 + 7, 3 * 4096, 1, 40_000, 3 * 4 * 1024 * 4 + 1]
        .iter()
        .enumerate()
        .map(|(i, &count)| Case {
            count,
            dtype: if i % 2 == 0 { DType::F32 } else { DType::F16 },
            op: ReduceOp::Sum,
        })
        .collect();
    for window in [8192, 2 * 8192, 100] {
        let cfg = RingConfig {
            min_chunk_bytes: 3 * 4096,
            window_bytes: window,
            ..small_config(4, 8192)
        };
        let w = run_ring(3, cfg, &cases);
        assert_all_right(3, &cases, &w);
    }
}

#[test]
fn one_rank_and_misuse() {
    let cases = [Case {
        count: 10,
        dtype: DType::I32,
        op: ReduceOp::Sum,
    }];
    assert_all_right(1, &cases, &run_ring(1, small_config(2, 4096), &cases));

    let job = fresh_job();
    let ctx = Context::open(&device(job.block, 0)).unwrap();
    let mut boot = job.boot(0, 1).unwrap();
    let mut comm = Communicator::new(&ctx, &mut boot, small_config(2, 4096)).unwrap();
    let e = comm
        .all_reduce_in_place((1 << 20) / 4 + 1, DType::F32, ReduceOp::Sum)
        .unwrap_err();
    assert!(e.to_string().contains("capacity"), "{e}");
    let mut odd = vec![0u8; 6];
    let e = comm
        .all_reduce(&mut odd, DType::F32, ReduceOp::Sum)
        .unwrap_err();
    assert!(e.to_string().contains("whole float elements"), "{e}");
    let bad = RingConfig {
        qps_per_connection: 0,
        ..small_config(2, 4096)
    };
    assert!(Communicator::new(&ctx, &mut boot, bad).is_err());

    // Page-locking the host buffer for GPU copies: without a CUDA driver, a GPU error that
    // says so; the communicator still works.
    let pinned = comm.pin_for_gpu(0);
    match erdma::gpu::device_count() {
        Ok(n) if n > 0 => assert!(pinned.is_ok(), "{pinned:?}"),
        _ => {
            let e = pinned.unwrap_err();
            assert!(matches!(e, erdma::Error::Gpu { .. }), "{e:?}");
            assert!(e.to_string().contains("could not be page-locked"), "{e}");
        }
    }
    let mut v: Vec<u8> = (0..10i32).flat_map(|i| (i * 3 - 7).to_ne_bytes()).collect();
    let want = v.clone();
    comm.all_reduce(&mut v, DType::I32, ReduceOp::Sum).unwrap();
    assert_eq!(v, want, "one rank's sum is its own input");
}

/// Runs two ranks, each with its own configuration and call; returns what each got.
fn two_ranks_disagreeing(cfgs: [RingConfig; 2], counts: [usize; 2]) -> Vec<erdma::Result<()>> {
    let job = fresh_job();
    let handles: Vec<_> = cfgs
        .into_iter()
        .zip(counts)
        .enumerate()
        .map(|(rank, (cfg, count))| {
            let job = job.clone();
            std::thread::spawn(move || -> erdma::Result<()> {
                join(&job, rank, 2, cfg)?.all_reduce_in_place(count, DType::F32, ReduceOp::Sum)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

#[test]
fn ranks_that_disagree_fail_with_a_clear_error() {
    // Another chunk floor on one rank: both refuse to build the ring, naming the cause.
    let other_floor = RingConfig {
        min_chunk_bytes: 8192,
        ..small_config(2, 16384)
    };
    let got = two_ranks_disagreeing([small_config(2, 16384), other_floor], [100, 100]);
    for (rank, r) in got.iter().enumerate() {
        let e = r.as_ref().expect_err("a ring of mismatched configurations");
        assert!(
            e.to_string().contains("another ring configuration"),
            "rank {rank}: {e}"
        );
    }
    // Different counts: the chunks do not match what the receiver expects. Every rank fails
    // within its timeout (none hangs) and at least one says why.
    let cfg = RingConfig {
        timeout: Duration::from_secs(5),
        ..small_config(2, 4096)
    };
    let started = std::time::Instant::now();
    let got = two_ranks_disagreeing([cfg.clone(), cfg], [3000, 7000]);
    assert!(started.elapsed() < Duration::from_secs(30));
    let errors: Vec<String> = got
        .iter()
        .map(|r| {
            r.as_ref()
                .expect_err("a call with mismatched counts")
                .to_string()
        })
        .collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("do all ranks reduce the same count and type?")),
        "{errors:?}"
    );
}

#[test]
fn staged_buffers_reduce_like_in_place() {
    let job = fresh_job();
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let job = job.clone();
            std::thread::spawn(move || -> erdma::Result<usize> {
                let mut comm = join(&job, rank, 2, small_config(2, 4096))?;
                let count = 12_345;
                let mut data = vec![0u8; count * 2];
                fill(&mut data, rank, count, DType::F16, 9);
                comm.all_reduce(&mut data, DType::F16, ReduceOp::Sum)?;
                Ok(wrong(&data, 2, count, DType::F16, ReduceOp::Sum, 9))
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap().unwrap(), 0);
    }
}

#[test]
#[ignore = "large sizes; run in release by bench/scripts/allreduce-mpi"]
fn large_sizes() {
    let cases: Vec<Case> = [(16 << 20) / 4 + 5, (64 << 20) / 4]
        .iter()
        .flat_map(|&count| {
            [DType::F32, DType::Bf16].map(|dtype| Case {
                count: count * 4 / dtype.size() - 1,
                dtype,
                op: ReduceOp::Sum,
            })
        })
        .collect();
    let cfg = RingConfig {
        max_bytes: 64 << 20,
        timeout: Duration::from_secs(120),
        ..RingConfig::default()
    };
    let w = run_ring(4, cfg, &cases);
    assert_all_right(4, &cases, &w);
}

/// One rank of the kill test: reduces 64 KiB forever, printing a line per call.
#[test]
#[ignore = "entry point of the rank processes spawned by `a_killed_rank_fails_the_others`"]
fn rank_process() {
    let block: u16 = std::env::var("ALLREDUCE_TEST_BLOCK")
        .unwrap()
        .parse()
        .unwrap();
    let rank = RankInfo::from_env().unwrap().rank;
    let ctx = Context::open(&device(block, rank)).unwrap();
    // Rank 0 hosts on the socket the test handed it.
    let mut boot = Bootstrap::from_env(BOOT).unwrap();
    // The defaults' transport timers (a dead neighbour is noticed in ~2 s); a rank further
    // away gives up after 15 s without progress. Not shorter: this debug build shares the
    // cores with the other tests' rings.
    let cfg = RingConfig {
        timeout: Duration::from_secs(15),
        ..small_config(2, 4096)
    };
    let mut comm = Communicator::new(&ctx, &mut boot, cfg).unwrap();
    for call in 0.. {
        if let Err(e) = comm.all_reduce_in_place(16 << 10, DType::F32, ReduceOp::Sum) {
            eprintln!("rank {rank} failed: {e}");
            std::process::exit(3);
        }
        println!("call {call}");
    }
}

#[test]
fn a_killed_rank_fails_the_others() {
    let world = 4;
    let block = fresh_block();
    // Rank 0's socket, bound here and inherited by rank 0's process.
    let master = MasterSocket::bind("0.0.0.0:0").unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.args(["--exact", "rank_process", "--ignored", "--nocapture"])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", master.port().to_string())
                .env("ALLREDUCE_TEST_BLOCK", block.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if rank == 0 {
                master.pass_to(&mut cmd).unwrap();
            }
            cmd.spawn().unwrap()
        })
        .collect();
    // Wait until every rank has finished a few calls: the ring is running.
    let mut readers: Vec<_> = children
        .iter_mut()
        .map(|c| BufReader::new(c.stdout.take().unwrap()))
        .collect();
    for (rank, r) in readers.iter_mut().enumerate() {
        let mut line = String::new();
        loop {
            line.clear();
            let n = r.read_line(&mut line).unwrap();
            if n == 0 {
                let mut err = String::new();
                let c = &mut children[rank];
                let _ = c.wait();
                let _ = std::io::Read::read_to_string(c.stderr.as_mut().unwrap(), &mut err);
                for c in &mut children {
                    let _ = c.kill();
                }
                panic!("rank {rank} stopped before the ring ran:\n{err}");
            }
            if line.starts_with("call 3") {
                break;
            }
        }
    }
    // Held until now: rank 0 could not have listened on the port itself.
    drop(master);
    let victim = 2;
    children[victim].kill().unwrap();
    let killed_at = Instant::now();
    let _ = children[victim].wait();
    // Keep draining stdout so no survivor blocks on a full pipe.
    let drains: Vec<_> = readers
        .into_iter()
        .map(|mut r| {
            std::thread::spawn(move || {
                let mut sink = String::new();
                while r.read_line(&mut sink).unwrap_or(0) > 0 {
                    sink.clear();
                }
            })
        })
        .collect();
    let limit = Duration::from_secs(60);
    for (rank, child) in children.iter_mut().enumerate() {
        if rank == victim {
            continue;
        }
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if killed_at.elapsed() > limit {
                let _ = child.kill();
                panic!("rank {rank} still runs {limit:?} after rank {victim} was killed");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert_eq!(
            status.code(),
            Some(3),
            "rank {rank}: {status}; stderr:\n{err}"
        );
        assert!(
            err.contains(&format!("rank {rank} failed: ")) && err.contains("rank "),
            "rank {rank} gave no clear error:\n{err}"
        );
        let msg = err.lines().find(|l| l.contains("failed:")).unwrap_or("");
        assert!(
            msg.contains("gone") || msg.contains("failed earlier") || msg.contains("stuck"),
            "rank {rank}: unclear error: {msg}"
        );
    }
    for d in drains {
        let _ = d.join();
    }
}

/// The credit-based channel on its own: credits bound what is posted, messages land in their
/// slots in order (or where the receiver granted), credits come back, and broken order or
/// bookkeeping is a protocol error.
#[test]
fn channel_credits_slots_and_errors() {
    use erdma::collective::channel::{Message, Receiver, Sender, Target};
    use erdma::{Access, Completion, InitOptions, QpConfig, Sge, WcOpcode};

    const TAG: u64 = 7 << 32;
    const SLOT: usize = 256;
    let block = fresh_block();
    let a = Context::open(&device(block, 0)).unwrap();
    let b = Context::open(&device(block, 1)).unwrap();
    let (pa, pb) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    let (ca, cb) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
    let mut src = pa.alloc(4096, Access::LOCAL_WRITE).unwrap();
    let staging = pb.alloc(2 * 2 * SLOT, Access::ALL).unwrap();
    let granted = pb.alloc(4096, Access::ALL).unwrap();
    let init = InitOptions {
        access: Access::ALL,
        ..InitOptions::default()
    };
    let mut qa = Vec::new();
    let mut qb = Vec::new();
    for _ in 0..2 {
        let x = pa
            .create_qp(&QpConfig::new(&ca))
            .unwrap()
            .init(&init)
            .unwrap();
        let y = pb
            .create_qp(&QpConfig::new(&cb))
            .unwrap()
            .init(&init)
            .unwrap();
        let (ex, ey) = (x.endpoint().unwrap(), y.endpoint().unwrap());
        qa.push(x.connect(&ey, &Default::default()).unwrap());
        qb.push(y.connect(&ex, &Default::default()).unwrap());
    }
    let mut tx = Sender::new(qa, 2, SLOT, staging.remote(), TAG).unwrap();
    let mut rx = Receiver::new(qb, 2, SLOT, TAG).unwrap();
    for (i, byte) in src.as_mut_slice().iter_mut().enumerate() {
        *byte = i as u8;
    }
    let sge = |off: u64, len: u32| Sge {
        addr: src.addr() + off,
        length: len,
        lkey: src.lkey(),
    };
    let msg = |off: u64, user: u32| Message {
        local: sge(off, 100),
        target: Target::Slot,
        user,
    };
    let wait = |cq: &erdma::Cq| cq.wait_one(Duration::from_secs(10)).unwrap().ok().unwrap();

    // Two credits on queue pair 1: only two of three messages go.
    let three = [msg(0, 10), msg(100, 11), msg(200, 12)];
    // `src` is not written until the credits of these messages are back (checked below).
    // SAFETY: `src` outlives the channel's use of it.
    assert_eq!(unsafe { tx.post(1, &three) }.unwrap(), 2);
    assert_eq!(tx.credits(1), 0);
    assert_eq!(tx.in_flight(), 2);
    // SAFETY: as above.
    assert_eq!(unsafe { tx.post(1, &three[2..]) }.unwrap(), 0);
    for expect in 0..2 {
        let wc = wait(&cb);
        assert_eq!(wc.wr_id, TAG | 1);
        let got = rx.arrival(1, &wc).unwrap();
        assert_eq!(
            (got.q, got.slot, got.user, got.len),
            (1, expect, 10 + expect as u32, 100)
        );
        let at = got.slot_offset;
        assert_eq!(at, (2 + expect) * SLOT);
        assert_eq!(
            &staging.to_vec(at..at + 100),
            &src.to_vec(expect * 100..expect * 100 + 100)
        );
        // Taken in order: consumed before the next one is checked.
        rx.consume(&got).unwrap();
    }
    // The credits of both travel back in one message.
    assert!(rx.owes_credits());
    rx.flush_credits().unwrap();
    assert!(!rx.owes_credits());
    let wc = wait(&ca);
    assert_eq!(wc.opcode, WcOpcode::Recv);
    tx.on_credit(1, &wc).unwrap();
    assert!(tx.all_credits_back());

    // Messages on both queue pairs: their credits come back packed in one message, on the
    // lowest queue pair they credit, and nothing else arrives.
    // SAFETY: as above.
    assert_eq!(unsafe { tx.post(0, &[msg(0, 20)]) }.unwrap(), 1);
    let two = [msg(100, 21), msg(200, 22)];
    // SAFETY: as above.
    assert_eq!(unsafe { tx.post(1, &two) }.unwrap(), 2);
    assert_eq!((tx.credits(0), tx.credits(1)), (1, 0));
    let mut next_slot = [0usize, 0];
    let mut slot_of = |q: usize| {
        let s = next_slot[q];
        next_slot[q] = (s + 1) % 2;
        s
    };
    for _ in 0..3 {
        let wc = wait(&cb);
        let q = (wc.wr_id & 0xffff_ffff) as usize;
        let got = rx.arrival(q, &wc).unwrap();
        assert_eq!(got.slot, slot_of(q));
        rx.consume(&got).unwrap();
    }
    rx.flush_credits().unwrap();
    let wc = wait(&ca);
    assert_eq!(wc.wr_id, TAG);
    // A packed credit's right placement is on queue pair 0; elsewhere it is refused.
    assert!(
        tx.on_credit(1, &wc)
            .unwrap_err()
            .to_string()
            .contains("lowest")
    );
    tx.on_credit(0, &wc).unwrap();
    assert!(tx.all_credits_back());
    assert!(
        ca.poll_one().unwrap().is_none(),
        "one credit message for both"
    );
    // Packed counts for a queue pair the channel lacks, or beyond the slots: refused.
    let mut forged = wc;
    forged.imm = Some(3 << 30 | 1 << 4);
    assert!(tx.on_credit(0, &forged).is_err());
    forged.imm = Some(3 << 30 | 1 | 1 << 2);
    assert!(tx.on_credit(0, &forged).is_err());

    // A message to a granted place keeps the slot rotation going (slot 0 again).
    let direct = Message {
        local: sge(300, 64),
        target: Target::Remote(granted.remote().slice(1000, 64).unwrap()),
        user: 0x7f_ffff,
    };
    // SAFETY: as above.
    assert_eq!(unsafe { tx.post(1, &[direct]) }.unwrap(), 1);
    let wc = wait(&cb);
    let got = rx.arrival(1, &wc).unwrap();
    assert_eq!((got.slot, got.user, got.len), (0, 0x7f_ffff, 64));
    assert_eq!(&granted.to_vec(1000..1064), &src.to_vec(300..364));

    // Out of order, not a message, too many credits, too many user bits: all refused.
    let mut bad = wc;
    bad.imm = Some(1 << 8 | 1); // slot 1 where slot 0 is next (not consumed yet)
    assert!(
        rx.arrival(1, &bad)
            .unwrap_err()
            .to_string()
            .contains("slot 1")
    );
    let mut credit = Completion::default();
    credit.opcode = WcOpcode::Recv;
    credit.imm = Some(1 << 31 | 5);
    assert!(tx.on_credit(1, &credit).is_err());
    assert!(rx.arrival(1, &credit).is_err());
    // A queue pair the channel lacks: an error, not an index out of bounds.
    let e = rx.arrival(2, &wc).unwrap_err();
    assert!(e.to_string().contains("queue pair 2"), "{e}");
    let e = rx
        .consume(&erdma::collective::channel::Arrival { q: 5, ..got })
        .unwrap_err();
    assert!(matches!(e, erdma::Error::InvalidArgument(_)), "{e:?}");
    // A credit for no slot would look like progress while granting nothing: refused.
    credit.imm = Some(1 << 31);
    let e = tx.on_credit(1, &credit).unwrap_err();
    assert!(matches!(e, erdma::Error::Protocol { .. }), "{e:?}");
    // A message longer than the place the receiver granted: refused before anything is posted,
    // and the bytes after the grant stay as they were.
    let before = granted.to_vec(1016..1100).to_vec();
    let in_flight = tx.in_flight();
    let long = Message {
        local: sge(300, 64),
        target: Target::Remote(granted.remote().slice(1000, 16).unwrap()),
        user: 1,
    };
    // SAFETY: refused before anything is posted.
    let e = unsafe { tx.post(0, &[long]) }.unwrap_err();
    assert!(matches!(e, erdma::Error::OutOfBounds { .. }), "{e:?}");
    assert_eq!(tx.in_flight(), in_flight);
    assert_eq!(&granted.to_vec(1016..1100), &before[..]);
    let wide = Message {
        user: 1 << 23,
        ..msg(0, 0)
    };
    // SAFETY: refused before anything is posted.
    assert!(unsafe { tx.post(0, &[wide]) }.is_err());
    assert!(Sender::new(Vec::new(), 0, SLOT, staging.remote(), TAG).is_err());
    assert!(Receiver::new(Vec::new(), 2, SLOT, 3).is_err());
}

//! Bandwidth through the plugin's operations, without NCCL: two ranks (threads, each with its
//! own soft device) exchange messages both ways at once, as the two ranks of a ring do, each
//! keeping `--window` messages of `--size` bytes in flight per direction and connection, over
//! `--conns` connections (NCCL's channels), `--iters` messages each.
//!
//! ```sh
//! unshare -n sh -c 'ip link set lo up; cargo run --release -p erdma-nccl --example net_bw'
//! ```
//!
//! Prints GB/s per direction. Settings of the plugin (`ERDMA_NCCL_QPS`, `ERDMA_NCCL_CHUNK`, …)
//! apply as in NCCL.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use erdma_nccl::config::parse_bytes;
use erdma_nccl::net;

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

struct Buf(Vec<u8>);

fn main() {
    if std::env::var("ERDMA_NCCL_DEVICES").is_err() {
        // SAFETY: set before any other thread exists.
        unsafe { std::env::set_var("ERDMA_NCCL_DEVICES", "soft:127.0.0.2,soft:127.0.0.3") };
    }
    let size = parse_bytes(&arg("--size", "512K")).expect("--size") as usize;
    let window: usize = arg("--window", "8").parse().expect("--window");
    let conns: usize = arg("--conns", "2").parse().expect("--conns");
    let iters: usize = arg("--iters", "2000").parse().expect("--iters");
    let oneway = std::env::args().any(|a| a == "--oneway");
    net::init(None).expect("init");

    // Connections: for each channel, rank 0 -> 1 and rank 1 -> 0.
    let mut links = Vec::new(); // (send id of rank a, recv id of rank b, a)
    for _ in 0..conns {
        for a in 0..if oneway { 1 } else { 2 } {
            let b = 1 - a;
            let mut h = [0u8; 128];
            let l = net::listen(b, &mut h).expect("listen");
            let (mut s, mut r) = (None, None);
            while s.is_none() || r.is_none() {
                if s.is_none() {
                    s = net::connect(a, &mut h).expect("connect");
                }
                if r.is_none() {
                    r = net::accept(l).expect("accept");
                }
            }
            net::close_listen(l).expect("close");
            links.push((s.unwrap(), r.unwrap(), a));
        }
    }
    let barrier = Barrier::new(2);
    let results: Vec<f64> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..2i32)
            .map(|rank| {
                let mine: Vec<(u64, u64)> = links
                    .iter()
                    .map(|&(s, r, a)| if a == rank { (s, 0) } else { (0, r) })
                    .collect();
                let barrier = &barrier;
                sc.spawn(move || run(&mine, size, window, iters, barrier))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    if std::env::var("NET_BW_DEBUG").is_ok() {
        for d in ["soft:127.0.0.2", "soft:127.0.0.3"] {
            if let Ok(c) = erdma::Context::open(d) {
                eprintln!("{d}: {}", c.port_counters(1).unwrap());
            }
        }
    }
    if oneway {
        println!(
            "size {size} window {window} connections {conns}, one way: {:.2} GB/s",
            results[1]
        );
    } else {
        println!(
            "size {size} window {window} connections {conns}: {:.2} GB/s per direction (rank 0 \
             {:.2}, rank 1 {:.2})",
            (results[0] + results[1]) / 2.0,
            results[0],
            results[1]
        );
    }
}

/// One rank: drives its send and receive connections like NCCL's proxy thread; returns the
/// GB/s it received.
fn run(comms: &[(u64, u64)], size: usize, window: usize, iters: usize, barrier: &Barrier) -> f64 {
    struct Side {
        comm: u64,
        send: bool,
        bufs: Vec<Buf>,
        mh: Vec<u64>,
        reqs: Vec<Option<u64>>,
        next: usize,
        done: u64,
    }
    let mut sides: Vec<Side> = comms
        .iter()
        .map(|&(s, r)| {
            let send = s != 0;
            let comm = if send { s } else { r };
            let bufs: Vec<Buf> = (0..window).map(|_| Buf(vec![1u8; size])).collect();
            let mh = bufs
                .iter()
                .map(|b| {
                    // SAFETY: the buffers live until after the connections are closed.
                    unsafe { net::reg_mr(comm, b.0.as_ptr() as u64, size as u64, 1) }.expect("reg")
                })
                .collect();
            Side {
                comm,
                send,
                bufs,
                mh,
                reqs: vec![None; window],
                next: 0,
                done: 0,
            }
        })
        .collect();
    barrier.wait();
    let t0 = Instant::now();
    let mut received = 0u64;
    let mut report = t0;
    loop {
        if std::env::var("NET_BW_DEBUG").is_ok() && report.elapsed() > Duration::from_secs(1) {
            report = Instant::now();
            for s in &sides {
                eprintln!("send {} next {} done {}", s.send, s.next, s.done);
            }
        }
        let mut busy = false;
        for s in sides.iter_mut() {
            // Post into free slots in order (not after the end: drain instead).
            while s.next < iters && s.reqs[s.next % window].is_none() {
                let i = s.next % window;
                let addr = s.bufs[i].0.as_ptr() as u64;
                let r = if s.send {
                    net::isend(s.comm, addr, size as u64, 0, s.mh[i]).expect("isend")
                } else {
                    net::irecv(s.comm, &[(addr, size as u64, 0, s.mh[i])]).expect("irecv")
                };
                match r {
                    Some(q) => {
                        s.reqs[i] = Some(q);
                        s.next += 1;
                    }
                    None => break,
                }
            }
            // Test the oldest.
            let oldest = (s.done as usize) % window;
            if let Some(q) = s.reqs[oldest] {
                busy = true;
                if let Some((sizes, _)) = net::test(q).expect("test") {
                    s.reqs[oldest] = None;
                    s.done += 1;
                    if !s.send {
                        received += sizes[0];
                    }
                }
            }
        }
        if !busy && sides.iter().all(|s| s.next == iters) {
            break;
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    for s in &sides {
        for &m in &s.mh {
            net::dereg_mr(s.comm, m).expect("dereg");
        }
    }
    received as f64 / elapsed / 1e9
}

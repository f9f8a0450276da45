//! READ throughput, 4 KiB, through the safe async owned-buffer API ([`erdma::AsyncQp`]) and
//! through the raw path (`post_send_raw` + busy `poll`), in the same run, on two soft devices
//! (`127.0.92.1`, `127.0.92.2`). Each path keeps DEPTH READs of random 4 KiB pieces in flight
//! on its own queue pair; rounds alternate between the paths and the median of each is
//! reported, with the ratio. The async path runs on a current-thread tokio runtime, once with
//! `AsyncCq::new` (sleeps on the completion queue's descriptor when nothing is there) and once
//! with a spin budget (`AsyncCq::with_spin`, busy-polls up to that long first).
//! `bench/results/async-read.md` records the numbers.
//!
//! `cargo bench --bench async_read [-- READS DEPTH ROUNDS SPIN_US]` (in `unshare -n`, `lo` up).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use erdma::{
    Access, AsyncCq, AsyncQp, Completion, ConnectOptions, Context, Cq, InitOptions, Mr, OwnedBuf,
    Pd, Qp, QpConfig, RawSendWr, RemoteMr, SendFlags, Sge, WrOpcode,
};

const PIECE: usize = 4096;
const REGION: usize = 16 << 20;

/// One queue pair of device A connected to one of device B; B grants its region.
struct Link {
    cq: Cq,
    qp: Qp,
    _peer: Qp,
}

fn link(a: &Pd, b: &Pd, depth: u32) -> erdma::Result<Link> {
    let cq = a.context().create_cq(depth * 4)?;
    let cq_b = b.context().create_cq(16)?;
    let cfg = |cq: &Cq| QpConfig::new(cq).max_send_wr(depth * 2).max_recv_wr(4);
    let qa = a.create_qp(&cfg(&cq))?.init(&InitOptions::default())?;
    // The granting side lets its peer READ (queue pairs grant nothing by default).
    let grant = InitOptions {
        access: Access::REMOTE_READ,
        ..InitOptions::default()
    };
    let qb = b.create_qp(&cfg(&cq_b))?.init(&grant)?;
    let (ea, eb) = (qa.endpoint()?, qb.endpoint()?);
    let o = ConnectOptions::default();
    Ok(Link {
        cq,
        qp: qa.connect(&eb, &o)?,
        _peer: qb.connect(&ea, &o)?,
    })
}

struct Random(u64);

impl Random {
    /// A random 4 KiB piece of `remote`.
    fn piece(&mut self, remote: &RemoteMr) -> RemoteMr {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let at = (self.0 >> 33) % (REGION / PIECE) as u64 * PIECE as u64;
        remote.slice(at, PIECE as u64).expect("inside the region")
    }
}

/// The raw path: `post_send_raw` into slots of `local`, then busy `poll` or, with `sleep`,
/// `Cq::wait` (sleeps on the descriptor like the async path). Returns bytes/s.
fn raw_round(
    sleep: bool,
    l: &Link,
    local: &mut Mr<'static>,
    remote: &RemoteMr,
    reads: usize,
    depth: usize,
) -> f64 {
    let mut rng = Random(7);
    let post = |slot: u64, rng: &mut Random| {
        let sge = Sge {
            addr: local.addr() + slot * PIECE as u64,
            length: PIECE as u32,
            lkey: local.lkey(),
        };
        let mut wr = RawSendWr::new(slot, WrOpcode::RdmaRead, std::slice::from_ref(&sge));
        wr.flags = SendFlags::SIGNALED;
        wr.remote = rng.piece(remote);
        // Slot `slot` of `local` is posted at most once at a time (reposted only after its
        // completion), `local` outlives every request (all complete before this returns), and
        // the CPU does not touch it meanwhile.
        // SAFETY: the raw path's contract holds (above).
        unsafe { l.qp.post_send_raw(&[wr]) }.expect("posting a READ");
    };
    let start = Instant::now();
    for slot in 0..depth as u64 {
        post(slot, &mut rng);
    }
    let (mut posted, mut done) = (depth, 0);
    let mut out = [Completion::default(); 32];
    while done < reads {
        let n = if sleep {
            l.cq.wait(&mut out, Duration::from_secs(10))
        } else {
            l.cq.poll(&mut out)
        }
        .expect("polling");
        for c in &out[..n] {
            assert!(c.is_ok(), "{c:?}");
            done += 1;
            if posted < reads {
                post(c.wr_id, &mut rng);
                posted += 1;
            }
        }
    }
    (reads * PIECE) as f64 / start.elapsed().as_secs_f64()
}

/// The safe async path: DEPTH owned buffers, each READ moving one in and its completion
/// giving it back. Returns bytes/s and the buffers.
async fn async_round(
    qp: &AsyncQp,
    bufs: Vec<OwnedBuf>,
    remote: &RemoteMr,
    reads: usize,
) -> (f64, Vec<OwnedBuf>) {
    let mut rng = Random(7);
    let start = Instant::now();
    let mut posted = bufs.len();
    let mut pending: VecDeque<_> = bufs
        .into_iter()
        .map(|b| qp.read(b, rng.piece(remote)))
        .collect();
    let mut back = Vec::new();
    while let Some(p) = pending.pop_front() {
        let buf = p.await.expect("a READ");
        if posted < reads {
            pending.push_back(qp.read(buf, rng.piece(remote)));
            posted += 1;
        } else {
            back.push(buf);
        }
    }
    ((reads * PIECE) as f64 / start.elapsed().as_secs_f64(), back)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> erdma::Result<()> {
    let arg = |i: usize, d: usize| {
        std::env::args()
            .filter(|a| !a.starts_with('-'))
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(d)
    };
    let (reads, depth, rounds, spin_us) = (arg(1, 20_000), arg(2, 16), arg(3, 5), arg(4, 50));
    let (a, b) = (
        Context::open("soft:127.0.92.1")?,
        Context::open("soft:127.0.92.2")?,
    );
    let (pa, pb) = (a.alloc_pd()?, b.alloc_pd()?);
    let region = pb.alloc(REGION, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    let remote = region.remote();
    let raw = link(&pa, &pb, depth as u32)?;
    let mut local = pa.alloc(depth * PIECE, Access::LOCAL_WRITE)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    // The links stay alive for the whole run: a peer queue pair dropped leaves READs unanswered.
    let (l0, l1) = (link(&pa, &pb, depth as u32)?, link(&pa, &pb, depth as u32)?);
    let (sleepy, spinny) = rt.block_on(async {
        let make = |l: &Link, spin: Duration| -> erdma::Result<AsyncQp> {
            AsyncQp::new(
                l.qp.clone(),
                Arc::new(AsyncCq::with_spin(l.cq.clone(), spin)?),
            )
        };
        let spin = Duration::from_micros(spin_us as u64);
        Ok::<_, erdma::Error>((make(&l0, Duration::ZERO)?, make(&l1, spin)?))
    })?;
    let bufs = |qp: &AsyncQp| {
        OwnedBuf::alloc(qp.qp().pd(), depth * PIECE, Access::LOCAL_WRITE).map(|b| b.chunks(PIECE))
    };
    let (mut b0, mut b1) = (bufs(&sleepy)?, bufs(&spinny)?);
    let (mut r_raw, mut r_wait, mut r_sleep, mut r_spin) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // A warm-up round of each, then the measured rounds, alternating.
    for round in 0..=rounds {
        let x = raw_round(false, &raw, &mut local, &remote, reads, depth);
        let w = raw_round(true, &raw, &mut local, &remote, reads, depth);
        let (y, back) = rt.block_on(async_round(&sleepy, b0, &remote, reads));
        b0 = back;
        let (z, back) = rt.block_on(async_round(&spinny, b1, &remote, reads));
        b1 = back;
        if round > 0 {
            r_raw.push(x);
            r_wait.push(w);
            r_sleep.push(y);
            r_spin.push(z);
        }
    }
    let w = median(&mut r_wait);
    let (x, y, z) = (
        median(&mut r_raw),
        median(&mut r_sleep),
        median(&mut r_spin),
    );
    println!(
        "READ {PIECE} B, {depth} in flight, {reads} READs per round, median of {rounds} rounds"
    );
    let row = |name: &str, v: f64| {
        let vs = |base: f64| (v / base - 1.0) * 100.0;
        println!(
            "  {name:<38} {:8.1} MB/s  {:+6.1} % vs raw poll  {:+6.1} % vs raw wait",
            v / 1e6,
            vs(x),
            vs(w)
        );
    };
    row("raw: post_send_raw + busy Cq::poll", x);
    row("raw: post_send_raw + Cq::wait (sleeps)", w);
    row("async: AsyncQp::read, AsyncCq::new", y);
    row(&format!("async: AsyncQp::read, spin {spin_us} us"), z);
    Ok(())
}

//! The SDK's per-operation costs on the soft device: post + poll of one request (a full round
//! trip, the peer's ACK included), post + poll per request when 32 are in flight, and the cost of
//! checking a work request against the device's limits.
//!
//! Two soft devices on `127.0.91.1` and `127.0.91.2` (loopback addresses no other program of the
//! project uses by default). `cargo bench --bench datapath`; `-- --quick` for a short run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use erdma::{
    Access, Completion, ConnectOptions, Context, Cq, Error, InitOptions, Limit, Mr, Qp, QpCaps,
    QpConfig, RawSendWr, RemoteMr, SendFlags, Sge, WrOpcode,
};

/// How long one completion may take before the benchmark gives up.
const WAIT: Duration = Duration::from_secs(10);

struct Pair {
    _ctx: [Context; 2],
    cq: Cq,
    qp: Qp,
    mr: Mr<'static>,
    remote: RemoteMr,
    _peer: (Cq, Qp, Mr<'static>),
}

fn pair() -> erdma::Result<Pair> {
    let caps = QpCaps {
        max_send_wr: 256,
        max_recv_wr: 16,
        max_send_sge: 2,
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let mut sides = Vec::new();
    for dev in ["soft:127.0.91.1", "soft:127.0.91.2"] {
        let ctx = Context::open(dev)?;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(512)?;
        let mr = pd.alloc(1 << 16, Access::ALL)?;
        let qp = pd
            .create_qp(&QpConfig::new(&cq).caps(caps))?
            .init(&InitOptions {
                access: Access::ALL,
                ..InitOptions::default()
            })?;
        sides.push((ctx, cq, mr, qp));
    }
    let (cb, cqb, mrb, qb) = sides.pop().expect("two sides");
    let (ca, cqa, mra, qa) = sides.pop().expect("two sides");
    let (ea, eb) = (qa.endpoint()?, qb.endpoint()?);
    let qa = qa.connect(&eb, &ConnectOptions::default())?;
    let qb = qb.connect(&ea, &ConnectOptions::default())?;
    Ok(Pair {
        _ctx: [ca, cb],
        cq: cqa,
        qp: qa,
        remote: mrb.remote(),
        mr: mra,
        _peer: (cqb, qb, mrb),
    })
}

impl Pair {
    fn sge(&self, len: u32) -> [Sge; 1] {
        [Sge {
            addr: self.mr.addr(),
            length: len,
            lkey: self.mr.lkey(),
        }]
    }

    fn post_write(&self, sge: &[Sge], wr_id: u64, flags: SendFlags) {
        let mut wr = RawSendWr::new(wr_id, WrOpcode::RdmaWrite, sge);
        wr.remote = self.remote;
        wr.flags = flags;
        // SAFETY: the SGE lies inside `self.mr`, which lives as long as the pair; the CPU never
        // writes it while requests are outstanding, and every request is reaped before the pair
        // is dropped.
        unsafe { self.qp.post_send_raw(&[wr]) }.expect("post");
    }

    /// Reaps exactly `n` successful completions.
    fn reap(&self, n: usize, out: &mut [Completion]) {
        let deadline = Instant::now() + WAIT;
        let mut got = 0;
        let room = out.len();
        while got < n {
            let k = self.cq.poll(&mut out[..(n - got).min(room)]).expect("poll");
            for c in &out[..k] {
                assert!(c.status.is_success(), "{c:?}");
            }
            got += k;
            assert!(Instant::now() < deadline, "no completion within {WAIT:?}");
        }
    }
}

fn all(c: &mut Criterion) {
    let p = pair().expect("two soft devices on 127.0.91.1 and 127.0.91.2");
    post_poll(c, &p);
    validation(c, &p);
}

fn post_poll(c: &mut Criterion, p: &Pair) {
    let mut out = [Completion::default(); 32];
    let mut g = c.benchmark_group("post+poll");
    let inline = p.sge(8);
    g.throughput(Throughput::Elements(1));
    g.bench_function("WRITE 8 B inline, one at a time (round trip)", |b| {
        b.iter(|| {
            p.post_write(&inline, 1, SendFlags::SIGNALED | SendFlags::INLINE);
            p.reap(1, &mut out);
        })
    });
    for size in [8u32, 4096] {
        let sge = p.sge(size);
        g.throughput(Throughput::Elements(32));
        g.bench_function(format!("WRITE {size} B, 32 in flight, per 32"), |b| {
            b.iter(|| {
                for i in 0..32 {
                    p.post_write(&sge, i, SendFlags::SIGNALED);
                }
                p.reap(32, &mut out);
            })
        });
    }
    g.finish();
}

fn validation(c: &mut Criterion, p: &Pair) {
    let mut g = c.benchmark_group("validation");
    let ctx = p.qp.pd().context().clone();
    let caps = p.qp.caps();
    g.bench_function("QP caps against the limit profile", |b| {
        b.iter(|| ctx.limits().check_qp_caps(black_box(&caps)))
    });
    // An atomic with two SGEs passes the inline, SGE-count and message-size checks and is
    // refused at the atomic SGE check: nearly the whole path, and an error that allocates nothing.
    let sges = [p.sge(8)[0], p.sge(8)[0]];
    let mut wr = RawSendWr::new(7, WrOpcode::AtomicFetchAndAdd, &sges);
    wr.remote = p.remote;
    wr.flags = SendFlags::SIGNALED;
    g.bench_function("WR refused at the last limit check", |b| {
        b.iter(|| {
            // SAFETY: the request is refused before the device sees it (asserted below), and
            // its SGEs lie inside `p.mr` anyway.
            let r = unsafe { p.qp.post_send_raw(black_box(&[wr])) };
            match r {
                Err(Error::LimitExceeded {
                    limit: Limit::AtomicSge,
                    ..
                }) => {}
                other => panic!("expected the atomic SGE limit, got {other:?}"),
            }
        })
    });
    g.finish();
}

criterion_group!(benches, all);
criterion_main!(benches);

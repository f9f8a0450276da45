//! Helpers shared by the integration tests: two connected queue pairs on two devices.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use erdma::{Access, ConnectOptions, Context, Cq, InitOptions, Mr, Mtu, Qp, QpConfig, Result};

/// One side of a connection.
pub struct Side {
    pub ctx: Context,
    pub cq: Cq,
    pub qp: Qp,
    pub mr: Mr<'static>,
}

/// How long a test waits for any one completion.
pub const WAIT: Duration = Duration::from_secs(20);

/// A fresh pair of loopback addresses for soft devices, so tests running in parallel in one
/// process never share a device.
pub fn soft_pair() -> (String, String) {
    static NEXT: AtomicU8 = AtomicU8::new(2);
    let n = NEXT.fetch_add(2, Ordering::Relaxed);
    (format!("soft:127.0.{n}.1"), format!("soft:127.0.{n}.2"))
}

/// Device names from the environment (for running the same tests on verbs devices), or two
/// fresh soft devices.
pub fn device_pair() -> (String, String) {
    match (
        std::env::var("ERDMA_TEST_DEV_A"),
        std::env::var("ERDMA_TEST_DEV_B"),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        _ => soft_pair(),
    }
}

/// Options for [`connect_pair`].
#[derive(Clone, Copy)]
pub struct PairOptions {
    pub mr_len: usize,
    pub access: Access,
    pub mtu: Option<Mtu>,
    pub depth: u32,
    pub connect: ConnectOptions,
}

impl Default for PairOptions {
    fn default() -> Self {
        PairOptions {
            mr_len: 1 << 21,
            access: Access::ALL,
            mtu: None,
            depth: 256,
            connect: ConnectOptions::default(),
        }
    }
}

/// Two connected sides on the devices `a` and `b`.
pub fn connect_pair(a: &str, b: &str, o: &PairOptions) -> Result<(Side, Side)> {
    let (sa_ctx, sa_cq, sa_mr, qa) = parts(a, o)?;
    let (sb_ctx, sb_cq, sb_mr, qb) = parts(b, o)?;
    let (qa, qb) = connect_qps(qa, qb, o.mtu, &o.connect)?;
    Ok((
        Side {
            ctx: sa_ctx,
            cq: sa_cq,
            qp: qa,
            mr: sa_mr,
        },
        Side {
            ctx: sb_ctx,
            cq: sb_cq,
            qp: qb,
            mr: sb_mr,
        },
    ))
}

/// Connects two initialized queue pairs to each other (at `mtu`, when given).
pub fn connect_qps(
    qa: erdma::Qp<erdma::Init>,
    qb: erdma::Qp<erdma::Init>,
    mtu: Option<Mtu>,
    o: &ConnectOptions,
) -> Result<(Qp, Qp)> {
    let mut ea = qa.endpoint()?;
    let mut eb = qb.endpoint()?;
    if let Some(m) = mtu {
        ea.mtu = m;
        eb.mtu = m;
    }
    Ok((qa.connect(&eb, o)?, qb.connect(&ea, o)?))
}

fn parts(
    name: &str,
    o: &PairOptions,
) -> Result<(Context, Cq, Mr<'static>, erdma::Qp<erdma::Init>)> {
    let ctx = Context::open(name)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(o.depth * 2)?;
    let mr = pd.alloc(o.mr_len, o.access)?;
    let caps = erdma::QpCaps {
        max_send_wr: o.depth,
        max_recv_wr: o.depth,
        max_send_sge: ctx.limits().max_send_sge.min(4),
        max_recv_sge: 1,
        max_inline_data: 64,
    };
    let qp = pd
        .create_qp(&QpConfig::new(&cq).caps(caps))?
        .init(&InitOptions {
            access: Access::ALL,
            ..InitOptions::default()
        })?;
    Ok((ctx, cq, mr, qp))
}

/// A deterministic byte pattern (differs per seed and position).
pub fn pattern(seed: u32, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 24) as u8
        })
        .collect()
}

/// A hook for [`erdma::connect::cm::Setup::on_init`] that posts one receive per `(wr_id, offset,
/// len)` into `mr`, before the connection is made: on iWARP a SEND that finds no receive breaks
/// the connection, and the peer may send as soon as it is connected.
///
/// The caller keeps `mr` (in the connection's application value) for as long as the queue pair
/// may complete these receives: until the connection and every handle of its queue pair are gone.
pub fn prepost(
    mr: &Mr<'static>,
    recvs: &[(u64, usize, usize)],
) -> impl FnOnce(&erdma::Qp<erdma::Init>) -> Result<()> + Send + 'static {
    let sges: Vec<(u64, erdma::Sge)> = recvs
        .iter()
        .map(|&(wr_id, off, len)| {
            assert!(
                off + len <= mr.len(),
                "receive {wr_id} lies outside the region"
            );
            let sge = erdma::Sge {
                addr: mr.addr() + off as u64,
                length: len as u32,
                lkey: mr.lkey(),
            };
            (wr_id, sge)
        })
        .collect();
    move |qp| {
        for (wr_id, sge) in &sges {
            let wr = erdma::RawRecvWr {
                wr_id: *wr_id,
                sges: std::slice::from_ref(sge),
            };
            // The SGE lies inside `mr` (asserted above), which the caller keeps alive and
            // untouched by the CPU while the queue pair may write it (this function's contract).
            // SAFETY: as above.
            unsafe { qp.post_recv_raw(std::slice::from_ref(&wr))? };
        }
        Ok(())
    }
}

/// Whether soft devices of this process move long payloads by reference between themselves
/// (`ERDMA_SOFT_SAME_HOST` unset or `cma`, not `off`): one packet then stands for up to 64 KiB.
pub fn soft_same_host_refs() -> bool {
    std::env::var("ERDMA_SOFT_SAME_HOST").map_or(true, |v| v.trim() != "off")
}

/// Whether this process's soft devices transmit in the posting thread, with polling threads
/// doing the receive work: `ERDMA_SOFT_TX=inline`, or unset with one engine per device (the
/// default). With several engines their lanes transmit and receive instead.
pub fn soft_transmits_inline() -> bool {
    match std::env::var("ERDMA_SOFT_TX").as_deref().map(str::trim) {
        Ok("inline") => true,
        Ok(_) => false,
        Err(_) => std::env::var("ERDMA_SOFT_ENGINES")
            .map_or(true, |v| v.trim().is_empty() || v.trim() == "1"),
    }
}

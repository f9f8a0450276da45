//! Memory footprint of the soft device's objects: heap bytes (counted by a wrapping global
//! allocator) and resident memory (RSS from `/proc/self/statm`) added per queue pair, per memory
//! region and per completion-queue entry, measured over creating many of each; plus the sizes of
//! the main structures.
//!
//! Not a criterion benchmark: `cargo bench --bench footprint` prints one table
//! (`-- --quick` creates fewer objects).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use erdma::{Access, Completion, Context, Cq, InitOptions, Mr, Qp, QpCaps, QpConfig};

/// The system allocator, counting the bytes currently allocated.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every method forwards to the system allocator with the caller's arguments unchanged,
// so the allocator contract is the system allocator's; the counter has no effect on memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc_zeroed`'s contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is; `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `realloc`'s contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Resident bytes of this process.
fn rss() -> i64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: i64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as i64;
    pages * page
}

/// Heap and RSS now.
fn snapshot() -> (i64, i64) {
    (LIVE.load(Ordering::Relaxed) as i64, rss())
}

fn row(what: &str, count: usize, before: (i64, i64), after: (i64, i64)) {
    let n = count as f64;
    println!(
        " {:<34} {:>8} {:>16.0} {:>16.0}",
        what,
        count,
        (after.0 - before.0) as f64 / n,
        (after.1 - before.1) as f64 / n
    );
}

fn caps(depth: u32) -> QpCaps {
    QpCaps {
        max_send_wr: depth,
        max_recv_wr: depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    }
}

fn main() -> erdma::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let (n_qp, n_mr, n_cq) = if quick { (50, 200, 4) } else { (500, 4000, 16) };
    println!(
        " object                             {:>8} {:>16} {:>16}",
        "count", "heap B each", "RSS B each"
    );

    let before = snapshot();
    let ctx = Context::open("soft:127.0.93.1")?;
    let pd = ctx.alloc_pd()?;
    row("device (context + engine, once)", 1, before, snapshot());

    for depth in [16u32, 256] {
        let cq = ctx.create_cq(depth * 2 * n_qp as u32)?;
        let before = snapshot();
        let mut qps: Vec<Qp> = Vec::with_capacity(n_qp);
        for _ in 0..n_qp {
            let qp = pd
                .create_qp(&QpConfig::new(&cq).caps(caps(depth)))?
                .init(&InitOptions {
                    access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                    ..InitOptions::default()
                })?;
            let me = qp.endpoint()?;
            qps.push(qp.connect(&me, &Default::default())?);
        }
        row(
            &format!("queue pair (RTS, {depth} send + {depth} recv)"),
            n_qp,
            before,
            snapshot(),
        );
        drop(qps);
    }

    // One buffer, allocated and touched before the baseline, then many regions over its pages:
    // what a registration itself costs.
    let page = 4096usize;
    let mut backing = vec![1u8; page * n_mr];
    let before = snapshot();
    let mut mrs: Vec<Mr<'static>> = Vec::with_capacity(n_mr);
    for i in 0..n_mr {
        // SAFETY: each 4 KiB chunk lies inside `backing`, which outlives every region (they are
        // dropped below, before it); nothing else accesses it meanwhile.
        let mr = unsafe { pd.register_raw(backing.as_mut_ptr().add(i * page), page, Access::ALL)? };
        mrs.push(mr);
    }
    row("memory region (4 KiB)", n_mr, before, snapshot());
    drop(mrs);
    drop(backing);

    let small_before = snapshot();
    let small: Vec<Cq> = (0..n_cq)
        .map(|_| ctx.create_cq(1))
        .collect::<erdma::Result<_>>()?;
    let small_after = snapshot();
    let big_depth = 65_536u32;
    let big: Vec<Cq> = (0..n_cq)
        .map(|_| ctx.create_cq(big_depth))
        .collect::<erdma::Result<_>>()?;
    let big_after = snapshot();
    let entries = (big[0].depth() - small[0].depth()) as usize * n_cq;
    row(
        "completion queue (depth 1)",
        n_cq,
        small_before,
        small_after,
    );
    row("completion-queue entry", entries, small_after, big_after);
    // The difference between a deep and a shallow queue, per extra entry.
    let per_entry_heap =
        ((big_after.0 - small_after.0) - (small_after.0 - small_before.0)) as f64 / entries as f64;
    println!(" (per entry, net of the queue itself: {per_entry_heap:.1} heap bytes)");
    drop(big);
    drop(small);

    println!();
    println!(" structure                          {:>8}", "bytes");
    for (name, size) in [
        ("erdma::Qp (handle)", std::mem::size_of::<Qp>()),
        ("erdma::Cq (handle)", std::mem::size_of::<Cq>()),
        ("erdma::Mr (handle)", std::mem::size_of::<Mr<'static>>()),
        ("erdma::Completion", std::mem::size_of::<Completion>()),
        (
            "soft::proto::Qp (protocol state)",
            std::mem::size_of::<erdma::soft::proto::Qp>(),
        ),
        (
            "soft::proto::Completion (core)",
            std::mem::size_of::<erdma::Completion>(),
        ),
    ] {
        println!(" {name:<34} {size:>8}");
    }
    Ok(())
}

//! GPU memory as the source and target of RDMA WRITE, READ and SEND, between two soft devices.
//!
//! Each test needs an NVIDIA GPU and its driver (`libcuda.so.1`). Without them every test prints
//! `SKIP <test>: <reason>` and passes; with them it prints `RAN <test>: <what was verified>`, so
//! a run always says which of the two happened. Contents are checked by copying GPU memory back
//! to the host.
//!
//! `bench_gpu_vs_host_write_bw` (ignored; run it with `--ignored`) measures RDMA WRITE bandwidth
//! between GPU buffers against the same between host buffers, on the same two soft devices.
//! With `ERDMA_GPU_BENCH_OUT=<dir>` it also writes `gpu.md` and `gpu.plot.json` there.

#![cfg(feature = "gpu")]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{WAIT, pattern, soft_pair};
use erdma::connect::{self, Listener, PeerInfo};
use erdma::gpu::{self, GpuBuffer, GpuMr, RegistrationPath};
use erdma::{
    Access, Completion, Context, Cq, Error, InitOptions, MrSlice, Qp, QpConfig, RecvWr, RemoteMr,
    SendWr, WcOpcode, WcStatus, scope,
};

/// Every size class up to 256 MiB: sub-MTU, MTU edges, multi-packet, multi-slot, huge.
const SIZES: &[usize] = &[
    1,
    63,
    4095,
    4096,
    4097,
    65536 + 13,
    (1 << 20) + 5,
    (16 << 20) + 1,
    64 << 20,
    256 << 20,
];
const MAX: usize = 256 << 20;

/// The GPU to use, or `None` after printing why the test is skipped.
fn gpu_or_skip(test: &str) -> Option<usize> {
    match gpu::device_count() {
        Ok(n) if n > 0 => {
            let name = gpu::device_name(0).unwrap_or_else(|e| e.to_string());
            println!("RUN  {test}: on CUDA device 0 ({name}) of {n}");
            Some(0)
        }
        Ok(_) => {
            println!("SKIP {test}: the CUDA driver reports no device");
            None
        }
        Err(e) => {
            println!("SKIP {test}: {e}");
            None
        }
    }
}

/// One end: a soft device with a connected queue pair.
struct End {
    ctx: Context,
    cq: Cq,
    qp: Qp,
}

fn ends(depth: u32) -> (End, End) {
    let (a, b) = soft_pair();
    let make = |name: &str| {
        let ctx = Context::open(name).unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(depth * 2).unwrap();
        let caps = erdma::QpCaps {
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: 64,
        };
        let qp = pd
            .create_qp(&QpConfig::new(&cq).caps(caps))
            .unwrap()
            .init(&InitOptions {
                access: Access::ALL,
                ..InitOptions::default()
            })
            .unwrap();
        (ctx, cq, qp)
    };
    let (ca, qa_cq, qa) = make(&a);
    let (cb, qb_cq, qb) = make(&b);
    let (qa, qb) = common::connect_qps(qa, qb, None, &Default::default()).unwrap();
    (
        End {
            ctx: ca,
            cq: qa_cq,
            qp: qa,
        },
        End {
            ctx: cb,
            cq: qb_cq,
            qp: qb,
        },
    )
}

fn gpu_mr(end: &End, dev: usize, len: usize) -> GpuMr<'static> {
    let pd = end.qp.pd().clone();
    let buf = GpuBuffer::new(dev, len).expect("allocating GPU memory");
    let mr = pd
        .register_gpu(buf, Access::ALL)
        .expect("registering GPU memory");
    assert_eq!(mr.path(), RegistrationPath::SoftStaging);
    assert!(mr.fallback_reason().is_none());
    let _ = &end.ctx;
    mr
}

fn done(cq: &Cq, what: &str) -> Completion {
    let c = cq.wait_one(WAIT).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(c.status, WcStatus::Success, "{what}: {c:?}");
    c
}

/// Checks `buf[at..at+want.len()] == want` and that the `guard` bytes around it kept `fill`.
fn check(buf: &GpuBuffer, at: usize, want: &[u8], fill: u8, what: &str) {
    let lo = at.saturating_sub(16);
    let hi = (at + want.len() + 16).min(buf.len());
    let mut got = vec![0u8; hi - lo];
    buf.copy_to_host(lo, &mut got).unwrap();
    let body = &got[at - lo..at - lo + want.len()];
    if body != want {
        let first = body.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
        panic!(
            "{what}: {} bytes differ, first at {first}",
            body.iter().zip(want).filter(|(a, b)| a != b).count()
        );
    }
    assert!(
        got[..at - lo]
            .iter()
            .chain(&got[at - lo + want.len()..])
            .all(|&b| b == fill),
        "{what}: bytes outside the message were touched"
    );
}

#[test]
fn gpu_write_read_send_every_size() {
    let test = "gpu_write_read_send_every_size";
    let Some(dev) = gpu_or_skip(test) else { return };
    let (a, b) = ends(64);
    let mut ga = gpu_mr(&a, dev, MAX + 4096);
    let mut gb = gpu_mr(&b, dev, MAX + 4096);
    let mut checked = 0;
    for (i, &len) in SIZES.iter().enumerate() {
        let data = pattern(i as u32 + 1, len);
        // Odd offsets on both sides for the small sizes.
        let (src_at, dst_at) = if len < (1 << 20) {
            (5, 4096 + 3)
        } else {
            (0, 0)
        };
        ga.buffer_mut().copy_from_host(src_at, &data).unwrap();
        let t = Instant::now();

        // WRITE: A's GPU memory → B's GPU memory.
        gb.buffer_mut().fill(0xEE).unwrap();
        let remote = gb.remote().slice(dst_at as u64, len as u64).unwrap();
        scope(|s| {
            let src = [ga.slice(src_at..src_at + len)];
            s.post_send(&a.qp, SendWr::write(1, &src, remote)).unwrap();
            done(&a.cq, "WRITE");
        });
        check(
            gb.buffer(),
            dst_at,
            &data,
            0xEE,
            &format!("WRITE {len} bytes"),
        );
        let t_write = t.elapsed();

        // READ: B reads A's GPU memory into its own.
        gb.buffer_mut().fill(0xEE).unwrap();
        let remote = ga.remote().slice(src_at as u64, len as u64).unwrap();
        scope(|s| {
            let dst = gb.slice_mut(dst_at..dst_at + len);
            s.post_send(&b.qp, SendWr::read(2, dst, remote)).unwrap();
            let c = done(&b.cq, "READ");
            assert_eq!(c.opcode, WcOpcode::RdmaRead);
        });
        check(
            gb.buffer(),
            dst_at,
            &data,
            0xEE,
            &format!("READ {len} bytes"),
        );

        // SEND: A's GPU memory into B's posted GPU receive buffer.
        gb.buffer_mut().fill(0xEE).unwrap();
        scope(|s| {
            s.post_recv(
                &b.qp,
                RecvWr::new(3, gb.slice_mut(dst_at..dst_at + len + 64)),
            )
            .unwrap();
            let src = [ga.slice(src_at..src_at + len)];
            s.post_send(&a.qp, SendWr::send(4, &src).with_imm(len as u32))
                .unwrap();
            done(&a.cq, "SEND");
            let got = done(&b.cq, "RECV");
            assert_eq!(got.byte_len as usize, len);
            assert_eq!(got.imm, Some(len as u32));
        });
        check(
            gb.buffer(),
            dst_at,
            &data,
            0xEE,
            &format!("SEND {len} bytes"),
        );
        checked += 3;
        println!(
            "     {len:>10} bytes: WRITE, READ, SEND verified (WRITE and its check: {:.1} ms)",
            t_write.as_secs_f64() * 1e3
        );
    }
    println!(
        "RAN  {test}: {checked} transfers between GPU buffers verified, sizes 1 B to {} MiB",
        MAX >> 20
    );
}

#[test]
fn gpu_and_host_memory_mix() {
    let test = "gpu_and_host_memory_mix";
    let Some(dev) = gpu_or_skip(test) else { return };
    let (a, b) = ends(64);
    let len = (3 << 20) + 77;
    let mut ga = gpu_mr(&a, dev, len);
    let pd_b = b.qp.pd().clone();
    let mut hb = pd_b.alloc(len, Access::ALL).unwrap();
    let data = pattern(7, len);
    ga.buffer_mut().copy_from_host(0, &data).unwrap();
    // GPU → host (WRITE), then host → GPU (READ by A of B's host memory into A's GPU memory).
    scope(|s| {
        let src = [ga.slice(..)];
        s.post_send(&a.qp, SendWr::write(1, &src, hb.remote()))
            .unwrap();
        done(&a.cq, "WRITE GPU→host");
    });
    assert!(hb.to_vec(..) == data, "host bytes written from GPU memory");
    let reversed: Vec<u8> = data.iter().rev().copied().collect();
    hb.write_at(0, &reversed).unwrap();
    scope(|s| {
        s.post_send(&a.qp, SendWr::read(2, ga.slice_mut(..), hb.remote()))
            .unwrap();
        done(&a.cq, "READ host→GPU");
    });
    assert!(
        ga.buffer().to_vec().unwrap() == reversed,
        "GPU bytes read from host memory"
    );
    // Several requests over the same GPU bytes, changed between them: each sees the bytes as
    // they were when it was posted.
    for round in 0..5u8 {
        ga.buffer_mut().fill(round).unwrap();
        scope(|s| {
            let src = [ga.slice(..)];
            s.post_send(&a.qp, SendWr::write(10, &src, hb.remote()))
                .unwrap();
            done(&a.cq, "WRITE after change");
        });
        assert!(
            hb.to_vec(..).iter().all(|&x| x == round),
            "round {round}: stale staged bytes were sent"
        );
    }
    // B's changes to its host memory are seen by later READs into GPU memory, and the peer
    // READing GPU memory after A changed it sees the change too.
    for round in 0..3u8 {
        ga.buffer_mut().fill(0x40 + round).unwrap();
        scope(|s| {
            s.post_send(&b.qp, SendWr::read(11, hb.slice_mut(..), ga.remote()))
                .unwrap();
            done(&b.cq, "peer READ of GPU memory");
        });
        assert!(
            hb.to_vec(..).iter().all(|&x| x == 0x40 + round),
            "round {round}"
        );
    }
    println!("RAN  {test}: GPU↔host WRITE/READ and re-use after changes verified");
}

#[test]
fn gpu_segments_are_guarded() {
    let test = "gpu_segments_are_guarded";
    let Some(dev) = gpu_or_skip(test) else { return };
    let (a, b) = ends(16);
    let ga = gpu_mr(&a, dev, 4096);
    let gb = gpu_mr(&b, dev, 4096);
    // Inline sends are copied by the CPU: GPU segments are refused before the device sees them.
    let err = scope(|s| {
        let src = [ga.slice(..32)];
        s.post_send(&a.qp, SendWr::send(1, &src).inline())
    })
    .expect_err("inline GPU data");
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // The CPU cannot read GPU segments in place (dereferencing one panics: see the unit tests).
    let seg: MrSlice<'_> = ga.slice(..8);
    assert!(seg.is_device());
    // Atomics need CPU access to the word: refused with a remote operational error.
    let mut hb = a.qp.pd().alloc(8, Access::ALL).unwrap();
    let c = scope(|s| {
        s.post_send(
            &a.qp,
            SendWr::fetch_add(5, hb.slice_mut(..8), gb.remote().slice(0, 8).unwrap(), 1),
        )
        .unwrap();
        a.cq.wait_one(WAIT).unwrap()
    });
    assert_eq!(c.status, WcStatus::RemOpErr, "{c:?}");
    // A borrowed buffer may not grant peers access.
    let mut foreign = GpuBuffer::new(dev, 4096).unwrap();
    let err =
        a.qp.pd()
            .register_gpu_local(&mut foreign, Access::ALL)
            .expect_err("remote rights on a borrowed buffer");
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    println!("RAN  {test}: inline refused, segments marked, atomics NAKed, borrow rules held");
}

#[test]
fn foreign_pointers_and_dmabuf_export() {
    let test = "foreign_pointers_and_dmabuf_export";
    let Some(dev) = gpu_or_skip(test) else { return };
    let owner = GpuBuffer::new(dev, 1 << 20).unwrap();
    // SAFETY: `owner` outlives `view` (dropped first below) and is not freed meanwhile.
    let mut view = unsafe { GpuBuffer::from_raw(owner.device_ptr() + 4096, 8192) }.unwrap();
    assert!(!view.is_owned());
    assert_eq!(view.device(), dev);
    view.copy_from_host(0, b"foreign").unwrap();
    let mut back = [0u8; 7];
    owner.copy_to_host(4096, &mut back).unwrap();
    assert_eq!(&back, b"foreign");
    // Past the allocation, and host memory, are refused.
    // SAFETY: the call only queries the driver; it fails before anything uses the range.
    let past = unsafe { GpuBuffer::from_raw(owner.device_ptr() + 4096, 1 << 20) };
    assert!(matches!(past, Err(Error::OutOfBounds { .. })), "{past:?}");
    let host = [0u8; 64];
    // SAFETY: as above.
    let not_gpu = unsafe { GpuBuffer::from_raw(host.as_ptr() as u64, 64) };
    assert!(matches!(not_gpu, Err(Error::Gpu { .. })), "{not_gpu:?}");
    // Copies outside the buffer are refused.
    assert!(matches!(
        view.copy_to_host(8190, &mut [0u8; 4]),
        Err(Error::OutOfBounds { .. })
    ));
    // A borrowed buffer registers for local use.
    let (a, _b) = ends(4);
    {
        let mr =
            a.qp.pd()
                .register_gpu_local(&mut view, Access::LOCAL_WRITE)
                .unwrap();
        assert_eq!(mr.len(), 8192);
    }
    drop(view);
    // dma-buf export: what ibv_reg_dmabuf_mr is given on kernel devices.
    let supported = gpu::dmabuf_supported(dev).unwrap();
    match owner.export_dmabuf() {
        Ok((fd, offset)) => {
            use std::os::fd::AsRawFd;
            assert!(fd.as_raw_fd() >= 0);
            assert_eq!(offset, 0, "cuMemAlloc memory is page aligned");
            println!(
                "     dma-buf export: fd {} (device says supported: {supported})",
                fd.as_raw_fd()
            );
        }
        Err(e) => println!("     dma-buf export refused (device says supported: {supported}): {e}"),
    }
    println!("RAN  {test}: foreign pointers checked, copies bounded, dma-buf export tried");
}

#[test]
fn without_a_gpu_errors_are_clear() {
    match gpu::device_count() {
        Err(e) => {
            let text = e.to_string();
            assert!(matches!(e, Error::Gpu { .. }), "{e:?}");
            assert!(text.contains("libcuda.so.1"), "names the library: {text}");
            let alloc = GpuBuffer::new(0, 4096).expect_err("no driver");
            assert!(alloc.to_string().contains("libcuda.so.1"), "{alloc}");
            println!("RAN  without_a_gpu_errors_are_clear: no driver → `{text}`");
        }
        Ok(n) => {
            let bad = GpuBuffer::new(n + 3, 4096).expect_err("no such device");
            assert!(bad.to_string().contains("no CUDA device"), "{bad}");
            let empty = GpuBuffer::new(0, 0).expect_err("empty");
            assert!(matches!(empty, Error::InvalidArgument(_)), "{empty}");
            println!("RAN  without_a_gpu_errors_are_clear: {n} device(s); bad ordinal → `{bad}`");
        }
    }
}

/// Sizes the two-process test moves (each WRITE, then READ back).
const TWO_PROCESS_SIZES: &[usize] = &[1, 4097, (1 << 20) + 3, 64 << 20];

/// FNV-1a over `data`: what the server reports back for the bytes it found in its GPU memory.
fn checksum(data: &[u8]) -> u32 {
    data.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

/// A queue pair in INIT on a fresh context.
fn init_qp(dev: &str) -> (Context, Cq, erdma::Qp<erdma::Init>) {
    let ctx = Context::open(dev).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let qp = pd
        .create_qp(&QpConfig::new(&cq))
        .unwrap()
        .init(&InitOptions {
            access: Access::ALL,
            ..InitOptions::default()
        })
        .unwrap();
    (ctx, cq, qp)
}

/// The server process of `gpu_two_processes`: exposes a GPU region, and after each
/// notification (a SEND whose immediate is the length written) answers with the checksum of
/// what its GPU memory holds.
#[test]
#[ignore = "entry point of the child process spawned by `gpu_two_processes`"]
fn gpu_server_process() {
    let (Ok(dev), Ok(listen)) = (
        std::env::var("ERDMA_GPU_SERVER_DEVICE"),
        std::env::var("ERDMA_GPU_SERVER_LISTEN"),
    ) else {
        panic!("gpu_server_process needs ERDMA_GPU_SERVER_DEVICE and ERDMA_GPU_SERVER_LISTEN");
    };
    let gpu_dev = gpu::device_count().map(|_| 0).unwrap();
    let (_ctx, cq, qp) = init_qp(&dev);
    let region = qp
        .pd()
        .register_gpu(GpuBuffer::new(gpu_dev, 64 << 20).unwrap(), Access::ALL)
        .unwrap();
    let mut notes = qp.pd().alloc(4096, Access::LOCAL_WRITE).unwrap();
    let listener = Listener::bind(listen.as_str()).unwrap();
    let (mut stream, _) = listener.accept(WAIT).unwrap();
    let local = PeerInfo {
        endpoints: vec![qp.endpoint().unwrap()],
        regions: vec![region.remote()],
        user: Vec::new(),
    };
    let peer = connect::exchange(&mut stream, &local, WAIT).unwrap();
    let qp = qp.connect(&peer.endpoints[0], &Default::default()).unwrap();
    for _ in TWO_PROCESS_SIZES {
        let len = scope(|s| {
            s.post_recv(&qp, RecvWr::new(1, notes.slice_mut(..)))
                .unwrap();
            let c = done(&cq, "notification");
            c.imm.expect("the length as immediate") as usize
        });
        let mut got = vec![0u8; len];
        region.buffer().copy_to_host(0, &mut got).unwrap();
        let sum = checksum(&got);
        scope(|s| {
            s.post_send(&qp, SendWr::send_inline(2, b"sum").with_imm(sum))
                .unwrap();
            done(&cq, "checksum reply");
        });
    }
    // Wait for the client to close, so nothing is in flight at teardown.
    let mut byte = [0u8; 1];
    let _ = connect::read_exact_by(&mut stream, &mut byte, Instant::now() + WAIT, "the close");
}

#[test]
fn gpu_two_processes() {
    let test = "gpu_two_processes";
    let Some(dev) = gpu_or_skip(test) else { return };
    let (dev_a, dev_b) = soft_pair();
    let addr = format!("127.0.0.1:{}", 40000 + (std::process::id() % 20000) as u16);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "gpu_server_process", "--nocapture"])
        .env("ERDMA_GPU_SERVER_DEVICE", &dev_b)
        .env("ERDMA_GPU_SERVER_LISTEN", &addr)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let (_ctx, cq, qp) = init_qp(&dev_a);
    let mut src = qp
        .pd()
        .register_gpu(GpuBuffer::new(dev, 64 << 20).unwrap(), Access::ALL)
        .unwrap();
    let mut back = qp
        .pd()
        .register_gpu(GpuBuffer::new(dev, 64 << 20).unwrap(), Access::ALL)
        .unwrap();
    let mut notes = qp.pd().alloc(4096, Access::LOCAL_WRITE).unwrap();
    let mut stream = connect::dial(addr.as_str(), WAIT).unwrap();
    let local = PeerInfo {
        endpoints: vec![qp.endpoint().unwrap()],
        regions: vec![src.remote()],
        user: Vec::new(),
    };
    let peer = connect::exchange(&mut stream, &local, WAIT).unwrap();
    let qp = qp.connect(&peer.endpoints[0], &Default::default()).unwrap();
    let remote = peer.regions[0];
    for (i, &len) in TWO_PROCESS_SIZES.iter().enumerate() {
        let data = pattern(100 + i as u32, len);
        src.buffer_mut().copy_from_host(0, &data).unwrap();
        // WRITE into the server's GPU memory, then tell it how much; it answers with the
        // checksum of what it finds there.
        let sum = scope(|s| {
            s.post_recv(&qp, RecvWr::new(9, notes.slice_mut(..)))
                .unwrap();
            let sgl = [src.slice(..len)];
            s.post_send(
                &qp,
                SendWr::write(1, &sgl, remote.slice(0, len as u64).unwrap()),
            )
            .unwrap();
            done(&cq, "WRITE to the server's GPU memory");
            s.post_send(&qp, SendWr::send_inline(2, b"len").with_imm(len as u32))
                .unwrap();
            let mut sum = None;
            for _ in 0..2 {
                let c = done(&cq, "notification or reply");
                if c.opcode == WcOpcode::Recv {
                    sum = c.imm;
                }
            }
            sum.expect("the server's checksum")
        });
        assert_eq!(
            sum,
            checksum(&data),
            "{len} bytes in the server's GPU memory"
        );
        // READ them back from the server's GPU memory into another GPU buffer of ours.
        back.buffer_mut().fill(0).unwrap();
        scope(|s| {
            s.post_send(
                &qp,
                SendWr::read(
                    3,
                    back.slice_mut(..len),
                    remote.slice(0, len as u64).unwrap(),
                ),
            )
            .unwrap();
            done(&cq, "READ from the server's GPU memory");
        });
        let mut got = vec![0u8; len];
        back.buffer().copy_to_host(0, &mut got).unwrap();
        assert!(got == data, "{len} bytes READ back");
    }
    drop(stream);
    let status = child.wait().unwrap();
    assert!(status.success(), "server process failed: {status}");
    println!(
        "RAN  {test}: WRITE into and READ from another process's GPU memory verified, {} sizes \
         up to 64 MiB",
        TWO_PROCESS_SIZES.len()
    );
}

/// Posts `iters` WRITEs of `src` to `remote`, keeping up to `window` in flight; returns Gb/s.
fn write_bw(end: &End, src: MrSlice<'_>, remote: RemoteMr, iters: usize, window: usize) -> f64 {
    let len = src.len();
    let t = scope(|s| {
        let mut out = [Completion::default(); 32];
        let (mut posted, mut finished) = (0, 0);
        let t0 = Instant::now();
        while finished < iters {
            while posted < iters && posted - finished < window {
                s.post_send(&end.qp, SendWr::write(posted as u64, &[src], remote))
                    .unwrap();
                posted += 1;
            }
            let n = end.cq.poll_wait(&mut out, WAIT).unwrap();
            assert!(n > 0, "no completion in time");
            for c in &out[..n] {
                assert_eq!(c.status, WcStatus::Success, "{c:?}");
            }
            finished += n;
        }
        t0.elapsed()
    });
    (len * iters) as f64 * 8.0 / t.as_secs_f64() / 1e9
}

#[test]
#[ignore = "benchmark: GPU vs host WRITE bandwidth on soft devices (needs a GPU)"]
fn bench_gpu_vs_host_write_bw() {
    let test = "bench_gpu_vs_host_write_bw";
    let Some(dev) = gpu_or_skip(test) else { return };
    let sizes: &[usize] = &[64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20];
    let max = *sizes.last().unwrap();
    let window = 16;
    let (a, b) = ends(64);
    let ga = gpu_mr(&a, dev, max);
    let gb = gpu_mr(&b, dev, max);
    let ha = a.qp.pd().alloc(max, Access::ALL).unwrap();
    let hb = b.qp.pd().alloc(max, Access::ALL).unwrap();
    let mut rows = Vec::new();
    println!(" #bytes     #iterations  host[Gb/sec]  gpu[Gb/sec]  gpu/host");
    for &size in sizes {
        let iters = ((1usize << 30) / size).clamp(32, 20_000);
        let remote_h = hb.remote().slice(0, size as u64).unwrap();
        let remote_g = gb.remote().slice(0, size as u64).unwrap();
        // Warm up both paths, then alternate to even out drift.
        write_bw(&a, ha.slice(..size), remote_h, iters / 8 + 1, window);
        write_bw(&a, ga.slice(..size), remote_g, iters / 8 + 1, window);
        let mut host = Vec::new();
        let mut gpu = Vec::new();
        for _ in 0..5 {
            host.push(write_bw(&a, ha.slice(..size), remote_h, iters, window));
            gpu.push(write_bw(&a, ga.slice(..size), remote_g, iters, window));
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(|x, y| x.total_cmp(y));
            v[v.len() / 2]
        };
        let (h, g) = (med(&mut host), med(&mut gpu));
        println!(" {size:<10} {iters:<12} {h:<13.2} {g:<12.2} {:.2}", g / h);
        rows.push(Row {
            size,
            iters,
            host: h,
            gpu: g,
        });
    }
    if let Ok(dir) = std::env::var("ERDMA_GPU_BENCH_OUT") {
        write_report(std::path::Path::new(&dir), dev, window, &rows);
    }
    println!("RAN  {test}: {} sizes measured", rows.len());
    // Data check after the measurement: the last WRITE landed intact.
    let mut tail = vec![0u8; 4096];
    gb.buffer().copy_to_host(max - 4096, &mut tail).unwrap();
    let mut want = vec![0u8; 4096];
    ga.buffer().copy_to_host(max - 4096, &mut want).unwrap();
    assert_eq!(tail, want);
    let _ = Duration::ZERO;
}

/// One measured size: Gb/s with host buffers and with GPU buffers.
struct Row {
    size: usize,
    iters: usize,
    host: f64,
    gpu: f64,
}

fn write_report(dir: &std::path::Path, dev: usize, window: usize, rows: &[Row]) {
    let name = gpu::device_name(dev).unwrap_or_default();
    let (major, minor) = gpu::driver_version().unwrap_or((0, 0));
    let date = std::env::var("ERDMA_GPU_BENCH_DATE").unwrap_or_else(|_| "unknown date".into());
    let target = 0.70;
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut md = String::new();
    md.push_str(
        "## GPU memory: RDMA WRITE bandwidth, GPU buffers vs host buffers (soft devices)\n\n",
    );
    md.push_str(&format!(
        "Measured {date} on {name} (CUDA driver API {major}.{minor}), {cores} CPU cores, Linux; two soft \
         devices on loopback (`soft:127.0.x.1` ↔ `soft:127.0.x.2`) in one process, one RC queue \
         pair, {window} WRITEs in flight, one source region and one target region reused by every \
         WRITE. *GPU*: both regions are CUDA device memory registered with `Pd::register_gpu` \
         (the soft device stages the bytes through pinned host slots with asynchronous CUDA \
         copies). *Host*: both regions are host memory (`Pd::alloc`). Each figure is the median \
         of five runs after a warm-up; ratio = GPU / host (higher is better). Target: GPU ≥ \
         {:.0}% of host at every size.\n\n",
        target * 100.0
    ));
    md.push_str("| bytes | iterations | host Gb/s | GPU Gb/s | GPU/host | target met |\n");
    md.push_str("| ---: | ---: | ---: | ---: | ---: | :---: |\n");
    for r in rows {
        let ratio = r.gpu / r.host;
        md.push_str(&format!(
            "| {} | {} | {:.2} | {:.2} | {ratio:.2} | {} |\n",
            r.size,
            r.iters,
            r.host,
            r.gpu,
            if ratio >= target { "yes" } else { "no" }
        ));
    }
    let ratios = rows.iter().map(|r| r.gpu / r.host);
    let (lo, hi) = ratios.fold((f64::MAX, 0.0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
    md.push_str(&format!(
        "\n- Target: GPU-buffer WRITE bandwidth ≥ {:.0}% of host buffers at every size — GPU/host \
         {lo:.2}–{hi:.2}: **{}**\n",
        target * 100.0,
        if lo >= target { "met" } else { "missed" }
    ));
    md.push_str(
        "\nCommands (on the GPU machine, with the test binary built elsewhere by \
         `cargo test -p erdma --release --test gpu --no-run`):\n\n\
         ```sh\nERDMA_GPU_BENCH_OUT=bench/results ./gpu-<hash> --ignored --exact \
         bench_gpu_vs_host_write_bw --nocapture\n```\n",
    );
    let series = |f: fn(&Row) -> f64| {
        rows.iter()
            .map(|r| format!("[{}, {:.3}]", r.size, f(r)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let json = format!(
        "{{\"title\": \"RDMA WRITE bandwidth on soft devices: GPU vs host buffers ({name})\", \
         \"xlabel\": \"message size (bytes)\", \"ylabel\": \"Gb/s\", \"xlog\": true, \
         \"ylog\": false, \"series\": {{\"host buffers\": [{}], \"GPU buffers\": [{}]}}}}\n",
        series(|r| r.host),
        series(|r| r.gpu)
    );
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("gpu.md"), md).unwrap();
    std::fs::write(dir.join("gpu.plot.json"), json).unwrap();
}

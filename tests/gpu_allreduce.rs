//! The AllReduce example with `--gpu --check 1`: 2, 3 and 4 ranks (processes, each on its own
//! soft device), each rank's data in CUDA device memory, several sizes (odd element counts that
//! divide by neither ranks nor queue pairs nor chunk), f32, bf16, f16 and i32, sum and max. The
//! example checks every element of every iteration after copying the result back from the GPU;
//! the test asserts it found no wrong element, printed every size, and said how it reduced.
//!
//! Without an NVIDIA GPU and driver each GPU test prints `SKIP <test>: <reason>` and passes, and
//! `without_a_gpu_the_example_fails_clearly` checks the example's error instead; with one they
//! print `RAN <test>: …`.
//!
//! The example binary: `$ERDMA_ALLREDUCE_BIN` when set, else `allreduce` next to this test
//! binary, else `../examples/allreduce` from it (where cargo puts examples:
//! `target/<profile>/deps/<this test>` → `target/<profile>/examples/allreduce`). `cargo test`
//! builds the example; to run elsewhere, ship both binaries (see `bench/results/gpu.md`).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use erdma::gpu;

/// Longest a whole example run may take before the test kills it and fails.
const RUN_LIMIT: Duration = Duration::from_secs(240);

/// The CUDA device count, or `None` after printing why the test is skipped.
fn gpu_or_skip(test: &str) -> Option<usize> {
    match gpu::device_count() {
        Ok(n) if n > 0 => {
            let name = gpu::device_name(0).unwrap_or_else(|e| e.to_string());
            println!("RUN  {test}: {n} CUDA device(s), device 0 is {name}");
            Some(n)
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

/// Where the allreduce example is (see the module documentation).
fn example_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ERDMA_ALLREDUCE_BIN") {
        return PathBuf::from(p);
    }
    let me = std::env::current_exe().expect("this test's path");
    let dir = me.parent().expect("this test's folder");
    let beside = dir.join("allreduce");
    if beside.is_file() {
        return beside;
    }
    let cargo = dir.join("../examples/allreduce");
    assert!(
        cargo.is_file(),
        "the allreduce example is not at {} nor {}: build it (`cargo build --example \
         allreduce`) or set ERDMA_ALLREDUCE_BIN",
        beside.display(),
        cargo.display()
    );
    cargo
}

/// What one run of the example left behind.
struct Outcome {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// Runs the example with `args`, killing it (and failing) past [`RUN_LIMIT`].
fn run_example(args: &[&str]) -> Outcome {
    let mut child = Command::new(example_bin())
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the allreduce example");
    // Drain both pipes on threads so a chatty child never blocks on a full pipe.
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for the example") {
            break st;
        }
        if start.elapsed() > RUN_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("allreduce {args:?} ran past {RUN_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Outcome {
        ok: status.success(),
        stdout: out_t.join().expect("stdout reader"),
        stderr: err_t.join().expect("stderr reader"),
    }
}

/// The sizes (bytes) of a sweep from `min` by `factor` up to `max`, as the example walks it.
fn sweep(min: usize, max: usize, factor: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min;
    while s <= max {
        v.push(s);
        s *= factor;
    }
    v
}

/// One `--gpu --check 1` run: a type, an operator, a sweep.
struct GpuCase {
    dtype: &'static str,
    elem: usize,
    op: &'static str,
    min: usize,
    max: usize,
    factor: usize,
    chunk: &'static str,
}

/// Odd element counts from one element up to a few MiB: 3·7ᵏ elements never divide by the
/// ranks (2-4), the queue pairs (8) or the chunk, so every split has a remainder.
const CASES: &[GpuCase] = &[
    GpuCase {
        dtype: "float",
        elem: 4,
        op: "sum",
        min: 12,
        max: 10 << 20,
        factor: 7,
        chunk: "64K",
    },
    GpuCase {
        dtype: "bfloat16",
        elem: 2,
        op: "sum",
        min: 6,
        max: 5 << 20,
        factor: 7,
        chunk: "16K",
    },
    GpuCase {
        dtype: "half",
        elem: 2,
        op: "max",
        min: 2,
        max: 1 << 20,
        factor: 13,
        chunk: "64K",
    },
    GpuCase {
        dtype: "int32",
        elem: 4,
        op: "sum",
        min: 4,
        max: 1 << 20,
        factor: 17,
        chunk: "4K",
    },
];

fn gpu_allreduce(test: &str, ranks: usize, base: &str) {
    let Some(devices) = gpu_or_skip(test) else {
        return;
    };
    let ranks_s = ranks.to_string();
    for c in CASES {
        let (min, max, factor) = (c.min.to_string(), c.max.to_string(), c.factor.to_string());
        let args = [
            "--gpu",
            "--ranks",
            &ranks_s,
            "--soft-base",
            base,
            "-b",
            &min,
            "-e",
            &max,
            "-f",
            &factor,
            "-d",
            c.dtype,
            "-o",
            c.op,
            "--chunk",
            c.chunk,
            "-n",
            "3",
            "-w",
            "1",
            "-c",
            "1",
        ];
        let out = run_example(&args);
        let what = format!("{ranks} ranks, {} {}", c.dtype, c.op);
        assert!(
            out.ok,
            "{what}: the example failed\nstdout:\n{}\nstderr:\n{}",
            out.stdout, out.stderr
        );
        assert!(
            out.stdout
                .contains("# GPU buffers: reduction on host over staged copies"),
            "{what}: the output says how it reduced:\n{}",
            out.stdout
        );
        let mut pinned = 0;
        for r in 0..ranks {
            let dev = r % devices;
            let line = out
                .stdout
                .lines()
                .find(|l| {
                    l.starts_with(&format!("#  Rank {r:2} device "))
                        && l.contains(&format!("CUDA device {dev} "))
                })
                .unwrap_or_else(|| {
                    panic!("{what}: rank {r} on CUDA device {dev}:\n{}", out.stdout)
                });
            // The host buffer is page-locked, or the line says why not.
            if line.ends_with(", host buffer page-locked") {
                pinned += 1;
            } else {
                assert!(
                    line.contains(", host buffer pageable: GPU: "),
                    "{what}: rank {r} does not say whether its host buffer is page-locked: \
                     {line:?}"
                );
            }
        }
        // Every size of the sweep has its row, with zero wrong elements.
        let sizes = sweep(c.min, c.max, c.factor);
        for &bytes in &sizes {
            let row = out
                .stdout
                .lines()
                .find(|l| l.split_whitespace().next() == Some(&bytes.to_string()))
                .unwrap_or_else(|| panic!("{what}: no row for {bytes} B:\n{}", out.stdout));
            let cols: Vec<&str> = row.split_whitespace().collect();
            assert_eq!(cols.len(), 8, "{what}: row {row:?}");
            assert_eq!(cols[1], (bytes / c.elem).to_string(), "{what}: {row:?}");
            assert_eq!(cols[2], c.dtype, "{what}: {row:?}");
            assert_eq!(cols[3], c.op, "{what}: {row:?}");
            assert_eq!(cols[7], "0", "{what}: wrong elements at {bytes} B: {row:?}");
        }
        assert!(
            out.stdout.contains("# Wrong elements : 0 OK"),
            "{what}:\n{}",
            out.stdout
        );
        println!(
            "     {what}: {} sizes from {} to {} B checked after the copy back from the GPU, \
             0 wrong; {pinned} of {ranks} host buffers page-locked",
            sizes.len(),
            c.min,
            sizes.last().copied().unwrap_or(0)
        );
    }
    println!("RAN  {test}: --gpu --check 1 correct for {ranks} ranks");
}

#[test]
fn gpu_allreduce_2_ranks() {
    gpu_allreduce("gpu_allreduce_2_ranks", 2, "127.78.2.1");
}

#[test]
fn gpu_allreduce_3_ranks() {
    gpu_allreduce("gpu_allreduce_3_ranks", 3, "127.78.3.1");
}

#[test]
fn gpu_allreduce_4_ranks() {
    gpu_allreduce("gpu_allreduce_4_ranks", 4, "127.78.4.1");
}

/// With a GPU a device past the last one is refused by name; without one `--gpu` names the
/// missing driver. Either way: a non-zero exit, one clear line, no panic, no rank started.
#[test]
fn without_a_gpu_the_example_fails_clearly() {
    let (args, want): (Vec<String>, String) = match gpu::device_count() {
        Ok(n) if n > 0 => (
            vec!["--gpu".into(), "--gpu-device".into(), (n + 5).to_string()],
            format!("--gpu-device {}", n + 5),
        ),
        Ok(_) => (vec!["--gpu".into()], "no device".into()),
        Err(_) => (vec!["--gpu".into()], "libcuda.so.1".into()),
    };
    let mut full = args.clone();
    full.extend(["--ranks", "2", "--soft-base", "127.78.9.1"].map(String::from));
    let refs: Vec<&str> = full.iter().map(String::as_str).collect();
    let out = run_example(&refs);
    assert!(!out.ok, "{args:?} must fail: {}", out.stdout);
    assert!(
        out.stderr.starts_with("allreduce: --gpu") && out.stderr.contains(&want),
        "{args:?}: the error names why: {:?}",
        out.stderr
    );
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    assert!(out.stdout.is_empty(), "no rank ran: {}", out.stdout);
    println!(
        "RAN  without_a_gpu_the_example_fails_clearly: {args:?} → {}",
        out.stderr.trim()
    );
}

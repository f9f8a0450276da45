//! allreduce: a ring AllReduce over RC queue pairs (K per ring link, like NCCL over eRDMA with
//! `NCCL_IB_QPS_PER_CONNECTION=8`), measured in nccl-tests' `all_reduce_perf` columns.
//!
//! ```text
//! allreduce                       4 ranks on soft devices 127.0.0.1-4, a short sweep, checked
//! allreduce --ranks 8 -b 1K -e 64M -f 2 -d bfloat16 -o max
//! RANK=0 WORLD_SIZE=2 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 allreduce --device erdma_0
//! allreduce --gpu -b 1M -e 64M -f 2     each rank's data in CUDA device memory
//! ```
//!
//! With `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT` in the environment (as torchrun and
//! mpirun set them) the process is one rank of a job; otherwise it launches `--ranks` copies
//! of itself on this machine, each on its own soft device (or all on `--device`).
//!
//! `--gpu` puts each rank's data in a [`GpuBuffer`] on CUDA device `--gpu-device`, or by
//! default on device `LOCAL_RANK % devices` (`RANK` where `LOCAL_RANK` is unset; ranks launched
//! here are local ranks), so ranks spread over the machine's GPUs as torchrun places them. The
//! reduction runs on the host over staged copies: the ring's registered host buffer
//! (page-locked for the GPU, where the driver allows) is loaded from the GPU piece by piece,
//! ahead of the ring, and each piece of the result goes back to the GPU as soon as it is final
//! (the timed figures include the copies). With `--check 1` results are verified after they
//! were copied back from the GPU. Without a usable GPU, `--gpu` fails at once naming why.

use std::net::Ipv4Addr;
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

use crate::cli::{Args, CliError, Spec};
use crate::report::{CollRow, coll_header, coll_line, counter_message, counters_line};
use erdma::Context;
use erdma::collective::{
    Bootstrap, Communicator, DType, MAX_RANKS, MasterSocket, RankInfo, ReduceOp, RingConfig,
};
use erdma::gpu::{self, GpuBuffer};

/// Prints a line to stdout; a closed stdout (`| head`) is not an error worth a panic.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

/// Longest `--timeout`: later deadlines are no use to a benchmark, and a day stays far from
/// the overflow of a clock's deadline.
const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);

/// What `--help` says before the flags: what the tool does and how its ranks start.
const ABOUT: &str = "ring AllReduce over RDMA, in nccl-tests' columns.

Reduce-scatter, then all-gather, around a ring of ranks: RDMA WRITE WITH IMM into buffers the
receiving rank grants (credits), each ring link striped over -q queue pairs.

Usage:
  allreduce [options]          launches --ranks processes on this machine, each on its own soft
                               device (--soft-base, the next address, ...) or all on --device;
                               rank 0 inherits the socket the launcher bound for the job, so no
                               other program can take its port in between
  RANK=r WORLD_SIZE=n MASTER_ADDR=host MASTER_PORT=port allreduce [options]
                               one rank of a job, as torchrun and mpirun start it
  allreduce --gpu [options]    each rank's data in GPU memory, reduced on the host";

const SPECS: &[Spec] = &[
    Spec::opt(
        Some('b'),
        "minbytes",
        "size",
        "smallest size per rank (default 1K)",
    ),
    Spec::opt(
        Some('e'),
        "maxbytes",
        "size",
        "largest size per rank (default 16M)",
    ),
    Spec::opt(
        Some('f'),
        "stepfactor",
        "n",
        "size multiplier of the sweep (default 4)",
    ),
    Spec::opt(
        Some('n'),
        "iters",
        "n",
        "timed iterations per size (default 20)",
    ),
    Spec::opt(
        Some('w'),
        "warmup_iters",
        "n",
        "warm-up iterations per size (default 5)",
    ),
    Spec::opt(
        Some('c'),
        "check",
        "0/1",
        "verify every iteration against a local reference (default 1)",
    ),
    Spec::opt(
        Some('d'),
        "dtype",
        "type",
        "float, half, bfloat16 or int32 (default float)",
    ),
    Spec::opt(Some('o'), "op", "op", "sum or max (default sum)"),
    Spec::opt(
        Some('q'),
        "qps-per-connection",
        "k",
        "queue pairs per ring link (default 8)",
    ),
    Spec::opt(
        None,
        "ranks",
        "n",
        "ranks to launch on this machine (default 4)",
    ),
    Spec::opt(
        None,
        "device",
        "name",
        "RDMA device (default: soft devices --soft-base, +1, …)",
    ),
    Spec::opt(
        None,
        "soft-base",
        "ipv4",
        "first soft device address when launching (default 127.0.0.1)",
    ),
    Spec::opt(
        None,
        "chunk",
        "size",
        "largest chunk and staging slot (default 256K)",
    ),
    Spec::opt(
        None,
        "slots",
        "n",
        "staging slots (credits) per queue pair (default 4)",
    ),
    Spec::opt(
        None,
        "min-chunk",
        "size",
        "smallest chunk a segment is cut into (default 256K)",
    ),
    Spec::opt(
        None,
        "window",
        "size",
        "most bytes in flight towards the successor, at least one chunk (default 2M)",
    ),
    Spec::opt(
        None,
        "timeout",
        "secs",
        "longest wait for progress before failing (default 15)",
    ),
    Spec::opt(
        None,
        "spin-us",
        "us",
        "poll (yielding) this long before sleeping on the completion queue (default 1000)",
    ),
    Spec::opt(
        None,
        "spin-max",
        "size",
        "largest AllReduce that polls before sleeping (default 2M)",
    ),
    Spec::switch(
        None,
        "gpu",
        "buffers in GPU memory, reduced on the host over staged copies",
    ),
    Spec::opt(
        None,
        "gpu-device",
        "n",
        "CUDA device of every rank with --gpu (default: local rank % devices)",
    ),
];

/// Everything a rank needs, parsed once.
#[derive(Debug, Clone)]
struct Opts {
    min: usize,
    max: usize,
    factor: usize,
    iters: usize,
    warmup: usize,
    check: bool,
    dtype: DType,
    op: ReduceOp,
    qps: usize,
    ranks: usize,
    device: Option<String>,
    soft_base: Ipv4Addr,
    chunk: usize,
    slots: usize,
    min_chunk: usize,
    window: usize,
    timeout: Duration,
    spin: Duration,
    spin_max: usize,
    gpu: bool,
    gpu_device: Option<usize>,
}

fn bad(flag: &str, value: &str, expected: &str) -> CliError {
    CliError::BadValue {
        flag: flag.into(),
        value: value.into(),
        expected: expected.into(),
    }
}

fn parse(argv: &[String]) -> Result<Opts, CliError> {
    let a = Args::parse("allreduce", ABOUT, SPECS, 0, argv.iter().cloned())?;
    let dtype_s = a.str("dtype").unwrap_or("float");
    let op_s = a.str("op").unwrap_or("sum");
    // The ring's own defaults (the help text names them).
    let d = RingConfig::default();
    let o = Opts {
        min: a.get("minbytes", 1 << 10)?,
        max: a.get("maxbytes", 16 << 20)?,
        factor: a.get("stepfactor", 4)?,
        iters: a.get("iters", 20)?,
        warmup: a.get("warmup_iters", 5)?,
        check: match a.get::<u8>("check", 1)? {
            0 => false,
            1 => true,
            v => return Err(bad("--check", &v.to_string(), "0 or 1")),
        },
        dtype: dtype_s
            .parse()
            .map_err(|_| bad("--dtype", dtype_s, "float, half, bfloat16 or int32"))?,
        op: op_s.parse().map_err(|_| bad("--op", op_s, "sum or max"))?,
        qps: a.get("qps-per-connection", d.qps_per_connection)?,
        ranks: a.get("ranks", 4)?,
        device: a.str("device").map(str::to_string),
        soft_base: a.get("soft-base", Ipv4Addr::new(127, 0, 0, 1))?,
        chunk: a.get("chunk", d.chunk_bytes)?,
        slots: a.get("slots", d.slots)?,
        min_chunk: a.get("min-chunk", d.min_chunk_bytes)?,
        window: a.get("window", d.window_bytes)?,
        timeout: Duration::from_secs(a.get("timeout", d.timeout.as_secs())?),
        spin: Duration::from_micros(a.get("spin-us", d.spin.as_micros() as u64)?),
        spin_max: a.get("spin-max", d.spin_max_bytes)?,
        gpu: a.has("gpu"),
        gpu_device: a.opt("gpu-device")?,
    };
    if o.min == 0 || o.min > o.max {
        return Err(bad(
            "--minbytes",
            &o.min.to_string(),
            "between 1 and --maxbytes",
        ));
    }
    if o.max > 1 << 30 {
        return Err(bad("--maxbytes", &o.max.to_string(), "at most 1G"));
    }
    if o.factor < 2 {
        return Err(bad("--stepfactor", &o.factor.to_string(), "at least 2"));
    }
    if o.iters == 0 {
        return Err(bad("--iters", "0", "at least 1"));
    }
    if o.ranks == 0 || o.ranks > MAX_RANKS {
        return Err(bad("--ranks", &o.ranks.to_string(), "between 1 and 32"));
    }
    if o.timeout.is_zero() || o.timeout > MAX_TIMEOUT {
        return Err(bad(
            "--timeout",
            &o.timeout.as_secs().to_string(),
            "between 1 and 86400 (a day)",
        ));
    }
    // The launcher numbers the ranks' soft devices up from --soft-base.
    if o.device.is_none()
        && u32::from(o.soft_base)
            .checked_add(o.ranks as u32 - 1)
            .is_none()
    {
        return Err(bad(
            "--soft-base",
            &o.soft_base.to_string(),
            &format!("an address with {} more after it", o.ranks - 1),
        ));
    }
    Ok(o)
}

/// The `allreduce` tool: parses the command line, then runs one rank (with `RANK` in the
/// environment) or launches `--ranks` of them here.
pub fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse(&argv) {
        Ok(o) => o,
        Err(CliError::Help(h)) => {
            say!("{h}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("allreduce: {e}");
            return ExitCode::from(2);
        }
    };
    if opts.gpu {
        if let Err(why) = gpu_devices(&opts) {
            eprintln!("allreduce: --gpu: {why}");
            return ExitCode::FAILURE;
        }
    } else if opts.gpu_device.is_some() {
        eprintln!("allreduce: --gpu-device needs --gpu");
        return ExitCode::from(2);
    }
    let result = if std::env::var_os("RANK").is_some() {
        run_rank(&opts)
    } else {
        launch(&opts, &argv)
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            let rank = std::env::var("RANK").unwrap_or_else(|_| "-".into());
            eprintln!("allreduce: rank {rank}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The number of CUDA devices, or why `--gpu` cannot run here (no driver, no device, or a
/// `--gpu-device` past the last one).
fn gpu_devices(o: &Opts) -> Result<usize, String> {
    let count = gpu::device_count().map_err(|e| format!("no usable GPU: {e}"))?;
    if count == 0 {
        return Err("no usable GPU: the CUDA driver reports no device".into());
    }
    if let Some(d) = o.gpu_device.filter(|&d| d >= count) {
        return Err(format!(
            "--gpu-device {d}: this machine has {count} CUDA device(s), numbered from 0"
        ));
    }
    Ok(count)
}

/// The CUDA device of this rank: `--gpu-device`, else the local rank (`LOCAL_RANK`, or `RANK`
/// where unset) modulo the number of devices.
fn gpu_device_of(o: &Opts, rank: usize) -> erdma::Result<usize> {
    let count = gpu_devices(o).map_err(|what| erdma::Error::Gpu { what })?;
    let local = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(rank);
    Ok(o.gpu_device.unwrap_or(local % count))
}

/// Starts `opts.ranks` copies of this program, one per rank, and waits for them.
fn launch(opts: &Opts, argv: &[String]) -> erdma::Result<ExitCode> {
    let exe = std::env::current_exe()
        .map_err(|e| erdma::Error::InvalidArgument(format!("finding this program: {e}")))?;
    // Rank 0's socket, bound before any rank starts and inherited by rank 0: the port cannot be
    // taken by another program in between.
    // On loopback: every rank runs here and dials 127.0.0.1, and no other host can join.
    let master = MasterSocket::bind("127.0.0.1:0")?;
    let port = master.port();
    let base = u32::from(opts.soft_base);
    let mut children: Vec<(usize, Child)> = Vec::new();
    for rank in 0..opts.ranks {
        let device = match &opts.device {
            Some(d) => d.clone(),
            None => format!("soft:{}", Ipv4Addr::from(base + rank as u32)),
        };
        let mut cmd = Command::new(&exe);
        cmd.args(argv)
            .args(["--device", &device])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", opts.ranks.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
        if rank == 0 {
            // Rank 0 starts first: no rank runs yet that would need stopping if this fails.
            master.pass_to(&mut cmd)?;
        } else {
            cmd.stdout(std::process::Stdio::null());
        }
        match cmd.spawn() {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                for (_, c) in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(erdma::Error::InvalidArgument(format!(
                    "starting rank {rank}: {e}"
                )));
            }
        }
    }
    // Rank 0 has its own copy of the socket now.
    drop(master);
    // Ranks fail on their own in bounded time when a peer dies; after the first failure the
    // rest get that long to report, then are stopped.
    let mut failed: Option<Instant> = None;
    let mut ok = true;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait() {
                Ok(Some(status)) => {
                    if !status.success() {
                        eprintln!("allreduce: rank {} exited with {status}", children[i].0);
                        ok = false;
                        failed.get_or_insert_with(Instant::now);
                    }
                    children.remove(i);
                }
                Ok(None) => i += 1,
                Err(_) => {
                    ok = false;
                    children.remove(i);
                }
            }
        }
        if let Some(t) = failed {
            if t.elapsed() > opts.timeout + Duration::from_secs(10) {
                for (rank, c) in &mut children {
                    eprintln!("allreduce: stopping rank {rank}");
                    let _ = c.kill();
                    let _ = c.wait();
                }
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Input of `rank` at element `i` for iteration `salt`: small integers, so every sum of up to
/// 32 ranks is exact in every type and results can be compared bit for bit.
fn input(rank: usize, i: usize, salt: usize) -> f64 {
    ((i * 7 + rank * 13 + salt * 5) % 17) as f64 - 8.0
}

fn fill(buf: &mut [u8], rank: usize, count: usize, t: DType, salt: usize) {
    let size = t.size();
    for (i, e) in buf[..count * size].chunks_exact_mut(size).enumerate() {
        t.encode(input(rank, i, salt), e);
    }
}

fn count_wrong(buf: &[u8], world: usize, count: usize, t: DType, op: ReduceOp, salt: usize) -> u64 {
    let size = t.size();
    let mut want = vec![0u8; size];
    let mut wrong = 0;
    for (i, e) in buf[..count * size].chunks_exact(size).enumerate() {
        let vals = (0..world).map(|r| input(r, i, salt));
        let v = match op {
            ReduceOp::Sum => vals.sum(),
            ReduceOp::Max => vals.fold(f64::MIN, f64::max),
        };
        t.encode(v, &mut want);
        wrong += u64::from(e != &want[..]);
    }
    wrong
}

/// Where a rank's data lives.
enum Data {
    /// In the communicator's registered host buffer, reduced in place.
    Host,
    /// In GPU memory (exactly the size's bytes), with a host vector to fill and check it.
    Gpu(GpuBuffer, Vec<u8>),
}

impl Data {
    /// Fills the data with this rank's input for iteration `salt`.
    fn load(
        &mut self,
        comm: &mut Communicator,
        rank: usize,
        count: usize,
        t: DType,
        salt: usize,
    ) -> erdma::Result<()> {
        match self {
            Data::Host => {
                fill(comm.buffer_mut(), rank, count, t, salt);
                Ok(())
            }
            Data::Gpu(dev, host) => {
                fill(host, rank, count, t, salt);
                dev.copy_from_host(0, host)
            }
        }
    }

    /// One AllReduce of the data.
    fn reduce(
        &mut self,
        comm: &mut Communicator,
        count: usize,
        t: DType,
        op: ReduceOp,
    ) -> erdma::Result<()> {
        match self {
            Data::Host => comm.all_reduce_in_place(count, t, op),
            Data::Gpu(dev, _) => comm.all_reduce(dev, t, op),
        }
    }

    /// The data's current contents as host bytes (copied back from the GPU for GPU data).
    fn result<'a>(
        &'a mut self,
        comm: &'a Communicator,
        count: usize,
        t: DType,
    ) -> erdma::Result<&'a [u8]> {
        match self {
            Data::Host => Ok(&comm.buffer()[..count * t.size()]),
            Data::Gpu(dev, host) => {
                host.fill(0);
                dev.copy_to_host(0, host)?;
                Ok(host)
            }
        }
    }
}

/// One rank of the job.
fn run_rank(o: &Opts) -> erdma::Result<ExitCode> {
    // A job larger than a ring would otherwise wait for every rank to join before saying so.
    let world = RankInfo::from_env()?.world;
    if world > MAX_RANKS {
        return Err(erdma::Error::InvalidArgument(format!(
            "WORLD_SIZE={world}: a ring has at most {MAX_RANKS} ranks"
        )));
    }
    let mut boot = Bootstrap::from_env(Duration::from_secs(60))?;
    let (rank, world) = (boot.rank(), boot.world());
    let ctx = match &o.device {
        Some(d) => Context::open(d)?,
        None => Context::open_default()?,
    };
    let elem = o.dtype.size();
    let cfg = RingConfig {
        qps_per_connection: o.qps,
        chunk_bytes: o.chunk,
        slots: o.slots,
        min_chunk_bytes: o.min_chunk,
        window_bytes: o.window,
        // A size below one element runs one element (`sweep`), so the buffer holds one.
        max_bytes: (o.max / elem).max(1) * elem,
        timeout: o.timeout,
        spin: o.spin,
        spin_max_bytes: o.spin_max,
        ..RingConfig::default()
    };
    let mut comm = Communicator::new(&ctx, &mut boot, cfg)?;
    let gpu_dev = if o.gpu {
        Some(gpu_device_of(o, rank)?)
    } else {
        None
    };
    // Who receives while a rank polls depends on the CPUs this host has per rank.
    let receiver = if comm.host_share().is_some_and(|h| h.two_cpus_per_rank()) {
        "the device receives beside the rank"
    } else {
        "the rank's polls receive"
    };
    let mut where_ = match comm.host_share() {
        Some(h) => format!(
            "{}, host: {} rank{} of the ring on {} CPU{}, {receiver}",
            ctx.name(),
            h.ranks,
            if h.ranks == 1 { "" } else { "s" },
            h.cpus,
            if h.cpus == 1 { "" } else { "s" }
        ),
        None => format!("{}, host not known, {receiver}", ctx.name()),
    };
    if let Some(d) = gpu_dev {
        let name = gpu::device_name(d)?;
        let pinned = match comm.pin_for_gpu(d) {
            Ok(()) => "host buffer page-locked".to_string(),
            Err(e) => format!("host buffer pageable: {e}"),
        };
        where_ = format!("{where_}, CUDA device {d} ({name}), {pinned}");
    }
    let devices = boot.all_gather(where_.as_bytes())?;
    if rank == 0 {
        say!(
            "# erdma allreduce: {world} ranks, {} queue pairs per link, chunk {} B (floor {} B), \
             {} slots, window {} B, iters {}, warm-up {}, check {}",
            o.qps,
            o.chunk,
            o.min_chunk,
            o.slots,
            o.window,
            o.iters,
            o.warmup,
            u8::from(o.check)
        );
        for (r, d) in devices.iter().enumerate() {
            say!("#  Rank {r:2} device {}", String::from_utf8_lossy(d));
        }
        if o.gpu {
            say!(
                "# GPU buffers: reduction on host over staged copies (each call loads the GPU \
                 buffer into the ring's host buffer piece by piece ahead of the ring, and copies \
                 each piece of the result back as soon as it is final; times include the \
                 copies{})",
                if o.check {
                    "; results checked after the copy back from the GPU"
                } else {
                    ""
                }
            );
        }
        say!("#\n{}", coll_header());
    }
    // Retries and drops during the sweep tell whether loss shaped the figures.
    let counters_before = ctx.port_counters(1).ok();
    let mut bus_sum = 0.0;
    let mut rows = 0usize;
    let mut wrong_total = 0u64;
    let mut size = o.min;
    while size <= o.max {
        let count = (size / elem).max(1);
        let bytes = count * elem;
        let mut data = match gpu_dev {
            Some(d) => Data::Gpu(GpuBuffer::new(d, bytes)?, vec![0u8; bytes]),
            None => Data::Host,
        };
        data.load(&mut comm, rank, count, o.dtype, 0)?;
        for _ in 0..o.warmup {
            data.reduce(&mut comm, count, o.dtype, o.op)?;
        }
        let mut wrong = 0u64;
        let secs = if o.check {
            // Refill before every call (untimed) and check every result.
            let mut spent = Duration::ZERO;
            for it in 0..o.iters {
                data.load(&mut comm, rank, count, o.dtype, it + 1)?;
                let t = Instant::now();
                data.reduce(&mut comm, count, o.dtype, o.op)?;
                spent += t.elapsed();
                let result = data.result(&comm, count, o.dtype)?;
                wrong += count_wrong(result, world, count, o.dtype, o.op, it + 1);
            }
            spent.as_secs_f64()
        } else {
            boot.barrier()?;
            let t = Instant::now();
            for _ in 0..o.iters {
                data.reduce(&mut comm, count, o.dtype, o.op)?;
            }
            t.elapsed().as_secs_f64()
        };
        drop(data);
        let mut mine = (secs / o.iters as f64).to_be_bytes().to_vec();
        mine.extend_from_slice(&wrong.to_be_bytes());
        let all = boot.all_gather(&mine)?;
        let mut slowest = 0.0f64;
        let mut wrong_all = 0u64;
        for m in &all {
            let (t, w) = m.split_at(8.min(m.len()));
            let t: [u8; 8] = t.try_into().map_err(|_| {
                erdma::Error::InvalidArgument("a rank sent a malformed result".into())
            })?;
            let w: [u8; 8] = w.try_into().map_err(|_| {
                erdma::Error::InvalidArgument("a rank sent a malformed result".into())
            })?;
            slowest = slowest.max(f64::from_be_bytes(t));
            wrong_all += u64::from_be_bytes(w);
        }
        let row = CollRow {
            bytes: bytes as u64,
            count: count as u64,
            dtype: o.dtype.name().into(),
            redop: o.op.name().into(),
            time_us: slowest * 1e6,
            ranks: world,
            wrong: o.check.then_some(wrong_all),
        };
        if rank == 0 {
            say!("{}", coll_line(&row));
        }
        bus_sum += row.busbw();
        rows += 1;
        wrong_total += wrong_all;
        size = match size.checked_mul(o.factor) {
            Some(s) => s,
            None => break,
        };
    }
    let counted = counters_before
        .and_then(|b| Some(ctx.port_counters(1).ok()?.since(&b)))
        .unwrap_or_default();
    let all = boot.all_gather(&counter_message(ctx.name(), &counted))?;
    if rank == 0
        && let Some(line) = counters_line(&all)
    {
        say!("{line}");
    }
    if rank == 0 {
        if o.check {
            say!(
                "# Wrong elements : {wrong_total} {}",
                if wrong_total == 0 { "OK" } else { "FAILED" }
            );
        }
        say!(
            "# Avg bus bandwidth    : {:.4}",
            bus_sum / rows.max(1) as f64
        );
    }
    Ok(if wrong_total == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

//! Completion modes side by side: latency, message rate and idle CPU of busy-poll
//! ([`Cq::poll`]), hybrid ([`Cq::wait_hybrid`]), blocking event ([`Cq::wait`]) and async
//! ([`AsyncCq`] on tokio, with and without a spin budget).
//!
//! Two queue pairs on two devices (by default the soft devices `soft:127.0.0.1` and
//! `soft:127.0.0.2` in this process; `-d rxe0 --peer-dev rxe0` runs it on a kernel device):
//! - latency: SEND/RECV ping-pong, both sides waiting in the mode under test; half the round
//!   trip is reported, in perftest's latency layout;
//! - message rate: a stream of WRITEs with a window of outstanding requests, every one signaled,
//!   its completions reaped in the mode under test, with the CPU time that cost;
//! - idle: one wait of `--idle` seconds with the connection open and no traffic; the CPU the
//!   waiting thread used (`getrusage(RUSAGE_THREAD)`) and the whole process used.
//!
//! `cq_modes --help` lists the flags.

use std::error::Error as StdError;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use crate::cli::{self, Args, CliError, Spec};
use crate::report::{self, LatStats};
use erdma::{
    Access, AsyncCq, Completion, ConnectOptions, Context, Cq, InitOptions, Mr, Qp, QpCaps,
    QpConfig, RawRecvWr, RawSendWr, SendFlags, Sge, WcOpcode, WrOpcode,
};

type BoxResult<T> = Result<T, Box<dyn StdError + Send + Sync>>;

/// How long any single wait may take before the run is declared stuck.
const WAIT: Duration = Duration::from_secs(10);
/// The most round trips, messages or rounds a count flag takes.
const MAX_COUNT: usize = 10_000_000;
/// Receives each side keeps posted during the ping-pong.
const RECV_DEPTH: usize = 64;

const SPECS: &[Spec] = &[
    Spec::opt(
        Some('d'),
        "ib-dev",
        "DEV",
        "device of the first side (default soft:127.0.0.1)",
    ),
    Spec::opt(
        None,
        "peer-dev",
        "DEV",
        "device of the second side (default soft:127.0.0.2)",
    ),
    Spec::opt(
        Some('s'),
        "size",
        "LIST",
        "message sizes, comma-separated (default 8)",
    ),
    Spec::opt(
        Some('n'),
        "iters",
        "N",
        "ping-pong round trips per size (default 10000)",
    ),
    Spec::opt(
        Some('m'),
        "modes",
        "LIST",
        "modes, comma-separated: busy-poll,hybrid,event,async,async-hybrid (default all)",
    ),
    Spec::opt(
        None,
        "spin-us",
        "US",
        "spin budget of the hybrid modes (default 100)",
    ),
    Spec::opt(
        None,
        "rate-iters",
        "N",
        "WRITEs per mode in the rate test (default 200000; 0 skips)",
    ),
    Spec::opt(
        None,
        "window",
        "N",
        "outstanding WRITEs in the rate test (default 64)",
    ),
    Spec::opt(
        None,
        "idle",
        "SECS",
        "idle period per mode (default 2; 0 skips)",
    ),
    Spec::opt(
        None,
        "warmup",
        "N",
        "untimed round trips before each measurement (default 500)",
    ),
    Spec::opt(
        None,
        "rounds",
        "N",
        "latency rounds over all modes, interleaved; samples are pooled (default 3)",
    ),
];

/// A way of waiting for completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    BusyPoll,
    Hybrid,
    Event,
    Async,
    AsyncHybrid,
}

impl Mode {
    const ALL: [Mode; 5] = [
        Mode::BusyPoll,
        Mode::Hybrid,
        Mode::Event,
        Mode::Async,
        Mode::AsyncHybrid,
    ];

    fn name(self) -> &'static str {
        match self {
            Mode::BusyPoll => "busy-poll",
            Mode::Hybrid => "hybrid",
            Mode::Event => "event",
            Mode::Async => "async",
            Mode::AsyncHybrid => "async-hybrid",
        }
    }

    fn parse(s: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == s)
    }
}

#[derive(Debug, Clone)]
struct Config {
    dev_a: String,
    dev_b: String,
    sizes: Vec<usize>,
    iters: usize,
    modes: Vec<Mode>,
    spin: Duration,
    rate_iters: usize,
    window: usize,
    idle: Duration,
    warmup: usize,
    rounds: usize,
}

fn bad(flag: &str, value: &str, expected: &str) -> CliError {
    CliError::BadValue {
        flag: flag.into(),
        value: value.into(),
        expected: expected.into(),
    }
}

fn parse_config(argv: Vec<String>) -> Result<Config, CliError> {
    let args = Args::parse(
        "cq_modes",
        "Latency, message rate and idle CPU of each completion mode.",
        SPECS,
        0,
        argv,
    )?;
    let sizes = match args.str("size") {
        None => vec![8],
        Some(list) => list
            .split(',')
            .map(|v| {
                cli::parse_size(v)
                    .or_else(|| v.trim().parse().ok())
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n > 0 && n <= 1 << 20)
                    .ok_or_else(|| bad("--size", v, "sizes from 1 B to 1M"))
            })
            .collect::<Result<_, _>>()?,
    };
    let modes = match args.str("modes") {
        None => Mode::ALL.to_vec(),
        Some(list) => list
            .split(',')
            .map(|m| {
                Mode::parse(m.trim()).ok_or_else(|| {
                    bad(
                        "--modes",
                        m,
                        "busy-poll, hybrid, event, async or async-hybrid",
                    )
                })
            })
            .collect::<Result<_, _>>()?,
    };
    let window: usize = args.get("window", 64)?;
    if window == 0 || window > 1024 {
        return Err(bad("--window", &window.to_string(), "1 to 1024"));
    }
    // Counts are bounded so that samples fit in memory and sums cannot wrap: latency samples
    // are kept (8 bytes each) for every round trip of a round.
    let count = |flag: &str, default: usize, min: usize| -> Result<usize, CliError> {
        let n: usize = args.get(flag, default)?;
        if !(min..=MAX_COUNT).contains(&n) {
            let want = format!("{min} to {MAX_COUNT}");
            return Err(bad(&format!("--{flag}"), &n.to_string(), &want));
        }
        Ok(n)
    };
    let iters = count("iters", 10_000, 1)?;
    let idle: f64 = args.get("idle", 2.0)?;
    if !(0.0..=600.0).contains(&idle) {
        return Err(bad("--idle", &idle.to_string(), "0 to 600 seconds"));
    }
    Ok(Config {
        dev_a: args.get("ib-dev", "soft:127.0.0.1".to_string())?,
        dev_b: args.get("peer-dev", "soft:127.0.0.2".to_string())?,
        sizes,
        iters,
        modes,
        spin: Duration::from_micros(args.get("spin-us", 100)?),
        rate_iters: count("rate-iters", 200_000, 0)?,
        window,
        idle: Duration::from_secs_f64(idle),
        warmup: count("warmup", 500, 0)?,
        rounds: count("rounds", 3, 1)?,
    })
}

/// One side of the connection.
struct Side {
    cq: Cq,
    qp: Qp,
    mr: Mr<'static>,
    max_inline: u32,
}

/// The registered buffer: `RECV_DEPTH` receive slots, then one send slot, each `slot` bytes.
fn slot_len(max_size: usize) -> usize {
    max_size.next_multiple_of(64)
}

fn connect(cfg: &Config) -> BoxResult<(Side, Side, Vec<Context>)> {
    let slot = slot_len(cfg.sizes.iter().copied().max().unwrap_or(8));
    let depth = (RECV_DEPTH + cfg.window + 16) as u32;
    let mut parts = Vec::new();
    for dev in [&cfg.dev_a, &cfg.dev_b] {
        let ctx = Context::open(dev)?;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(depth * 2)?;
        let mr = pd.alloc(slot * (RECV_DEPTH + 1), Access::ALL)?;
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: RECV_DEPTH as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64.min(ctx.limits().max_inline_data),
        };
        let qp = pd
            .create_qp(&QpConfig::new(&cq).caps(caps))?
            .init(&InitOptions {
                access: Access::ALL,
                ..InitOptions::default()
            })?;
        let max_inline = qp.caps().max_inline_data;
        parts.push((ctx, cq, mr, qp, max_inline));
    }
    let (ctx_b, cq_b, mr_b, qp_b, inl_b) = parts.pop().ok_or("no second side")?;
    let (ctx_a, cq_a, mr_a, qp_a, inl_a) = parts.pop().ok_or("no first side")?;
    let ea = qp_a.endpoint()?;
    let eb = qp_b.endpoint()?;
    // A local ACK timeout of ~1 s (code 18) instead of ~67 ms: this measures completion modes,
    // not retransmission, and on a heavily loaded machine a starved process can otherwise use
    // up its transport retries.
    let opts = ConnectOptions {
        timeout: 18,
        ..ConnectOptions::default()
    };
    let qp_a = qp_a.connect(&eb, &opts)?;
    let qp_b = qp_b.connect(&ea, &opts)?;
    Ok((
        Side {
            cq: cq_a,
            qp: qp_a,
            mr: mr_a,
            max_inline: inl_a,
        },
        Side {
            cq: cq_b,
            qp: qp_b,
            mr: mr_b,
            max_inline: inl_b,
        },
        vec![ctx_a, ctx_b],
    ))
}

/// Waits for completions in one mode.
enum Waiter<'a> {
    Sync {
        cq: &'a Cq,
        mode: Mode,
        spin: Duration,
    },
    Async(Box<AsyncCq>),
}

impl<'a> Waiter<'a> {
    /// Must be called inside the tokio runtime that will drive it.
    fn new(cq: &'a Cq, mode: Mode, spin: Duration) -> BoxResult<Waiter<'a>> {
        Ok(match mode {
            Mode::Async => Waiter::Async(Box::new(AsyncCq::new(cq.clone())?)),
            Mode::AsyncHybrid => Waiter::Async(Box::new(AsyncCq::with_spin(cq.clone(), spin)?)),
            _ => Waiter::Sync { cq, mode, spin },
        })
    }

    /// At least one completion into `out` within `timeout`; `Ok(0)` when none came.
    async fn wait_for(&self, out: &mut [Completion], timeout: Duration) -> BoxResult<usize> {
        match self {
            Waiter::Sync { cq, mode, spin } => Ok(match mode {
                Mode::BusyPoll => {
                    let deadline = Instant::now() + timeout;
                    loop {
                        let n = cq.poll(out)?;
                        if n > 0 {
                            break n;
                        }
                        if Instant::now() >= deadline {
                            break 0;
                        }
                        std::hint::spin_loop();
                    }
                }
                Mode::Hybrid => cq.wait_hybrid(out, *spin, timeout)?,
                _ => cq.wait(out, timeout)?,
            }),
            Waiter::Async(acq) => match tokio::time::timeout(timeout, acq.next_batch(out)).await {
                Ok(r) => Ok(r?),
                Err(_) => Ok(0),
            },
        }
    }

    /// As [`Waiter::wait_for`] with the run's stall limit; no completion is an error.
    async fn wait(&self, out: &mut [Completion], what: &str) -> BoxResult<usize> {
        match self.wait_for(out, WAIT).await? {
            0 => Err(format!("no completion within {WAIT:?} ({what})").into()),
            n => {
                for c in &out[..n] {
                    if !c.status.is_success() {
                        return Err(format!("{what}: failed completion {c:?}").into());
                    }
                }
                Ok(n)
            }
        }
    }
}

fn runtime() -> BoxResult<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// CPU time (user + system) of this thread or of the whole process.
fn cpu_time(who: libc::c_int) -> Duration {
    let mut ru: libc::rusage = zeroed_rusage();
    // SAFETY: `ru` is a valid, writable rusage; getrusage only writes into it.
    let rc = unsafe { libc::getrusage(who, &mut ru) };
    if rc != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn zeroed_rusage() -> libc::rusage {
    // SAFETY: rusage is plain old data (integers and timevals); all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

fn recv_sge(side: &Side, slot: usize, i: usize) -> Sge {
    Sge {
        addr: side.mr.addr() + (i * slot) as u64,
        length: slot as u32,
        lkey: side.mr.lkey(),
    }
}

fn post_recv(side: &Side, slot: usize, i: usize) -> BoxResult<()> {
    let sge = [recv_sge(side, slot, i)];
    // The slot lies inside `side.mr`, which outlives every request of this run (the queue
    // pairs are flushed and dropped before the regions), and the CPU never touches the receive
    // slots while they are posted.
    // SAFETY: `post_recv_raw`'s contract holds (above).
    unsafe {
        side.qp.post_recv_raw(&[RawRecvWr {
            wr_id: i as u64,
            sges: &sge,
        }])?
    };
    Ok(())
}

fn post_send(side: &Side, slot: usize, size: usize, signaled: bool, wr_id: u64) -> BoxResult<()> {
    let send_at = side.mr.addr() + (RECV_DEPTH * slot) as u64;
    let sge = [Sge {
        addr: send_at,
        length: size as u32,
        lkey: side.mr.lkey(),
    }];
    let mut wr = RawSendWr::new(wr_id, WrOpcode::Send, &sge);
    if size <= side.max_inline as usize {
        wr.flags |= SendFlags::INLINE;
    }
    if signaled {
        wr.flags |= SendFlags::SIGNALED;
    }
    // The send slot lies inside `side.mr` (alive for the whole run) and the CPU never writes
    // it while requests are outstanding.
    // SAFETY: `post_send_raw`'s contract holds (above).
    unsafe { side.qp.post_send_raw(&[wr])? };
    Ok(())
}

/// Signal one send in this many (the rest are unsignaled, as perftest does).
const SIGNAL_EVERY: u64 = 16;

/// Runs `rounds` round trips on one side; `first` sends first. Returns per-round-trip times
/// in microseconds when `first`.
async fn ping_pong(
    side: &Side,
    waiter: &Waiter<'_>,
    slot: usize,
    size: usize,
    rounds: usize,
    first: bool,
) -> BoxResult<Vec<f64>> {
    let mut out = [Completion::default(); 16];
    let mut samples = Vec::with_capacity(if first { rounds } else { 0 });
    for i in 0..rounds as u64 {
        let signaled = i % SIGNAL_EVERY == SIGNAL_EVERY - 1;
        let t0 = Instant::now();
        if first {
            post_send(side, slot, size, signaled, i)?;
        }
        // Wait for the peer's message.
        'got: loop {
            let n = waiter.wait(&mut out, "ping-pong receive").await?;
            for c in &out[..n] {
                if c.opcode == WcOpcode::Recv {
                    if c.byte_len as usize != size {
                        return Err(format!("received {} bytes, sent {size}", c.byte_len).into());
                    }
                    post_recv(side, slot, c.wr_id as usize)?;
                    break 'got;
                }
            }
        }
        if first {
            samples.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
        } else {
            post_send(side, slot, size, signaled, i)?;
        }
    }
    Ok(samples)
}

/// Drains whatever completions are left (sends signaled near the end of a run).
fn drain(cq: &Cq) -> BoxResult<()> {
    let mut out = [Completion::default(); 32];
    let deadline = Instant::now() + Duration::from_millis(50);
    while Instant::now() < deadline {
        if cq.poll(&mut out)? == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(())
}

/// One latency round: the timed half round trips, in microseconds.
fn measure_latency(
    a: &Side,
    b: &Side,
    cfg: &Config,
    mode: Mode,
    size: usize,
) -> BoxResult<Vec<f64>> {
    let slot = slot_len(cfg.sizes.iter().copied().max().unwrap_or(8));
    let rounds = cfg.warmup + cfg.iters;
    let barrier = Barrier::new(2);
    let samples = std::thread::scope(|s| -> BoxResult<Vec<f64>> {
        let server = s.spawn(|| -> BoxResult<()> {
            let rt = runtime()?;
            rt.block_on(async {
                let w = Waiter::new(&b.cq, mode, cfg.spin)?;
                barrier.wait();
                ping_pong(b, &w, slot, size, rounds, false).await?;
                Ok(())
            })
        });
        let rt = runtime()?;
        let client = rt.block_on(async {
            let w = Waiter::new(&a.cq, mode, cfg.spin)?;
            barrier.wait();
            ping_pong(a, &w, slot, size, rounds, true).await
        });
        let server = server.join().map_err(|_| "the echo thread panicked")?;
        let samples = client?;
        server?;
        Ok(samples)
    })?;
    drain(&a.cq)?;
    drain(&b.cq)?;
    Ok(samples[cfg.warmup..].to_vec())
}

struct Rate {
    msgs: usize,
    mpps: f64,
    thread_cpu: f64,
    process_cpu: f64,
}

fn measure_rate(a: &Side, b: &Side, cfg: &Config, mode: Mode, size: usize) -> BoxResult<Rate> {
    let remote = b.mr.remote();
    let src = [Sge {
        addr: a.mr.addr(),
        length: size as u32,
        lkey: a.mr.lkey(),
    }];
    let rt = runtime()?;
    rt.block_on(async {
        let w = Waiter::new(&a.cq, mode, cfg.spin)?;
        let mut out = [Completion::default(); 64];
        let total = cfg.rate_iters;
        let (mut posted, mut done) = (0usize, 0usize);
        let (t0, cpu0, proc0) = (
            Instant::now(),
            cpu_time(libc::RUSAGE_THREAD),
            cpu_time(libc::RUSAGE_SELF),
        );
        while done < total {
            while posted < total && posted - done < cfg.window {
                let mut wr = RawSendWr::new(posted as u64, WrOpcode::RdmaWrite, &src);
                wr.remote = remote.slice(0, size as u64)?;
                wr.flags = SendFlags::SIGNALED;
                if size <= a.max_inline as usize {
                    wr.flags |= SendFlags::INLINE;
                }
                // The source lies inside `a.mr`, alive for the whole run and not written by
                // the CPU while requests are outstanding.
                // SAFETY: `post_send_raw`'s contract holds (above).
                unsafe { a.qp.post_send_raw(&[wr])? };
                posted += 1;
            }
            done += w.wait(&mut out, "WRITE completion").await?;
        }
        let secs = t0.elapsed().as_secs_f64();
        Ok(Rate {
            msgs: total,
            mpps: total as f64 / secs / 1e6,
            thread_cpu: (cpu_time(libc::RUSAGE_THREAD) - cpu0).as_secs_f64() / secs * 100.0,
            process_cpu: (cpu_time(libc::RUSAGE_SELF) - proc0).as_secs_f64() / secs * 100.0,
        })
    })
}

struct Idle {
    secs: f64,
    thread_cpu: f64,
    process_cpu: f64,
}

fn measure_idle(a: &Side, cfg: &Config, mode: Mode) -> BoxResult<Idle> {
    let rt = runtime()?;
    rt.block_on(async {
        let w = Waiter::new(&a.cq, mode, cfg.spin)?;
        let mut out = [Completion::default(); 16];
        let (t0, cpu0, proc0) = (
            Instant::now(),
            cpu_time(libc::RUSAGE_THREAD),
            cpu_time(libc::RUSAGE_SELF),
        );
        let n = w.wait_for(&mut out, cfg.idle).await?;
        let secs = t0.elapsed().as_secs_f64();
        if n != 0 {
            return Err(format!("{n} unexpected completions while idle: {:?}", out[0]).into());
        }
        Ok(Idle {
            secs,
            thread_cpu: (cpu_time(libc::RUSAGE_THREAD) - cpu0).as_secs_f64() / secs * 100.0,
            process_cpu: (cpu_time(libc::RUSAGE_SELF) - proc0).as_secs_f64() / secs * 100.0,
        })
    })
}

fn run(cfg: &Config) -> BoxResult<()> {
    let (a, b, _ctxs) = connect(cfg)?;
    let slot = slot_len(cfg.sizes.iter().copied().max().unwrap_or(8));
    for i in 0..RECV_DEPTH {
        post_recv(&a, slot, i)?;
        post_recv(&b, slot, i)?;
    }
    println!(
        "{}",
        report::banner(
            "Completion modes: SEND/RECV ping-pong, WRITE rate, idle CPU",
            &[
                ("Device", cfg.dev_a.clone()),
                ("Peer device", cfg.dev_b.clone()),
                ("Hybrid spin", format!("{} usec", cfg.spin.as_micros())),
                (
                    "Iterations",
                    format!("{} x {} rounds", cfg.iters, cfg.rounds)
                ),
                ("Rate window", cfg.window.to_string()),
                ("Idle period", format!("{:.1} sec", cfg.idle.as_secs_f64())),
            ]
        )
    );
    println!(" Latency: half round trip of a SEND/RECV ping-pong, both sides in the mode");
    println!(" mode         {}", report::lat_header().trim_start());
    for &size in &cfg.sizes {
        let mut pooled: Vec<Vec<f64>> = vec![Vec::new(); cfg.modes.len()];
        for _ in 0..cfg.rounds {
            for (i, &mode) in cfg.modes.iter().enumerate() {
                pooled[i].extend(measure_latency(&a, &b, cfg, mode, size)?);
            }
        }
        for (i, &mode) in cfg.modes.iter().enumerate() {
            let st = LatStats::from_samples(size as u64, &mut pooled[i]).ok_or("no samples")?;
            println!(
                " {:<12} {}",
                mode.name(),
                report::lat_line(&st).trim_start()
            );
        }
    }
    if cfg.rate_iters > 0 {
        println!("{}", report::RULE);
        println!(
            " Message rate: {}-deep window of signaled WRITEs, completions reaped in the mode",
            cfg.window
        );
        println!(" mode         #bytes  #msgs       MsgRate[Mpps]  thread CPU[%]  process CPU[%]");
        for &size in &cfg.sizes {
            for &mode in &cfg.modes {
                let r = measure_rate(&a, &b, cfg, mode, size)?;
                println!(
                    " {:<12} {:<7} {:<11} {:<14.4} {:<14.1} {:.1}",
                    mode.name(),
                    size,
                    r.msgs,
                    r.mpps,
                    r.thread_cpu,
                    r.process_cpu
                );
            }
        }
    }
    if !cfg.idle.is_zero() {
        println!("{}", report::RULE);
        println!(" Idle: one wait with the connection open and no traffic");
        println!(" mode         idle[sec]  waiter CPU[%]  process CPU[%]");
        for &mode in &cfg.modes {
            let r = measure_idle(&a, cfg, mode)?;
            println!(
                " {:<12} {:<10.2} {:<14.2} {:.2}",
                mode.name(),
                r.secs,
                r.thread_cpu,
                r.process_cpu
            );
        }
    }
    println!("{}", report::RULE);
    Ok(())
}

/// The `cq_modes` tool: parses the command line and runs every measurement it asks for.
pub fn main() {
    let cfg = match parse_config(std::env::args().skip(1).collect()) {
        Ok(c) => c,
        Err(CliError::Help(text)) => {
            println!("{text}");
            return;
        }
        Err(e) => {
            eprintln!("cq_modes: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&cfg) {
        eprintln!("cq_modes: {e}");
        std::process::exit(1);
    }
}
